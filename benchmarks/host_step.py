"""Host time of an engine step, per phase, without the model: CPU figures of this machine.

    python3 -m benchmarks.host_step --rows 256,512,1024 --adapters 1000 --profile 25

Builds a real CPU engine (the bench's tiny preset, random weights, ``--adapters`` adapter ids
of random ranks in [8, 64] over one weight set per rank) and runs its real loop: scheduler,
admission, adapter residency, ``plan_step``, the runner's host side, ``step_outputs``
(sampling at ``--temperature``), read-back and ``postprocess``. Only the model's forward is
replaced: it lays the step out as the GPU path does (a decode step fills a CUDA-graph bucket's
static buffers, ``ModelRunner._fill``; other steps ``upload``) and returns random logits of the
right shape. This stub exists for timing alone; no test of behaviour uses it.

Prints, per row count, the mean ms of each phase over the decode turns (a turn schedules and
launches step N+1 and reads step N back), the mean rows of those steps, the same over the mixed
turns (a step with a prefill chunk: eager on the GPU) with their mean prefill tokens, and with
``--profile`` cProfile's top functions of the whole run by own time. ``--kv-cache-dtype fp8``
runs the engine with fp8 KV pages (one page per token, ``PagePool.use_fp8_kv``).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import logging
import pstats
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

import slora_batch.engine.engine as engine_module
from slora_batch.bench.model import build_model
from slora_batch.engine.config import EngineConfig
from slora_batch.engine.device import to_device
from slora_batch.engine.engine import Engine, assemble
from slora_batch.engine.execution import outputs as outputs_module
from slora_batch.engine.execution import runner as runner_module
from slora_batch.engine.execution.batch import upload
from slora_batch.engine.execution.memory import graph_buckets
from slora_batch.engine.execution.parts import EngineParts
from slora_batch.engine.requests.request import Request

# "outputs" is step_outputs less "sample": the sampler's tensor math, which runs on the device
# on a GPU (queued, the host does not wait) and here on the CPU, so it is shown apart and left
# out of "host"; so is the bench's own counting of each turn's rows and adapters (a pass over
# the rows, ~0.05 ms at 512; commit 656cd82 and later).
# "gc": Python's cyclic garbage collector, inside whichever phases it interrupted.
PHASES = ("load_ahead", "schedule", "plan_step", "upload", "sampling_params", "outputs",
          "launched", "read_back", "postprocess", "count_step", "gc", "host", "sample")  # fmt: skip
COUNTS = ("rows", "adapters", "prefill")  # per turn: rows, distinct adapters, prefill tokens


class Timer:
    """Per loop turn: seconds per phase; a turn is a decode turn when its step is decode-only."""

    def __init__(self) -> None:
        self.turns: list[dict] = []

    def collecting(self, phase: str, info: dict) -> None:  # a gc.callbacks entry
        if phase == "start":
            self._gc = time.perf_counter()
        elif self.turns:
            self.turns[-1]["gc"] += time.perf_counter() - self._gc

    def wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.turns:
                    self.turns[-1][phase] += time.perf_counter() - began

        setattr(owner, name, timed)


def write_rank_dirs(model, root: Path, ranks: list[int]) -> dict[int, Path]:
    """One PEFT directory per distinct rank (the bench's writer, its ranks swapped)."""
    import slora_batch.bench.model as bench_model

    saved = bench_model.RANKS
    bench_model.RANKS = tuple(ranks)
    try:
        return model.write_adapters(root, seed=0)
    finally:
        bench_model.RANKS = saved


def requests(count: int, adapters: int, context: int, args, vocab: int) -> list[Request]:
    rng = np.random.default_rng(args.seed)
    lens = rng.integers(int(context * 0.9), int(context * 1.1) + 1, size=count)
    outs = rng.integers(args.min_output, args.max_output + 1, size=count)
    which = rng.integers(0, adapters, size=count)
    return [
        Request(
            id=i,
            adapter=f"a{int(which[i]):04d}",
            prompt_token_ids=rng.integers(3, vocab, size=int(lens[i])).tolist(),
            max_new_tokens=int(outs[i]),
            ignore_eos=True,
            temperature=args.temperature,
            top_k=args.top_k,
        )  # fmt: skip
        for i in range(count)
    ]


def stub_forward(engine: Engine, timer: Timer, vocab: int):
    """The runner's host side as on the GPU, then random logits [S, vocab]."""
    runner, statics = engine.runner, {}
    runner.scratch = engine.pool.alloc(2, "graph padding")
    runner.max_rank = max(engine.store.info(n).rank for n in engine.store.names)
    runner.targets = (0, 1, 2, 3)
    runner.graph_table(engine.config.max_num_seqs)
    buckets = graph_buckets(engine.config.max_num_seqs)  # the runner's
    logits = torch.randn(engine.config.max_num_seqs + 64, vocab)

    def forward(host, prev_tokens=None):
        began = time.perf_counter()
        batch = len(host.b_seq_len)
        if host.decode_only and host.score_index is None:
            bucket = min(b for b in buckets if b >= batch)
            tiled = runner._tiled(host.b_slot)
            if (bucket, tiled) not in statics:
                statics[bucket, tiled] = runner._static_input(bucket, tiled)
            runner._fill(host, bucket, tiled, prev_tokens)
        else:
            step = upload(host, engine.residency, engine.device)
            if host.prev_rows is not None:
                rows = to_device(host.prev_rows, engine.device)
                runner_module.gather_previous(step.input_ids, rows, prev_tokens)
        timer.turns[-1]["upload"] += time.perf_counter() - began
        rows = len(host.logits_index)
        start = engine._steps % 64
        return logits[start : start + rows]

    runner.forward = forward


def run(rows: int, model, rank_dirs: dict[int, Path], args) -> dict:
    rng = np.random.default_rng(args.seed + 1)
    ranks = sorted(rank_dirs)
    adapters = {f"a{i:04d}": rank_dirs[ranks[int(rng.integers(len(ranks)))]]
                for i in range(args.adapters)}  # fmt: skip
    kv = 2 * rows * int(args.context * 1.1 + args.max_output + 1)
    config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=rows,
                          num_pages=int(kv * 1.05) + args.adapter_pages, cuda_graphs=False,
                          lookahead=max(1024, 2 * rows),
                          kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    engine = assemble(model.model_dir, adapters, config, parts=EngineParts(model.weights))
    timer = Timer()
    stub_forward(engine, timer, model.spec.vocab_size)
    sched = engine.scheduler
    timer.wrap(engine.prefetcher, "load_ahead", "load_ahead")
    timer.wrap(sched, "schedule", "schedule")
    timer.wrap(engine_module, "plan_step", "plan_step")
    timer.wrap(engine_module, "step_outputs", "outputs")
    timer.wrap(outputs_module.SamplingBatch, "build", "sampling_params")
    timer.wrap(outputs_module, "sample", "sample")
    timer.wrap(sched, "launched", "launched")
    timer.wrap(outputs_module.Inflight, "read", "read_back")
    timer.wrap(engine_module, "take_outputs", "read_back")
    timer.wrap(sched, "postprocess", "postprocess")
    timer.wrap(engine.counters, "count_step", "count_step")
    schedule = sched.schedule

    def turn():  # a turn starts with load_ahead; its kind is the step it schedules
        timer.turns.append(defaultdict(float, began=time.perf_counter()))
        step = schedule()
        counted = time.perf_counter()  # the bench's own counts: in no phase, and not host time
        timer.turns[-1]["decode"] = bool(step) and max(step.num_new) == 1
        timer.turns[-1]["prefill"] = sum(n for n in step.num_new if n > 1)
        timer.turns[-1]["rows"] = len(step.seqs)
        timer.turns[-1]["adapters"] = len({s.adapter for s in step.seqs})
        timer.turns[-1]["counting"] = time.perf_counter() - counted
        return step

    sched.schedule = turn
    work = requests(args.requests_per_row * rows, args.adapters, args.context, args,
                    model.spec.vocab_size)  # fmt: skip
    gc.callbacks.append(timer.collecting)
    profiler = cProfile.Profile() if args.profile else None
    results = engine.generate(iter(work))
    began = time.perf_counter()
    if profiler:
        profiler.enable()
    done = 0
    for _ in results:
        done += 1
        if len(timer.turns) >= args.turns:
            break
    if profiler:
        profiler.disable()
    wall = time.perf_counter() - began
    gc.callbacks.remove(timer.collecting)
    results.close()
    for a, b in zip(timer.turns, timer.turns[1:], strict=False):
        a["turn"] = b["began"] - a["began"]
        a["outputs"] -= a["sample"] + a["sampling_params"]
        a["host"] = a["turn"] - a["sample"] - a["counting"]
    busy = [t for t in timer.turns[:-1] if t["rows"] >= args.min_rows * rows]
    decode = [t for t in busy if t["decode"]]
    mixed = [t for t in busy if not t["decode"]]
    figures = dict(max_rows=rows, turns=len(timer.turns), decode_turns=len(decode),
                   mixed_turns=len(mixed), wall_s=wall, results=done)  # fmt: skip
    for kind, turns in (("decode", decode), ("mixed", mixed)):
        figures[kind] = {
            key: (1 if key in COUNTS else 1e3) * float(np.mean([t[key] for t in turns]))
            if turns
            else float("nan")
            for key in (*PHASES, *COUNTS)
        }
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile)
        figures["profile"] = text.getvalue()
    engine.close()
    return figures


