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
import multiprocessing as mp
import os
import signal
import socket
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from slora_batch.engine.config import ConfigError
from slora_batch.engine.device import pick_device, pick_dtype, set_cpu_threads
from slora_batch.engine.execution.parts import build_parts, make_runner, pick_backend
from slora_batch.engine.models.spec import read_spec

log = logging.getLogger(__name__)

# Collectives wait this long for a rank before they fail (a rank that died mid-step).
TIMEOUT_S = 600


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


def _join(rank: int, size: int, address: str, device: torch.device) -> None:
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
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )


def launch(model, adapters, config, weights=None) -> TensorParallel:
    """Rank 0: starts ranks 1..N-1 as worker processes and joins the group with them."""
    size = config.tensor_parallel
    device = device_of(config, 0)
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ConfigError(
            f"engine.tensor_parallel is {size} but {torch.cuda.device_count()} CUDA devices "
            "are visible"
        )
    address = f"tcp://127.0.0.1:{_free_port()}"
    context = mp.get_context("spawn")
    tp = TensorParallel(0, size, device)
    level = logging.getLogger().getEffectiveLevel()
    for rank in range(1, size):
        ours, theirs = context.Pipe()
        process = context.Process(
            target=worker_main,
            args=(rank, size, address, model, adapters, config, weights, level, theirs),
            name=f"slora-tp-{rank}",
            daemon=True,
        )
        process.start()
        theirs.close()
        tp.processes.append(process)
        tp.pipes.append(ours)
    log.info("tensor parallel: %d ranks on %s, workers %s", size, device.type,
             [p.pid for p in tp.processes])  # fmt: skip
    _join(0, size, address, device)
    return tp


class PageTableSender:
    """Rank 0's side of the page tables: instead of a step's whole table ([rows, context, 2]:
    megabytes at long contexts), the entries each sequence added since it was last sent, by the
    sequence's key (``HostStep.seq_keys``: a preempted sequence gets a new one). A key unseen
    for ``FORGET_STEPS`` steps is dropped on both sides (sent again whole if it comes back)."""

    FORGET_STEPS = 64

    def __init__(self) -> None:
        self.sent: dict[tuple, int] = {}  # key -> table entries the other ranks hold
        self.seen: dict[tuple, int] = {}  # key -> the step it was last in
        self.steps = 0

    def encode(self, host) -> tuple:
        """(host without its page table, table width, [(key, start, new entries)], dropped)."""
        self.steps += 1
        rows = []
        for b, key in enumerate(host.seq_keys):
            length, start = int(host.b_seq_len[b]), self.sent.get(key, 0)
            if length > start:
                rows.append((key, start, host.page_table[b, start:length].copy()))
                self.sent[key] = length
            self.seen[key] = self.steps
        dropped = [k for k, step in self.seen.items() if step < self.steps - self.FORGET_STEPS]
        for key in dropped:
            del self.seen[key], self.sent[key]
        return replace(host, page_table=None), host.page_table.shape[1], rows, dropped


class PageTableReceiver:
    """A worker rank's side: each key's entries, grown as they come; the step's table rebuilt."""

    def __init__(self) -> None:
        self.tables: dict[tuple, np.ndarray] = {}

    def decode(self, host, width: int, rows: list, dropped: list):
        for key in dropped:
            self.tables.pop(key, None)
        for key, start, entries in rows:
            table = self.tables.get(key)
            end = start + entries.shape[0]
            if table is None or start == 0:
                table = np.empty((max(end, 16), 2), dtype=np.int32)
            elif end > table.shape[0]:
                grown = np.empty((max(end, 2 * table.shape[0]), 2), dtype=np.int32)
                grown[:start] = table[:start]
                table = grown
            table[start:end] = entries
            self.tables[key] = table
        page_table = np.full((len(host.seq_keys), width, 2), -1, dtype=np.int32)
        for b, key in enumerate(host.seq_keys):
            length = int(host.b_seq_len[b])
            page_table[b, :length] = self.tables[key][:length]
        return replace(host, page_table=page_table)


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
        if shared:
            self.tp.broadcast(prev_tokens)
        return self.runner.forward(host, prev_tokens)


def build_shard(model, adapters, config, tp: TensorParallel, weights=None):
    """A worker rank's engine parts, built in the order rank 0 builds its own (``Engine``), so
    that their collectives meet: the shard's store, model, pool and residency, then the runner
    (which captures its graphs with the others)."""
    spec = read_spec(model)
    dtype = pick_dtype(config.dtype, tp.device)
    max_len = min(config.max_model_len or spec.max_context, spec.max_context)
    parts = build_parts(spec, adapters, config, tp.device, dtype, max_len, weights, tp=tp)
    ops = pick_backend(config.backend, tp.device)
    return parts, make_runner(parts, ops, tp.device, config, max_len)


def worker_main(rank, size, address, model, adapters, config, weights, level, pipe) -> None:
    """Ranks 1..N-1: build the shard, then repeat rank 0's steps until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C reaches the group: rank 0 stops us
    logging.basicConfig(level=level, format=f"%(levelname)s tp rank {rank}: %(message)s")
    try:
        device = device_of(config, rank)
        if device.type == "cpu":
            set_cpu_threads(config.cpu_threads)
        tp = TensorParallel(rank, size, device)
        _join(rank, size, address, device)
        parts, runner = build_shard(model, adapters, config, tp, weights)
        _serve(parts, runner, tp, pipe)
    except Exception as exc:
        log.error("tensor-parallel rank %d failed", rank, exc_info=True)
        with contextlib.suppress(Exception):
            pipe.send(("failed", f"{type(exc).__name__}: {exc}"))
        os._exit(1)
    os._exit(0)


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
