"""What the bench writes: results.parquet, results.md, summary.json, run.json, throughput.png.

All files are rewritten after every run, so a bench cut short keeps the runs that finished.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import platform
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from slora_batch.bench.engine_run import ABLATIONS

log = logging.getLogger(__name__)

COMMIT_ENV = "SLORA_BATCH_COMMIT"  # where the tree travels without .git (the device machine)
# the scoring systems' rows have no output tokens (NaN) and two figures of their own
SUMMARY_KEYS = ("requests_per_s", "output_tokens_per_s", "roofline_fraction", "rows_per_s",
                "scored_tokens_per_s")  # fmt: skip
SCORE_TARGET = 20.0  # score@N / peft-score best, rows/s (the target)
# the prefix cache's issue: (system, the one it is measured against, need >= this), per count
PREFIX_TARGETS = (("prefix", "prefix-off", 3.0), ("slora", "slora-off", 0.98),
                  ("samples", "samples-separate", 4.0))  # fmt: skip
OWN_WORKLOAD = ("prefix", "prefix-off", "samples", "samples-separate")  # not slora's requests


def run_meta(
    device: torch.device, dtype: torch.dtype, rates, config, model, weight_sets: int
) -> dict:
    """The results header: date, card, commit, versions, the two measured rates, the settings."""
    if device.type == "cuda":
        card = torch.cuda.get_device_name(device)
    else:
        card = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    settings = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(config).items()
    }
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "card": card,
        "commit": _commit(),
        "versions": {name: _version(name) for name in ("torch", "triton", "transformers", "peft")},
        "dtype": str(dtype).removeprefix("torch."),
        "parameters": model.num_params,
        "matmul_tflops": rates.matmul_flops_per_s / 1e12,
        "copy_tb_per_s": rates.copy_bytes_per_s / 1e12,
        "adapter_weight_sets": weight_sets,
        "settings": settings,
        "skipped": [],
    }


def _commit() -> str:
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        root = Path(__file__).resolve().parent.parent
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"unknown (no git; set {COMMIT_ENV})"
    return head + (" + uncommitted changes" if dirty else "")


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def write_outputs(out: Path, rows: list[dict], meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(k for row in rows for k in row))  # a failed run's row is short
    table = (
        pa.Table.from_pylist([{k: row.get(k) for k in columns} for row in rows])
        if rows
        else pa.table({})
    )
    table = table.replace_schema_metadata({"bench": json.dumps(meta)})
    pq.write_table(table, out / "results.parquet")
    (out / "run.json").write_text(json.dumps(meta, indent=1) + "\n")
    summary: dict[str, dict[str, dict]] = {}
    for row in rows:
        if not row.get("error"):
            summary.setdefault(row["system"], {})[str(row["adapters"])] = {
                k: row[k] for k in SUMMARY_KEYS if not _missing(row.get(k))
            }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "results.md").write_text(markdown(rows, meta))
    plot(rows, out / "throughput.png")


def markdown(rows: list[dict], meta: dict) -> str:
    v = meta["versions"]
    lines = [
        "# slora-batch bench",
        "",
        f"- date: {meta['date']}",
        f"- card: {meta['card']}",
        f"- commit: {meta['commit']}",
        f"- torch {v['torch']}, triton {v['triton']}, transformers {v['transformers']}, peft {v['peft']}",
        f"- measured: {meta['dtype']} matmul {meta['matmul_tflops']:.4g} TFLOP/s, "
        f"copy {meta['copy_tb_per_s']:.4g} TB/s (read + write)",
        f"- model: {meta['settings']['model_preset']} shapes, random weights, "
        f"{meta['parameters'] / 1e9:.2f}B parameters",
        f"- workload: {meta['settings']['requests']} requests, input {meta['settings']['min_input']}-"
        f"{meta['settings']['max_input']}, output {meta['settings']['min_output']}-"
        f"{meta['settings']['max_output']}, popularity power({0.1 if meta['settings']['skewed'] else 1})"
        f", seed {meta['settings']['seed']}; adapter ids share {meta['adapter_weight_sets']} weight "
        "sets (one per rank 8/16/32/64), each id loaded, paged and evicted on its own",
        f"- time limits: engine runs {_limit(meta['settings']['max_seconds'])}, peft runs "
        f"{_limit(meta['settings']['peft_max_seconds'])} (a run cut at its limit counts the work "
        "done by then: note *cut*)",
    ]
    lines += _scoring_workload(meta["settings"])
    lines += _prefix_workloads(meta["settings"])
    if meta["skipped"]:
        lines.append(f"- skipped for time: {', '.join(meta['skipped'])}")
    lines += [
        "",
        "| system | adapters | requests done | req/s | output tok/s | vs slora | vs base | "
        "wall s | setup s | peak GiB | roofline | decode host share | decode batch | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    slora = {r["adapters"]: r for r in rows if r["system"] == "slora" and not r.get("error")}
    base = next((r for r in rows if r["system"] == "base" and not r.get("error")), None)
    for r in rows:
        if r.get("error"):
            lines.append(
                f"| {r['system']} | {r['adapters']} | | | | | | | | | | | | failed: "
                f"{r['error'][:80].replace('|', '/')} |"
            )
            continue
        tok = r["output_tokens_per_s"]
        own = r["system"] in OWN_WORKLOAD  # another workload: no ratio to slora or base
        vs_slora = (
            tok / slora[r["adapters"]]["output_tokens_per_s"]
            if r["adapters"] in slora and not own
            else math.nan
        )
        vs_base = tok / base["output_tokens_per_s"] if base and not own else math.nan
        note = ", ".join(
            filter(
                None,
                [
                    "cut" if r["truncated"] else "",
                    f"{r['error_rows']} error rows" if r["error_rows"] else "",
                    f"{r['length_mismatches']} length mismatches" if r["length_mismatches"] else "",
                    _builds_note(r),
                    _score_note(r),
                    _prefix_note(r),
                ],
            )
        )
        lines.append(
            f"| {r['system']} | {r['adapters']} | {r['finished']}/{r['requests']} | "
            f"{r['requests_per_s']:.2f} | {_num(tok, 0)} | {_num(vs_slora)} | {_num(vs_base)} | "
            f"{r['wall_s']:.1f} | {r['setup_s']:.1f} | {_num(r['peak_mem_gib'], 1)} | "
            f"{r['roofline_fraction']:.3f} | {_pct(r['decode_host_share'])} | "
            f"{_num(r['decode_batch'], 0)} | {note} |"
        )
    lines += ["", "## Acceptance (issue 4)", ""] + acceptance(rows) + [""]
    return "\n".join(lines)


def acceptance(rows: list[dict]) -> list[str]:
    """The issue's thresholds on the rows at hand; a check whose runs are missing says so."""
    ok = [r for r in rows if not r.get("error")]

    def tok(system: str, n: int) -> float | None:
        hit = [r["output_tokens_per_s"] for r in ok if r["system"] == system and r["adapters"] == n]
        return hit[0] if hit else None

    peft = [r for r in ok if r["system"] == "peft"]
    best = max(peft, key=lambda r: r["output_tokens_per_s"]) if peft else None
    checks = [
        (
            "slora@1000 / peft best",
            tok("slora", 1000),
            best and best["output_tokens_per_s"],
            30.0,
            f" (peft best at {best['adapters']} adapters)" if best else "",
        ),
        ("slora@1000 / base", tok("slora", 1000), tok("base", 0), 0.85, ""),
        ("slora@2000 / slora@10", tok("slora", 2000), tok("slora", 10), 0.95, ""),
    ]
    lines = []
    for name, num, den, need, extra in checks:
        if num is None or not den:
            lines.append(f"- {name}: not measured")
        else:
            lines.append(
                f"- {name} = {num / den:.2f} (need >= {need}): "
                f"{'pass' if num / den >= need else 'FAIL'}{extra}"
            )
    lines += _score_acceptance(ok)
    lines += _prefix_acceptance(ok)
    for r in ok:
        if r["system"] in ("base", "slora"):
            lines.append(
                f"- roofline {r['system']}@{r['adapters']} = {r['roofline_fraction']:.3f} "
                f"(need >= 0.30): {'pass' if r['roofline_fraction'] >= 0.30 else 'FAIL'}"
            )
        if r["system"] in (*ABLATIONS, "job") and tok("slora", r["adapters"]):
            lines.append(
                f"- {r['system']}@{r['adapters']} / slora@{r['adapters']} = "
                f"{r['output_tokens_per_s'] / tok('slora', r['adapters']):.2f}"
            )
        if r["system"] == "job":
            lines.append(
                f"- job@{r['adapters']}: {r['output_tokens_per_s']:.0f} tok/s over engine time, "
                f"{r['end_to_end_tokens_per_s']:.0f} end to end; wall {r['job_wall_s']:.1f} s = "
                f"load {r['job_load_s'] or 0:.1f} + warmup {r['job_warmup_s'] or 0:.1f} + engine "
                f"{r['wall_s']:.1f} + read {r['job_read_s']:.1f} + write {r['job_write_s']:.1f} s "
                f"and the rest (scan, stats); files written in {r['job_files_s']:.1f} s"
            )
        if r["system"] in ("base-par", "slora-par"):
            one = r["system"].removesuffix("-par")
            layout = f"tp {r['tensor_parallel']} x dp {r['data_parallel']}"
            ratio = tok(one, r["adapters"])
            lines.append(
                f"- {r['system']}@{r['adapters']} ({layout}) = {r['output_tokens_per_s']:.0f} "
                f"tok/s" + (f", {r['output_tokens_per_s'] / ratio:.2f}x {one}@{r['adapters']}"
                            if ratio else f"; {one}@{r['adapters']} not measured")
            )  # fmt: skip
            if r["system"] == "slora-par" and tok("base-par", 0):
                lines.append(
                    f"- slora-par@{r['adapters']} / base-par ({layout}) = "
                    f"{r['output_tokens_per_s'] / tok('base-par', 0):.2f}"
                )
        if r["system"] == "slora" and not math.isnan(r["decode_host_share"]):
            lines.append(
                f"- decode host share slora@{r['adapters']} = {_pct(r['decode_host_share'])}"
                f" (all steps {_pct(r['host_share'])}) at a mean decode batch of "
                f"{r['decode_batch']:.0f} (need < 10% at >= 128)"
            )
    return lines


