"""The Ray Data stage: rows through engine actors, one ``Engine`` each, grouped by adapter.

``generate(ds, model, adapters, ...)`` sorts a dataset of input rows (``id``, ``adapter``,
``prompt`` or ``messages``, per-row sampling overrides) by adapter and maps its batches through a
pool of ``EngineActor``s: each batch holds a few adapters, so an actor's pool swaps few. Every
row comes back as one output row with the job tool's columns (``jobs/schema.py``); a bad row or
an adapter the engine does not know is an error row, never a failed block.

``EngineActor`` also serves the job runner (``job.py``): there a call gets one *unit* (the
pending rows of one input block and one adapter bucket, already turned into requests by the
job tool's ``rows.py``), commits them as one part named after the run and the unit
(``fence.part_name``), so a retried call replaces its own part, and returns a one-row summary.
An actor whose run was fenced off by a later run (``fence.py``) commits nothing.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from slora_batch.engine.config import EngineConfig, SamplingConfig
from slora_batch.engine.hub import locate
from slora_batch.engine.requests.request import Request, Result
from slora_batch.jobs.config import COLUMN_KEYS, SCORE_KEYS
from slora_batch.jobs.fsio import FsDir
from slora_batch.jobs.ordering import sort_key
from slora_batch.jobs.response_format import format_value
from slora_batch.jobs.rows import to_request
from slora_batch.jobs.samples import SamplesDue
from slora_batch.jobs.schema import job_columns, kept_names, part_schema
from slora_batch.jobs.writer import PartRows
from slora_batch.ray.fence import fenced_out, part_name, still_ours
from slora_batch.ray.fs import commit_table

logger = logging.getLogger(__name__)

UNIT, ITEM = "_slora_unit", "_slora_item"  # the job runner's columns: unit key, pickled item
SORT = "_slora_adapter"  # generate's sort column: the adapter, "" for the base model
COLUMNS = {key: key for key in COLUMN_KEYS}
COUNTERS = (
    "adapter_loads",
    "disk_loads",
    "adapter_evictions",
    "prefetch_hits",
    "peak_pages",
    "prefix_hit_tokens",
    "cached_blocks",
    "block_evictions",
    "grammar_rows",
)
TIMERS = ("grammar_mask_s",)  # the actor's engine seconds so far, added up over actors as COUNTERS
SUMMARY_SCHEMA = pa.schema(
    [
        ("unit", pa.string()),
        ("part", pa.string()),  # the part's file name ("" when the stage returns rows)
        ("actor", pa.string()),  # "host:pid" of the actor's process
        ("calls", pa.int64()),  # the actor's calls so far, this one included
        ("fenced", pa.bool_()),  # a later run started: nothing was committed
        ("rows", pa.int64()),
        ("tokens", pa.int64()),  # completion tokens
        ("prompt_tokens", pa.int64()),  # of the rows that ran (error rows compute nothing)
        ("error_rows", pa.int64()),
        ("errors", pa.list_(pa.string())),  # a few error messages
        ("adapters", pa.list_(pa.string())),  # distinct adapters of the unit ("" = base model)
        ("engine_s", pa.float64()),  # this call's generation time
        ("load_s", pa.float64()),  # the actor's engine build time
        ("warmup_s", pa.float64()),  # the actor's engine warm-up so far
        ("device", pa.string()),
        ("dtype", pa.string()),
        *((name, pa.int64()) for name in COUNTERS),  # the actor's engine counters so far
        *((name, pa.float64()) for name in TIMERS),
    ]
)
ERROR_EXAMPLES = 3


def adapter_bucket(adapter: str | None, buckets: int) -> int:
    """A stable bucket of an adapter (the same in every process, unlike ``hash``)."""
    return zlib.crc32((adapter or "").encode("utf-8", "surrogatepass")) % buckets


@dataclass
class DatasetRow:
    """A dataset row as ``rows.to_request`` reads an input row (``reader.InputRow``'s fields)."""

    values: dict[str, Any]
    where: str  # "source" column when given, else "dataset row <id>"
    columns: dict[str, str] = field(default_factory=lambda: dict(COLUMNS))
    kept: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    position: int | None = None  # the output's row_index: a dataset row's order is not known


class EngineActor:
    """One ``Engine`` in a Ray actor; ``__call__`` maps a batch (a pyarrow table) to its output
    rows, or in the job runner (``output`` given) to a one-row summary after committing the
    unit's part. Adapters are read from paths every node sees (a shared filesystem)."""

    def __init__(
        self,
        model: str,
        adapters: str | dict[str, str] | None,
        engine: EngineConfig,
        sampling: SamplingConfig,
        schema: pa.Schema,
        output: str | FsDir | None = None,  # a local directory or one on another filesystem
        run: int = 0,  # the job runner's run number (``fence.py``)
    ) -> None:
        from slora_batch.engine.engine import Engine  # torch: only in the actor's process

        started = time.perf_counter()
        self.engine = Engine(model, adapters=adapters, config=engine, sampling=sampling)
        self.load_s = time.perf_counter() - started
        self.sampling, self.run, self.calls = sampling, run, 0
        self.output = Path(output) if isinstance(output, str) else output
        self.parts = PartRows(schema)
        self.kept = kept_names(schema)
        self.actor = f"{os.uname().nodename}:{os.getpid()}"

    def __call__(self, batch: pa.Table) -> pa.Table:
        if ITEM in batch.column_names:
            items = [pickle.loads(b) for b in batch.column(ITEM).to_pylist()]
            unit = batch.column(UNIT)[0].as_py()
        else:
            items, unit = [self._request(row) for row in batch.to_pylist()], ""
        self.calls += 1
        if self.output is not None and fenced_out(self.output, self.run):
            logger.warning(
                "actor %s of run %d: a later run started; unit %s skipped",
                self.actor,
                self.run,
                unit,
            )
            return self._summary(unit, "", [], 0.0, fenced=True)
        started = time.perf_counter()
        results = self._generate(items)
        engine_s = time.perf_counter() - started
        table = self.parts.table([self.parts.row(r) for r in results])
        if self.output is None:
            return table
        name = part_name(self.run, unit)
        commit_table(self.output, name, table)
        if not still_ours(self.output, self.run, name):
            return self._summary(unit, "", [], engine_s, fenced=True)
        logger.debug(
            "actor %s committed %s (%d rows, unit %s)", self.actor, name, len(results), unit
        )
        return self._summary(unit, name, results, engine_s)

    def _request(self, row: dict[str, Any]) -> Request | Result:
        values = {k: v for k, v in row.items() if v is not None and k not in self.kept}
        if isinstance(values.get("response_format"), dict):  # a struct column: JSON strings pass
            fmt = format_value(values.pop("response_format"))
            if fmt is not None:
                values["response_format"] = fmt
        kept = {k: row[k] for k in self.kept if row.get(k) is not None}
        where = row.get("source") or f"dataset row {row.get('id')!r}"
        return to_request(DatasetRow(values, str(where), kept=kept), self.sampling)

    def _generate(self, items: list[Request | Result]) -> list[Result]:
        """Bad rows' results as they are, then the engine's in the order it finishes them (a
        failed request of a resumed row as the first sample it asked for: ``SamplesDue``)."""
        requests = sorted((i for i in items if isinstance(i, Request)), key=sort_key)
        results = [i for i in items if isinstance(i, Result)]
        if requests:
            due = SamplesDue()
            for request in requests:
                if request.sample_indices:
                    due.add(request, len(request.sample_indices))
            for result in self.engine.generate(requests):
                due.finished(result)
                results.append(result)
        return results

    def _summary(
        self, unit: str, name: str, results: list[Result], engine_s: float, fenced: bool = False
    ) -> pa.Table:
        counters = self.engine.counters
        errors = [r.error for r in results if r.finish_reason == "error"]
        row = {
            "unit": unit,
            "part": name,
            "actor": self.actor,
            "calls": self.calls,
            "fenced": fenced,
            "rows": len(results),
            "tokens": sum(r.completion_tokens for r in results),
            "prompt_tokens": sum(r.prompt_tokens for r in results if r.finish_reason != "error"),
            "error_rows": len(errors),
            "errors": [e or "" for e in errors[:ERROR_EXAMPLES]],
            "adapters": sorted({r.adapter or "" for r in results}),
            "engine_s": engine_s,
            "load_s": self.load_s,
            "warmup_s": float(getattr(counters, "warmup_s", 0.0)),
            "device": str(self.engine.device),
            "dtype": str(self.engine.dtype).removeprefix("torch."),
            **{name: int(getattr(counters, name, 0)) for name in COUNTERS},
            **{name: float(getattr(counters, name, 0.0)) for name in TIMERS},
        }
        return pa.Table.from_pylist([row], schema=SUMMARY_SCHEMA)


def generate(
    ds,
    model: str,
    adapters: str | dict[str, str] | None = None,
    *,
    engine: EngineConfig | dict | None = None,
    sampling: SamplingConfig | dict | None = None,
    replicas: int = 1,
    gpus_per_replica: float = 0.0,
    batch_rows: int = 256,
    keep_columns: list[str] | tuple[str, ...] = (),
):
    """A Ray ``Dataset`` of the output rows of ``ds``'s rows (the job tool's columns, then the
    ``keep_columns``), made by ``replicas`` engine actors of ``gpus_per_replica`` GPUs each:
    the scoring columns when ``ds`` has a scoring column, ``logprobs`` when it has ``logprobs``.

    ``ds`` has the columns ``id``, ``adapter``, ``prompt`` or ``messages``, optional per-row
    sampling overrides and an optional ``source`` naming each row in error messages. ``model``
    and the mapping's adapter paths may be Hub names (``hub.locate``, here on the driver). Rows are
    sorted by adapter first, so each batch of ``batch_rows`` holds few adapters. ``id`` is int64
    in the output when ``ds``'s ``id`` column is an integer column, else string. Lazy, like any
    Ray Dataset: nothing runs until it is consumed (``write_parquet``, ``take_all``, ...)."""
    engine = _config(EngineConfig, engine)
    sampling = _config(SamplingConfig, sampling)
    located = locate(model, adapters)  # Hub names resolved here, once: actors get directories
    names = ds.schema().names
    types = dict(zip(names, ds.schema().types, strict=True))
    missing = [c for c in keep_columns if c not in names]
    if missing:
        raise ValueError(f"keep_columns: the dataset has no column {missing[0]!r}")
    id_type = "int64" if "id" in types and pa.types.is_integer(types["id"]) else "string"
    scoring = any(key in names for key in SCORE_KEYS)  # the columns ``ds`` can ask for
    columns = job_columns(scoring, "logprobs" in names)
    schema = part_schema(id_type, {name: types[name] for name in keep_columns}, (), columns)
    keyed = ds.map_batches(_with_sort_key, batch_format="pyarrow")
    return keyed.sort(SORT).map_batches(
        EngineActor,
        fn_constructor_kwargs={
            "model": str(located.model),
            "adapters": located.adapters,
            "engine": engine,
            "sampling": sampling,
            "schema": schema,
        },
        batch_size=batch_rows,
        batch_format="pyarrow",
        concurrency=replicas,
        num_gpus=gpus_per_replica or None,
    )


def _with_sort_key(batch: pa.Table) -> pa.Table:
    if "adapter" in batch.column_names:
        adapters = [a if isinstance(a, str) else "" for a in batch.column("adapter").to_pylist()]
    else:
        adapters = [""] * batch.num_rows
    return batch.append_column(SORT, pa.array(adapters, pa.string()))


def _config(cls, value):
    if value is None:
        return cls()
    if isinstance(value, dict):
        return cls(**value)
    return value
