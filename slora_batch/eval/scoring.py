"""Each adapter's lm-eval ``evaluate`` as soon as its rows are all in, while the engine runs the
later adapters' rows (an eval job's rows come adapter by adapter: ``jobs.resume.adapter_major``).

``AdapterScoring`` is the job's result hook (``run_plan(on_result=...)``): it keeps this run's
results of each adapter in memory (the fields ``rows.answer`` reads, as the parts store them) and
hands an adapter to the scoring process once it holds all of that adapter's rows. An adapter with
rows from an earlier run (a resumed job) never fills up here: it is scored at the end from the
committed parts, as is every adapter of a job that was complete already. Either way the same rows
and the same ``evaluate``: the same numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slora_batch.engine.requests.request import Result

logger = logging.getLogger(__name__)

Rows = dict[str, dict[str, Any]]  # row id -> the fields ``rows.answer`` reads


def result_fields(result: Result) -> dict[str, Any]:
    """What ``rows.answer`` reads of an engine ``Result`` (the parts' columns of those names)."""
    return {
        "logprob": result.logprob,
        "is_greedy": result.is_greedy,
        "token_ids": result.token_ids,
        "error": result.error,
    }


class AdapterScoring:
    """Scores adapters whose ``per_adapter`` rows complete in this run in ``worker`` (a
    ``worker.ScoringProcess``) as they complete; ``finish`` scores the rest with ``score(adapter,
    rows)`` here, after the run (never on the engine's thread while it runs): those the worker
    did not answer (or all, without one) from the rows held, the others from the parts."""

    def __init__(
        self, per_adapter: int, score: Callable[[str | None, Rows], Any], worker=None
    ) -> None:
        self.per_adapter, self.score, self.worker = per_adapter, score, worker
        self.rows: dict[str | None, Rows] = {}  # this run's rows of adapters still running
        self.complete: dict[str | None, Rows] = {}  # kept till the worker answers
        self.outputs: dict[str | None, Any] = {}
        self.errors: dict[str | None, BaseException] = {}

    def add(self, result: Result) -> None:
        adapter = result.adapter or None
        rows = self.rows.setdefault(adapter, {})
        rows[str(result.id)] = result_fields(result)
        if len(rows) == self.per_adapter:
            self.complete[adapter] = self.rows.pop(adapter)
            if self.worker is not None:
                self.worker.submit(adapter, rows)

    def _score(self, adapter: str | None, rows: Rows) -> None:
        try:
            self.outputs[adapter] = self.score(adapter, rows)
        except Exception as exc:  # noqa: BLE001 - raised by finish in the adapters' order
            self.errors[adapter] = exc

    def finish(
        self, adapters: list[str | None], read: Callable[[], dict[str | None, Rows]]
    ) -> dict[str | None, Any]:
        """Every adapter's output in ``adapters``' order: the worker's, then the others scored
        here, from ``read()`` (the committed parts) when their rows are not held. The first
        adapter in that order that failed raises."""
        answered = self.worker.collect(list(self.complete)) if self.worker is not None else {}
        logger.info(
            "lm-eval scored %d of %d adapters beside the engine", len(answered), len(adapters)
        )
        for adapter, (output, error) in answered.items():
            if error is None:
                self.outputs[adapter] = output
            else:
                self.errors[adapter] = error
        for adapter, rows in self.complete.items():
            if adapter not in answered:
                self._score(adapter, rows)
        missing = [a for a in adapters if a not in self.outputs and a not in self.errors]
        if missing:
            found = read()
            for adapter in missing:
                self._score(adapter, found.get(adapter, {}))
        for adapter in adapters:
            if adapter in self.errors:
                raise self.errors[adapter]
        return {adapter: self.outputs[adapter] for adapter in adapters}


def read_parts(out: Path) -> dict[str | None, Rows]:
    """{adapter: {row id: the row's fields}} from the committed parts of ``out`` (None: the
    base model; a part without the scoring columns, of a job of generated rows only, reads as
    null scores)."""
    import pyarrow.parquet as pq

    from slora_batch.jobs.outdir import part_files
    from slora_batch.jobs.schema import adapter_name

    found: dict[str | None, Rows] = {}
    for _, path in part_files(out):
        names = pq.read_schema(path).names
        table = pq.read_table(path, columns=[c for c in PART_COLUMNS if c in names])
        for row in table.to_pylist():
            row = {name: row.get(name) for name in PART_COLUMNS}
            found.setdefault(adapter_name(row["adapter"]), {})[str(row["id"])] = row
    return found


PART_COLUMNS = ["id", "adapter", "logprob", "is_greedy", "token_ids", "error"]
