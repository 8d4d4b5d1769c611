"""The data-parallel driver's handle on one worker process (``WorkerHandle``): its pipes, its
share of the current stream, the results each row sent to it still owes, and how it died.

A row is returned when all the results it owes are (``expected_results``: one per sample it
asks for, one for a scored row; one error result stands for all of them), so that the driver's
bound on rows outstanding holds with n samples per row as with one.

Liveness: every message from the worker (its heartbeat among them, ``dp_worker``) marks it
heard; a result, a step more, or a change of what it does marks progress. A worker silent for
``timeout_s`` (stopped, frozen), or one that holds rows and makes no progress for ``timeout_s``
while not waiting for rows (stuck in a step), is unresponsive: the driver kills it and reports
it as a death, naming what it was doing and for how long it was silent.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from slora_batch.engine.config import SamplingConfig
from slora_batch.engine.counters import EngineCounters
from slora_batch.engine.parallel.dp_worker import WorkerSlot
from slora_batch.engine.parallel.messages import Alive, Log, ToDriver, ToWorker
from slora_batch.engine.requests.request import Request, Result


class WorkerDied(RuntimeError):
    """A worker process ended while it held rows; they were never yielded (a re-run redoes them)."""


def expected_results(request: Request, sampling: SamplingConfig) -> int:
    """The results a request gives: one per sample it asks for (``n``, or ``sample_indices``),
    one for a scored row. A request that fails gives one error result instead, never more."""
    if request.scored:
        return 1
    if isinstance(request.sample_indices, list) and request.sample_indices:
        return len(request.sample_indices)
    n = request.n if request.n is not None else sampling.n
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1


@dataclass(eq=False)
class WorkerHandle:
    """The driver's handle on one worker process and its share of the current stream."""

    slot: WorkerSlot
    process: Any  # multiprocessing's SpawnProcess
    inbox: Connection  # driver -> worker
    outbox: Connection  # worker -> driver
    counters: EngineCounters = field(default_factory=EngineCounters)
    info: dict[str, Any] = field(default_factory=dict)  # device, dtype, adapters, lookahead
    bound: int = 1  # rows outstanding at most
    outstanding: int = 0  # rows sent in this stream, not returned yet
    owed: dict = field(default_factory=dict)  # (id, adapter) -> results each such row owes
    rows: int = 0  # rows returned, all streams
    adapters: set = field(default_factory=set)  # distinct adapters sent, all streams
    last_adapter: Any = ()  # the adapter the last chunk ended with (() before any)
    done: bool = False  # the worker finished the current stream
    closed: bool = False  # a send failed: no more rows for it
    alive: bool = True
    failure: str | None = None  # the exception a failing worker reported
    heard: float = field(default_factory=time.monotonic)  # its last message, any kind
    progressed: float = field(default_factory=time.monotonic)  # its last result, step or change
    doing: str = "starting"  # what its last heartbeat said it did
    steps: int = 0  # its engine's steps, by its last heartbeat
    hung: str | None = None  # why the driver killed it: it stopped answering

    def send(self, message: ToWorker) -> None:
        try:
            self.inbox.send(message)
        except OSError:  # dying: its exit shows on the outbox and the sentinel
            self.closed = True

    def heard_from(self, message: ToDriver) -> None:
        """Any message: the worker answers. A result, a step more or a new state: progress."""
        self.heard = now = time.monotonic()
        if isinstance(message, Log):
            return
        if isinstance(message, Alive):
            if (message.doing, message.steps) == (self.doing, self.steps):
                return
            self.doing, self.steps = message.doing, message.steps
        self.progressed = now

    def unresponsive(self, timeout_s: float) -> str | None:
        """Why the worker counts as hung (None: it does not): silent for ``timeout_s``, or no
        progress for as long while it holds rows and does not wait for them."""
        now = time.monotonic()
        if now - self.heard > timeout_s:
            return f"sent nothing for {now - self.heard:.1f} s (last seen {self.doing})"
        busy = self.outstanding and self.doing != "waiting for rows"
        if busy and now - self.progressed > timeout_s:
            return (
                f"made no progress for {now - self.progressed:.1f} s while {self.doing} "
                f"(after {self.steps} steps)"
            )
        return None

    def returned(self, result: Result) -> None:
        """A result came back: its row is returned once all its samples are (or its error)."""
        owed = self.owed.get((result.id, result.adapter))
        if not owed:
            return
        left = 0 if result.finish_reason == "error" else owed[0] - 1
        if left:
            owed[0] = left
            return
        owed.popleft()
        if not owed:
            del self.owed[(result.id, result.adapter)]
        self.outstanding -= 1

    def describe(self) -> str:
        return f"worker {self.slot.index} ({self.slot.device}, pid {self.process.pid})"

    def death(self) -> WorkerDied:
        lost = self.outstanding and (
            f"; its {self.outstanding} rows in flight were not written: re-run to resume them"
        )
        if self.hung:
            what = f"stopped answering: it {self.hung} holding {self.outstanding} rows; killed"
            return WorkerDied(f"data-parallel {self.describe()} {what}{lost or ''}")
        code = self.process.exitcode
        status = f"exit code {code}"
        if code is not None and code < 0:
            status += f" ({signal.Signals(-code).name})"
        reason = f" after {self.failure}" if self.failure else ""
        return WorkerDied(f"data-parallel {self.describe()} died with {status}{reason}{lost or ''}")
