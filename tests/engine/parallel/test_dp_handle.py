"""The driver's view of a worker's liveness: heartbeats that repeat the same step count while it
holds rows count as no progress; a step more, a result or a new state count as progress."""

from __future__ import annotations

from slora_batch.engine.parallel import dp_handle
from slora_batch.engine.parallel.dp_handle import WorkerHandle
from slora_batch.engine.parallel.messages import Alive, Log


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _handle(monkeypatch) -> tuple[WorkerHandle, Clock]:
    clock = Clock()
    monkeypatch.setattr(dp_handle.time, "monotonic", clock)
    return WorkerHandle(slot=None, process=None, inbox=None, outbox=None, outstanding=3), clock


def test_heartbeats_without_a_step_more_are_no_progress_while_rows_are_held(monkeypatch):
    handle, clock = _handle(monkeypatch)
    handle.heard_from(Alive("running steps", 7))
    for _ in range(5):  # the same step count, again and again: it answers, but is stuck
        clock.now += 4.0
        handle.heard_from(Alive("running steps", 7))
        handle.heard_from(Log({"msg": "still here"}))
    why = handle.unresponsive(timeout_s=10.0)
    assert why is not None and "made no progress for 20.0 s while running steps" in why
    assert "after 7 steps" in why


def test_a_step_more_or_a_new_state_is_progress(monkeypatch):
    handle, clock = _handle(monkeypatch)
    handle.heard_from(Alive("running steps", 7))
    clock.now += 8.0
    handle.heard_from(Alive("running steps", 8))
    clock.now += 8.0
    assert handle.unresponsive(timeout_s=10.0) is None
    handle.heard_from(Alive("waiting for rows", 8))
    clock.now += 30.0  # silent for 30 s: hung whatever it said last
    assert handle.unresponsive(timeout_s=10.0).startswith("sent nothing for 30.0 s")


def test_a_worker_waiting_for_rows_is_not_stuck(monkeypatch):
    handle, clock = _handle(monkeypatch)
    handle.heard_from(Alive("waiting for rows", 0))
    for _ in range(5):
        clock.now += 4.0
        handle.heard_from(Alive("waiting for rows", 0))
    assert handle.unresponsive(timeout_s=10.0) is None
