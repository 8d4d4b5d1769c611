"""Data parallelism on cpu: two worker processes give the tokens of one engine, balance skewed
adapter popularity, report a worker's death after every result received, and survive an
abandoned stream."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

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


def one_engine(tiny, rows, value=lambda r: r.token_ids) -> dict:
    model_dir, adapters = tiny
    engine = Engine(model_dir, adapters=adapters, config=EngineConfig(cpu_threads=1, **KNOBS))
    return {r.id: value(r) for r in engine.generate(Request(**row) for row in rows)}


def sorted_requests(rows) -> list[Request]:
    return list(sorted_windows((Request(**row) for row in rows), window=ROWS))


def rows_per_worker(dp, before: list[int]) -> list[int]:
    return [w["rows"] - b for w, b in zip(dp.workers_summary(), before, strict=True)]


def test_chunks_cut_at_adapter_changes():
    names = ["a", "a", "a", "b", "b", "c", "d", "d", "d", "d", "e"]
    got = [[r.adapter for r in c] for c in chunks([Request(i, n) for i, n in enumerate(names)], 4)]
    assert got == [["a"] * 3, ["b"] * 2, ["c", "d", "d", "d"], ["d", "e"]]


def launch_rows(kind: str, count: int, adapters: list[str]) -> list[dict]:
    """Rows that finish in the step that launches them (issue 23's repro): scored ones, or
    equal lengths whose last token is drawn there (``ignore_eos``)."""
    rows = []
    for k in range(count):
        row = {"id": k, "adapter": adapters[k % len(adapters)] if k % 3 else None,
               "prompt_token_ids": [3 + k % (VOCAB - 3), 7, 9]}  # fmt: skip
        if kind == "scored":
            row["continuation_token_ids"] = [11, 12]
        else:
            row.update(max_new_tokens=4, ignore_eos=True)
        rows.append(row)
    return rows


def outcome(result) -> tuple:
    return result.finish_reason, result.token_ids, result.continuation_tokens


@contextlib.contextmanager
def deadline(engine, seconds: float):
    """Fails a stream still running after ``seconds`` (a deadlock), by killing the workers so
    that the driver's wait ends instead of hanging the test."""
    hung = threading.Event()

    def expire() -> None:
        hung.set()
        for pid in engine.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(seconds, expire)
    timer.start()
    try:
        yield hung
    except WorkerDied:
        assert not hung.is_set(), f"the stream was still running after {seconds} s: deadlock"
        raise
    finally:
        timer.cancel()


@pytest.mark.parametrize("kind", ["mixed", "scored", "equal-length"])
def test_two_workers_give_the_results_of_one_engine(tiny, dp, kind):
    """Mixed rows, and rows that all finish at their launch step (scored; equal lengths): more
    of them than twice a worker's bound of rows outstanding (lookahead + 2 chunks), so that a
    worker holding finished results while it waits for rows would hang the stream."""
    count = ROWS if kind == "mixed" else 6 * (KNOBS["lookahead"] + 4)
    names = list(tiny[1])
    rows = (
        make_rows(count, VOCAB, names, seed=3)
        if kind == "mixed"
        else launch_rows(kind, count, names)
    )
    before = [w["rows"] for w in dp.workers_summary()]
    with deadline(dp, 120):
        results = list(dp.generate(sorted_requests(rows)))
    assert sorted(r.id for r in results) == list(range(count))  # every row once
    assert not [r.error for r in results if r.error]
    expected = one_engine(tiny, rows, outcome)
    assert {r.id: outcome(r) for r in results} == expected
    if kind == "scored":
        alone = one_engine(tiny, rows, lambda r: r.logprob)
        assert {r.id: r.logprob for r in results} == pytest.approx(alone, abs=1e-4)
    assert all(w.outstanding == 0 for w in dp.workers)
    shares = rows_per_worker(dp, before)
    assert sum(shares) == count and min(shares) > 0, shares
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


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("kind", ["scored", "equal-length"])
def test_the_engine_pulls_only_after_yielding_what_it_read_back(tiny, kind, overlap):
    """The invariant data parallel relies on: whenever the engine pulls a row, the rows it holds
    unanswered (pulled, no result yielded) are fewer than lookahead, also when whole steps finish
    at launch and are read back only after the next step (overlap)."""
    model_dir, adapters = tiny
    config = EngineConfig(cpu_threads=1, overlap=overlap, **KNOBS)
    engine = Engine(model_dir, adapters=adapters, config=config)
    rows = launch_rows(kind, 4 * KNOBS["lookahead"], list(adapters))
    held, answered = [], set()

    def source():
        for row in rows:
            held.append(int(row["id"]) + 1 - len(answered))  # this row and those unanswered
            yield Request(**row)

    for result in engine.generate(source()):
        answered.add(result.id)
    assert len(answered) == len(rows)
    assert max(held) <= KNOBS["lookahead"], max(held)