def table(results: list[dict], kind: str) -> str:
    head = ["rows", "turns", "mean rows", "adapters", "prefill tok", *PHASES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for f in results:
        k = f[kind]
        cells = [str(f["max_rows"]), str(f[f"{kind}_turns"])]
        cells += [f"{k[c]:.0f}" for c in COUNTS] + [f"{k[p]:.2f}" for p in PHASES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="256,512,1024",
                        help="max_num_seqs values, comma-separated")  # fmt: skip
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--min-rank", type=int, default=8)
    parser.add_argument("--max-rank", type=int, default=64)
    parser.add_argument("--context", type=int, default=500, help="prompt tokens, +-10%%")
    parser.add_argument("--min-output", type=int, default=64)
    parser.add_argument("--max-output", type=int, default=192)
    parser.add_argument("--requests-per-row", type=int, default=4)
    parser.add_argument("--turns", type=int, default=400, help="loop turns timed per row count")
    parser.add_argument(
        "--min-rows",
        type=float,
        default=0.75,
        help="turns counted: at least this fraction of rows running",
    )
    parser.add_argument(
        "--adapter-pages",
        type=int,
        default=200_000,
        help="pool pages beyond the rows' KV (the adapters' room)",
    )
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="EngineConfig.kv_cache_dtype: fp8 pages hold a token's K and V")  # fmt: skip
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=int, default=0, help="cProfile: top N functions")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_model("tiny", torch.device("cpu"), torch.float32, root, seed=0, hf=False)
        rng = np.random.default_rng(args.seed)
        ranks = sorted({int(r) for r in rng.integers(args.min_rank, args.max_rank + 1, 16)})
        rank_dirs = write_rank_dirs(model, root / "adapters", ranks)
        results = []
        for rows in (int(r) for r in args.rows.split(",")):
            figures = run(rows, model, rank_dirs, args)
            results.append(figures)
            print(f"rows {rows}: {figures['decode_turns']} decode and {figures['mixed_turns']} "
                  f"mixed turns of {figures['turns']}, {figures['results']} results, "
                  f"{figures['wall_s']:.1f} s")  # fmt: skip
            if "profile" in figures:
                print(figures["profile"])
    print(f"kv_cache_dtype {args.kv_cache_dtype}: ms per turn (CPU host time, forward stubbed)")
    for kind in ("decode", "mixed"):
        print(f"{kind} turns:")
        print(table(results, kind))


if __name__ == "__main__":
    main()
