"""Adapters that take a large share of the pool (LoRA on every expert of a mixture of experts:
about 1 GB each on Qwen3-30B-A3B), on a tiny Qwen3-MoE: ``max_num_seqs: auto`` still plans rows
of KV beside them (execution/seats.py); an adapter that fits only alone runs once the batch's
adapter is idle, and rows whose adapter cannot fit at all are error rows; a uniform mix of many
such adapters loads each about once (the scheduler picks rows of pinned, then resident adapters
first)."""

from __future__ import annotations

import random

import pytest
import torch
from moe_factory import VOCAB, make_moe_model

from slora_batch import Engine, EngineConfig, Request
from slora_batch.bench.adapters import write_expert_adapters
from slora_batch.engine.config import AUTO_MIN_SEQS
from slora_batch.engine.execution.seats import PINNED_SHARE, auto_num_seqs
from slora_batch.engine.models.spec import read_spec
from slora_batch.engine.scheduling.kv_pages import PAGES_PER_TOKEN


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """The tiny Qwen3-MoE (8 experts, 2 layers) and one expert adapter directory per rank 8,
    16, 32 (q, k, v, o and both expert parameters: 70 pages a rank)."""
    root = tmp_path_factory.mktemp("large-adapters")
    model_dir = make_moe_model(root, "qwen3-moe")
    dirs = write_expert_adapters(read_spec(model_dir), torch.float32, root, 0, (8, 16, 32))
    return model_dir, dirs


def rows(names: list[str], seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(id=i, adapter=name, max_new_tokens=rng.randrange(2, 7), ignore_eos=True,
                prompt_token_ids=[rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 13))])
        for i, name in enumerate(names)
    ]  # fmt: skip


def run(model_dir, adapters, requests, **knobs) -> tuple[dict, Engine]:
    engine = Engine(model_dir, adapters=adapters, config=EngineConfig(device="cpu", **knobs))
    return {r.id: r for r in engine.generate(requests)}, engine


def test_auto_seats_hold_back_at_most_half_the_pool_for_adapters():
    config = EngineConfig(auto_context_tokens=100)
    # 100 adapters of 1000 pages in a pool of 10000: all of them would leave no KV (16 rows,
    # the floor); half the pool is held back, the other half holds 25 rows of 100 tokens
    assert auto_num_seqs(config, 10_000, 2, [1000] * 100, 4096) == 25
    # small adapters are held back one a row: 47 rows of 200 pages beside 470 adapter pages
    assert auto_num_seqs(config, 10_000, 2, [10] * 100, 4096) == 47


def test_an_engine_with_large_adapters_plans_rows_beside_half_the_pool(moe):
    model_dir, dirs = moe
    adapters = {f"x{i}": dirs[(8, 16)[i % 2]] for i in range(24)}  # 840 pages on average
    context = 16
    pages = 3 * 840
    results, engine = run(model_dir, adapters, rows(["x0", "x1"], 0), num_pages=pages,
                          auto_context_tokens=context)  # fmt: skip
    want = (pages - int(pages * PINNED_SHARE)) // (PAGES_PER_TOKEN * context)
    assert engine.config.max_num_seqs == want > AUTO_MIN_SEQS
    assert all(r.finish_reason == "length" for r in results.values())


def test_an_adapter_that_fits_only_alone_runs_after_the_batch_and_a_too_large_one_fails(moe):
    """The pool holds one rank-16 expert adapter (1120 pages) and some KV, not two: rows of a
    and b, interleaved, all complete (a's rows first, then b's once a is idle: each loaded
    once), with the tokens of a pool that holds both; c (rank 32, 2240 pages) never fits, and
    its rows are error rows saying so."""
    model_dir, dirs = moe
    adapters = {"a": dirs[16], "b": dirs[16], "c": dirs[32]}
    requests = rows(["a", "b", "c"] * 5, seed=1)
    pages = 1120 + 300
    results, engine = run(model_dir, adapters, requests, num_pages=pages, max_num_seqs=8)
    for request in requests:
        result = results[request.id]
        if request.adapter == "c":
            assert result.finish_reason == "error" and f"the pool has {pages}" in result.error
        else:
            assert result.finish_reason == "length", result.error
    assert (engine.counters.adapter_loads, engine.counters.adapter_evictions) == (2, 1)
    roomy, _ = run(model_dir, adapters, [r for r in requests if r.adapter != "c"],
                   num_pages=20_000, max_num_seqs=8)  # fmt: skip
    assert {i: r.token_ids for i, r in roomy.items()} == {i: results[i].token_ids for i in roomy}


def test_a_uniform_mix_of_many_large_adapters_loads_each_about_once(moe):
    """24 expert adapters (ranks 8 and 16), 4 rows each in random order, in a pool that holds
    about three of them: every row completes and each adapter is loaded once, plus at most once
    per preempted row (whose adapter may have left meanwhile), though the pool cycles through
    all of them. Picking the queue's head instead of a resident adapter's rows would load an
    adapter for nearly every row."""
    model_dir, dirs = moe
    names = [f"x{i:02d}" for i in range(24)]
    adapters = {name: dirs[(8, 16)[i % 2]] for i, name in enumerate(names)}
    mix = [name for name in names for _ in range(4)]
    random.Random(2).shuffle(mix)
    results, engine = run(model_dir, adapters, rows(mix, seed=3), num_pages=3 * 840)
    assert all(r.finish_reason == "length" for r in results.values())
    counters = engine.counters
    assert counters.adapter_evictions >= len(names) - 3  # the pool held a few at a time
    assert len(names) <= counters.adapter_loads <= len(names) + counters.preemptions
