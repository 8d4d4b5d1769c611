"""The step-by-step floor of bench/floor.py on hand-built traces, and the trace of a real
engine run; a mixture of experts' weights and expert adapters' rows by the experts a step's
tokens reach."""

import random

import pytest

from slora_batch.bench.floor import (
    PARTS,
    AdapterRows,
    Routing,
    StepWork,
    WeightBytes,
    floor_parts,
    trace_steps,
    weight_bytes,
)
from slora_batch.bench.roofline import Rates

RATES = Rates(matmul_flops_per_s=1e12, copy_bytes_per_s=1e9)


def test_the_docstring_example_adds_up():
    """3 decode rows at contexts 10, 20, 30 (60 positions read), two 1 MB adapters, 100 MB of
    weights, 1 kB of KV a token, 1 GB/s, 50M parameters at 1 TFLOP/s."""
    step = StepWork(tokens=3, kv_tokens=60, adapter_bytes=2_000_000)
    parts = floor_parts([step], WeightBytes(100_000_000), 1000, 50_000_000, RATES)
    assert parts["floor_weight_s"] == pytest.approx(0.1)
    assert parts["floor_kv_s"] == pytest.approx(60e-6)
    assert parts["floor_adapter_s"] == pytest.approx(0.002)
    assert parts["floor_flops_s"] == 0
    assert parts["floor2_s"] == pytest.approx(0.10206)


def test_each_step_takes_the_larger_term_and_the_parts_add_up():
    rng = random.Random(3)
    weights, kv_token, params = WeightBytes(10_000_000), 4096, 5_000_000
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
        byte_s = (10_000_000 + s.kv_tokens * kv_token + s.adapter_bytes) / RATES.copy_bytes_per_s
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


def test_touched_experts_is_the_expectation_over_every_routing():
    """E (1 - (1 - k/E)^T) against the mean distinct count over every way T tokens pick k of E
    experts each (all equally likely), on tiny numbers."""
    from itertools import combinations, product

    for experts, k in ((4, 2), (5, 2), (3, 1)):
        routing = Routing(experts, k, moe_layers=1)
        picks = list(combinations(range(experts), k))
        for tokens in range(1, 4):
            counts = [len(set().union(*chosen)) for chosen in product(picks, repeat=tokens)]
            assert routing.touched(tokens) == pytest.approx(sum(counts) / len(counts))
        assert routing.touched(0) == 0 and routing.touched(1) == pytest.approx(k)
        assert routing.touched(10_000) == pytest.approx(experts)
    assert Routing(128, 8, 48).touched(16) == pytest.approx(82.42, abs=0.01)
    assert Routing().touched(100) == 0  # a dense model


def test_a_moe_step_reads_the_dense_weights_and_the_experts_its_tokens_reach():
    """The module docstring's example: 2 MoE layers of 4 experts of 10 MB, top 2, beside 20 MB
    of other weights; 3 tokens reach 3.5 experts a layer: 90 MB. FLOPs count active parameters."""
    weights = WeightBytes(20_000_000, 10_000_000, Routing(4, 2, 2))
    assert weights.step(3) == pytest.approx(90_000_000)
    assert weights.step(1) == pytest.approx(20_000_000 + 2 * 2 * 10_000_000)
    assert WeightBytes(5).step(1000) == 5  # dense: every step reads all
    step = StepWork(tokens=3, kv_tokens=60, adapter_bytes=0)
    parts = floor_parts([step], weights, 1000, 50_000_000, RATES)
    assert parts["floor_weight_s"] == pytest.approx(0.09)
    prefill = StepWork(tokens=100_000, kv_tokens=100_000, adapter_bytes=0)
    parts = floor_parts([prefill], weights, 10, 7_000_000, RATES)
    assert parts["floor_flops_s"] == pytest.approx(2 * 7_000_000 * 100_000 / 1e12)


def test_weight_bytes_and_active_parameters_of_qwen3_30b_a3b(tmp_path):
    """The preset's 30.5B parameters: 2.46 GB read by every step (attention, norms, router, LM
    head) beside 48 x 128 experts of 3 x 2048 x 768 in bf16; a token runs 8 experts a layer."""
    import torch

    from slora_batch.bench.model import build_model

    model = build_model("qwen3-30b-a3b", torch.device("cpu"), torch.bfloat16, tmp_path, 0, hf=False)
    assert model.num_params == 30_532_122_624
    expert = 3 * 2048 * 768
    assert model.active_params == model.num_params - 48 * 120 * expert
    weights = WeightBytes.of(model.spec, model.num_params, 2)
    embed = 151936 * 2048
    assert weights.expert == 2 * expert and weights.routing == Routing(128, 8, 48)
    assert weights.dense == 2 * (model.num_params - 48 * 128 * expert - embed)
    assert weights.step(512) == pytest.approx(2 * (model.num_params - embed), rel=1e-6)


def test_expert_adapter_rows_count_the_experts_its_tokens_reach(tmp_path):
    """An expert adapter's attention rows are read whole, its expert rows by the experts its
    tokens reach (per MoE layer, in the pool's page layout); an attention adapter's whole."""
    import torch

    from slora_batch.bench.adapters import write_attention_adapters, write_expert_adapters
    from slora_batch.bench.model import build_model
    from slora_batch.engine.adapters.store import AdapterStore

    model = build_model("tiny-moe", torch.device("cpu"), torch.float32, tmp_path, 0, hf=False)
    spec = model.spec
    experts = write_expert_adapters(spec, torch.float32, tmp_path / "e", 0, (4,))
    attention = write_attention_adapters(spec, torch.float32, tmp_path / "a", 0, (4,))
    store = AdapterStore(spec, {"e": experts[4], "a": attention[4]})
    routing = Routing.of(spec)
    rows = AdapterRows(store, routing)
    assert rows("a", 1) == rows("a", 500) == store.nbytes("a")
    # per expert and layer: rank 4 on gate_up (64 -> 64) and down (32 -> 64) in pages of 32
    page = spec.page_size * 4
    per_expert = 4 * ((2 + 2) + (1 + 2)) * page
    whole = store.nbytes("a")  # the same q, k, v, o rows at the same rank
    layers = routing.moe_layers
    assert rows("e", 0) == whole
    assert rows("e", 1) == pytest.approx(whole + layers * 2 * per_expert)
    assert rows("e", 10_000) == pytest.approx(store.nbytes("e"))
    assert store.nbytes("e") == whole + layers * spec.num_experts * per_expert
    assert rows("e", 3) == pytest.approx(whole + layers * routing.touched(3) * per_expert)
