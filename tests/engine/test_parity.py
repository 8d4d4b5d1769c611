"""End-to-end: the engine's greedy tokens equal transformers + PEFT, row for row, in fp32 on CPU."""

from __future__ import annotations

import random

import pytest
from factory import KINDS, make_adapters, make_model, make_rows, reference

from slora_batch import Engine, EngineConfig, Request

ROWS = 44
VOCAB = 300


@pytest.fixture(scope="module", params=KINDS)
def case(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model_dir = make_model(root, request.param)
    adapters = make_adapters(model_dir, root / "adapters")
    rows = make_rows(ROWS, VOCAB, list(adapters), seed=KINDS.index(request.param))
    return model_dir, adapters, rows, reference(model_dir, adapters, rows)


def run(model_dir, adapters, rows, **knobs) -> tuple[dict, Engine]:
    config = EngineConfig(device="cpu", dtype="float32", **knobs)
    engine = Engine(model_dir, adapters=adapters, config=config)
    results = {r.id: r for r in engine.generate(Request(**row) for row in rows)}
    assert sorted(map(str, results)) == sorted(str(row["id"]) for row in rows)
    assert all(r.error is None for r in results.values()), [
        r.error for r in results.values() if r.error
    ]
    return results, engine


def assert_parity(results, expected) -> None:
    wrong = {
        i: (results[i].token_ids, want)
        for i, want in expected.items()
        if results[i].token_ids != want
    }
    assert not wrong, f"{len(wrong)} rows differ from transformers + PEFT: {wrong}"


def test_parity_roomy_pool(case):
    model_dir, adapters, rows, expected = case
    results, engine = run(model_dir, adapters, rows, num_pages=8000, max_num_batched_tokens=64)
    assert_parity(results, expected)
    assert engine.counters.preemptions == 0
    assert (
        engine.counters.steps > 10
    )  # chunked prefill and decode steps mixed, not one row at a time
    for row in rows:
        r = results[row["id"]]
        assert r.completion_tokens == len(r.token_ids) <= row["max_new_tokens"]
        assert r.prompt_tokens == len(row["prompt_token_ids"])
        ended_on_eos = r.token_ids[-1] == 2  # the factory's eos id
        assert r.finish_reason == ("stop" if ended_on_eos else "length")


def test_parity_with_preemption_and_eviction(case):
    model_dir, adapters, rows, expected = case
    results, engine = run(
        model_dir,
        adapters,
        rows,
        num_pages=1400,
        max_num_batched_tokens=48,
        max_adapters_per_batch=3,
    )
    assert_parity(results, expected)
    assert engine.counters.preemptions > 0
    assert engine.counters.adapter_evictions > 0
    assert engine.counters.peak_pages <= 1400


def test_shuffled_input_same_outputs(case):
    model_dir, adapters, rows, expected = case
    shuffled = rows[:]
    random.Random(7).shuffle(shuffled)
    results, _ = run(
        model_dir, adapters, shuffled, num_pages=3000, max_num_batched_tokens=32, max_num_seqs=6
    )
    assert_parity(results, expected)


def test_seeded_sample_independent_of_batch(case):
    model_dir, adapters, rows, _ = case
    probe = dict(
        rows[3], id="probe", temperature=0.9, top_p=0.9, top_k=50, seed=11, max_new_tokens=12
    )
    alone, _ = run(model_dir, adapters, [probe], num_pages=3000)
    crowd, _ = run(
        model_dir, adapters, rows[:20] + [probe], num_pages=3000, max_num_batched_tokens=40
    )
    assert alone["probe"].token_ids == crowd["probe"].token_ids
    other_seed, _ = run(model_dir, adapters, [dict(probe, seed=12)], num_pages=3000)
    assert other_seed["probe"].token_ids != alone["probe"].token_ids


@pytest.mark.parametrize("system", ["bmm", "no-unified"])
def test_ablations_compute_the_same(case, system):
    """The benchmark's ablations (padded bmm LoRA; separate KV and adapter pools), composed from
    the parts the bench assembles the engine from, are exact too."""
    import torch

    from slora_batch.bench.engine_run import engine_parts
    from slora_batch.engine.engine import assemble

    model_dir, adapters, rows, expected = case
    config = EngineConfig(device="cpu", dtype="float32", num_pages=8000, max_num_batched_tokens=64)
    parts = engine_parts(system, "torch", torch.device("cpu"))
    engine = assemble(model_dir, adapters, config, parts=parts)
    results = {r.id: r for r in engine.generate(Request(**row) for row in rows)}
    assert_parity(results, expected)
    if system == "no-unified":
        assert engine.lora_pool is not engine.pool
        assert engine.pool.num_pages + engine.lora_pool.num_pages == 8000


@pytest.mark.parametrize("num_pages", [8000, 1400], ids=["roomy", "preempting"])
def test_overlapped_steps_match_one_at_a_time(case, num_pages):
    """Step N+1 launched before step N's tokens are read back (its input ids gathered on the
    device, rows finished by EOS computed once more and dropped, their pages held a step
    longer) gives the rows one-step-at-a-time gives: greedy and seeded sampling alike."""
    model_dir, adapters, rows, expected = case
    rows = [
        dict(row, temperature=0.8, top_p=0.9, seed=i) if i % 3 == 1 else row
        for i, row in enumerate(rows)
    ]
    knobs = dict(num_pages=num_pages, max_num_batched_tokens=48, max_adapters_per_batch=3)
    overlapped, engine = run(model_dir, adapters, rows, overlap=True, **knobs)
    serial, _ = run(model_dir, adapters, rows, overlap=False, **knobs)
    assert {i: (r.token_ids, r.finish_reason) for i, r in overlapped.items()} == {
        i: (r.token_ids, r.finish_reason) for i, r in serial.items()
    }
    assert_parity(overlapped, {i: want for i, want in expected.items() if i % 3 != 1})
    if num_pages == 1400:
        assert engine.counters.preemptions > 0
    assert engine.pool.num_used == engine.residency.evictable_pages()  # no KV page leaked
