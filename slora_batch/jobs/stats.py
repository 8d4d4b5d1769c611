"""``_stats.parquet``: its schema, the job row and the per-adapter rows a run writes, reading them
back, and the row and token counts of the committed parts.

Rows are output rows: one sample of one input row for one adapter (``samples.py``), so a job
with ``sampling: {n: 4}`` counts four per input row and adapter (one for a row that failed).

Two scopes, never mixed in one figure. The whole output: ``rows``, ``ok_rows``, ``error_rows``,
``scored_rows``, ``prompt_tokens``, ``completion_tokens`` and ``accuracy`` count every committed
part, earlier runs' included (an adapter row's ``tokens`` is its ``completion_tokens``). This
run: ``rows_this_run``, ``prompt_tokens_this_run`` and ``completion_tokens_this_run``, every
time (``wall_s``, ``engine_s``, ...), every rate and the engine counters (adapter loads,
evictions, peak pool pages, ``computed_tokens``). So a rate divides this run's tokens by this
run's seconds, also after a resume:

- ``tokens_per_s``: ``completion_tokens_this_run / engine_s`` (generated tok/s);
- ``computed_tokens_per_s``: ``computed_tokens / engine_s``, every token the engine computed
  (prefill+decode tok/s; ``progress.py`` shows both under the same labels);
- ``requests_per_s``: ``rows_this_run / engine_s``.

``engine_s`` is the generation loop's time without reading input and writing parts; model load
(``load_s``), compile and capture (``warmup_s``), reading (``read_s``) and writing (``write_s``)
are their own fields. An adapter's ``seconds`` is this run's span from its first row entering
the engine to its last result: divide its ``completion_tokens_this_run`` by it, not its
``tokens``. ``scored_rows`` counts rows scored rather than generated (finish_reason "score"),
and ``accuracy`` is the share of ``correct`` among the rows with an answer (null when none has
one); parts written before those columns existed count as having neither.

Files of earlier versions lack the this-run columns: ``read_stats`` gives them as None (and
their ``tokens_per_s`` was this run's already).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.engine.config import EngineConfig
from slora_batch.jobs.feed import RunRecord
from slora_batch.jobs.fsio import FsDir
from slora_batch.jobs.outdir import (
    OLD_STATS_FILE,
    STATS_FILE,
    commit,
    part_files,
    remove_file,
)
from slora_batch.jobs.progress import per_second
from slora_batch.jobs.schema import adapter_name

STATS_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),  # "job" or "adapter"
        ("adapter", pa.string()),  # adapter rows: name, null = base model
        ("rows", pa.int64()),
        ("ok_rows", pa.int64()),
        ("error_rows", pa.int64()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("wall_s", pa.float64()),  # this run, start to end
        ("tokens_per_s", pa.float64()),  # completion_tokens_this_run / engine_s
        ("requests_per_s", pa.float64()),  # rows_this_run / engine_s
        ("engine_s", pa.float64()),  # generating: the loop less reading, writing and warmup
        ("load_s", pa.float64()),  # building the engine: weights, tokenizer, pool
        ("warmup_s", pa.float64()),  # compiling kernels, capturing CUDA graphs
        ("read_s", pa.float64()),  # reading input rows, skipping done ones included
        ("write_s", pa.float64()),  # buffering and committing parts
        ("adapters_seen", pa.int64()),
        ("adapters_broken", pa.int64()),  # adapters that cannot run: their rows are errors
        ("adapter_loads", pa.int64()),
        ("adapter_disk_loads", pa.int64()),  # adapter weight files read
        ("adapter_evictions", pa.int64()),
        ("prefetch_hits", pa.int64()),
        ("peak_pool_pages", pa.int64()),
        ("max_num_seqs", pa.int64()),  # rows at once this run (max_num_seqs: auto resolved)
        ("prefix_hit_tokens", pa.int64()),  # prompt tokens whose KV came from the prefix cache
        ("cached_blocks", pa.int64()),  # prefix blocks in the pool at the end
        ("block_evictions", pa.int64()),  # idle prefix blocks evicted for room
        ("grammar_rows", pa.int64()),  # draws under a response_format grammar
        ("grammar_mask_s", pa.float64()),  # filling their token masks on the host
        ("device", pa.string()),
        ("dtype", pa.string()),
        ("tokens", pa.int64()),  # adapter rows: completion tokens of the adapter's rows
        ("seconds", pa.float64()),  # adapter rows: time the adapter's rows were running
        ("scored_rows", pa.int64()),  # rows scored (finish_reason "score"), not generated
        ("accuracy", pa.float64()),  # share of correct rows among those with an answer
        ("rows_this_run", pa.int64()),  # rows this run wrote (the rest were there before)
        ("prompt_tokens_this_run", pa.int64()),  # prompt tokens of this run's ok rows
        ("completion_tokens_this_run", pa.int64()),  # generated tokens of this run's ok rows
        ("computed_tokens", pa.int64()),  # job row: tokens the engine computed this run
        ("computed_tokens_per_s", pa.float64()),  # job row: computed_tokens / engine_s
    ]
)
THIS_RUN_KEYS = ("rows_this_run", "prompt_tokens_this_run", "completion_tokens_this_run")


COUNT_KEYS = ("rows", "ok_rows", "error_rows", "prompt_tokens", "completion_tokens", "scored_rows")
ANSWER_KEYS = ("answered_rows", "correct_rows")  # rows with an answer, those right: accuracy


def output_counts(out_dir: str | Path | FsDir) -> dict[str | None, dict[str, int]]:
    """Rows, ok, error and scored rows, prompt and completion tokens, rows with an answer and
    those answered right, per adapter over every committed part (None = base model)."""
    return part_counts(part_files(out_dir), out_dir.fs if isinstance(out_dir, FsDir) else None)


def part_counts(parts: list[tuple[int, Path]], fs: Any = None) -> dict[str | None, dict[str, int]]:
    """``output_counts`` of the committed ``parts`` (``outdir.part_files``' list) of an output
    on ``fs`` (None: the local disk)."""
    counts: dict[str | None, dict[str, int]] = {}
    for _, path in parts:
        has_correct = "correct" in pq.read_schema(str(path), filesystem=fs).names
        table = pq.read_table(
            str(path),
            columns=["adapter", "finish_reason", "prompt_tokens", "completion_tokens"]
            + (["correct"] if has_correct else []),
            filesystem=fs,
        )
        sums = [([], "count_all"), ("prompt_tokens", "sum"), ("completion_tokens", "sum")]
        if has_correct:
            sums += [("correct", "count"), ("correct", "sum")]
        grouped = table.group_by(["adapter", "finish_reason"]).aggregate(sums)
        for row in grouped.to_pylist():  # the base model: "" in parts, null in older ones
            adapter = adapter_name(row["adapter"])
            c = counts.setdefault(adapter, dict.fromkeys(COUNT_KEYS + ANSWER_KEYS, 0))
            c["rows"] += row["count_all"]
            c["error_rows" if row["finish_reason"] == "error" else "ok_rows"] += row["count_all"]
            c["scored_rows"] += row["count_all"] if row["finish_reason"] == "score" else 0
            if row["finish_reason"] != "error":  # an error row computed nothing
                c["prompt_tokens"] += row["prompt_tokens_sum"]
                c["completion_tokens"] += row["completion_tokens_sum"]
            c["answered_rows"] += row.get("correct_count") or 0
            c["correct_rows"] += row.get("correct_sum") or 0  # null: the group had no answer
    return counts


def committed_rows(out_dir: str | Path | FsDir) -> int:
    """Rows in the committed parts of an output directory (0 when it has none)."""
    return sum(c["rows"] for c in output_counts(out_dir).values())


def accuracy(counts: dict[str, int]) -> float | None:
    """The share of correct rows among those with an answer; None when none has one."""
    answered = counts["answered_rows"]
    return counts["correct_rows"] / answered if answered else None


def write_stats(
    out_dir: str | Path | FsDir, job_row: dict[str, Any], adapter_rows: list[dict[str, Any]]
) -> Path:
    """Write ``_stats.parquet``: one row kind="job", then one kind="adapter" per adapter, and
    remove an earlier version's ``stats.parquet``. Keys must be ``STATS_SCHEMA`` names; missing
    ones are null."""
    rows = [{**job_row, "kind": "job"}] + [{**row, "kind": "adapter"} for row in adapter_rows]
    for row in rows:
        unknown = sorted(set(row) - set(STATS_SCHEMA.names))
        if unknown:
            raise ValueError(f"stats {row['kind']} row: unknown column {unknown[0]!r}")
    table = pa.Table.from_pylist(rows, schema=STATS_SCHEMA)
    path = commit(out_dir, STATS_FILE, lambda handle: pq.write_table(table, handle))
    remove_file(out_dir, OLD_STATS_FILE)
    return path


def read_stats(out_dir: str | Path | FsDir) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """The job row and the adapter rows of ``_stats.parquet`` (or of an earlier version's
    ``stats.parquet``), or None when there is none."""
    if isinstance(out_dir, FsDir):
        name = next((n for n in (STATS_FILE, OLD_STATS_FILE) if out_dir.exists(n)), None)
        if name is None:
            return None
        rows = pq.read_table(out_dir.child(name), filesystem=out_dir.fs).to_pylist()
    else:
        paths = (Path(out_dir) / name for name in (STATS_FILE, OLD_STATS_FILE))
        path = next((p for p in paths if p.is_file()), None)
        if path is None:
            return None
        rows = pq.read_table(path).to_pylist()
    job = [r for r in rows if r["kind"] == "job"]
    if not job:
        return None
    # every column of this version; None where an older version's file has none
    names = [name for name in STATS_SCHEMA.names if name != "kind"]
    strip = lambda row: {name: row.get(name) for name in names}
    return strip(job[0]), [strip(r) for r in rows if r["kind"] == "adapter"]


def complete_stats(
    out_dir: Path | FsDir,
) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """The stats of a complete output, or None when they cannot be read: the job then runs,
    with nothing left to do but the stats."""
    try:
        return read_stats(out_dir)
    except (OSError, pa.ArrowException):
        return None


def write_run_stats(
    out_dir: Path | FsDir,
    parts: list[tuple[int, Path]],
    run: RunRecord,
    wall_s: float,
    adapters_broken: int,
    engine: EngineConfig,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``stats_rows`` after ``run``, written to ``_stats.parquet``; the job row and the
    adapter rows."""
    job_row, adapter_rows = stats_rows(out_dir, parts, run, wall_s, adapters_broken, engine)
    write_stats(out_dir, job_row, adapter_rows)
    return job_row, adapter_rows


def stats_rows(
    out_dir: Path | FsDir,
    parts: list[tuple[int, Path]],
    run: RunRecord,
    wall_s: float,
    adapters_broken: int,
    engine: EngineConfig,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The job row and the per-adapter rows of ``_stats.parquet`` (see the module docstring)
    of output ``out_dir`` whose committed parts are ``parts``, after ``run``, which took
    ``wall_s``; ``engine``: the job's settings, whose device and dtype a run without an engine
    names when no earlier run's stats do."""
    previous = _previous_stats(out_dir)
    per_adapter = part_counts(parts, out_dir.fs if isinstance(out_dir, FsDir) else None)
    totals = {key: sum(c[key] for c in per_adapter.values()) for key in COUNT_KEYS + ANSWER_KEYS}
    counters = run.counters
    engine_s = run.engine_s
    # the engine's own count: a Ray run's actors report none
    computed = run.computed if hasattr(counters, "prefill_tokens") else None
    job_row = {
        **{key: totals[key] for key in COUNT_KEYS},
        "accuracy": accuracy(totals),
        "rows_this_run": run.rows,
        "prompt_tokens_this_run": run.prompt_tokens,
        "completion_tokens_this_run": run.tokens,
        "computed_tokens": computed,
        "wall_s": wall_s,
        "tokens_per_s": per_second(run.tokens, engine_s),
        "computed_tokens_per_s": per_second(computed, engine_s),
        "requests_per_s": per_second(run.rows, engine_s),
        "engine_s": engine_s,
        "load_s": getattr(counters, "load_s", None) or run.load_s,
        "warmup_s": getattr(counters, "warmup_s", 0.0),
        "read_s": run.read_s,
        "write_s": run.write_s,
        "adapters_seen": sum(1 for a, c in per_adapter.items() if a is not None and c["ok_rows"]),
        "adapters_broken": adapters_broken,
        "adapter_loads": getattr(counters, "adapter_loads", 0),
        "adapter_disk_loads": getattr(counters, "disk_loads", 0),
        "adapter_evictions": getattr(counters, "adapter_evictions", 0),
        "prefetch_hits": getattr(counters, "prefetch_hits", 0),
        "peak_pool_pages": getattr(counters, "peak_pages", 0),
        "max_num_seqs": getattr(counters, "max_num_seqs", None) or None,
        "prefix_hit_tokens": getattr(counters, "prefix_hit_tokens", 0),
        "cached_blocks": getattr(counters, "cached_blocks", 0),
        "block_evictions": getattr(counters, "block_evictions", 0),
        "grammar_rows": getattr(counters, "grammar_rows", 0),
        "grammar_mask_s": getattr(counters, "grammar_mask_s", 0.0),
        # no engine this run (every row was done): the device of the run that made them
        "device": previous.get("device") or engine.device,
        "dtype": previous.get("dtype") or engine.dtype,
    }
    if run.device is not None:
        job_row["device"], job_row["dtype"] = run.device, run.dtype
    tracked = bool(run.per_adapter) or not run.rows  # a Ray run's actors count no adapter's
    adapter_rows = []
    for adapter in sorted(per_adapter, key=lambda a: (a is not None, a or "")):
        counts = per_adapter[adapter]
        span = None
        if adapter in run.first_in and adapter in run.last_out:
            span = run.last_out[adapter] - run.first_in[adapter]
        mine = run.per_adapter.get(adapter, {})
        adapter_rows.append(
            {
                "adapter": adapter,
                **{key: counts[key] for key in COUNT_KEYS},
                "accuracy": accuracy(counts),
                "tokens": counts["completion_tokens"],
                "seconds": span,
                **{
                    key: mine.get(key.removesuffix("_this_run"), 0) if tracked else None
                    for key in THIS_RUN_KEYS
                },
            }
        )
    return job_row, adapter_rows


def _previous_stats(out_dir: Path | FsDir) -> dict[str, Any]:
    try:
        stats = read_stats(out_dir)
    except (OSError, pa.ArrowException):
        return {}
    return stats[0] if stats else {}
