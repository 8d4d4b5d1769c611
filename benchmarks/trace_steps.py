"""Per-step device time from a torch.profiler Chrome trace: what each engine step kept the GPU busy
with, by kernel family, and how long the GPU sat idle before the next step's first kernel.

``mark_steps(engine)`` wraps ``Engine._launch`` so that each step's host launch is one
``step:N`` range in the trace and its shape (decode or mixed, rows, prefill tokens, adapters) is
kept; ``step_table(trace, marks)`` assigns every GPU event to the step whose range launched it
(through the CUDA runtime call's correlation id) and sums them up by step kind.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch

FAMILIES = (  # (family, substrings of the kernel name), first match wins
    ("lora-tiled", ("_shrink_kernel", "_expand_kernel")),
    ("lora-vector", ("_shrink_vector", "_expand_vector")),
    ("lora-reduce", ("_shrink_reduce",)),
    ("attn-decode", ("_decode_split", "_decode_merge")),
    ("attn-prefill", ("_prefill_kernel",)),
    ("gemm", ("nvjet", "gemm", "xmma", "cutlass", "sm90_")),
    ("fused", ("_rms_norm", "_rope", "_silu_mul", "_kv_write")),
)


def family(event: dict) -> str:
    if event.get("cat") == "gpu_memcpy":
        return "memcpy"
    if event.get("cat") == "gpu_memset":
        return "memset"
    name = event.get("name", "")
    for fam, keys in FAMILIES:
        if any(k in name for k in keys):
            return fam
    return "other"


def mark_steps(engine) -> list[dict]:
    """Wraps ``engine._launch``: each step's launch becomes a ``step:N`` range; returns the list
    that collects the steps' shapes (index N)."""
    marks: list[dict] = []
    launch = engine._launch

    def traced(step, started, prev):
        prefill = [(s, n) for s, n in zip(step.seqs, step.num_new, strict=True) if n > 1]
        marks.append(
            dict(
                kind="mixed" if prefill else "decode",
                rows=len(step.seqs),
                prefill_tokens=sum(n for _, n in prefill),
                adapters=len({s.adapter for s in step.seqs if s.adapter}),
                prefill_adapters=len({s.adapter for s, _ in prefill if s.adapter}),
            )
        )
        with torch.profiler.record_function(f"step:{len(marks) - 1}"):
            return launch(step, started, prev)

    engine._launch = traced
    return marks


def step_table(trace: str | Path, marks: list[dict]) -> tuple[str, dict]:
    """(Markdown, figures) of the traced steps by kind: mean GPU period (first kernel to the next
    step's first kernel), busy and idle ms on the main stream, ms by kernel family, and the
    side streams' copies."""
    events = json.loads(Path(trace).read_text())["traceEvents"]
    ranges = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), int(e["name"].split(":")[1]))
        for e in events
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("step:")
    )
    launched = {  # correlation id -> host time of the runtime call that launched it
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu or not ranges:
        return "no GPU events or steps in the trace\n", {}
    streams: dict[int, int] = defaultdict(int)
    for e in gpu:
        streams[e["args"].get("stream", -1)] += 1
    main = max(streams, key=streams.get)  # the step's stream: most events (copies are few)
    per_step: dict[int, list[dict]] = defaultdict(list)
    side = defaultdict(float)  # family -> us on other streams
    side_bytes = 0
    for e in gpu:
        if e["args"].get("stream", -1) != main:
            side[family(e)] += e.get("dur", 0)
            side_bytes += e["args"].get("bytes", 0)
            continue
        t = launched.get(e["args"].get("correlation"))
        step = next((n for lo, hi, n in ranges if t is not None and lo <= t <= hi), None)
        per_step[-1 if step is None else step].append(e)
    firsts = sorted((min(x["ts"] for x in evs), n) for n, evs in per_step.items() if n >= 0)
    kinds: dict[str, dict] = {}
    for i, (start, n) in enumerate(firsts[:-1]):  # the last step has no next step to end it
        evs = per_step[n]
        period = firsts[i + 1][0] - start
        busy = sum(x.get("dur", 0) for x in evs)
        k = kinds.setdefault(
            marks[n]["kind"],
            dict(
                steps=0,
                period=0.0,
                busy=0.0,
                rows=0,
                prefill_tokens=0,
                adapters=0,
                prefill_adapters=0,
                families=defaultdict(float),
            ),
        )
        k["steps"] += 1
        k["period"] += period
        k["busy"] += busy
        for key in ("rows", "prefill_tokens", "adapters", "prefill_adapters"):
            k[key] += marks[n][key]
        for x in evs:
            k["families"][family(x)] += x.get("dur", 0)
    names = [f for f, _ in FAMILIES] + ["memcpy", "memset", "other"]
    lines = [
        "| steps | kind | rows | prefill tok | adapters (prefill) | period ms | busy ms | idle ms | "
        + " | ".join(names)
        + " |",
        "|---:|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(names),
    ]
    figures = {}
    for kind, k in sorted(kinds.items()):
        s = k["steps"]
        fams = {f: k["families"].get(f, 0.0) / s / 1e3 for f in names}
        row = dict(
            steps=s,
            period_ms=k["period"] / s / 1e3,
            busy_ms=k["busy"] / s / 1e3,
            rows=k["rows"] / s,
            prefill_tokens=k["prefill_tokens"] / s,
            adapters=k["adapters"] / s,
            prefill_adapters=k["prefill_adapters"] / s,
            families_ms=fams,
        )
        figures[kind] = row
        lines.append(
            f"| {s} | {kind} | {row['rows']:.0f} | {row['prefill_tokens']:.0f} | "
            f"{row['adapters']:.0f} ({row['prefill_adapters']:.1f}) | {row['period_ms']:.2f} | "
            f"{row['busy_ms']:.2f} | {row['period_ms'] - row['busy_ms']:.2f} | "
            + " | ".join(f"{fams[f]:.2f}" for f in names)
            + " |"
        )
    outside = sum(x.get("dur", 0) for x in per_step.get(-1, []))
    figures["side_ms"] = {f: v / 1e3 for f, v in side.items()}
    figures["side_bytes"] = side_bytes
    figures["unattributed_main_ms"] = outside / 1e3
    lines.append(
        f"\nside streams: {', '.join(f'{f} {v / 1e3:.1f} ms' for f, v in side.items()) or 'none'}"
        f" ({side_bytes / 1e9:.2f} GB); main-stream events outside any step: {outside / 1e3:.1f} ms"
    )
    return "\n".join(lines) + "\n", figures
