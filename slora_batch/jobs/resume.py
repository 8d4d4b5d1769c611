"""Resuming a job: the samples of each row in committed parts (``DoneSamples``), and the input
rows not yet complete among them, asking for the missing samples of a row partly done (an output
row is one sample of an input row for one adapter: ``samples.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.engine.requests.request import Request, Result
from slora_batch.jobs.check import JobPlan
from slora_batch.jobs.fsio import FsDir
from slora_batch.jobs.ordering import sort_key
from slora_batch.jobs.outdir import OutputError, part_files
from slora_batch.jobs.prompts import Prompts
from slora_batch.jobs.reader import InputRow, input_root, read_rows
from slora_batch.jobs.rows import identity, row_key, to_request
from slora_batch.jobs.samples import DoneSamples, resumed, row_samples
from slora_batch.jobs.scan import InputScan
from slora_batch.jobs.scoring import scored

COLUMNS = ("id", "adapter", "sample_index", "finish_reason", "source")


def done_samples(out_dir: str | Path | FsDir, only: set[str] | None = None) -> DoneSamples:
    """The samples in committed parts by ``row_key`` (of the parts named in ``only`` when
    given); temp files are never read. A part written before ``sample_index`` existed holds
    sample 0 of each row."""
    done = DoneSamples()
    fs = out_dir.fs if isinstance(out_dir, FsDir) else None
    for _, path in part_files(out_dir if fs else Path(out_dir)):
        if only is not None and path.name not in only:
            continue
        try:
            names = pq.read_schema(str(path), filesystem=fs).names
            table = pq.read_table(
                str(path), columns=[c for c in COLUMNS if c in names], filesystem=fs
            )
        except (OSError, pa.ArrowException) as exc:
            raise OutputError(f"{path}: committed part is unreadable: {exc}") from exc
        rows = table.num_rows
        ids, adapters = table["id"].to_pylist(), table["adapter"].to_pylist()
        sources = table["source"].to_pylist() if "source" in names else [None] * rows
        indices = table["sample_index"].to_pylist() if "sample_index" in names else [0] * rows
        errors = [reason == "error" for reason in table["finish_reason"].to_pylist()]
        for key, index, error in zip(
            map(row_key, ids, adapters, sources), indices, errors, strict=True
        ):
            done.add(key, index, error)
    return done


def pending_items(
    plan: JobPlan, scan: InputScan, done: DoneSamples
) -> Iterator[tuple[Request | Result, int]]:
    """The job's requests and bad-row results not yet complete in the output, in input order,
    each with the output rows it owes (the samples it asks for; a bad row's error row stands
    for as many). A done row is skipped before it is turned into a request (only its id,
    adapter and n are read)."""
    return ((item, samples) for _, item, samples in pending_rows(plan, scan, done))


def pending_rows(
    plan: JobPlan,
    scan: InputScan,
    done: DoneSamples,
    files: list[Path] | None = None,
    root: Path | None = None,
    start: int = 0,
) -> Iterator[tuple[InputRow, Request | Result, int]]:
    """``pending_items`` with the input row each item comes from (a fanned-out row once per
    adapter; an eval job's adapter by adapter: ``adapter_major``), over ``files`` (default: the
    job's) named relative to ``root`` (default: the folder that holds every input file of the
    job); ``start``: the position in the job's input of ``files``' first row (the output's
    ``row_index``)."""
    job = plan.job
    fanout = plan.sweep is not None
    root = root or input_root(plan.files, plan.input_fs)
    prompts = Prompts.of(job)
    rows = read_rows(
        files or plan.files,
        job.columns,
        keep=scan.kept_columns(),
        root=root,
        fs=plan.input_fs,
        openai=plan.openai,
        fields=prompts.fields,
        start=start,
        limit=job.limit,
        position_ids=scan.position_ids,
    )
    if fanout and job.eval is not None:
        yield from adapter_major(plan, list(rows), done)
        return
    for row in rows:
        id_, adapter, problem = identity(row, fanout)
        adapters = plan.sweep if fanout else [adapter]
        n = 1 if problem else row_samples(row.values.get("n"), job.sampling, scored(row.values))
        if done:
            todo = [(a, done.missing(row_key(id_, a), n)) for a in adapters]
            todo = [(a, missing) for a, missing in todo if missing]
        else:
            todo = [(a, list(range(n))) for a in adapters]
        if not todo:
            continue
        item = to_request(row, job.sampling, fanout, prompts)
        for name, missing in todo:
            one = with_adapter(item, name) if fanout else item
            yield row, resumed(one, missing, n), len(missing)


def adapter_major(
    plan: JobPlan, rows: list[InputRow], done: DoneSamples
) -> Iterator[tuple[InputRow, Request | Result, int]]:
    """An eval job's items adapter by adapter, in ``ordering.sort_key``'s order (the base model
    first, then by name; within an adapter bad rows first, then by prompt): each adapter's
    rows finish together, and its lm-eval scoring runs while the engine computes the next
    adapters' (``eval/sweep``); ``sorted_windows``' order, sorted once. Its input, lm-eval's
    requests, is held whole by the sweep anyway: each row is read and made a request once."""
    job = plan.job
    entries = []
    for row in rows:
        id_, _, problem = identity(row, True)
        n = 1 if problem else row_samples(row.values.get("n"), job.sampling, scored(row.values))
        entries.append((row, id_, n, to_request(row, job.sampling, True)))
    entries.sort(key=lambda entry: sort_key(entry[3]))
    for adapter in sorted(plan.sweep, key=lambda a: (a is not None, a or "")):
        for row, id_, n, item in entries:
            missing = done.missing(row_key(id_, adapter), n) if done else list(range(n))
            if missing:
                yield row, resumed(with_adapter(item, adapter), missing, n), len(missing)


def with_adapter(item: Request | Result, adapter: str | None) -> Request | Result:
    """A copy of ``item`` for ``adapter``: ``dataclasses.replace`` without its checks, a
    fraction of its time (once per row and adapter of a fan-out)."""
    one = object.__new__(type(item))
    one.__dict__.update(item.__dict__)
    one.adapter = adapter or None
    return one
