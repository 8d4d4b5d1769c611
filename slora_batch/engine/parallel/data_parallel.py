"""Data parallelism: M engine worker processes, one device each, behind ``Engine``'s surface.

``DataParallelEngine`` starts one process per worker (``execution.processes``; each sees only
its GPU through ``CUDA_VISIBLE_DEVICES``, on cpu the workers share the cores) that builds an
``Engine`` and runs ``generate`` over the rows the driver sends it. The driver, in the caller's process, cuts the
request stream (already sorted by adapter in windows) into chunks of consecutive rows and hands
the next chunk to the worker with the fewest rows outstanding, up to a bound of its engine's
``lookahead`` plus two chunks: a fast worker takes more (work stealing), so skewed adapter
popularity balances, and consecutive rows keep each worker's adapters few. Results come back as
they finish; the caller stays the only writer of outputs.

A worker that dies (killed, crashed, a CUDA error) stops the feeding; the others finish the rows
they hold, every result received is yielded, then ``WorkerDied`` names the worker, its device
and its exit status. A worker that stops answering (silent, or holding rows without a step for
``worker_timeout_s``: ``dp_handle``) is killed and reported the same way, naming what it was
doing. Rows it held never came back, so a job re-run resumes them. Workers exit
when the driver goes (their pipe from it closes, or they are re-parented), so a killed driver
leaves no process behind.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slora_batch.engine.config import EngineConfig, SamplingConfig
from slora_batch.engine.counters import EngineCounters
from slora_batch.engine.execution.processes import call_in_environment, worker_args, worker_context
from slora_batch.engine.parallel.dp_handle import WorkerDied, WorkerHandle, expected_results
from slora_batch.engine.parallel.dp_worker import (
    WorkerSlot,
    beat_s,
    relog,
    worker_main,
    worker_slots,
)
from slora_batch.engine.parallel.messages import (
    Abort,
    Alive,
    Done,
    End,
    Failed,
    Log,
    Ready,
    RowResult,
    Rows,
    ToDriver,
    ToWorker,
)
from slora_batch.engine.requests.request import Request, Result

if TYPE_CHECKING:  # torch's: imported by the worker and the engine, not here
    from slora_batch.engine.execution.parts import EngineParts

__all__ = ["DataParallelEngine", "WorkerDied", "chunks", "open_engine"]

log = logging.getLogger(__name__)

CHUNK_ROWS = 64  # most rows per chunk; a chunk is at most lookahead // 8 rows
STOP_WAIT_S = 10.0  # a closing worker's time to exit before it is terminated
MAX_FIELDS = ("load_s", "warmup_s")  # workers build at once: the slowest counts; others add up


def open_engine(
    model,
    adapters=None,
    config: EngineConfig | None = None,
    sampling=None,
    parts: EngineParts | None = None,
):
    """An ``Engine``, or a ``DataParallelEngine`` when the config asks for more than one worker.
    ``parts`` as ``engine.assemble``'s (each worker gets a copy), for the benchmark."""
    config = config or EngineConfig()
    if config.data_parallel > 1 or config.gpus:
        slots = worker_slots(config)
        if len(slots) > 1:
            return DataParallelEngine(model, adapters, config, sampling, slots, parts=parts)
    from slora_batch.engine.engine import assemble

    return assemble(model, adapters, config, sampling, parts)


