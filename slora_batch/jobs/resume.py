"""Resuming a job: the ``row_key``s of the rows in committed parts, and the input rows not yet
among them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.engine.request import Request, Result
from slora_batch.jobs.check import JobPlan
from slora_batch.jobs.fsio import FsDir
from slora_batch.jobs.outdir import OutputError, part_files
from slora_batch.jobs.reader import InputRow, input_root, read_rows
from slora_batch.jobs.rows import identity, row_key, to_request
from slora_batch.jobs.scan import InputScan


def done_keys(out_dir: str | Path | FsDir) -> set[str]:
    """``row_key``s of the rows in committed parts; temp files are never read."""
    keys: set[str] = set()
    fs = out_dir.fs if isinstance(out_dir, FsDir) else None
    for _, path in part_files(out_dir if fs else Path(out_dir)):
        try:
            names = pq.read_schema(str(path), filesystem=fs).names
            table = pq.read_table(
                str(path),
                columns=[c for c in ("id", "adapter", "source") if c in names],
                filesystem=fs,
            )
        except (OSError, pa.ArrowException) as exc:
            raise OutputError(f"{path}: committed part is unreadable: {exc}") from exc
        ids, adapters = table["id"].to_pylist(), table["adapter"].to_pylist()
        sources = table["source"].to_pylist() if "source" in names else [None] * len(ids)
        keys.update(map(row_key, ids, adapters, sources))
    return keys


def pending_items(plan: JobPlan, scan: InputScan, done: set[str]) -> Iterator[Request | Result]:
    """The job's requests and bad-row results not yet in the output, in input order. A done
    row is skipped before it is turned into a request (only its id and adapter are read)."""
    return (item for _, item in pending_rows(plan, scan, done))


def pending_rows(
    plan: JobPlan,
    scan: InputScan,
    done: set[str],
    files: list[Path] | None = None,
    root: Path | None = None,
) -> Iterator[tuple[InputRow, Request | Result]]:
    """``pending_items`` with the input row each item comes from (a fanned-out row once per
    adapter), over ``files`` (default: the job's) named relative to ``root`` (default: the
    folder that holds every input file of the job)."""
    job = plan.job
    fanout = plan.sweep is not None
    root = root or input_root(plan.files, plan.input_fs)
    rows = read_rows(
        files or plan.files, job.columns, keep=list(scan.keep), root=root, fs=plan.input_fs
    )
    for row in rows:
        id_, adapter, _ = identity(row, fanout)
        adapters = plan.sweep if fanout else [adapter]
        todo = [a for a in adapters if row_key(id_, a) not in done] if done else adapters
        if not todo:
            continue
        item = to_request(row, job.sampling, fanout)
        if not fanout:
            yield row, item
            continue
        for name in todo:
            yield row, dataclasses.replace(item, adapter=name or None)
