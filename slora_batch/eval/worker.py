"""lm-eval's scoring in a process of its own, off the engine's thread: lm-eval is Python, and a
thread of it would take the GIL from the engine's host loop; a process takes a spare core.

``ScoringProcess`` starts it when an eval job starts (a fresh interpreter, ``python -c``: not
multiprocessing's spawn, which would run the caller's main module again in it). It loads the
tasks and builds their requests itself (the job's seeded build: the same instances), hidden
behind the job's own preparation and the engine's start-up, then scores each adapter ``submit``
hands it (lm-eval's ``evaluate`` over that adapter's rows), writes that adapter's JSON and sends
back its ``report.Scored``. Whatever it has not answered when ``collect`` is called (not ready
yet, failed, died) is left to the job's process (``scoring.AdapterScoring``). It ends when told,
or when the job's process is gone (its pipe closes: a kill -9 leaves no process behind).
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from slora_batch.jobs.eval_keys import EvalConfig

logger = logging.getLogger(__name__)
READY, FAILED = "__ready__", "__failed__"  # messages beside (adapter, scored, error)
BOOT = (
    "import sys; from multiprocessing.connection import Connection; "
    "tasks = Connection(int(sys.argv[1]), writable=False); sys.path[:] = tasks.recv(); "
    "from slora_batch.eval.worker import serve; "
    "serve(tasks, Connection(int(sys.argv[2]), readable=False))"
)


class ScoringProcess:
    """The scoring process of one eval job: ``submit`` never blocks (a feeder thread sends),
    ``collect`` ends it and returns what it scored."""

    def __init__(self, config: EvalConfig, model_path: str, max_length: int, out: Path) -> None:
        task_read, task_write = os.pipe()
        result_read, result_write = os.pipe()
        quiet = subprocess.DEVNULL  # its tasks' loading says what the job's own said already
        # its stderr is kept aside: when it fails or dies, the job's log says why (failure)
        self.stderr = tempfile.TemporaryFile(prefix="slora-batch-lm-eval-")  # noqa: SIM115 - closed by close()
        self.process = subprocess.Popen(
            [sys.executable, "-c", BOOT, str(task_read), str(result_write)],
            pass_fds=(task_read, result_write),
            stdin=quiet,
            stdout=quiet,
            stderr=self.stderr,
        )
        os.close(task_read)
        os.close(result_write)
        self.tasks = Connection(task_write, readable=False)
        self.results = Connection(result_read, writable=False)
        self.ready = False
        self.error: str | None = None  # what it reported when it failed to prepare
        self.expected: list[str | None] | None = None  # collect's adapters, once told to end
        self.answers: dict[str | None, tuple[Any, BaseException | None]] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._feeder = threading.Thread(target=self._feed, name="lm-eval-feeder", daemon=True)
        self._feeder.start()
        self._queue.put(list(sys.path))
        self._queue.put((config, model_path, max_length, str(out)))

    def submit(self, adapter: str | None, rows: dict[str, dict[str, Any]]) -> None:
        self._queue.put((adapter, rows))

    def _feed(self) -> None:
        while (message := self._queue.get()) is not StopIteration:
            try:
                self.tasks.send(message)
            except OSError:  # the process is gone: collect scores the rest here
                return

    def collect(self, adapters: list[str | None]) -> dict[str | None, tuple[Any, Any]]:
        """{adapter: (scored, error)} for those of ``adapters`` the process answered; the
        process is stopped. One that is not ready yet is stopped at once (scoring here is no
        slower than waiting for its start)."""
        self.expected = adapters
        self._queue.put(None)
        self._drain(wait=False)
        while self.ready and any(a not in self.answers for a in adapters):
            if not self._drain(wait=True):  # it died or failed
                break
        self.close()
        return {a: self.answers[a] for a in adapters if a in self.answers}

    def _drain(self, wait: bool) -> bool:
        """Read the messages there are (``wait``: at least one); False when nothing more will
        come (the process ended or failed)."""
        while wait or self.results.poll():
            wait = False
            try:
                adapter, scored, error = self.results.recv()
            except (EOFError, OSError):
                if self.expected is not None and all(a in self.answers for a in self.expected):
                    return False  # it ended as told, every answer in
                if self.process.poll() is None:
                    self.process.terminate()
                logger.warning(
                    "the lm-eval scoring process ended early; scoring here: %s", self.failure()
                )
                return False
            if adapter == READY:
                self.ready = True
            elif adapter == FAILED:
                self.error = error
                logger.warning(
                    "the lm-eval scoring process failed; scoring here: %s", self.failure()
                )
                return False
            else:
                self.answers[adapter] = (scored, error)
        return True

    def failure(self, lines: int = 20) -> str:
        """Why the process stopped answering: its error or exit status, and the last ``lines``
        lines of its stderr."""
        try:
            code = self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a report never holds up the job's own scoring
            code = None
        if code is None:
            status = "still running"
        else:
            status = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace").splitlines()[-lines:]
        said = f"{self.error}; " if self.error else ""
        return f"{said}{status}" + ("; its stderr ends:\n" + "\n".join(tail) if tail else "")

    def close(self) -> None:
        self._queue.put(StopIteration)
        if self.process.poll() is None:
            self.process.terminate()
        self.process.wait()
        # the feeder is done before the pipe closes: a send in flight would otherwise write to
        # whatever pipe takes the closed descriptor's number next (another job's process);
        # with the process gone a blocked send fails at once
        self._feeder.join()
        self.tasks.close()
        self.results.close()
        self.stderr.close()


def serve(tasks: Connection, results: Connection) -> None:
    """The scoring process: prepare, say ready, score what comes until None (or the job's
    process is gone)."""
    try:
        config, model_path, max_length, out = tasks.recv()
        score = scorer(config, model_path, max_length)
    except Exception:  # noqa: BLE001 - the job scores in its own process instead
        results.send((FAILED, None, traceback.format_exc(limit=-4).strip()))
        return
    results.send((READY, None, None))
    while True:
        try:
            task = tasks.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        adapter, rows = task
        try:
            results.send((adapter, score(adapter, rows).written(Path(out), adapter), None))
        except Exception as exc:  # noqa: BLE001 - raised in the job, in the adapters' order
            results.send((adapter, None, _picklable(exc)))


def scorer(config: EvalConfig, model_path: str, max_length: int):
    """``score(adapter, rows)`` -> ``report.Scored``: lm-eval's ``evaluate`` over the tasks
    built here as the job builds them."""
    from slora_batch.engine.requests.tokens import load_tokenizer
    from slora_batch.eval.encoding import Encoder
    from slora_batch.eval.tasks import adapter_scorer, build_requests, load_tasks

    encoder = Encoder(load_tokenizer(model_path), max_length, config.max_gen_toks)
    loaded = load_tasks(config)
    build_requests(loaded, config.limit)
    return adapter_scorer(config, encoder, loaded)


def _picklable(exc: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")