def chunks(requests: Iterable[Request], rows: int) -> Iterator[list[Request]]:
    """Consecutive requests in chunks of at most ``rows``; a chunk of at least ``rows // 2`` ends
    where the adapter changes, so only adapters with short runs share a chunk.

    Running example (rows 4): a a a b b c d d d d e -> [a a a] [b b] [c d d d] [d e].
    """
    chunk: list[Request] = []
    for request in requests:
        changes = bool(chunk) and (request.adapter or None) != (chunk[-1].adapter or None)
        if len(chunk) == rows or (changes and len(chunk) >= max(1, rows // 2)):
            yield chunk
            chunk = []
        chunk.append(request)
    if chunk:
        yield chunk


class DataParallelEngine:
    """``Engine``'s surface over ``len(slots)`` worker processes (see the module docstring).

    ``counters`` sums the workers' (``load_s`` and ``warmup_s``: the slowest worker's);
    ``workers_summary()`` gives each worker's rows and distinct adapters; ``pids`` the
    processes. ``chunk_rows`` overrides the chunk size (at most ``lookahead // 8`` rows, 64).
    """

    def __init__(
        self,
        model: str | Path,
        adapters: dict[str, str | Path] | str | Path | None = None,
        config: EngineConfig | None = None,
        sampling: SamplingConfig | None = None,
        slots: list[WorkerSlot] | None = None,
        chunk_rows: int | None = None,
        parts: EngineParts | None = None,
    ) -> None:
        began = time.perf_counter()
        self.config = config = config or EngineConfig()
        self.slots = slots or worker_slots(config)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        share = max(1, ((cores or 1) - 1) // len(self.slots))  # cpu: the cores split, one spare
        worker_config = dataclasses.replace(
            config,
            data_parallel=1,
            gpus=None,
            device="cpu" if self.slots[0].visible is None else "cuda",
            cpu_threads=config.cpu_threads or share,
        )
        self.chunk_rows = chunk_rows or max(1, min(CHUNK_ROWS, config.lookahead // 8))
        self.counters = EngineCounters()
        self.timeout_s = config.worker_timeout_s
        self.tick_s = beat_s(self.timeout_s)  # the driver's waits end this often to check them
        self.workers: list[WorkerHandle] = []
        self._epoch = 0
        self._active: weakref.ref | None = None
        context = worker_context()
        level = min(logging.getLogger("slora_batch").getEffectiveLevel(), logging.INFO)
        try:
            for slot in self.slots:
                inbox_reader, inbox = context.Pipe(duplex=False)
                outbox, outbox_writer = context.Pipe(duplex=False)
                args = (slot, model, adapters, worker_config, sampling, level)
                process = context.Process(
                    target=call_in_environment,
                    args=worker_args(worker_main, *args, inbox_reader, outbox_writer, parts),
                    name=f"slora-dp-{slot.index}",
                    # a tensor-parallel worker starts its own ranks: daemons cannot
                    daemon=config.tensor_parallel == 1,
                )
                process.start()
                inbox_reader.close()  # the worker's ends: only it may hold them, so that
                outbox_writer.close()  # its exit closes the pipe (EOF)
                self.workers.append(WorkerHandle(slot, process, inbox, outbox))
                log.info(
                    "data parallel: worker %d on %s, pid %d", slot.index, slot.device, process.pid
                )
            ready = [self._start(worker) for worker in self.workers]
        except BaseException:
            self.close()
            raise
        self.device = f"{self.slots[0].device.split(':')[0]} x{len(self.workers)}"
        self.dtype = ready[0].dtype
        self.adapter_names: list[str] = ready[0].adapters
        self.sampling = sampling or SamplingConfig()
        self._combine()
        self.counters.load_s = time.perf_counter() - began - self.counters.warmup_s

    @property
    def pids(self) -> list[int]:
        return [worker.process.pid for worker in self.workers]

    def workers_summary(self) -> list[dict[str, Any]]:
        return [
            {
                "worker": w.slot.index,
                "device": w.slot.device,
                "pid": w.process.pid,
                "rows": w.rows,
                "adapters": len(w.adapters),
                "alive": w.alive,
            }
            for w in self.workers
        ]

    def _start(self, worker: WorkerHandle) -> Ready:
        """Waits for the worker's engine: its device, dtype, adapters and counters."""
        while worker.alive:
            for message in self._receive(worker, block=True):
                if isinstance(message, Ready):
                    worker.info, worker.counters = message._asdict(), message.counters
                    worker.bound = message.lookahead + 2 * self.chunk_rows
                    return message
                if isinstance(message, Failed) and isinstance(message.error, BaseException):
                    raise message.error  # the engine's own error (a model it cannot load, ...)
            self._watch(worker)
        raise worker.death()

    def _receive(self, worker: WorkerHandle, block: bool = False) -> Iterator[ToDriver]:
        """The worker's messages waiting in its pipe (``block``: after waiting for one, or for
        its exit), less its heartbeats and log records (logged here). At its end (EOF, or the
        process gone and the pipe empty) it is marked dead."""
        try:
            if block:
                wait([worker.outbox, worker.process.sentinel], self.tick_s)
            while worker.outbox.poll():
                message = worker.outbox.recv()
                worker.heard_from(message)
                if isinstance(message, Alive):
                    continue
                if isinstance(message, Log):
                    relog(worker.slot.index, message.record)
                    continue
                if isinstance(message, Failed):
                    worker.failure = message.text
                yield message
            if worker.process.exitcode is None:
                return
        except (EOFError, OSError):
            pass
        worker.process.join(STOP_WAIT_S)
        worker.alive = False

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        """As ``Engine.generate``: lazy, results as they finish. A worker's death raises
        ``WorkerDied`` after every result received; abandoning the iterator drops the rows the
        workers hold."""
        previous = self._active() if self._active is not None else None
        if previous is not None:
            previous.close()
        generator = self._generate(iter(requests))
        self._active = weakref.ref(generator)
        return generator

    def _generate(self, source: Iterator[Request]) -> Iterator[Result]:
        """Feeds the stream's chunks to the workers with room, yields their results as they
        come, ends the stream (``End``) when its rows are all sent or a worker died, and
        abandons it (``Abort``) when the caller does; then raises a worker's death."""
        epoch, stream = self._open_stream(), chunks(source, self.chunk_rows)
        chunk, ended, died, finished = next(stream, None), False, None, False
        try:
            while True:
                if died is None:
                    chunk = self._feed(chunk, stream, epoch)
                if not ended and (chunk is None or died is not None):
                    ended = True
                    self._tell_alive(End(epoch))
                live = [w for w in self.workers if w.alive and not w.done]
                if ended and not live:
                    break
                wait([w.outbox for w in live] + [w.process.sentinel for w in live], self.tick_s)
                for worker in live:
                    yield from self._results(worker, epoch)
                    if not worker.alive:
                        died = died or worker
                        log.error("%s", worker.death())
            finished = True
        finally:
            if not finished:
                self._tell_alive(Abort(epoch))
            self._log_summary()
        if died is not None:
            raise died.death()

    def _open_stream(self) -> int:
        """The new stream's number, each worker's share of it empty; a dead worker's death is
        raised instead."""
        dead = [w for w in self.workers if not w.alive]
        if dead:
            raise dead[0].death()
        self._epoch += 1
        for worker in self.workers:
            worker.outstanding, worker.done = 0, False
            worker.owed.clear()
        return self._epoch

    def _feed(
        self, chunk: list[Request] | None, stream: Iterator[list[Request]], epoch: int
    ) -> list[Request] | None:
        """Sends chunks, from ``chunk`` on, while a worker has room (``_pick``); the chunk no
        worker had room for, or None when the stream is all sent."""
        while chunk is not None and (target := self._pick(chunk)):
            self._send_rows(target, chunk, epoch)
            chunk = next(stream, None)
        return chunk

    def _send_rows(self, worker: WorkerHandle, chunk: list[Request], epoch: int) -> None:
        """Sends the chunk to the worker and counts its rows, and the results each owes, as
        outstanding there."""
        if not worker.outstanding:  # busy from now on: its progress is watched
            worker.progressed = time.monotonic()
        worker.send(Rows(epoch, chunk))
        worker.outstanding += len(chunk)
        for request in chunk:  # the results each row owes, by its key
            key = (request.id, request.adapter or None)
            owed = expected_results(request, self.sampling)
            worker.owed.setdefault(key, deque()).append(owed)
        worker.adapters.update(r.adapter or None for r in chunk)
        worker.last_adapter = chunk[-1].adapter or None

    def _results(self, worker: WorkerHandle, epoch: int) -> Iterator[Result]:
        """The worker's results of stream ``epoch`` waiting in its pipe, its counters taken
        as they come and its ``Done`` noted (messages of an abandoned stream are dropped); then
        whether it still answers (``_watch``)."""
        for message in self._receive(worker):
            if isinstance(message, RowResult) and message.stream == epoch:
                worker.returned(message.result)
                worker.rows += 1
                if message.counters is not None:
                    worker.counters = message.counters
                    self._combine()
                yield message.result
            elif isinstance(message, Done) and message.stream == epoch:
                worker.counters, worker.done = message.counters, True
                self._combine()
        self._watch(worker)

    def _tell_alive(self, message: ToWorker) -> None:
        """Sends the message to every live worker."""
        for worker in self.workers:
            if worker.alive:
                worker.send(message)

    def _watch(self, worker: WorkerHandle) -> None:
        """After its pipe is drained: a worker that stopped answering
        (``WorkerHandle.unresponsive``) is killed and marked dead; its death names why."""
        reason = worker.unresponsive(self.timeout_s) if worker.alive else None
        if reason is None:
            return
        worker.hung, worker.alive = reason, False
        worker.process.kill()
        worker.process.join(STOP_WAIT_S)

    def _pick(self, chunk: list[Request]) -> WorkerHandle | None:
        """The worker with the fewest rows outstanding that has room for the chunk; the one whose
        last chunk ended with this chunk's adapter when it is within a chunk of that."""
        room = [
            w
            for w in self.workers
            if w.alive
            and not (w.done or w.closed)
            and (w.outstanding + len(chunk) <= w.bound or not w.outstanding)
        ]
        if not room:
            return None
        least = min(room, key=lambda w: w.outstanding)
        adapter = chunk[0].adapter or None
        for worker in room:
            if worker.last_adapter == adapter and worker.outstanding < least.outstanding + len(
                chunk
            ):
                return worker
        return least

    def _combine(self) -> None:
        for name in (
            f.name
            for f in dataclasses.fields(EngineCounters)
            if f.name != "started" and not f.name.startswith("_")
        ):
            values = [getattr(w.counters, name) for w in self.workers]
            setattr(self.counters, name, max(values) if name in MAX_FIELDS else sum(values))

    def _log_summary(self) -> None:
        for w in self.workers_summary():
            log.info(
                "data parallel: worker %(worker)d (%(device)s, pid %(pid)d): %(rows)d rows, "
                "%(adapters)d distinct adapters",
                w,
            )

    def close(self) -> None:
        """Stops the workers: each exits when its pipe from the driver closes; one still there
        after ``STOP_WAIT_S`` is terminated, then killed."""
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()
        for worker in self.workers:
            worker.inbox.close()
        deadline = time.monotonic() + STOP_WAIT_S
        for worker in self.workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            for stop in (worker.process.terminate, worker.process.kill):
                if worker.process.exitcode is None:
                    stop()
                    worker.process.join(STOP_WAIT_S)
            worker.outbox.close()
            worker.alive = False

    def __enter__(self) -> DataParallelEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
