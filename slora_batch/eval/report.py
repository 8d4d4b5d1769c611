"""An eval job's results: ``_eval_results.parquet`` (adapter, task, metric, value, stderr, n),
one lm-eval results JSON per adapter (``_eval_results/<adapter>.json``, the base model's
``__base__.json``; lm-eval's ``evaluate`` output without its samples), and the summary table.

Their names start with "_" so that readers of the output's Parquet files (pyarrow datasets,
pandas, Spark) read the job's rows alone; an earlier version's ``results.parquet`` and
``eval-results/`` are removed when the results are written under these names."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.jobs.outdir import commit_file

logger = logging.getLogger(__name__)

RESULTS_FILE = "_eval_results.parquet"
RESULTS_DIR = "_eval_results"
OLD_RESULTS_FILE, OLD_RESULTS_DIR = "results.parquet", "eval-results"  # an earlier version's
BASE_NAME = "__base__"  # the base model's JSON (an adapter may be called "base")
SCHEMA = pa.schema(
    [
        ("adapter", pa.string()),
        ("task", pa.string()),
        ("metric", pa.string()),
        ("value", pa.float64()),
        ("stderr", pa.float64()),
        ("n", pa.int64()),
    ]
)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def results_rows(per_adapter: dict[str | None, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (adapter, task, metric) of lm-eval's results; a metric's filter is kept
    after a comma unless it is lm-eval's "none" (``acc``, ``exact_match,strict-match``)."""
    rows = []
    for adapter, output in per_adapter.items():
        counts = output.get("n-samples", {})
        for task, metrics in output["results"].items():
            n = counts.get(task, {}).get("effective")
            for key, value in metrics.items():
                if "," not in key or "_stderr," in key or _number(value) is None:
                    continue
                metric, filter_name = key.split(",", 1)
                stderr = _number(metrics.get(f"{metric}_stderr,{filter_name}"))
                rows.append(
                    {
                        "adapter": adapter,
                        "task": task,
                        "metric": metric if filter_name == "none" else key,
                        "value": float(value),
                        "stderr": None if stderr is None or math.isnan(stderr) else stderr,
                        "n": n,
                    }
                )
    return rows


@dataclass
class Scored:
    """One adapter's lm-eval output as the job keeps it: its ``results_rows`` and its JSON
    (lm-eval's ``evaluate`` output without its samples; None once ``written``)."""

    rows: list[dict[str, Any]]
    text: bytes | None

    def written(self, out: Path, adapter: str | None) -> Scored:
        """This adapter's JSON committed into ``out``; the rows alone."""
        (out / RESULTS_DIR).mkdir(exist_ok=True)
        path = out / RESULTS_DIR / f"{adapter or BASE_NAME}.json"
        commit_file(path, lambda handle: handle.write(self.text))
        return Scored(self.rows, None)


def scored(adapter: str | None, output: dict[str, Any]) -> Scored:
    kept = {key: value for key, value in output.items() if key != "samples"}
    return Scored(results_rows({adapter: output}), json.dumps(kept, indent=2, default=str).encode())


def write_results(out: Path, per_adapter: dict[str | None, Scored]) -> list[dict[str, Any]]:
    """``RESULTS_FILE`` and the JSONs not written yet (an earlier version's results removed);
    the rows of ``RESULTS_FILE``."""
    rows = [row for one in per_adapter.values() for row in one.rows]
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    commit_file(out / RESULTS_FILE, lambda handle: pq.write_table(table, handle))
    for adapter, one in per_adapter.items():
        if one.text is not None:
            one.written(out, adapter)
    _remove_old_results(out)
    return rows


def _remove_old_results(out: Path) -> None:
    """An earlier version's ``results.parquet`` and its JSONs in ``eval-results/`` (the folder
    too when nothing else is in it): dataset readers of the output would read them as data."""
    old_dir = out / OLD_RESULTS_DIR
    names = [out / OLD_RESULTS_FILE, *(old_dir.glob("*.json") if old_dir.is_dir() else ())]
    for path in names:
        if path.is_file():
            logger.info("removing %s (now in %s and %s/)", path, RESULTS_FILE, RESULTS_DIR)
            path.unlink()
    if old_dir.is_dir() and not any(old_dir.iterdir()):
        old_dir.rmdir()


def eval_table(rows: list[dict[str, Any]]):
    """A rich table: one line per (task, metric), one column per adapter ("base" first)."""
    from rich.markup import escape
    from rich.table import Table

    adapters = list(dict.fromkeys(row["adapter"] for row in rows))
    table = Table(title="lm-eval results", title_justify="left")
    table.add_column("task", overflow="fold")  # at any width a name is whole, never cut
    table.add_column("metric", overflow="fold")
    for adapter in adapters:
        table.add_column(escape(adapter or "(base)"), justify="right", overflow="fold")
    cells: dict[tuple[str, str], dict[str | None, str]] = {}
    for row in rows:
        err = f" ± {row['stderr']:.3f}" if row["stderr"] is not None else ""
        cells.setdefault((row["task"], row["metric"]), {})[row["adapter"]] = (
            f"{row['value']:.4f}{err}"
        )
    for (task, metric), values in cells.items():
        table.add_row(escape(task), escape(metric), *(values.get(a, "") for a in adapters))
    return table
