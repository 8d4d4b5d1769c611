"""``max_num_seqs: auto`` (execution/seats.py): the formula, its bounds, the engine that
resolves it and runs at most that many rows, and the CUDA-graph buckets up to it."""

from __future__ import annotations

import logging
import random

import pytest
from factory import make_adapter, make_model, tiny_spec

from slora_batch import Engine, EngineConfig, Request
from slora_batch.engine.config import AUTO_MAX_SEQS, AUTO_MIN_SEQS, ConfigError
from slora_batch.engine.execution.memory import graph_buckets
from slora_batch.engine.execution.seats import auto_num_seqs
from slora_batch.engine.scheduling.kv_pages import PAGES_PER_TOKEN


def test_rows_whose_kv_fits_after_the_pinned_adapters_of_mean_size():
    config = EngineConfig(auto_context_tokens=100, max_adapters_per_batch=2,
                          max_resident_adapters=2)  # fmt: skip
    adapters = [30, 500, 70, 401]  # two of their mean size (250.25): 501 pages held back
    pages = 501 + 2 * 100 * 40 + 99  # 40 rows of 100 tokens, and not a 41st
    assert auto_num_seqs(config, pages, 2, adapters, max_model_len=4096) == 40
    # the model's context caps the planned one: 50 tokens a row, twice the rows
    assert auto_num_seqs(config, pages, 2, adapters, max_model_len=50) == 80
    # bounds: a tiny pool still runs AUTO_MIN_SEQS (admission stops at the pages), a huge one
    # no more than AUTO_MAX_SEQS; admit_batch raises the floor
    assert auto_num_seqs(config, 1000, 2, adapters, 4096) == AUTO_MIN_SEQS
    assert auto_num_seqs(config, 10**9, 2, adapters, 4096) == AUTO_MAX_SEQS
    wide = EngineConfig(admit_batch=64)
    assert auto_num_seqs(wide, 1000, 2, [], 4096) == 64
    # fewer adapters than a batch may pin: all of them (here 1001 pages), not the cap's worth
    few = EngineConfig(auto_context_tokens=100, max_adapters_per_batch=8)
    assert auto_num_seqs(few, 1001 + 2 * 100 * 40 + 99, 2, adapters, 4096) == 40


def test_config_takes_auto_or_a_positive_integer():
    assert EngineConfig().max_num_seqs == "auto"
    assert EngineConfig(max_num_seqs=7).seats_bound == 7
    assert EngineConfig().seats_bound == AUTO_MAX_SEQS
    for bad in ("many", 0, -3, True, 2.5):
        with pytest.raises(ConfigError, match="max_num_seqs"):
            EngineConfig(max_num_seqs=bad)
    with pytest.raises(ConfigError, match="admit_batch"):
        EngineConfig(max_num_seqs=8, admit_batch=9)
    with pytest.raises(ConfigError, match="auto_context_tokens"):
        EngineConfig(auto_context_tokens=0)


