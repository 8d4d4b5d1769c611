"""The step-by-step floor of bench/floor.py on hand-built traces, and the trace of a real
engine run."""

import random

import pytest

from slora_batch.bench.floor import PARTS, StepWork, floor_parts, trace_steps, weight_bytes
from slora_batch.bench.roofline import Rates

RATES = Rates(matmul_flops_per_s=1e12, copy_bytes_per_s=1e9)


def test_the_docstring_example_adds_up():
    """3 decode rows at contexts 10, 20, 30 (60 positions read), two 1 MB adapters, 100 MB of
    weights, 1 kB of KV a token, 1 GB/s, 50M parameters at 1 TFLOP/s."""
    step = StepWork(tokens=3, kv_tokens=60, adapter_bytes=2_000_000)
    parts = floor_parts([step], 100_000_000, 1000, 50_000_000, RATES)
    assert parts["floor_weight_s"] == pytest.approx(0.1)
    assert parts["floor_kv_s"] == pytest.approx(60e-6)
    assert parts["floor_adapter_s"] == pytest.approx(0.002)
    assert parts["floor_flops_s"] == 0
    assert parts["floor2_s"] == pytest.approx(0.10206)


def test_each_step_takes_the_larger_term_and_the_parts_add_up():
    rng = random.Random(3)
    weights, kv_token, params = 10_000_000, 4096, 5_000_000
    trace = [
        StepWork(
            rng.choice([1, 8, 64, 2048, 8192]),
            rng.randrange(0, 50_000),
            rng.randrange(0, 5_000_000),
        )  # fmt: skip
        for _ in range(200)
    ]
    parts = floor_parts(trace, weights, kv_token, params, RATES)
    expected = 0.0
    flops_bound = 0.0
    for s in trace:
        byte_s = (weights + s.kv_tokens * kv_token + s.adapter_bytes) / RATES.copy_bytes_per_s
        flop_s = 2 * params * s.tokens / RATES.matmul_flops_per_s
        expected += max(byte_s, flop_s)
        flops_bound += flop_s if flop_s > byte_s else 0.0
    assert 0 < flops_bound < expected  # the trace mixes both kinds of step
    assert parts["floor2_s"] == pytest.approx(expected)
    assert parts["floor_flops_s"] == pytest.approx(flops_bound)
    assert sum(parts[k] for k in PARTS) == pytest.approx(parts["floor2_s"])
    # two cards like the one measured: each reads and computes half of every step
    halved = floor_parts(trace, weights, kv_token, params, RATES, devices=2)
    assert halved["floor2_s"] == pytest.approx(expected / 2)


def test_weight_bytes_leave_out_an_untied_embedding_table():
    assert weight_bytes(1000, 10, 20, tied=False, elt=2) == (1000 - 200) * 2
    assert weight_bytes(1000, 10, 20, tied=True, elt=2) == 2000


def test_trace_counts_tokens_positions_and_distinct_adapters(tmp_path):
    from factory import make_adapter, make_model

    from slora_batch import Engine, EngineConfig, Request

    model_dir = make_model(tmp_path, "gqa")
    adapters = {
        f"a{i}": make_adapter(model_dir, tmp_path / f"a{i}", rank=2 + i,
                              targets=["q_proj", "v_proj"], alpha=4, rslora=False, seed=i)
        for i in range(3)
    }  # fmt: skip
    engine = Engine(
        model_dir, adapters=adapters, config=EngineConfig(device="cpu", num_pages=16384)
    )
    trace = trace_steps(engine)
    rng = random.Random(0)
    requests = [
        Request(id=i, adapter=[None, "a0", "a1", "a2"][i % 4], max_new_tokens=rng.randrange(1, 6),
                prompt_token_ids=[rng.randrange(3, 300) for _ in range(rng.randrange(1, 12))],
                ignore_eos=True)
        for i in range(12)
    ]  # fmt: skip
    results = list(engine.generate(requests))
    assert len(results) == 12
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    generated = sum(r.completion_tokens for r in results)
    # every prompt token and every generated token but each row's last is computed once
    assert sum(s.tokens for s in trace) == prompt + generated - len(requests)
    nbytes = {a: engine.store.nbytes(a) for a in adapters}
    assert max(s.adapter_bytes for s in trace) <= sum(nbytes.values())
    assert all(s.adapter_bytes in _subset_sums(nbytes.values()) for s in trace)
    assert all(s.kv_tokens >= s.tokens for s in trace)


def _subset_sums(values) -> set[int]:
    sums = {0}
    for v in values:
        sums |= {s + v for s in sums}
    return sums
