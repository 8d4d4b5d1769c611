"""FP8 accuracy on the sample model: the sample eval's per-token log-probabilities in fp32, bf16,
bf16 + fp8 KV and bf16 + fp8 weights + KV, each bf16 setting compared against bf16 and fp32.

    python -m benchmarks.fp8_accuracy [--device cpu|cuda] [--out DIR]

The accuracy targets of fp8: against the bf16 engine, the mean |delta| of per-token log-probs is
at most 0.02 nats with an fp8 KV cache and 0.05 with fp8 weights + KV, and the best choice is
unchanged on at least 95% of rows. bf16 against fp32 is printed beside them: the noise that
bf16 alone brings.

Rows: ``jobs/sample-eval.yaml`` read as ``slora-batch run`` reads it (its input, ``to_request``,
its fan-out over the base model and every sample adapter): 10 questions x 5 adapters = 50 rows
of 5 choices. Each choice goes to the engine as one continuation ``Request`` (same messages,
same scoring tokenization as a choices row), since a choices row returns only each choice's
sum and the comparison needs every token. A row's best choice is the one with the highest sum
(the engine's ``best_choice``) or the highest mean per token (``best_choice_norm``, the
length-normalized variant). On cpu the kernels are the torch twins (``kernels/ref.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import platform
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slora_batch.engine.config import EngineConfig, SamplingConfig
from slora_batch.engine.engine import Engine
from slora_batch.engine.requests.request import Request
from slora_batch.jobs.check import fanout_adapters
from slora_batch.jobs.config import load_jobs
from slora_batch.jobs.ordering import sort_key
from slora_batch.jobs.reader import iter_input_files, read_rows
from slora_batch.jobs.rows import to_request

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "sample-eval.yaml"


@dataclass(frozen=True)
class Setting:
    """One engine precision: the model dtype, the KV cache's and the base weights'."""

    name: str
    dtype: str
    kv_cache_dtype: str = "auto"
    weights: str = "auto"


SETTINGS = (
    Setting("fp32", "float32"),
    Setting("bf16", "bfloat16"),
    Setting("bf16 + fp8 KV", "bfloat16", kv_cache_dtype="fp8"),
    Setting("bf16 + fp8 W+KV", "bfloat16", kv_cache_dtype="fp8", weights="fp8"),
)
COMPARED = ("bf16", "bf16 + fp8 KV", "bf16 + fp8 W+KV")
REFERENCES = ("bf16", "fp32")  # bf16 is the one the targets are stated against
MAX_MEAN_DELTA = {"bf16 + fp8 KV": 0.02, "bf16 + fp8 W+KV": 0.05}  # nats, against bf16
MIN_SAME_BEST = 0.95  # share of rows whose best choice is unchanged, against bf16

# A continuation's key: (row id, adapter or None, choice index); a row's: (row id, adapter).
Key = tuple[Any, str | None, int]


def eval_requests(job_path: Path = JOB, limit: int | None = None) -> list[Request]:
    """The eval job's rows as continuation requests, one per (row, adapter, choice), in the
    job's order (``sort_key``: base first, then adapters by name). ``limit``: the first rows of
    the input only. Raises ValueError naming a row the job path turns into an error row."""
    job = load_jobs(job_path)[0]
    sweep = fanout_adapters(job)
    if sweep is None:
        raise ValueError(f"{job_path}: the eval job must fan out over adapters (fanout: all)")
    rows = read_rows(iter_input_files(job.input), job.columns)
    out = []
    for number, row in enumerate(rows):
        if limit is not None and number >= limit:
            break
        item = to_request(row, job.sampling, fanout=True)
        if not isinstance(item, Request):
            raise ValueError(item.error)
        if not item.choices:
            raise ValueError(f"{row.where}: the eval's rows are choices rows, this one has none")
        for adapter in sweep:
            for index, choice in enumerate(item.choices):
                out.append(dataclasses.replace(item, id=(item.id, adapter, index), adapter=adapter,
                                               choices=None, continuation=choice, answer=None))  # fmt: skip
    return sorted(out, key=sort_key)


def score(
    model: str | Path,
    adapters: str | Path,
    requests: list[Request],
    setting: Setting,
    device: str,
    **knobs: Any,
) -> tuple[dict[Key, np.ndarray], float]:
    """Every continuation's per-token log-probabilities [tokens] (float64) under ``setting``,
    and the seconds the engine took (built and run). Raises RuntimeError on an error row."""
    config = EngineConfig(device=device, dtype=setting.dtype, kv_cache_dtype=setting.kv_cache_dtype,
                          weights=setting.weights, backend="torch" if device == "cpu" else "auto",
                          **knobs)  # fmt: skip
    began = time.perf_counter()
    with Engine(model, adapters=adapters, config=config, sampling=SamplingConfig()) as engine:
        results = list(engine.generate(requests))
    seconds = time.perf_counter() - began
    errors = [r.error for r in results if r.error is not None]
    if errors:
        raise RuntimeError(f"{setting.name}: {len(errors)} error rows, first: {errors[0]}")
    scores = {r.id: np.asarray(r.token_logprobs, dtype=np.float64) for r in results}
    if len(scores) != len(requests):
        raise RuntimeError(f"{setting.name}: {len(scores)} results for {len(requests)} requests")
    return scores, seconds


def compare(got: dict[Key, np.ndarray], want: dict[Key, np.ndarray]) -> dict[str, Any]:
    """Per-token |delta| (nats) over every continuation token, and the share of rows whose best
    choice (by sum; by mean per token) is the same in ``got`` as in ``want``. Rows whose best
    choice changed are listed with the reference's margin (best minus runner-up, nats)."""
    deltas = []
    for key, w in want.items():
        g = got[key]
        if g.shape != w.shape:  # same text, same tokenizer: a mismatch is a bug, not noise
            raise ValueError(f"continuation {key}: {g.size} tokens against {w.size}")
        deltas.append(np.abs(g - w))
    delta = np.concatenate(deltas)
    same, same_norm, changed = 0, 0, []
    rows = _rows(want)
    for row, choices in rows.items():
        w_sum, w_mean = _totals(want, row, choices)
        g_sum, g_mean = _totals(got, row, choices)
        same += int(np.argmax(g_sum) == np.argmax(w_sum))
        same_norm += int(np.argmax(g_mean) == np.argmax(w_mean))
        for rule, w_t, g_t in (("sum", w_sum, g_sum), ("mean", w_mean, g_mean)):
            if np.argmax(g_t) != np.argmax(w_t):
                top2 = np.sort(w_t)[-2:]
                changed.append({"row": row[0], "adapter": row[1], "rule": rule,
                                "reference_best": int(np.argmax(w_t)), "best": int(np.argmax(g_t)),
                                "reference_margin": float(top2[1] - top2[0])})  # fmt: skip
    return {
        "tokens": int(delta.size),
        "rows": len(rows),
        "mean_abs_delta": float(delta.mean()),
        "max_abs_delta": float(delta.max()),
        "same_best": same / len(rows),
        "same_best_norm": same_norm / len(rows),
        "changed": changed,
    }


