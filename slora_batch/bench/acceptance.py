"""The checks that end results.md: each target the bench holds the engine to, checked on the
rows at hand (a check whose runs are missing says so), and the ratios of the other systems to
slora. A target is a ratio of two runs' throughput (or a share of the roofline bound) with the
least value that passes; each constant below says what it stands for."""

from __future__ import annotations

import math

from slora_batch.bench.engine_run import ABLATIONS
from slora_batch.bench.formatting import pct
from slora_batch.engine.counters import TURN_PHASES

# Generation at 1000 adapters: 30x the rows/s of PEFT's best batch; within 15% of the base
# model without adapters; and 2000 adapters within 5% of 10 (the adapter count costs little).
PEFT_TARGET, BASE_TARGET, SCALE_TARGET = 30.0, 0.85, 0.95
ROOFLINE_TARGET = 0.30  # base and slora runs reach 30% of the device's roofline bound
SCORE_TARGET = 20.0  # scoring rows through the engine: 20x the rows/s of PEFT's best batch
# Adapters on a mixture of experts' every expert (--adapter-targets experts: 1 GB each on
# Qwen3-30B-A3B): at 100 of them within 25% of the base model without adapters.
EXPERT_TARGET, EXPERT_ADAPTERS = 0.75, 100
# DoRA beside plain LoRA: slora's batch with one adapter id in four DoRA of the same rank
# (slora-dora@N) keeps 95% of the output tok/s of the batch with plain LoRA only (slora@N).
DORA_TARGET = 0.95
# The prefix cache, per adapter count: (system, the one it is measured against, need >= this).
# A prompt prefix shared per adapter computed once: 3x the output tok/s of computing it for
# every row; the cache costs slora at most 2% where nothing is shared; n samples of a prompt
# that share its prefill: 4x the same samples sent as separate requests.
PREFIX_TARGETS = (
    ("prefix", "prefix-off", 3.0),
    ("slora", "slora-off", 0.98),
    ("samples", "samples-separate", 4.0),
)
OWN_WORKLOAD = ("prefix", "prefix-off", "samples", "samples-separate")  # not slora's requests


def acceptance(rows: list[dict]) -> list[str]:
    """Every target's check on the rows at hand, then the ratios to slora and the host's share
    of each step; a check whose runs are missing says so."""
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
            PEFT_TARGET,
            f" (peft best at {best['adapters']} adapters)" if best else "",
        ),
        ("slora@1000 / base", tok("slora", 1000), tok("base", 0), BASE_TARGET, ""),
        ("slora@2000 / slora@10", tok("slora", 2000), tok("slora", 10), SCALE_TARGET, ""),
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
    lines += _expert_acceptance(ok)
    lines += _dora_acceptance(ok)
    lines += _score_acceptance(ok)
    lines += _json_acceptance(ok)
    lines += _eval_acceptance(ok)
    lines += _prefix_acceptance(ok)
    for r in ok:
        if r["system"] in ("base", "slora"):
            met = r["roofline_fraction"] >= ROOFLINE_TARGET
            lines.append(
                f"- roofline {r['system']}@{r['adapters']} = {r['roofline_fraction']:.3f} "
                f"(need >= {ROOFLINE_TARGET:.2f}): {'pass' if met else 'FAIL'}"
            )
        engine = "slora-par" if r["system"] == "job-par" else "slora"  # what it is set against
        if r["system"] in (*ABLATIONS, "job", "job-par") and tok(engine, r["adapters"]):
            layout = f" (tp {r['tensor_parallel']} x dp {r['data_parallel']})"
            lines.append(
                f"- {r['system']}@{r['adapters']} / {engine}@{r['adapters']}"
                f"{layout if r['system'] == 'job-par' else ''} = "
                f"{r['output_tokens_per_s'] / tok(engine, r['adapters']):.2f}"
            )
        if r["system"] in ("job", "job-par"):
            lines.append(
                f"- {r['system']}@{r['adapters']}: {r['output_tokens_per_s']:.0f} tok/s over engine "
                f"time, "
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
                f"tok/s"
                + (
                    f", {r['output_tokens_per_s'] / ratio:.2f}x {one}@{r['adapters']}"
                    if ratio
                    else f"; {one}@{r['adapters']} not measured"
                )
            )
            if r["system"] == "slora-par" and tok("base-par", 0):
                lines.append(
                    f"- slora-par@{r['adapters']} / base-par ({layout}) = "
                    f"{r['output_tokens_per_s'] / tok('base-par', 0):.2f}"
                )
        # The host's share of a decode step stays under 10% at a decode batch of 128 or more:
        # the device, not the Python between steps, bounds decode.
        if r["system"] == "slora" and not math.isnan(r["decode_host_share"]):
            lines.append(
                f"- decode host share slora@{r['adapters']} = {pct(r['decode_host_share'])}"
                f" (all steps {pct(r['host_share'])}) at a mean decode batch of "
                f"{r['decode_batch']:.0f} (need < 10% at >= 128)"
            )
        if r["system"] in ("base", "slora") and r.get("decode_turns", 0) > 0:
            phases = ", ".join(
                f"{p} {r[f'turn_{p}_s'] / r['decode_turns'] * 1e3:.2f}" for p in TURN_PHASES
            )
            lines.append(
                f"- host ms per decode turn {r['system']}@{r['adapters']} (max_num_seqs "
                f"{r.get('max_num_seqs', '?')}, {r['decode_turns']:.0f} turns): {phases}"
            )
    return lines


