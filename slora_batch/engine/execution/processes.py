"""How the engine starts its worker processes (tensor-parallel ranks, data-parallel workers).

A fresh interpreter (multiprocessing's "spawn") spends seconds of CPU importing torch, Triton
and the engine before it does any work, and every worker paid that again. Where the platform
has it (Linux, macOS), workers come from multiprocessing's fork server instead: one fresh
interpreter per driver process, started on the first worker and importing ``PRELOAD`` once,
that forks each worker from then on. The server never touches a GPU (importing torch does not
initialise CUDA), so its children may use CUDA as spawned ones do; each child is prepared as a
spawned one is (the driver's ``sys.path``, working directory and main module) and, through
``call_in_environment``, sees the driver's environment as it is when the worker starts, not as
it was when the server started. The server ends when the driver does; a worker watching its
parent process (``os.getppid()``) sees the server go then.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any

# what every worker imports: the fork server imports it once
PRELOAD = [
    "torch",
    "slora_batch.engine.execution.tp",
    "slora_batch.engine.parallel.dp_worker",
]


def worker_context() -> BaseContext:
    """The multiprocessing context of the engine's workers: the fork server (module doc), or
    spawn where the platform has none."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # no effect once this process's server runs
    return context


def worker_args(target: Callable[..., Any], *args: Any) -> tuple:
    """The ``args`` of a worker ``Process`` whose ``target`` is ``call_in_environment``: the
    driver's environment now, then ``target`` and its own arguments."""
    return (dict(os.environ), target, *args)


def call_in_environment(environment: dict[str, str], target: Callable[..., Any], *args) -> Any:
    """In the worker: the driver's environment (``worker_args``), then ``target(*args)``."""
    if os.environ != environment:
        os.environ.clear()
        os.environ.update(environment)
    return target(*args)