def _rows(scores: dict[Key, np.ndarray]) -> dict[tuple[Any, str | None], list[int]]:
    rows: dict[tuple[Any, str | None], list[int]] = {}
    for row_id, adapter, index in scores:
        rows.setdefault((row_id, adapter), []).append(index)
    return {row: sorted(indices) for row, indices in rows.items()}


def _totals(scores, row, choices) -> tuple[np.ndarray, np.ndarray]:
    """Per choice: the sum of its token log-probs [choices] and their mean per token."""
    values = [scores[(*row, i)] for i in choices]
    return np.array([v.sum() for v in values]), np.array([v.mean() for v in values])


def measure(
    model: str | Path,
    adapters: str | Path,
    requests: list[Request],
    device: str = "cpu",
    settings: Iterable[Setting] = SETTINGS,
    **knobs: Any,
) -> dict[str, Any]:
    """Score ``requests`` in every setting, compare the ``COMPARED`` ones against each of the
    ``REFERENCES``, and check the targets. ``knobs``: further ``EngineConfig`` fields."""
    settings = tuple(settings)
    scores, seconds = {}, {}
    for setting in settings:
        scores[setting.name], seconds[setting.name] = score(
            model, adapters, requests, setting, device, **knobs
        )
        print(f"{setting.name}: {len(requests)} continuations in {seconds[setting.name]:.1f} s",
              flush=True)  # fmt: skip
    comparisons = [
        {"setting": name, "reference": reference, **compare(scores[name], scores[reference])}
        for reference in REFERENCES
        for name in COMPARED
        if name in scores and reference in scores
    ]
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": str(model),
        "device": _device_name(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "continuations": len(requests),
        "settings": {
            s.name: {**dataclasses.asdict(s), "seconds": seconds[s.name]} for s in settings
        },
        "comparisons": comparisons,
        "targets": targets(comparisons),
    }


