"""The sample model (SmolLM2-135M-Instruct, GQA, tied embeddings) matches transformers + PEFT."""

from __future__ import annotations

import pytest
from factory import ALL, make_adapter, reference

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


@pytest.mark.slow
def test_sample_model_parity_fp32(sample_model_dir, sample_adapters):
    from transformers import AutoTokenizer

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
    tokenized = [
        {**row, "prompt_token_ids": tokenizer(row.pop("prompt"))["input_ids"]} for row in rows
    ]
    expected = reference(sample_model_dir, sample_adapters, tokenized)
    for row in tokenized:
        got = results[row["id"]]
        assert got.token_ids == expected[row["id"]], (row, got.text)
        assert got.prompt_tokens == len(row["prompt_token_ids"])
        assert got.text == tokenizer.decode(expected[row["id"]], skip_special_tokens=True)
