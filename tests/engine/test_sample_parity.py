"""The sample model (SmolLM2-135M-Instruct, GQA, tied embeddings) matches transformers + PEFT."""

from __future__ import annotations

import pytest
from factory import ALL, make_adapter

from slora_batch import Engine, EngineConfig, Request

# Six rows over the base model and the three adapters. Their prompts (5 to 15 tokens, 51 in
# all) overrun the engine's 24-token budget: some are prefilled in chunks, beside the decodes of
# the rows admitted before them.
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "Q: What is 12 times 12?\nA:",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Explain photosynthesis in one sentence:",
]
MAX_NEW = 10


@pytest.fixture(scope="module")
def sample_adapters(sample_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("sample-adapters")
    specs = {
        "r2": (2, ["q_proj", "v_proj"], 4, False),
        "r8": (8, ALL, 16, False),
        "r16": (16, ["q_proj", "k_proj", "o_proj", "down_proj"], 8, True),
    }
    return {
        name: make_adapter(sample_model_dir, root / name, r, t, a, rs, seed=i + 10)
        for i, (name, (r, t, a, rs)) in enumerate(specs.items())
    }


def greedy_tokens(
    model_dir, adapters: dict, rows: list[dict], results: dict
) -> tuple[dict[int, list[int]], set[int]]:
    """transformers + PEFT's greedy token after each prefix of each row's prompt and generated
    tokens (the adapter set per row): one forward a row over what the engine gave. A greedy
    generation is the token sequence whose every token is this choice, so a row equals
    ``generate``'s exactly when its tokens equal these and it stops where ``generate`` would.
    Also returns the model's EOS ids."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    first, *others = adapters
    model = PeftModel.from_pretrained(base, adapters[first], adapter_name=first)
    for name in others:
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()
    chosen = {}
    for row in rows:
        prompt = row["prompt_token_ids"]
        ids = torch.tensor([prompt + results[row["id"]].token_ids])
        with torch.no_grad():
            if row["adapter"]:
                model.set_adapter(row["adapter"])
                logits = model(input_ids=ids).logits
            else:
                with model.disable_adapter():
                    logits = model(input_ids=ids).logits
        chosen[row["id"]] = logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
    eos = base.config.eos_token_id
    return chosen, {eos} if isinstance(eos, int) else set(eos)


@pytest.mark.slow
def test_sample_model_parity_fp32(sample_model_dir, sample_adapters):
    """The engine's greedy generations, through the base model and three adapters in one
    batch, are transformers + PEFT's: every token its greedy choice after the tokens before
    it, and each row stops at its first EOS or at max_new_tokens."""
    from transformers import AutoTokenizer

    names = [None, "r2", "r8", "r16"]
    rows = [
        {"id": i, "adapter": names[i % 4], "prompt": p, "max_new_tokens": MAX_NEW}
        for i, p in enumerate(PROMPTS)
    ]
    engine = Engine(
        sample_model_dir,
        adapters=sample_adapters,
        config=EngineConfig(
            device="cpu", dtype="float32", num_pages=4000, max_num_batched_tokens=24
        ),
    )
    results = {r.id: r for r in engine.generate(Request(**row) for row in rows)}

    tokenizer = AutoTokenizer.from_pretrained(sample_model_dir)
    tokenized = [
        {**row, "prompt_token_ids": tokenizer(row.pop("prompt"))["input_ids"]} for row in rows
    ]
    chosen, eos = greedy_tokens(sample_model_dir, sample_adapters, tokenized, results)
    for row in tokenized:
        got = results[row["id"]]
        assert got.token_ids == chosen[row["id"]], (row, got.text)
        ends = [i for i, token in enumerate(got.token_ids) if token in eos]
        assert ends == ([len(got.token_ids) - 1] if ends else []), (row, got.token_ids)
        assert ends or len(got.token_ids) == MAX_NEW, (row, got.token_ids)
        assert got.prompt_tokens == len(row["prompt_token_ids"])
        assert got.text == tokenizer.decode(got.token_ids, skip_special_tokens=True)