def targets(comparisons: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fp8 accuracy targets, each against the bf16 engine: mean |delta| per fp8 setting and the
    share of rows with the same best choice (by sum and by mean per token)."""
    checks = []
    for c in comparisons:
        if c["reference"] != "bf16" or c["setting"] not in MAX_MEAN_DELTA:
            continue
        bound = MAX_MEAN_DELTA[c["setting"]]
        value = c["mean_abs_delta"]
        checks.append({"check": f"{c['setting']}: mean |delta| <= {bound} nats", "value": value,
                       "pass": math.isfinite(value) and value <= bound})  # fmt: skip
        for field, rule in (("same_best", "sum"), ("same_best_norm", "mean per token")):
            checks.append({"check": f"{c['setting']}: best choice ({rule}) unchanged >= "
                                    f"{MIN_SAME_BEST:.0%} of rows",
                           "value": c[field], "pass": c[field] >= MIN_SAME_BEST})  # fmt: skip
    return checks


def markdown(figures: dict[str, Any]) -> str:
    """The comparison table, the targets with pass/FAIL, and the rows whose best choice moved."""
    lines = [
        f"{figures['continuations']} continuations, {figures['device']}, torch {figures['torch']}"
        f" ({figures['threads']} threads); engine seconds: "
        + ", ".join(f"{name} {s['seconds']:.1f}" for name, s in figures["settings"].items()),
        "",
        "| setting | against | tokens | mean abs delta (nats) | max abs delta (nats) "
        "| best unchanged (sum) | best unchanged (mean per token) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for c in figures["comparisons"]:
        lines.append(f"| {c['setting']} | {c['reference']} | {c['tokens']} "
                     f"| {c['mean_abs_delta']:.4f} | {c['max_abs_delta']:.4f} "
                     f"| {c['same_best']:.1%} ({c['rows']} rows) | {c['same_best_norm']:.1%} |")  # fmt: skip
    lines += ["", "Targets (against the bf16 engine):", ""]
    for t in figures["targets"]:
        value = f"{t['value']:.4f}" if "delta" in t["check"] else f"{t['value']:.1%}"
        lines.append(f"- {t['check']}: {value} {'pass' if t['pass'] else 'FAIL'}")
    moved = [(c, m) for c in figures["comparisons"] for m in c["changed"]]
    if moved:
        lines += ["", "Rows whose best choice changed:", ""]
        for c, m in moved:
            lines.append(f"- {c['setting']} against {c['reference']}, by {m['rule']}: row "
                         f"{m['row']} adapter {m['adapter'] or 'base'}: choice {m['reference_best']}"
                         f" -> {m['best']} (reference margin {m['reference_margin']:.3f})")  # fmt: skip
    return "\n".join(lines) + "\n"


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.processor() or platform.machine()})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", default="out/fp8-accuracy", help="folder for the table and JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    job = load_jobs(JOB)[0]
    requests = eval_requests(JOB)
    figures = measure(job.model, job.adapters, requests, args.device)
    table = markdown(figures)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8-accuracy.md").write_text(table)
    (out / "fp8-accuracy.json").write_text(json.dumps(figures, indent=2, default=str) + "\n")
    print(table, end="")
    print(f"wrote {out / 'fp8-accuracy.md'} and {out / 'fp8-accuracy.json'}")


if __name__ == "__main__":
    main()
