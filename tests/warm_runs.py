"""``python -c SCRIPT ARGS`` for the tests that run a job in a process of its own (to kill it or
signal it at an exact moment), without paying the imports again each time.

A fresh interpreter spends 4-5 CPU-seconds importing torch, transformers and the job stack, most
of what such a run costs on the tiny model. Here one warm interpreter per test process imports
them once and forks a child per script; the child runs the script as ``python -c`` does: in
``__main__``, with ``sys.argv`` ``["-c", *args]``, its working directory and environment, stdin
from /dev/null, and the interpreter's normal exit after it (non-daemon threads joined, atexit
handlers, flushed streams). Its exit status is what ``subprocess.run`` reports: ``sys.exit``'s
code, 1 for an uncaught exception (traceback on stderr), minus the signal that killed it.

The warm interpreter imports modules only (no torch op, no Python thread, nothing forked
before its children), then freezes what they made out of the garbage collector's reach
(``gc.freeze``), so a child's full collections walk only its own objects. A script's patches
(``writer.commit_file = ...``) still take: the job code looks those names up when it calls
them. What a module reads from the environment when imported (tqdm its TQDM_ variables, rich
NO_COLOR) it read in the warm interpreter's: the test process's, with OMP_NUM_THREADS=1 and
PYTHONPATH at the checkout; what is read at run time sees the script's. The warm interpreter
ends when the test process closes its end of the pipe.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what ``slora-batch run`` imports on the tiny model: the CLI, the job tool, the engine, and
# what its tokenizer, its Parquet parts and its log records import on first use
JOB_STACK = (
    "torch",
    "pyarrow.parquet",
    "pyarrow.dataset",
    "pyarrow.pandas_compat",
    "cli",
    "slora_batch.jobs.run",
    "slora_batch.engine.engine",
    "slora_batch.engine.parallel.data_parallel",
    "slora_kernels.ref",
    "slora_kernels.fp8",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.configuration_llama",
    "transformers.tokenization_utils_tokenizers",
    "transformers.tokenization_python",
    "pydantic.main",
)
START_S = 120.0  # the warm interpreter's imports, on a busy machine

SERVER = r"""
import gc, importlib, json, os, sys


def serve(replies):
    '''Forks a child per request line and answers its pid, then its exit status. Returns the
    request in the child; the server itself exits when its stdin closes.'''
    replies.write("ready\n")
    while line := sys.stdin.readline():
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            return request
        replies.write(f"{pid}\n")
        _, status = os.waitpid(pid, 0)
        replies.write(f"{os.waitstatus_to_exitcode(status)}\n")
    sys.exit(0)


def enter(request):
    '''The child's process state as ``python -c`` would have it.'''
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((0, os.devnull), (1, request["stdout"]), (2, request["stderr"])):
        flags = os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        os.dup2(os.open(path, flags, 0o644), fd)
    sys.argv = ["-c", *request["args"]]


_replies = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # what the imports print goes to stderr, never into the replies
for module in sys.argv[1:]:
    importlib.import_module(module)
gc.collect()
gc.freeze()  # what the imports made: a child's full collections walk only its own objects
_request = serve(_replies)
enter(_request)
_code = compile(_request["script"], "<string>", "exec")
del gc, importlib, json, serve, enter, module, _replies, _request
exec(_code)
"""


class WarmInterpreter:
    """One warm interpreter (see the module docstring) and its pipe; ``run`` is
    ``subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True)``."""

    def __init__(self, preload: tuple[str, ...]) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 -- the server's stderr, for its life
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER, *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            cwd=ROOT,
        )
        self.pending = b""
        self._line(START_S)  # "ready": a failed import raises here, with its traceback

    def run(self, script: str, *args: str, cwd: Path, env: dict, timeout: float):
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = dict(
                script=script,
                args=list(args),
                cwd=str(cwd),
                env=env,
                stdout=str(out),
                stderr=str(err),
            )
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
            pid = int(self._line(START_S))
            try:
                code = int(self._line(timeout))
            except subprocess.TimeoutExpired:
                os.kill(pid, signal.SIGKILL)  # as subprocess.run does; the server reaps it
                self._line(START_S)
                raise
            return subprocess.CompletedProcess(
                ["-c", *args], code, out.read_text(), err.read_text()
            )

    def _line(self, timeout: float) -> str:
        """The server's next reply line, within ``timeout`` seconds."""
        deadline, fd = time.monotonic() + timeout, self.process.stdout.fileno()
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise subprocess.TimeoutExpired(["warm interpreter"], timeout)
            chunk = os.read(fd, 4096)
            if not chunk:
                self.log.seek(0)
                raise RuntimeError(f"the warm interpreter ended:\n{self.log.read().decode()}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(30)


@functools.cache
def warm(preload: tuple[str, ...]) -> WarmInterpreter:
    """This test process's warm interpreter that imported ``preload``, started on first use."""
    interpreter = WarmInterpreter(preload)
    atexit.register(interpreter.close)
    return interpreter


def run_script(
    script: str,
    *args: object,
    cwd: Path,
    env: dict,
    timeout: float = 120,
    preload: tuple[str, ...] = JOB_STACK,
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-c", script, *args], cwd=cwd, env=env,
    capture_output=True, text=True, timeout=timeout)``, forked from the warm interpreter."""
    return warm(preload).run(script, *[str(a) for a in args], cwd=cwd, env=env, timeout=timeout)
