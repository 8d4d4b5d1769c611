"""The eval job's engine built while lm-eval prepares (``eval/early.py``): built on the calling
thread while the preparation runs on another, handed to the run or closed, never left open."""

from __future__ import annotations

import threading

import pytest

import slora_batch.engine.parallel.data_parallel as data_parallel
from slora_batch.eval.early import prepare_beside_engine
from slora_batch.jobs.config import JobConfig
from slora_batch.jobs.lock import OutputLock


class FakeEngine:
    def __init__(self, *args) -> None:
        self.args, self.closed, self.thread = args, 0, threading.current_thread()

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def job(tmp_path, monkeypatch, sample_model_dir):
    monkeypatch.setattr(data_parallel, "open_engine", FakeEngine)
    return JobConfig(name="t", model=str(sample_model_dir), input=str(tmp_path / "in.jsonl"),
                     output=str(tmp_path / "out"))  # fmt: skip


def test_engine_built_here_while_prepare_runs_there(job):
    threads = []
    value, early = prepare_beside_engine(job, lambda: threads.append(threading.current_thread()))
    assert value is None and threads[0] is not threading.current_thread()
    engine = early.engine
    assert engine.thread is threading.current_thread() and str(engine.args[0]) == job.model
    assert early.take(None) is engine
    early.close()  # taken: the run closes it
    assert engine.closed == 0


def test_an_untaken_engine_is_closed_once(job):
    _, early = prepare_beside_engine(job, lambda: 7)
    early.close()
    early.close()
    assert early.engine.closed == 1


def test_a_failed_preparation_closes_the_engine(job, monkeypatch):
    built = []
    monkeypatch.setattr(
        data_parallel, "open_engine", lambda *a: built.append(FakeEngine()) or built[0]
    )

    def fail():
        raise ValueError("no such task")

    with pytest.raises(ValueError, match="no such task"):
        prepare_beside_engine(job, fail)
    assert built[0].closed == 1


def test_no_engine_when_another_run_holds_the_output_or_the_build_fails(job, monkeypatch):
    with OutputLock(job.output):
        assert prepare_beside_engine(job, lambda: 1) == (1, None)

    def broken(*args):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(data_parallel, "open_engine", broken)
    assert prepare_beside_engine(job, lambda: 2) == (2, None)  # the run builds and says why