def _score_acceptance(ok: list[dict]) -> list[str]:
    """score@N / peft-score at its best, in rows/s, for every N that score ran at."""
    scores = [r for r in ok if r["system"] == "score"]
    peft = [r for r in ok if r["system"] == "peft-score"]
    if not scores or not peft:
        return [] if not scores and not peft else ["- score@N / peft-score best: not measured"]
    best = max(peft, key=lambda r: r["rows_per_s"])
    lines = []
    for r in scores:
        ratio = r["rows_per_s"] / best["rows_per_s"]
        lines.append(
            f"- score@{r['adapters']} / peft-score best = {ratio:.2f} (need >= {SCORE_TARGET:g}): "
            f"{'pass' if ratio >= SCORE_TARGET else 'FAIL'}; {r['rows_per_s']:.2f} rows/s "
            f"against {best['rows_per_s']:.2f} (peft-score best at {best['adapters']} adapters)"
        )
    return lines


def _prefix_acceptance(ok: list[dict]) -> list[str]:
    """Each PREFIX_TARGETS ratio in output tok/s at every count where either system ran ("not
    measured" where one is missing); slora, in the default list, only where slora-off ran."""
    tok = {(r["system"], r["adapters"]): r["output_tokens_per_s"] for r in ok}
    lines = []
    for system, other, need in PREFIX_TARGETS:
        ran = {n for s, n in tok if s == other or (s == system and system in OWN_WORKLOAD)}
        for n in sorted(ran):
            name = f"{system}@{n} / {other}@{n}"
            num, den = tok.get((system, n)), tok.get((other, n))
            if num is None or not den:
                lines.append(f"- {name}: not measured")
                continue
            ratio = num / den
            lines.append(
                f"- {name} = {ratio:.2f} (need >= {need:g}): {'pass' if ratio >= need else 'FAIL'}"
                f"; {num:.0f} against {den:.0f} output tok/s"
            )
    return lines