# Structured output: JSON under its schema keeps 90% of the output tok/s of the same requests
# unconstrained (json@N / json-free@N).
JSON_TARGET = 0.9
# The lm-eval sweep (lm-eval's requests and scoring, the job's files) keeps 90% of the rows/s
# of the engine alone on the same rows (eval@N / eval-score@N).
EVAL_TARGET = 0.9


def _paired(ok: list[dict], system: str, other: str, key: str, need: float, detail) -> list[str]:
    """``system``@N against ``other``@N on ``key`` for every N that ``system`` ran at, each
    line ending with ``detail(row, other's row or None)``."""
    lines = []
    for r in ok:
        if r["system"] != system:
            continue
        found = [o for o in ok if o["system"] == other and o["adapters"] == r["adapters"]]
        where = f"{system}@{r['adapters']}"
        if not found:
            lines.append(f"- {where} / {other}: not measured; {detail(r, None)}")
            continue
        ratio = r[key] / found[0][key]
        unit = " rows/s" if key == "rows_per_s" else ""
        lines.append(
            f"- {where} / {other}@{r['adapters']}{unit} = {ratio:.2f} (need >= {need}): "
            f"{'pass' if ratio >= need else 'FAIL'}; {detail(r, found[0])}"
        )
    return lines


def _expert_acceptance(ok: list[dict]) -> list[str]:
    """slora at EXPERT_ADAPTERS adapters on the experts against base, where the run had them."""
    base = [r["output_tokens_per_s"] for r in ok if r["system"] == "base"]
    lines = []
    for r in ok:
        if r["system"] != "slora" or r.get("adapter_targets") != "experts":
            continue
        if r["adapters"] != EXPERT_ADAPTERS or not base:
            continue
        ratio = r["output_tokens_per_s"] / base[0]
        lines.append(
            f"- slora@{r['adapters']} on the experts / base = {ratio:.2f} (need >= "
            f"{EXPERT_TARGET}): {'pass' if ratio >= EXPERT_TARGET else 'FAIL'}"
        )
    return lines


def _dora_acceptance(ok: list[dict]) -> list[str]:
    """DoRA's price in a mixed batch: slora-dora against slora per adapter count, with how many
    ids and rows ran as DoRA and both decode batches."""

    def detail(r: dict, plain: dict | None) -> str:
        dora = (
            f"{r.get('dora_adapters', 0)} of {r['adapters']} ids DoRA, "
            f"{r.get('dora_rows', 0)} of {r['finished']} rows done on them"
        )
        if plain is None:
            return dora
        return (
            f"{r['output_tokens_per_s']:.0f} against {plain['output_tokens_per_s']:.0f} output "
            f"tok/s; {dora}; decode batch {r.get('decode_batch') or 0:.0f} vs "
            f"{plain.get('decode_batch') or 0:.0f}"
        )

    return _paired(ok, "slora-dora", "slora", "output_tokens_per_s", DORA_TARGET, detail)


def _json_acceptance(ok: list[dict]) -> list[str]:
    """Structured output's price: json against json-free (the same requests at the lengths json
    produced, unconstrained) per adapter count, with both decode batches and the mask time."""

    def detail(r: dict, free: dict | None) -> str:
        mask = f"masks filled in {r.get('grammar_mask_s') or 0.0:.1f} s on the host"
        if free is None:
            return mask
        return (
            f"decode batch {r.get('decode_batch') or 0:.0f} vs "
            f"{free.get('decode_batch') or 0:.0f}; {mask} for {r.get('grammar_rows', 0)} "
            f"constrained draws, wall {r['wall_s']:.1f} s"
        )

    return _paired(ok, "json", "json-free", "output_tokens_per_s", JSON_TARGET, detail)


def _eval_acceptance(ok: list[dict]) -> list[str]:
    """The lm-eval sweep against the engine alone on its rows, and where the sweep's time went."""

    def detail(r: dict, alone: dict | None) -> str:
        parts = (
            f"{r['finished']} rows in {r['wall_s']:.1f} s past start-up: engine "
            f"{r['eval_engine_s']:.1f} s, the rest (lm-eval, the job's files) "
            f"{r['eval_rest_s']:.1f} s; start-up {r['setup_s']:.1f} s"
        )
        if alone is None:
            return parts
        loads = (
            f"; adapter files read {r.get('disk_loads', 0):.0f} vs "
            f"{alone.get('disk_loads', 0):.0f} alone, "
            f"{alone.get('loader_waits', 0):.0f} reads waited for alone"
        )
        return f"{r['rows_per_s']:.1f} vs {alone['rows_per_s']:.1f}; {parts}{loads}"

    return _paired(ok, "eval", "eval-score", "rows_per_s", EVAL_TARGET, detail)


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
