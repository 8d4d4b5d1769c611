"""Data-parallel workers: their devices (``worker_slots``), and the worker process: one
``Engine`` on one device, fed rows by the driver (``data_parallel.DataParallelEngine``) through
a pipe, its results sent back through another (the messages: ``messages``).

A heartbeat thread sends ``Alive`` every ``beat_s(timeout)``: what the worker is doing and the
engine's steps so far, so that the driver tells a silent worker (stopped, frozen) and one that
makes no step while it holds rows from a busy one (``dp_handle.WorkerHandle.unresponsive``).
A reader thread drains the driver's pipe, so the driver never blocks on a send, and ends the
process as soon as the driver is gone (its pipe closed, or this process re-parented).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from slora_batch.engine.config import ConfigError, EngineConfig
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
)
from slora_batch.engine.requests.request import Request

log = logging.getLogger(__name__)

COUNTERS_EVERY_S = 0.5  # a worker sends its counters with a result at most this often
Send = Callable[[ToDriver], None]


def beat_s(timeout_s: float) -> float:
    """How often a worker says it is alive: several times within the driver's timeout."""
    return min(5.0, max(0.05, timeout_s / 6))


@dataclass(frozen=True)
class WorkerSlot:
    index: int
    device: str  # "cuda:1" (or "cuda:2-3" for a tensor-parallel group) in the driver's numbering
    visible: str | None  # the worker's CUDA_VISIBLE_DEVICES; None on cpu


