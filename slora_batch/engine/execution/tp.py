"""S-LoRA tensor parallelism: one model over N devices, one scheduler (rank 0), N page pools.

The base model is cut the Megatron way (``loader.load_model``): q/k/v, gate and up by output
rows (column-parallel: whole heads, KV heads included), o and down by input columns
(row-parallel: partial sums joined by one all-reduce), the LM head by vocabulary rows (logits
all-gathered). The adapters are cut to match, so that no adapter weight sits on every device
(``adapters.store.shard_adapter``); with ``x`` the projection's input and rank r's slices
written ``[r]``:

- column-parallel (q, k, v, gate, up): A by its input rows, B by its output columns.
  ``x[r] A[r]`` is a partial sum of ``x A``: an all-reduce of tokens x rank values makes it
  whole, then ``(x A) B[r]`` adds into the rank's output columns. (The S-LoRA paper cuts A by
  its rank columns and all-gathers; summing instead needs no padding of a rank to a multiple of
  N and no per-adapter interleaving of the gathered columns, for the same small tensor.)
- row-parallel (o, down): A by its input rows (the input is already cut), B by its output
  columns: ``x[r] A[r]`` all-reduced as above, ``(x A) B[r]`` added into the rank's columns of
  the partial output before the base model's own all-reduce, which carries it to every rank.

Every factor is cut on both sides, so each rank's pool holds 1/N of every resident adapter in
the pages of the shard's spec (``ModelSpec.shard``), as it holds 1/N of every token's KV.

Rank 0 is the engine: it schedules, samples and decides every page and adapter slot. Before
each step it sends the step's plan (``HostStep``, its page table as the entries each sequence
added since the last step: ``PageTableSender``) and the adapter loads and evictions since the
last one (``AdapterResidency.journal``) to the other ranks, worker processes it started
(``worker_main``), which repeat them on their own pools and run the same forward; the previous
step's drawn tokens reach them by a broadcast on the device. Collectives run through
``torch.distributed``: NCCL on GPUs, gloo on the CPU (the tests).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from slora_batch.engine.config import ConfigError
from slora_batch.engine.device import pick_device, pick_dtype, set_cpu_threads
from slora_batch.engine.execution.parts import EngineParts, build_parts, make_runner
from slora_batch.engine.execution.processes import call_in_environment, worker_args, worker_context
from slora_batch.engine.execution.tp_tables import PageTableReceiver, PageTableSender
from slora_batch.engine.models.spec import read_spec

__all__ = ["PageTableReceiver", "PageTableSender", "TensorParallel", "TensorParallelRunner"]

log = logging.getLogger(__name__)

PARENT_POLL_S = 0.5  # how often a rank checks that rank 0 (its parent process) is still there


@dataclass
class TensorParallel:
    """This process's place in a tensor-parallel group and its collectives."""

    rank: int
    size: int
    device: torch.device
    group: Any = None  # torch.distributed's group (the default one)
    # On rank 0: the workers' processes and the pipes that carry plans to them.
    processes: list[Any] = field(default_factory=list)
    pipes: list[Any] = field(default_factory=list)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        torch.distributed.all_reduce(tensor, group=self.group)

    def gather_vocab(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """Every rank's logits over its vocabulary rows, side by side: [S, vocab]."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        torch.distributed.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)[:, :vocab]

    def min_over_ranks(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def broadcast(self, tensor: torch.Tensor) -> None:
        torch.distributed.broadcast(tensor, src=0, group=self.group)

    def send(self, message: tuple) -> None:
        """Rank 0: a message to every worker; a worker that reported a failure raises here."""
        self.check()
        for pipe in self.pipes:
            pipe.send(message)

    def check(self) -> None:
        for rank, (pipe, process) in enumerate(zip(self.pipes, self.processes, strict=True), 1):
            failure = None
            with contextlib.suppress(EOFError, OSError):
                if pipe.poll():
                    failure = pipe.recv()[1]
            if failure is not None or not process.is_alive():
                raise RuntimeError(
                    f"tensor-parallel rank {rank} (pid {process.pid}) "
                    + (f"failed: {failure}" if failure else f"exited with {process.exitcode}")
                )

    def describe(self) -> str:
        """Rank 0: every other rank, its pid and whether it still runs."""
        return ", ".join(
            f"rank {rank} (pid {p.pid}, "
            + ("running" if p.is_alive() else f"exited with {p.exitcode}")
            + ")"
            for rank, p in enumerate(self.processes, 1)
        )

    def abort(self) -> None:
        """Rank 0, after its step raised: the other ranks may wait in a collective it will never
        join, or would pair their next one with the wrong step: they are killed at once."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(5)
        self.pipes.clear()
        self.processes.clear()
        if torch.distributed.is_initialized():
            with contextlib.suppress(Exception):
                torch.distributed.destroy_process_group()

    def close(self) -> None:
        """Rank 0: stops the workers, then leaves the group (every rank, in any order)."""
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(("stop",))
        for process in self.processes:
            process.join(30)
            if process.is_alive():
                process.terminate()
                process.join(5)
        self.pipes.clear()
        self.processes.clear()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def device_of(config, rank: int) -> torch.device:
    """Rank r's device: ``cuda:r`` of the visible devices, or the CPU."""
    device = pick_device(config.device)
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _join(rank: int, size: int, address: str, device: torch.device, timeout_s: float) -> None:
    if torch.distributed.is_initialized():
        raise RuntimeError(
            "tensor parallelism starts its own process group, but this process already has "
            "one (torchrun?): run the engine outside it"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(
        backend,
        init_method=address,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),  # a collective waits no longer
    )


def launch(model, adapters, config, given: EngineParts) -> TensorParallel:
    """Rank 0: starts ranks 1..N-1 as worker processes, each handed ``given`` (the parts rank 0
    builds from), and joins the group with them."""
    size = config.tensor_parallel
    device = device_of(config, 0)
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ConfigError(
            f"engine.tensor_parallel is {size} but {torch.cuda.device_count()} CUDA devices "
            "are visible"
        )
    address = f"tcp://127.0.0.1:{_free_port()}"
    context = worker_context()
    tp = TensorParallel(0, size, device)
    level = logging.getLogger().getEffectiveLevel()
    for rank in range(1, size):
        ours, theirs = context.Pipe()
        process = context.Process(
            target=call_in_environment,
            args=worker_args(
                worker_main,
                rank,
                size,
                address,
                model,
                adapters,
                config,
                given,
                level,
                theirs,
                os.getpid(),
            ),
            name=f"slora-tp-{rank}",
            daemon=True,
        )
        process.start()
        theirs.close()
        tp.processes.append(process)
        tp.pipes.append(ours)
    log.info(
        "tensor parallel: %d ranks on %s, workers %s",
        size,
        device.type,
        [p.pid for p in tp.processes],
    )
    _join(0, size, address, device, config.worker_timeout_s)
    return tp


class TensorParallelRunner:
    """Rank 0's ``ModelRunner``: each forward first sends the plan to the other ranks."""

    def __init__(self, runner, tp: TensorParallel) -> None:
        self.runner, self.tp = runner, tp
        self.tables = PageTableSender()
        residency = runner.residency
        residency.journal = []
        residency.store.ahead_log = []

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def forward(self, host, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        residency = self.runner.residency
        journal, residency.journal = residency.journal, []
        ahead, residency.store.ahead_log = residency.store.ahead_log, []
        shared = host.prev_rows is not None
        count = int(prev_tokens.numel()) if shared else 0
        self.tp.send(("step", self.tables.encode(host), journal, ahead, count))
        try:
            if shared:
                self.tp.broadcast(prev_tokens)
            return self.runner.forward(host, prev_tokens)
        except Exception as exc:  # a collective timed out, say: name the ranks
            raise RuntimeError(
                f"tensor-parallel step failed on rank 0 ({self.tp.device}, pid {os.getpid()}; "
                f"{self.tp.describe()}): {type(exc).__name__}: {exc}"
            ) from exc


def build_shard(model, adapters, config, tp: TensorParallel, given: EngineParts):
    """A worker rank's engine parts, built in the order rank 0 builds its own (``Engine``), so
    that their collectives meet: the shard's store, model, pool and residency, then the runner
    (which captures its graphs with the others)."""
    spec = read_spec(model)
    dtype = pick_dtype(config.dtype, tp.device)
    max_len = min(config.max_model_len or spec.max_context, spec.max_context)
    parts = build_parts(spec, adapters, config, tp.device, dtype, max_len, given, tp)
    ops = given.kernels(config.backend, tp.device)
    return parts, make_runner(parts, ops, tp.device, max_len)


def worker_main(rank, size, address, model, adapters, config, given, level, pipe, rank0) -> None:
    """Ranks 1..N-1: build the shard, then repeat rank 0's steps until told to stop (``rank0``:
    rank 0's pid)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C reaches the group: rank 0 stops us
    logging.basicConfig(level=level, format=f"%(levelname)s tp rank {rank}: %(message)s")
    threading.Thread(target=_watch_parent, args=(rank0, rank), daemon=True).start()
    try:
        device = device_of(config, rank)
        if device.type == "cpu":
            set_cpu_threads(config.cpu_threads)
        tp = TensorParallel(rank, size, device)
        _join(rank, size, address, device, config.worker_timeout_s)
        parts, runner = build_shard(model, adapters, config, tp, given)
        _serve(parts, runner, tp, pipe)
    except Exception as exc:
        log.error("tensor-parallel rank %d failed", rank, exc_info=True)
        with contextlib.suppress(Exception):
            pipe.send(("failed", f"{type(exc).__name__}: {exc}"))
        os._exit(1)
    os._exit(0)


def _watch_parent(rank0: int, rank: int) -> None:
    """A rank ends as soon as rank 0 is gone, also while it waits in a collective (which would
    otherwise wait ``worker_timeout_s`` for a rank that will never come): its parent process,
    rank 0 or rank 0's fork server (``processes``), which ends with rank 0, is gone."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    log.error("tensor-parallel rank %d: rank 0 (pid %d) is gone; exiting", rank, rank0)
    os._exit(1)


def _serve(parts, runner, tp: TensorParallel, pipe) -> None:
    residency, store = parts.residency, parts.store
    tables = PageTableReceiver()
    while True:
        try:
            message = pipe.recv()
        except EOFError:  # rank 0 is gone
            return
        if message[0] == "stop":
            return
        _, (host, width, rows, dropped), journal, ahead, count = message
        host = tables.decode(host, width, rows, dropped)
        for name in ahead:
            store.load_ahead(name)
        for entry in journal:
            if entry[0] == "load":
                _, name, slot, pages = entry
                residency.install(name, slot, np.asarray(pages))
            else:
                residency.uninstall(entry[1])
        prev = None
        if host.prev_rows is not None:
            prev = torch.empty(count, dtype=torch.int64, device=tp.device)
            tp.broadcast(prev)
        with torch.inference_mode():
            runner.forward(host, prev)
