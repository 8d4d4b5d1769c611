"""The sample model (SmolLM2-135M-Instruct, GQA, tied embeddings) matches transformers + PEFT."""

from __future__ import annotations

import pytest
import torch
from factory import ALL, make_adapter

from slora_batch import Engine, EngineConfig, Request

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "Explain photosynthesis in one sentence:",
    "def fibonacci(n):",
    "My favourite colour is",
    "Translate to French: good morning",
    "Q: What is 12 times 12?\nA:",
    "Once upon a time",
    "List three fruits:",
]


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


def test_sample_model_parity_fp32(sample_model_dir, sample_adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = [None, "r2", "r8", "r16"]
    rows = [
        {"id": i, "adapter": names[i % 4], "prompt": p, "max_new_tokens": 10}
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
    base = AutoModelForCausalLM.from_pretrained(sample_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, sample_adapters["r2"], adapter_name="r2")
    for name in ("r8", "r16"):
        model.load_adapter(sample_adapters[name], adapter_name=name)
    model.eval()
    for row in rows:
        ids = tokenizer(row["prompt"], return_tensors="pt")["input_ids"]
        kwargs = dict(
            max_new_tokens=10,
            do_sample=False,
            attention_mask=torch.ones_like(ids),
            pad_token_id=tokenizer.eos_token_id,
        )
        with torch.no_grad():
            if row["adapter"]:
                model.set_adapter(row["adapter"])
                out = model.generate(input_ids=ids, **kwargs)
            else:
                with model.disable_adapter():
                    out = model.generate(input_ids=ids, **kwargs)
        expected = out[0, ids.shape[1] :].tolist()
        got = results[row["id"]]
        if tokenizer.eos_token_id in expected:
            expected = expected[: expected.index(tokenizer.eos_token_id) + 1]
        assert got.token_ids == expected, (row, got.text)
        assert got.prompt_tokens == ids.shape[1]
        assert got.text == tokenizer.decode(expected, skip_special_tokens=True)
