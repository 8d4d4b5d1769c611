"""Adapters at scale on the CPU: 200 adapters, a host cache that holds 20, a device that holds
16; disk reads on the loader thread, counted, and close to the distinct adapters per window."""

from __future__ import annotations

import random
import shutil
import threading

import pytest
from factory import make_adapter, make_model

from slora_batch import Engine, EngineConfig, Request
from slora_batch.jobs.ordering import adapter_group, sorted_windows

ADAPTERS = 200
CACHED = 20  # adapters the host cache holds
WINDOW = 150
ROWS = 900


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    root = tmp_path_factory.mktemp("many")
    model_dir = make_model(root, "gqa")
    first = make_adapter(model_dir, root / "adapters" / "a000", 2, ["q_proj"], 4, False, seed=0)
    for i in range(1, ADAPTERS):  # distinct directories: each is read, cached and evicted alone
        shutil.copytree(first, root / "adapters" / f"a{i:03d}")
    return model_dir, root / "adapters"


def requests() -> list[Request]:
    """Adapters by a power law: a window of 150 rows holds about 90 of the 200."""
    rng = random.Random(0)
    return [
        Request(
            id=i,
            adapter=f"a{int(rng.random() ** 2 * ADAPTERS):03d}",
            prompt_token_ids=[rng.randrange(3, 300)],
            max_new_tokens=1,
        )
        for i in range(ROWS)
    ]


def run(many, group) -> Engine:
    model_dir, adapters = many
    probe = Engine(model_dir, adapters=adapters, config=EngineConfig(device="cpu", num_pages=64))
    config = EngineConfig(
        device="cpu", num_pages=4000, max_resident_adapters=16, max_adapters_per_batch=16,
        lookahead=64, host_cache_bytes=CACHED * probe.store.nbytes("a000"),
    )  # fmt: skip
    engine = Engine(model_dir, adapters=adapters, config=config)
    ordered = sorted_windows(requests(), window=WINDOW, group=group)
    results = list(engine.generate(ordered))
    assert len(results) == ROWS and all(r.error is None for r in results)
    return engine


def test_disk_loads_follow_distinct_adapters_per_window(many):
    rows = requests()
    per_window = [len({r.adapter for r in rows[i : i + WINDOW]}) for i in range(0, ROWS, WINDOW)]
    distinct = len({r.adapter for r in rows})
    alternating = run(many, group=adapter_group).counters
    cyclic = run(many, group=None).counters  # every window a..z: the order before alternation
    # Each window reads its adapters about once; alternating windows start with the adapters the
    # previous window ended with, still in the cache, so at least half the cache hits at each
    # of the 5 window boundaries.
    assert (
        distinct <= alternating.disk_loads <= sum(per_window) - (len(per_window) - 1) * CACHED // 2
    )
    assert alternating.disk_loads < cyclic.disk_loads <= sum(per_window) + len(per_window)
    assert alternating.adapter_loads >= alternating.disk_loads  # device loads include cache hits


def test_disk_reads_run_on_the_loader_thread(many, monkeypatch):
    """Reads happen on the store's loader thread, ahead of admission, never in the engine loop
    (except the very first adapter, which nothing runs beside)."""
    from slora_batch.engine.adapters import store as adapters_module

    threads: list[str] = []
    real = adapters_module.load_weights

    def spy(info, spec, **kwargs):
        threads.append(threading.current_thread().name)
        return real(info, spec, **kwargs)

    monkeypatch.setattr(adapters_module, "load_weights", spy)
    engine = run(many, group=adapter_group)
    loader = [t for t in threads if t.startswith("slora-adapter-loader")]
    assert len(threads) == engine.counters.disk_loads
    assert len(loader) >= len(threads) - 1
