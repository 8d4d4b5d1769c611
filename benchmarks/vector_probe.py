"""Why the vector LoRA kernels of a decode step on 2000 adapters move adapter rows at about 0.65
of the copy bandwidth: the same step (247 tokens drawn from 2000 adapters, Llama-2-7B q, k, v, o,
replayed from a CUDA graph) with every adapter at one rank, next to the workload's mixed ranks.
Equal fractions at one rank would clear the programs that a mixed step leaves idle past an
adapter's rank. The mixed step again with its rows ordered by rank, largest first: in graph
decode steps program i is row i, so the programs with the most rank rows would start first and
spread over the SMs (the o launches run in one or two waves). Then a step like the bench's
(``clustered_slots``: fewer distinct adapters than rows, an adapter's rows side by side), and the
same rows shuffled: whether the time follows the rows or the distinct adapters, and their order.
Then Nsight Compute's view of the two kernels, when ncu is there.

    python3 -m benchmarks.vector_probe --out $OUT        # timings, then ncu on the mixed case
    python3 -m benchmarks.vector_probe --no-ncu          # the timings only
    python3 -m benchmarks.vector_probe --launch          # what ncu profiles: the kernels alone
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.kernels import Table, _lora_case, copy_gbps
from kernels.meta import VECTOR_ALL
from slora_batch.bench import BenchConfig
from slora_batch.bench_engine import group_by_adapter
from slora_batch.bench_workload import Workload

TOKENS, ADAPTERS = 247, 2000
CYCLES = {"mixed 8/16/32/64": (8, 16, 32, 64), "all 64": (64,), "all 16": (16,), "all 8": (8,)}


def b_slot(by_rank: tuple[int, ...] | None = None) -> torch.Tensor:
    """The step's adapter slots; with ``by_rank`` (the rank cycle), rows by rank, largest first."""
    gen = torch.Generator().manual_seed(TOKENS + ADAPTERS)
    slots = torch.randint(0, ADAPTERS, (TOKENS,), generator=gen)
    if by_rank is None:
        return slots
    ranks = torch.tensor(by_rank)[slots % len(by_rank)]
    return slots[torch.sort(-ranks, stable=True).indices]


def clustered_slots(step: int = 300, cap: int = TOKENS) -> torch.Tensor:
    """The rows of a bench decode step at 2000 adapters: the bench's workload (DESIGN section 5,
    seed 0) in the bench's order (``group_by_adapter``), admitted into a batch of ``cap`` rows
    whenever rows finish, each row leaving after its output length; the batch's adapter slots at
    ``step``, in admission order. Requests of one adapter run side by side, so the step holds
    fewer distinct adapters than rows (179 of 247 at step 300)."""
    workload = Workload.generate(BenchConfig(), vocab_size=32000)
    queue = group_by_adapter(workload.requests(ADAPTERS))
    queue.reverse()  # popped from the end: the first request first
    active: list[list] = []  # [request, tokens still to make]

    def admit() -> None:
        while queue and len(active) < cap:
            request = queue.pop()
            active.append([request, request.max_new_tokens])

    for _ in range(step):
        admit()
        for row in active:
            row[1] -= 1
        active[:] = [row for row in active if row[1] > 0]
    admit()
    return torch.tensor([int(request.adapter[1:]) for request, _ in active])  # "a0042" -> 42


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out/probe")
    parser.add_argument("--launch", action="store_true", help="one timed case only (for ncu)")
    parser.add_argument("--no-ncu", action="store_true", help="the timings only")
    args = parser.parse_args()
    bw = copy_gbps()
    rows = Table()
    rows.append(("copy", "1 GiB", 0.0, f"{bw:.0f} GB/s", "1.00"))
    cycles = list(CYCLES.items())[:1] if args.launch else CYCLES.items()
    for label, cycle in cycles:
        rows += _lora_case(b_slot(), ADAPTERS, VECTOR_ALL, f"T={TOKENS} {ADAPTERS} adapters, "
                           f"ranks {label}", [{}], [{}], bw, rank_cycle=cycle)  # fmt: skip
    if args.launch:
        return
    mixed = CYCLES["mixed 8/16/32/64"]
    rows += _lora_case(b_slot(mixed), ADAPTERS, VECTOR_ALL, f"T={TOKENS} {ADAPTERS} adapters, "
                       "ranks mixed, rows by rank (largest first)", [{}], [{}], bw,
                       rank_cycle=mixed)  # fmt: skip
    clustered = clustered_slots()
    distinct = clustered.unique().numel()
    rows += _lora_case(clustered, ADAPTERS, VECTOR_ALL, f"T={clustered.numel()} bench-like, "
                       f"{distinct} adapters side by side", [{}], [{}], bw,
                       rank_cycle=mixed)  # fmt: skip
    order = torch.randperm(clustered.numel(), generator=torch.Generator().manual_seed(1))
    shuffled = clustered[order]
    rows += _lora_case(shuffled, ADAPTERS, VECTOR_ALL, f"T={clustered.numel()} bench-like, "
                       f"{distinct} adapters, rows shuffled", [{}], [{}], bw,
                       rank_cycle=mixed)  # fmt: skip
    if args.no_ncu:
        return
    ncu = shutil.which("ncu") or next(iter(Path("/opt/nvidia").glob("nsight-compute/*/ncu")), None)
    if ncu is None:
        print("no ncu on this machine", flush=True)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = ["SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "WarpStateStats",
                "LaunchStats", "SchedulerStats"]  # fmt: skip
    for kernel in ("shrink", "expand"):  # the q,k,v launch and the o launch of each
        cmd = [str(ncu), "--clock-control", "none", "--kernel-name", f"regex:_{kernel}_vector",
               "--launch-count", "2", *[a for s in sections for a in ("--section", s)],
               sys.executable, "-m", "benchmarks.vector_probe", "--launch"]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
        except subprocess.TimeoutExpired as exc:
            print(f"ncu on the {kernel}: {exc}", flush=True)
            continue
        (out / f"ncu-{kernel}.txt").write_text(done.stdout + done.stderr)
        print(
            f"ncu on the {kernel}: exit {done.returncode}, report in ncu-{kernel}.txt", flush=True
        )


if __name__ == "__main__":
    main()
