"""Data parallelism on cpu: two worker processes give the tokens of one engine, balance skewed
adapter popularity, report a worker's death after every result received, and survive an
abandoned stream."""

from __future__ import annotations

import os
import signal

import pytest
from factory import make_adapters, make_model, make_rows

from slora_batch import Engine, EngineConfig, Request
from slora_batch.engine.models.sample_model import ModelNotFoundError
from slora_batch.engine.parallel.data_parallel import DataParallelEngine, WorkerDied, chunks
from slora_batch.jobs.ordering import sorted_windows

ROWS = 48
VOCAB = 300
KNOBS = dict(device="cpu", dtype="float32", num_pages=4000, lookahead=16, max_num_seqs=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    model_dir = make_model(root, "gqa")
    return model_dir, make_adapters(model_dir, root / "adapters")


@pytest.fixture(scope="module")
def dp(tiny):
    model_dir, adapters = tiny
    with DataParallelEngine(model_dir, adapters, EngineConfig(data_parallel=2, **KNOBS)) as engine:
        yield engine


def one_engine(tiny, rows) -> dict:
    model_dir, adapters = tiny
    engine = Engine(model_dir, adapters=adapters, config=EngineConfig(cpu_threads=1, **KNOBS))
    return {r.id: r.token_ids for r in engine.generate(Request(**row) for row in rows)}


def sorted_requests(rows) -> list[Request]:
    return list(sorted_windows((Request(**row) for row in rows), window=ROWS))


def rows_per_worker(dp, before: list[int]) -> list[int]:
    return [w["rows"] - b for w, b in zip(dp.workers_summary(), before, strict=True)]


def test_chunks_cut_at_adapter_changes():
    names = ["a", "a", "a", "b", "b", "c", "d", "d", "d", "d", "e"]
    got = [[r.adapter for r in c] for c in chunks([Request(i, n) for i, n in enumerate(names)], 4)]
    assert got == [["a"] * 3, ["b"] * 2, ["c", "d", "d", "d"], ["d", "e"]]


def test_two_workers_give_the_tokens_of_one_engine(tiny, dp):
    rows = make_rows(ROWS, VOCAB, list(tiny[1]), seed=3)
    before = [w["rows"] for w in dp.workers_summary()]
    got = {r.id: r.token_ids for r in dp.generate(sorted_requests(rows))}
    assert got == one_engine(tiny, rows)
    shares = rows_per_worker(dp, before)
    assert sum(shares) == ROWS and min(shares) > 0, shares
    assert dp.device == "cpu x2" and dp.dtype == "torch.float32"
    assert dp.counters.rows >= ROWS and dp.counters.steps > 0
    assert all(1 <= w["adapters"] <= len(tiny[1]) + 1 for w in dp.workers_summary())


def test_skewed_popularity_still_uses_both_workers(tiny, dp):
    """Four rows in five on one adapter: its run is split between the workers, as chunks."""
    names = list(tiny[1])
    rows = make_rows(ROWS, VOCAB, names, seed=4)
    for i, row in enumerate(rows):
        row["adapter"] = names[1] if i % 5 else names[i % len(names)]
    before = [w["rows"] for w in dp.workers_summary()]
    got = {r.id: r.token_ids for r in dp.generate(sorted_requests(rows))}
    shares = rows_per_worker(dp, before)
    assert min(shares) >= ROWS // 4, shares
    assert got == one_engine(tiny, rows)


def test_an_abandoned_stream_then_a_new_one(tiny, dp):
    rows = make_rows(24, VOCAB, list(tiny[1]), seed=5)
    results = dp.generate(sorted_requests(rows))
    assert next(results).id in {row["id"] for row in rows}
    results.close()  # the workers drop what they hold
    got = {r.id: r.token_ids for r in dp.generate(sorted_requests(rows))}
    assert got == one_engine(tiny, rows)


def test_a_killed_worker_is_reported_after_every_result_received(tiny):
    model_dir, adapters = tiny
    rows = make_rows(ROWS, VOCAB, list(adapters), seed=6)
    config = EngineConfig(data_parallel=2, **KNOBS)
    got = []
    with DataParallelEngine(model_dir, adapters, config) as engine:
        with pytest.raises(WorkerDied) as died:
            for result in engine.generate(sorted_requests(rows)):
                got.append(result)
                if len(got) == 4:
                    os.kill(engine.pids[1], signal.SIGKILL)
        pid = engine.pids[1]
        assert f"worker 1 (cpu, pid {pid}) died with exit code -9 (SIGKILL)" in str(died.value)
        assert "rows in flight were not written" in str(died.value)
        assert 4 <= len(got) < ROWS and len({r.id for r in got}) == len(got)
        expected = one_engine(tiny, rows)
        assert all(r.token_ids == expected[r.id] for r in got)
        assert [w["alive"] for w in engine.workers_summary()] == [True, False]
        with pytest.raises(WorkerDied, match="worker 1"):
            next(engine.generate(sorted_requests(rows)))


def test_an_engine_that_cannot_start_raises_its_own_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        DataParallelEngine(tmp_path, None, EngineConfig(data_parallel=2, **KNOBS))


def test_n_samples_across_workers_every_sample_once(tiny, dp):
    """Rows of n samples: the driver counts the results each row owes, so its bound holds and
    each sample comes back once, with the tokens one engine gives."""
    rows = [dict(row, n=3, temperature=1.0, seed=4) for row in make_rows(24, VOCAB, list(tiny[1]))]
    results = list(dp.generate(sorted_requests(rows)))
    keys = [(r.id, r.sample_index) for r in results]
    assert sorted(keys) == sorted((row["id"], k) for row in rows for k in range(3))
    model_dir, adapters = tiny
    engine = Engine(model_dir, adapters=adapters, config=EngineConfig(cpu_threads=1, **KNOBS))
    alone = {(r.id, r.sample_index): r.token_ids for r in engine.generate(sorted_requests(rows))}
    assert {(r.id, r.sample_index): r.token_ids for r in results} == alone
    assert all(w.outstanding == 0 for w in dp.workers)
