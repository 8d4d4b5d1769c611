"""Where the engine's step time goes on the card: the bench's Llama-2-7B-shaped model and
workload, a window of steady-state steps timed by step type, then a shorter one under
torch.profiler (kernels by total device time).

    python3 -m benchmarks.profile_engine --adapters 0,100,1000 --out $OUT/profile

Prints, per adapter count: steps by type (decode replayed from a CUDA graph, other decode,
mixed/prefill), mean wall ms of each, the host share, and the top kernels.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.trace_steps import mark_steps, step_table
from slora_batch.bench.bench import BenchConfig
from slora_batch.bench.engine_run import group_by_adapter
from slora_batch.bench.workload import Workload, adapter_sources, build_model
from slora_batch.engine.config import EngineConfig, SamplingConfig
from slora_batch.engine.engine import Engine, assemble
from slora_batch.engine.execution.parts import EngineParts

log = logging.getLogger("profile_engine")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def snapshot(engine: Engine) -> dict:
    c = engine.counters
    return dict(steps=c.steps, decode=c.decode_steps, graph=c.graph_steps, step_s=c.step_s,
                decode_s=c.decode_step_s, host_s=c.host_s, decode_tokens=c.decode_tokens,
                prefill_tokens=c.prefill_tokens)  # fmt: skip


def describe(before: dict, after: dict) -> str:
    d = {k: after[k] - before[k] for k in before}
    mixed = d["steps"] - d["decode"]
    mixed_s = d["step_s"] - d["decode_s"]
    return (
        f"{d['steps']} steps: {d['graph']} graph decode, {d['decode'] - d['graph']} eager decode, "
        f"{mixed} mixed/prefill; decode step {1e3 * d['decode_s'] / max(d['decode'], 1):.2f} ms, "
        f"mixed step {1e3 * mixed_s / max(mixed, 1):.2f} ms; host share "
        f"{d['host_s'] / max(d['step_s'], 1e-9):.1%}; tokens: {d['decode_tokens']} decode, "
        f"{d['prefill_tokens']} prefill; {d['decode_tokens'] / max(d['steps'], 1):.0f} decode "
        f"rows a step; {d['step_s']:.2f} s"
    )


def run(n: int, model, rank_dirs, workload: Workload, args, out: Path) -> None:
    engine = assemble(
        model.model_dir,
        adapter_sources(n, rank_dirs) if n else {},
        EngineConfig(device=str(model.device), dtype=str(model.dtype)[6:], **args.set),
        SamplingConfig(ignore_eos=True),
        EngineParts(model.weights),
    )
    requests = workload.requests(n)
    if args.order == "adapter":  # as the bench feeds its engine systems
        requests = group_by_adapter(requests)
    results = engine.generate(iter(requests))
    for done, _ in enumerate(results, 1):  # steady state: the first requests are done
        if done >= args.skip_results:
            break
    sync(model.device)
    before, start = snapshot(engine), time.perf_counter()
    for _ in results:
        if engine.counters.steps - before["steps"] >= args.window_steps:
            break
    sync(model.device)
    line = f"adapters {n}{args.set or ''} ({args.order} order): {describe(before, snapshot(engine))}; wall {time.perf_counter() - start:.2f} s"
    print(line, flush=True)
    from torch.profiler import ProfilerActivity, profile

    before = snapshot(engine)
    marks = mark_steps(engine) if args.trace else None
    activities = [ProfilerActivity.CPU]
    if model.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in results:
            if engine.counters.steps - before["steps"] >= args.profile_steps:
                break
        sync(model.device)
    print(f"  profiled: {describe(before, snapshot(engine))}", flush=True)
    averages = prof.key_averages()
    try:
        key = "self_device_time_total" if model.device.type == "cuda" else "self_cpu_time_total"
        table = averages.table(sort_by=key, row_limit=args.rows)
    except Exception:  # older torch
        table = averages.table(sort_by="self_cuda_time_total", row_limit=args.rows)
    tag = "".join(f"-{k}-{v}" for k, v in args.set.items())  # no "=": the device tool drops it
    tag += "-arrival" if args.order == "arrival" else ""
    (out / f"profile-{n}{tag}.txt").write_text(line + "\n" + table)
    print(table, flush=True)
    if marks is not None:
        with tempfile.TemporaryDirectory(prefix="slora-trace-") as tmp:
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
            steps, figures = step_table(trace, marks)
        (out / f"steps-{n}{tag}.md").write_text(f"adapters {n}{tag}\n\n{steps}")
        (out / f"steps-{n}{tag}.json").write_text(json.dumps(figures, indent=1))
        print(
            f"steps by kind, adapters {n}{tag} (ms a step on the main stream):\n{steps}", flush=True
        )
    results.close()
    # the engine's cycles (runner, graphs) keep its page pool until collected; the next engine
    # sizes its pool from the free memory, so without this it got a few rows (12 at 10 adapters)
    del engine, results, prof
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


def _field(item: str) -> tuple[str, object]:
    """From "cuda_graphs=false" to ("cuda_graphs", False): the type is the default's."""
    name, _, text = item.partition("=")
    default = getattr(EngineConfig(), name)
    if isinstance(default, bool):
        return name, text.lower() in ("1", "true", "yes")
    return name, type(default)(text) if default is not None else int(text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--adapters", default="0,100,1000")
    parser.add_argument("--requests", type=int, default=1200)
    parser.add_argument("--skip-results", type=int, default=150)
    parser.add_argument("--window-steps", type=int, default=150)
    parser.add_argument("--profile-steps", type=int, default=12)
    parser.add_argument("--rows", type=int, default=22)
    parser.add_argument("--out", default="out/profile")
    parser.add_argument("--preset", default="llama2-7b", help="tiny: a CPU check of the script")
    parser.add_argument("--trace", action="store_true",
                        help="device time per step kind, from the profiled window's trace")  # fmt: skip
    parser.add_argument("--order", choices=["adapter", "arrival"], default="adapter")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="an EngineConfig field for every run, e.g. cuda_graphs=false")  # fmt: skip
    args = parser.parse_args()
    args.set = dict(_field(item) for item in args.set)
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = BenchConfig(requests=args.requests)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    with tempfile.TemporaryDirectory(prefix="slora-profile-") as tmp:
        model = build_model(args.preset, device, dtype, Path(tmp), 0)
        rank_dirs = model.write_adapters(Path(tmp) / "adapters", 0)
        workload = Workload.generate(config, model.spec.vocab_size)
        for n in [int(x) for x in args.adapters.split(",")]:
            run(n, model, rank_dirs, workload, args, out)
            if cuda:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