def _prefix_workloads(settings: dict) -> list[str]:
    """The header lines of the prefix cache's workloads, where one of their systems ran."""
    systems = set(settings.get("systems", ()))
    lines = []
    if {"prefix", "prefix-off"} & systems:
        lines.append(
            f"- shared-prefix workload: {settings['prefix_rows']} rows, one "
            f"{settings['prefix_tokens']}-token prefix per adapter then a suffix of "
            f"{settings['prefix_min_suffix']}-{settings['prefix_max_suffix']} tokens, "
            f"{settings['prefix_output']} output tokens; sorted by adapter, then prompt"
        )
    if {"samples", "samples-separate"} & systems:
        lines.append(
            f"- samples: {settings['samples_prompts']} prompts of the workload's shapes, "
            f"n = {settings['samples_n']} at temperature 1 (samples-separate: "
            f"{settings['samples_n']} requests of each); requests done and req/s count samples"
        )
    return lines


def _prefix_note(row: dict) -> str:
    hits = row.get("prefix_hit_tokens")
    if _missing(hits) or not hits:
        return ""
    return f"{int(hits)} prefix hit tokens"


def _scoring_workload(settings: dict) -> list[str]:
    """The scoring workload's line of the header, where a scoring system ran."""
    if not {"score", "peft-score"} & set(settings.get("systems", ())):
        return []
    return [
        f"- scoring workload: {settings['score_rows']} rows, context "
        f"{settings['score_min_context']}-{settings['score_max_context']}, "
        f"{settings['score_choices']} choices of {settings['score_min_choice']}-"
        f"{settings['score_max_choice']} tokens; peft-score the first "
        f"{settings['peft_score_rows']} rows in padded batches of {settings['peft_score_batch']} "
        "rows, one adapter per batch; req/s is rows/s"
    ]


