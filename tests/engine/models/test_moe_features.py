"""The engine's features on a mixture-of-experts base, each against itself turned off or against
transformers + PEFT, fp32 on CPU (a tiny random Qwen3-MoE, ``moe_factory``), with an adapter on
the experts beside base rows:

- structured output: constrained greedy tokens equal transformers + PEFT with each step's logits
  masked by an xgrammar matcher of the same grammar;
- the prefix cache and preemption: greedy rows sharing prompt prefixes keep PEFT's tokens while
  the cache hits and rows are preempted;
- n samples: a row's seeded samples are the same in a crowd and alone;
- the fp8 KV cache: tokens and logprobs equal a full-precision cache fed K/V rounded through
  e4m3 (the rounding is the only difference).
"""

from __future__ import annotations

import random

import pytest
from factory import make_rows, round_kv_writes
from moe_factory import VOCAB, assert_parity, make_expert_adapter, make_moe_model, reference_each
from structured import FORMATS, TOKENIZER_VOCAB, constrained_reference, save_tokenizer

from slora_batch import Engine, EngineConfig, Request

ADAPTERS = [None, "experts"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-features")
    model_dir = make_moe_model(root, "qwen3-moe", seed=5)
    save_tokenizer(model_dir)
    # rank 4 on the experts' fused parameters with LoRA on q and v beside them
    adapter = make_expert_adapter(
        model_dir, root / "experts", 4, 8, seed=7, modules=["q_proj", "v_proj"]
    )
    return model_dir, {"experts": adapter}


def run(model_dir, adapters, rows, **knobs):
    config = EngineConfig(device="cpu", dtype="float32", max_num_batched_tokens=48, **knobs)
    engine = Engine(model_dir, adapters=adapters, config=config)
    results = {(r.id, r.sample_index): r for r in engine.generate(Request(**row) for row in rows)}
    assert not [r.error for r in results.values() if r.error]
    return results, engine


def prefixed_rows(count: int, seed: int) -> list[dict]:
    """Greedy rows of both adapters; every other row starts with its adapter's shared prefix."""
    rows = make_rows(count, VOCAB, [a for a in ADAPTERS if a], seed=seed)
    rng = random.Random(seed)
    shared = {a: [rng.randrange(3, VOCAB) for _ in range(37)] for a in ADAPTERS}
    for i, row in enumerate(rows):
        row["adapter"] = ADAPTERS[i % 2]
        if i % 2 == 0 or i % 3 == 0:
            row["prompt_token_ids"] = shared[row["adapter"]] + row["prompt_token_ids"][:4]
    return rows


def test_structured_rows_equal_the_masked_reference(moe):
    model_dir, adapters = moe
    rng = random.Random(2)
    rows = [
        {
            "id": i,
            "adapter": ADAPTERS[i % 2],
            "prompt_token_ids": [rng.randrange(3, TOKENIZER_VOCAB) for _ in range(3 + i % 9)],
            "max_new_tokens": 24,
            "response_format": FORMATS[i % len(FORMATS)],
        }
        for i in range(len(FORMATS))
    ]
    expected = constrained_reference(model_dir, adapters, rows)
    results, engine = run(model_dir, adapters, rows, num_pages=6000)
    wrong = {
        i: (results[i, 0].token_ids, want)
        for i, want in expected.items()
        if results[i, 0].token_ids != want
    }
    assert not wrong, f"{len(wrong)} rows differ from the masked reference: {wrong}"
    assert len(engine.grammars.compiled) == len([f for f in FORMATS if f is not None])


def test_prefix_hits_and_preemption_keep_the_peft_tokens(moe):
    model_dir, adapters = moe
    rows = prefixed_rows(16, seed=4)
    expected = reference_each(model_dir, adapters, rows)
    results, engine = run(model_dir, adapters, rows, num_pages=700, max_num_seqs=8)
    assert_parity({i: r for (i, _), r in results.items()}, expected)
    assert engine.counters.prefix_hit_tokens > 0
    assert engine.counters.preemptions > 0


def test_seeded_samples_are_the_same_in_a_crowd_and_alone(moe):
    model_dir, adapters = moe
    rows = [
        dict(row, n=3, temperature=1.2, top_p=0.9, seed=11, max_new_tokens=12)
        for row in prefixed_rows(8, seed=6)
    ]
    crowd, _ = run(model_dir, adapters, rows, num_pages=6000)
    assert len(crowd) == 3 * len(rows)
    for row in rows[2:4]:  # a base row and an expert-adapter row, each alone
        alone, _ = run(model_dir, adapters, [row], num_pages=6000)
        for key, got in alone.items():
            assert crowd[key].token_ids == got.token_ids, key
    draws = {tuple(crowd[rows[3]["id"], s].token_ids) for s in range(3)}
    assert len(draws) > 1  # the samples are draws, not one greedy row three times


def test_fp8_kv_equals_the_rounded_full_precision_cache(moe, monkeypatch):
    model_dir, adapters = moe
    rows = prefixed_rows(12, seed=8)
    for row in rows:
        row["logprobs"] = 2
    rng = random.Random(9)
    rows += [
        dict(
            id=f"s{i}",
            adapter=ADAPTERS[i % 2],
            prompt_token_ids=[rng.randrange(3, VOCAB) for _ in range(5 + i)],
            continuation_token_ids=[rng.randrange(3, VOCAB) for _ in range(1 + i % 4)],
        )
        for i in range(6)
    ]
    got, engine = run(model_dir, adapters, rows, num_pages=1200, kv_cache_dtype="fp8")
    assert engine.pool.kv_pages_per_token == 1 and engine.pool.scales is not None
    assert engine.counters.prefix_hit_tokens > 0
    round_kv_writes(monkeypatch, engine.spec.num_kv_heads)
    want, _ = run(model_dir, adapters, rows, num_pages=6000)
    assert got.keys() == want.keys()
    for key, w in want.items():
        assert got[key].token_ids == w.token_ids, key
        if w.token_logprobs is not None:
            assert got[key].token_logprobs == pytest.approx(w.token_logprobs, abs=1e-4), key
