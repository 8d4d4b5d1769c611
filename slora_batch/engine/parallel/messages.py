"""The messages between the data-parallel driver (``data_parallel``) and its workers
(``dp_worker``), one type per kind, sent through ``multiprocessing`` pipes (so picklable:
NamedTuples of plain values, requests, results and counters).

Driver to worker, each naming the stream it belongs to (``stream``: the driver's count of
``generate`` calls, so that a worker drops what is left of an abandoned one): ``Rows`` (the next
chunk), ``End`` (no more rows: finish what is held), ``Abort`` (the driver abandoned the stream:
drop its rows).

Worker to driver: ``Ready`` once its engine is built; per stream a ``RowResult`` per result and
``Done`` at its end; ``Failed`` before the process exits with status 1; ``Log``, the worker's
log records, logged by the driver through its own handlers; ``Alive`` every
``dp_worker.beat_s(timeout)`` from a thread of its own, so that the driver tells a silent or
stuck worker from a busy one (``dp_handle.WorkerHandle.unresponsive``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from slora_batch.engine.counters import EngineCounters
from slora_batch.engine.requests.request import Request, Result


class Rows(NamedTuple):
    """The next chunk of the stream's rows."""

    stream: int
    requests: list[Request]


class End(NamedTuple):
    """No more rows in the stream: finish those held, then send ``Done``."""

    stream: int


class Abort(NamedTuple):
    """The driver abandoned the stream: drop its rows, send nothing more of it."""

    stream: int


class Ready(NamedTuple):
    """The worker's engine is built: what it runs on and what it knows."""

    device: str
    dtype: str
    counters: EngineCounters
    adapters: list[str]  # the adapter names its engine can use
    lookahead: int  # rows its engine holds unanswered at most


class RowResult(NamedTuple):
    """One result of the stream; the engine's counters at most every ``COUNTERS_EVERY_S``."""

    stream: int
    result: Result
    counters: EngineCounters | None


class Done(NamedTuple):
    """The worker sent every result of the stream."""

    stream: int
    counters: EngineCounters


class Failed(NamedTuple):
    """The worker is exiting on an exception: its text, and the exception itself when it
    pickles (None when not, or when the driver should report the exit rather than raise it)."""

    text: str
    error: BaseException | None


class Log(NamedTuple):
    """A worker's log record, as ``logging.makeLogRecord`` takes it (name, levelno,
    levelname, msg)."""

    record: dict[str, Any]


class Alive(NamedTuple):
    """The worker's heartbeat: what it does ("loading the engine", "waiting for rows", "running
    steps", "idle") and its engine's steps so far."""

    doing: str
    steps: int


ToWorker = Rows | End | Abort
ToDriver = Ready | RowResult | Done | Failed | Log | Alive
