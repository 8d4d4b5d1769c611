"""What the bench writes: results.parquet, results.md (its header and table here; the checks
against the targets in acceptance.py), summary.json, run.json (run_meta.py) and throughput.png
(plot.py).

All files are rewritten after every run, so a bench cut short keeps the runs that finished.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.bench.acceptance import OWN_WORKLOAD, acceptance
from slora_batch.bench.formatting import missing, num, pct
from slora_batch.bench.plot import plot

# the scoring systems' rows have no output tokens (NaN) and two figures of their own
SUMMARY_KEYS = (
    "requests_per_s",
    "output_tokens_per_s",
    "roofline_fraction",
    "floor_fraction",
    "rows_per_s",
    "scored_tokens_per_s",
)


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
                k: row[k] for k in SUMMARY_KEYS if not missing(row.get(k))
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
        f"{meta['parameters'] / 1e9:.2f}B parameters{_active(meta)}",
        f"- workload: {meta['settings']['requests']} requests, input {meta['settings']['min_input']}-"
        f"{meta['settings']['max_input']}, output {meta['settings']['min_output']}-"
        f"{meta['settings']['max_output']}, popularity power({0.1 if meta['settings']['skewed'] else 1})"
        f", seed {meta['settings']['seed']}; {_adapters(meta)}",
        f"- time limits: engine runs {_limit(meta['settings']['max_seconds'])}, peft runs "
        f"{_limit(meta['settings']['peft_max_seconds'])} (a run cut at its limit counts the work "
        "done by then: note *cut*)",
    ]
    lines += _scoring_workload(meta["settings"])
    lines += _prefix_workloads(meta["settings"])
    lines += _dora_workload(meta["settings"])
    if meta["skipped"]:
        lines.append(f"- skipped for time: {', '.join(meta['skipped'])}")
    lines += [
        "",
        "| system | adapters | requests done | req/s | output tok/s | vs slora | vs base | "
        "wall s | setup s | peak GiB | roofline | floor fraction | decode host share | decode batch | "
        "max seqs | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    slora = {r["adapters"]: r for r in rows if r["system"] == "slora" and not r.get("error")}
    base = next((r for r in rows if r["system"] == "base" and not r.get("error")), None)
    for r in rows:
        if r.get("error"):
            lines.append(
                f"| {r['system']} | {r['adapters']} | | | | | | | | | | | | | | failed: "
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
            f"{r['requests_per_s']:.2f} | {num(tok, 0)} | {num(vs_slora)} | {num(vs_base)} | "
            f"{r['wall_s']:.1f} | {r['setup_s']:.1f} | {num(r['peak_mem_gib'], 1)} | "
            f"{r['roofline_fraction']:.3f} | {num(r.get('floor_fraction'), 3)} | "
            f"{pct(r['decode_host_share'])} | {num(r['decode_batch'], 0)} | "
            f"{num(r.get('max_num_seqs'), 0)} | {note} |"
        )
    lines += ["", "## Checks against the targets", ""] + acceptance(rows) + [""]
    return "\n".join(lines)


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


def _dora_workload(settings: dict) -> list[str]:
    """The header line of slora-dora's adapters, where it ran."""
    if "slora-dora" not in settings.get("systems", ()):
        return []
    return [
        "- slora-dora: slora's requests and adapter ids; the ids whose i // 4 is a multiple of 4 "
        "(one in four, every rank) are DoRA adapters of their rank: the same A and B, magnitudes "
        "about the base weights' row norms (one more weight set per rank)"
    ]


def _prefix_note(row: dict) -> str:
    hits = row.get("prefix_hit_tokens")
    if missing(hits) or not hits:
        return ""
    return f"{int(hits)} prefix hit tokens"


def _active(meta: dict) -> str:
    """ ", 3.35B active" where a mixture of experts runs fewer parameters a token than it has."""
    active = meta.get("active_parameters", meta["parameters"])
    return f", {active / 1e9:.2f}B active" if active != meta["parameters"] else ""


def _adapters(meta: dict) -> str:
    """What the adapter ids are: their targets, ranks and shared weight sets."""
    targets = meta["settings"].get("adapter_targets", "attention")
    on = "q, k, v, o and the experts" if targets == "experts" else "q, k, v, o"
    ranks = meta.get("adapter_ranks", [8, 16, 32, 64])
    return (
        f"adapters on {on}, ranks cycling {'/'.join(map(str, ranks))}; adapter ids share "
        f"{meta['adapter_weight_sets']} weight sets (one per rank), each id loaded, paged and "
        "evicted on its own"
    )


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
    if missing(row.get("scored_tokens_per_s")):
        return ""
    return f"{row['scored_tokens_per_s']:.0f} scored tok/s"


def _limit(seconds: float) -> str:
    return f"{seconds:g} s" if seconds else "none"


def _builds_note(row: dict) -> str:
    """Triton builds inside the timed run (they slow it down; see slora_kernels.builds)."""
    count = row.get("kernel_builds")
    if count is None or math.isnan(count) or count == 0:
        return ""
    return f"{int(count)} kernel builds ({row['kernel_build_s']:.1f} s)"