def worker_slots(config: EngineConfig) -> list[WorkerSlot]:
    """One slot per worker: ``data_parallel`` of them, or for ``gpus: all`` as many as the
    visible GPUs hold groups of ``tensor_parallel``. Each slot gets its own ``tensor_parallel``
    devices. On cpu, ``data_parallel`` processes share the cores; ``gpus: all`` is an error."""
    import torch

    cuda = config.device != "cpu" and torch.cuda.is_available()
    if config.device.startswith("cuda") and not cuda:
        raise ConfigError(f"engine.device is {config.device!r} but no CUDA device is available")
    if not cuda:
        if config.gpus:
            raise ConfigError("engine.gpus is 'all' but no CUDA device is visible")
        return [WorkerSlot(i, "cpu", None) for i in range(config.data_parallel)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")] if visible else []
    ids = (ids or [str(i) for i in range(torch.cuda.device_count())])[: torch.cuda.device_count()]
    per = config.tensor_parallel
    count = len(ids) // per if config.gpus else config.data_parallel
    if count < 1 or count * per > len(ids):
        raise ConfigError(
            f"engine.data_parallel {max(count, 1)} x tensor_parallel {per} needs "
            f"{max(count, 1) * per} CUDA devices, {len(ids)} are visible"
        )

    def name(i: int) -> str:
        first, last = i * per, (i + 1) * per - 1
        return f"cuda:{first}" if per == 1 else f"cuda:{first}-{last}"

    return [WorkerSlot(i, name(i), ",".join(ids[i * per : (i + 1) * per])) for i in range(count)]


def worker_main(slot, model, adapters, config, sampling, level: int, inbox, outbox, parts) -> None:
    """A worker process: its device first (before torch touches CUDA), then its engine, built
    from ``parts`` (``execution.parts.EngineParts``, the driver's)."""
    if slot.visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = slot.visible
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C reaches the group: the driver stops us
    lock = threading.Lock()

    def send(message: ToDriver) -> None:
        with lock:  # the engine's loader thread logs too
            outbox.send(message)

    root = logging.getLogger()
    root.setLevel(level)
    root.handlers[:] = [_Forward(send)]  # the driver's handlers, wherever they write
    messages: queue.SimpleQueue = queue.SimpleQueue()
    aborted = [0]  # the latest stream the driver abandoned
    threading.Thread(target=_read, args=(inbox, messages, aborted), daemon=True).start()
    state = {"doing": "loading the engine", "engine": None}
    beat = beat_s(config.worker_timeout_s)
    threading.Thread(target=_beat, args=(send, state, beat), daemon=True).start()
    try:
        from slora_batch.engine.engine import assemble

        engine = assemble(model, adapters, config, sampling, parts)
    except Exception as exc:
        _fail(send, exc, exc)
    state.update(engine=engine, doing="idle")
    send(
        Ready(
            device=str(engine.device),
            dtype=str(engine.dtype),
            counters=engine.counters,
            adapters=engine.adapter_names,
            lookahead=config.lookahead,
        )
    )
    while True:
        state["doing"] = "idle"
        first = messages.get()
        if isinstance(first, Abort) or first.stream <= aborted[0]:
            continue  # what was left of an abandoned stream
        try:
            _stream(engine, first, messages, aborted, send, state)
        except Exception as exc:  # a CUDA error, say: the driver reports it with our exit status
            log.error("worker %d failed", slot.index, exc_info=True)
            _fail(send, exc, None)


def _stream(
    engine,
    first: Rows | End,
    messages: queue.SimpleQueue,
    aborted: list[int],
    send: Send,
    state: dict,
) -> None:
    """One ``generate`` over the stream that ``first`` opens, until its ``End`` (or ``Abort``).

    The engine pulls a row only after sending every result it has read back, and only while it
    holds fewer than ``lookahead`` rows unanswered (``Engine._pull``), so when it waits here for
    rows, every row the driver counts as outstanding is either in the engine (fewer than
    lookahead) or a result on its way: the driver, whose bound is lookahead plus two chunks,
    then always has room to send the next chunk (or ``End``). No interleaving deadlocks."""
    stream, pending = first.stream, [first]

    def pull() -> Rows | End | Abort:
        if pending:
            return pending.pop()
        state["doing"] = "waiting for rows"
        message = messages.get()
        state["doing"] = "running steps"
        return message

    def requests() -> Iterator[Request]:
        while True:
            message = pull()
            if message.stream < stream:
                continue  # rows of an abandoned stream still on their way
            if not isinstance(message, Rows):  # End, or Abort
                return
            yield from message.requests

    sent, state["doing"] = time.monotonic(), "running steps"
    with contextlib.closing(engine.generate(requests())) as results:
        for result in results:
            if aborted[0] >= stream:
                return
            now = time.monotonic()
            counters = engine.counters if now - sent > COUNTERS_EVERY_S else None
            sent = sent if counters is None else now
            send(RowResult(stream, result, counters))
    send(Done(stream, engine.counters))


def _beat(send: Send, state: dict, every_s: float) -> None:
    """The worker's heartbeat: what it does and the engine's steps, every ``every_s``."""
    with contextlib.suppress(Exception):  # the pipe closed: the process is ending
        while True:
            engine = state["engine"]
            send(Alive(state["doing"], engine.counters.steps if engine is not None else 0))
            time.sleep(every_s)


def _fail(send: Send, exc: Exception, error: Exception | None) -> None:
    """Tells the driver why (``error``, the exception itself, when it pickles), then exits at
    once: no thread of the engine's may hold the process (and its pipe) open."""
    text = f"{type(exc).__name__}: {exc}"
    with contextlib.suppress(Exception):
        try:
            send(Failed(text, error))
        except Exception:  # an exception that does not pickle: its text only
            send(Failed(text, None))
    os._exit(1)


def _read(inbox: Connection, messages: queue.SimpleQueue, aborted: list[int]) -> None:
    """Drains the driver's pipe into ``messages``; the driver gone, the process ends at once."""
    parent = os.getppid()
    with contextlib.suppress(EOFError, OSError):
        while os.getppid() == parent:
            if inbox.poll(1.0):
                message = inbox.recv()
                if isinstance(message, Abort):
                    aborted[0] = max(aborted[0], message.stream)
                messages.put(message)
    os._exit(0)


class _Forward(logging.Handler):
    """A worker's log records, sent to the driver."""

    def __init__(self, send: Send) -> None:
        super().__init__()
        self.send_message = send

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(OSError):
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            fields = {"name": record.name, "levelno": record.levelno, "levelname": record.levelname}
            self.send_message(Log({**fields, "msg": text}))


def relog(index: int, record: dict[str, Any]) -> None:
    """In the driver: a worker's record, through the driver's logger of the same name."""
    logger = logging.getLogger(record["name"])
    if logger.isEnabledFor(record["levelno"]):
        record["msg"] = f"worker {index}: {record['msg']}"
        logger.handle(logging.makeLogRecord(record))