def _score_note(row: dict) -> str:
    if _missing(row.get("scored_tokens_per_s")):
        return ""
    return f"{row['scored_tokens_per_s']:.0f} scored tok/s"


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _limit(seconds: float) -> str:
    return f"{seconds:g} s" if seconds else "none"


def _num(x: float, digits: int = 2) -> str:
    return "" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def _pct(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


@functools.cache
def _pyplot():
    """matplotlib's pyplot on the Agg backend, or None (logged once) where it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning(
            "matplotlib is not installed: no throughput.png (the table and Parquet have the figures)"
        )
        return None
    return plt


def plot(rows: list[dict], path: Path) -> None:
    """Output tokens/s against the number of adapters, one line per system (base: a level);
    beside it, where a scoring system ran, rows/s of score and peft-score the same way."""
    plt = _pyplot()
    if plt is None:
        return
    ok = [r for r in rows if not r.get("error")]
    scoring = any(not _missing(r.get("rows_per_s")) for r in ok)
    panels = [("output_tokens_per_s", "output tokens / s", "throughput")]
    if scoring and all(_missing(r.get("output_tokens_per_s")) for r in ok):
        panels = []  # only scoring runs
    if scoring:
        panels.append(("rows_per_s", "scored rows / s", "scoring"))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for ax, (key, label, title) in zip(axes[0], panels, strict=True):
        drawn = False
        for system in dict.fromkeys(r["system"] for r in ok):
            points = sorted(
                (r["adapters"], r[key])
                for r in ok
                if r["system"] == system and not _missing(r.get(key))
            )  # a scoring row has no output tokens, a generation row no rows/s
            if not points:
                continue
            drawn = True
            if system == "base":
                ax.axhline(points[0][1], linestyle="--", color="gray", label="base (no adapters)")
            else:
                ax.plot(*zip(*points, strict=True), marker="o", label=system)
        ax.set_xscale("log")
        ax.set_yscale("log")  # peft sits one to two orders of magnitude below the engine
        ax.set_xlabel("number of adapters")
        ax.set_ylabel(label)
        ax.set_title(f"slora-batch bench: {title} against the number of adapters")
        ax.grid(True, which="both", alpha=0.3)
        if drawn:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _builds_note(row: dict) -> str:
    """Triton builds inside the timed run (they slow it down; see kernels.builds)."""
    count = row.get("kernel_builds")
    if count is None or math.isnan(count) or count == 0:
        return ""
    return f"{int(count)} kernel builds ({row['kernel_build_s']:.1f} s)"