def test_graph_buckets_cover_every_batch_up_to_the_cap():
    for cap in (1, 5, 16, 255, 256, 300, 512, 700, 1024):
        buckets = graph_buckets(cap)
        assert buckets == sorted(set(buckets)) and buckets[-1] == cap
        for batch in range(1, cap + 1):
            bucket = min(b for b in buckets if b >= batch)
            assert bucket - batch <= max(16, batch // 8)  # padding stays under 1/8 past 128
    assert graph_buckets(256) == [1, 2, 4, 8, *range(16, 257, 16)]  # as before up to 256
    assert len(graph_buckets(1024)) == 36


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("seats")
    model_dir = make_model(root, "gqa")
    adapters = {
        f"a{i}": make_adapter(model_dir, root / f"a{i}", rank=2 + 2 * i, targets=["q_proj"],
                              alpha=4, rslora=False, seed=i)
        for i in range(3)
    }  # fmt: skip
    return model_dir, adapters


def _requests(n: int) -> list[Request]:
    rng = random.Random(1)
    return [
        Request(id=i, adapter=[None, "a0", "a1", "a2"][i % 4], max_new_tokens=rng.randrange(2, 6),
                prompt_token_ids=[rng.randrange(3, 300) for _ in range(rng.randrange(1, 6))],
                ignore_eos=True)
        for i in range(n)
    ]  # fmt: skip


def _peak_rows(engine: Engine, requests: list[Request]) -> tuple[int, dict]:
    peak, schedule = [0], engine.scheduler.schedule

    def counted():
        step = schedule()
        peak[0] = max(peak[0], len(engine.scheduler.running))
        return step

    engine.scheduler.schedule = counted
    results = {r.id: r.token_ids for r in engine.generate(requests)}
    return peak[0], results


def test_engine_resolves_auto_from_its_pool_and_runs_that_many_rows(tiny, caplog):
    model_dir, adapters = tiny
    probe = Engine(model_dir, adapters=adapters, config=EngineConfig(device="cpu", num_pages=64))
    adapter_pages = sum(probe.store.pages(a) for a in adapters)
    context = 16
    rows = 37  # the pool holds the adapters and 37 rows of 16 tokens
    pages = adapter_pages + rows * PAGES_PER_TOKEN * context + 5
    config = EngineConfig(device="cpu", num_pages=pages, auto_context_tokens=context)
    with caplog.at_level(logging.INFO, logger="slora_batch.engine.execution.seats"):
        engine = Engine(model_dir, adapters=adapters, config=config)
    assert engine.config.max_num_seqs == rows == engine.counters.max_num_seqs
    assert engine.scheduler.config.max_num_seqs == rows
    assert "max_num_seqs auto: 37 rows" in caplog.text
    requests = _requests(64)
    peak, auto_tokens = _peak_rows(engine, requests)
    assert AUTO_MIN_SEQS < peak <= rows  # past the floor, never past the resolved cap
    # a fixed cap stays as given, and the tokens do not depend on the cap
    fixed = Engine(model_dir, adapters=adapters,
                   config=EngineConfig(device="cpu", num_pages=pages, max_num_seqs=16))  # fmt: skip
    assert fixed.config.max_num_seqs == 16
    fixed_peak, fixed_tokens = _peak_rows(fixed, requests)
    assert fixed_peak == 16 and fixed_tokens == auto_tokens


def test_auto_on_a_card_takes_the_most_rows_whose_own_reserve_leaves_room_for_them(monkeypatch):
    """On cuda the reserve for the sampler and CUDA graphs grows with the cap: the cap is the
    most rows whose own reserve leaves a pool that holds them (a 150k vocabulary's sampler at
    the 1024-row bound would take ~7 GiB and plan a fraction of the rows). Faked device memory:
    no card needed."""
    import torch

    from slora_batch.engine.execution import memory, parts

    spec = tiny_spec(vocab_size=151936, max_position_embeddings=4096, num_layers=48,
                     hidden_size=2048, num_heads=32, num_kv_heads=4, head_dim=128)  # fmt: skip
    free = {"bytes": 24 << 30}
    monkeypatch.setattr(memory, "device_memory", lambda device: (free["bytes"], 80 << 30))
    cuda, dtype = torch.device("cuda"), torch.bfloat16
    config = EngineConfig(device="cuda", auto_context_tokens=512)
    adapters = [300] * 50

    def rows_held(seats: int) -> int:
        pages = memory.num_pages(parts.resolved(config, seats), spec, dtype, cuda, 4096, True)
        return auto_num_seqs(config, pages, PAGES_PER_TOKEN, adapters, 4096, quiet=True)

    resolved, pages = parts._auto_seats(config, spec, dtype, cuda, 4096, None, adapters)
    seats = resolved.max_num_seqs
    assert rows_held(seats) >= seats and rows_held(seats + 1) < seats + 1
    assert pages == memory.num_pages(resolved, spec, dtype, cuda, 4096)
    # planned from the pool at the bound's reserve, a fraction of those rows
    at_bound = auto_num_seqs(config, memory.num_pages(config, spec, dtype, cuda, 4096),
                             PAGES_PER_TOKEN, adapters, 4096)  # fmt: skip
    assert AUTO_MIN_SEQS < at_bound < 0.8 * seats and seats < AUTO_MAX_SEQS, (at_bound, seats)
    # a card where the bound's reserve leaves no pool at all still plans the rows that fit
    free["bytes"] = 12 << 30
    with pytest.raises(memory.DeviceMemoryError):
        memory.num_pages(config, spec, dtype, cuda, 4096)
    small, _ = parts._auto_seats(config, spec, dtype, cuda, 4096, None, adapters)
    assert AUTO_MIN_SEQS < small.max_num_seqs < seats
