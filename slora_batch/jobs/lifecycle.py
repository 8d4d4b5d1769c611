"""One job's run over its output directory, the same story for every way its rows are run: in
this process (``run.py``: one engine, or ``engine.data_parallel`` workers) and on a Ray cluster
(``slora_batch/ray/job.py``). ``run_output`` tells it:

1. the output's lock is taken (``lock.output_lock``; none off the local disk), and with
   ``overwrite`` what earlier runs wrote is removed;
2. the job's fingerprint is compared with the output's manifest (``manifest``): a directory
   holding rows of other inputs or settings is refused, naming what changed; a changed
   ``limit`` removes the complete marker first and scans the input again;
3. a complete job (``_SUCCESS``) returns its summary from its stats: no engine, nothing written
   (an OpenAI output that still has an earlier version's file names gets them rewritten);
4. the input is scanned once (``scan.scan_input``: id type, kept columns, duplicates, unused
   columns) unless the manifest holds the scan, and a job whose (id, adapter) rows repeat is
   refused; the manifest is written;
5. the samples already committed are read (resume), and the executor runs the rows left;
6. ``_stats.parquet``, the OpenAI files (``output_format: openai``, a local output) and last
   the marker ``_SUCCESS``: whoever sees the marker sees every other file whole.

A job refused before any work leaves no directory behind. The executor (``Rows``) is how rows
run: ``gpu`` (whether its engines see a GPU, for the fingerprint; None: this process's answer),
``clear`` (its own files, on ``overwrite``), ``open`` (the run starts on the output: the
committed samples it may count) and ``run`` (the pending rows into parts: this run's account).

A row is an output row: one sample of one input row for one adapter (``samples.py``); progress,
stats and the summary count those.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from slora_batch.jobs.check import (
    JOB_ERRORS,
    LOUD_NOTES,
    JobPlan,
    check_scan,
    input_notes,
    job_error,
)
from slora_batch.jobs.config import JobConfig
from slora_batch.jobs.feed import RunRecord
from slora_batch.jobs.fsio import FsDir
from slora_batch.jobs.lock import output_lock
from slora_batch.jobs.manifest import fingerprint, new_manifest, resumable_manifest, write_manifest
from slora_batch.jobs.openai_input import base_model_name, kept_columns
from slora_batch.jobs.openai_output import openai_stale, write_openai_files
from slora_batch.jobs.outdir import (
    SUCCESS_FILE,
    OutputError,
    clear_output,
    read_success,
    remove_file,
    shown_output,
    write_success,
)
from slora_batch.jobs.progress import JobProgress, ProgressCallback
from slora_batch.jobs.samples import DoneSamples
from slora_batch.jobs.scan import InputScan, limit_changed, scan_input
from slora_batch.jobs.schema import OUTPUT_COLUMNS
from slora_batch.jobs.stats import read_stats, stats_rows, write_stats
from slora_batch.jobs.summary import JobSummary

logger = logging.getLogger(__name__)


@dataclass
class Pending:
    """What an executor runs: the checked job, its input scan and the samples committed
    already, and where the rows go: the output, its manifest (the columns its parts hold, the
    engine resolution its rows were made with) and the lock held on it."""

    plan: JobPlan
    scan: InputScan
    done: DoneSamples
    out: Path | FsDir
    manifest: dict[str, Any]
    lock: Any  # the ``OutputLock`` held, or a null context off the local disk
    notify: ProgressCallback


class Rows(Protocol):
    """How a job's rows run (see the module docstring)."""

    gpu: bool | None

    def clear(self, out: Path | FsDir) -> None: ...

    def open(self, out: Path | FsDir) -> DoneSamples: ...

    def run(self, pending: Pending) -> RunRecord: ...


def run_output(
    plan: JobPlan,
    out: Path | FsDir,
    rows: Rows,
    overwrite: bool = False,
    progress: ProgressCallback | None = None,
) -> JobSummary:
    """Run a checked job into ``out`` (its output directory: a local path, or a ``FsDir`` on
    another filesystem) with ``rows``; resume unless ``overwrite``."""
    job, started = plan.job, time.perf_counter()
    notify = progress or _unheard
    with _locked(job, out) as lock, _as_job_error(job):
        if overwrite:
            clear_output(out)
            rows.clear(out)
        current = plan.taken if plan.taken is not None else fingerprint(plan, gpu=rows.gpu)
        manifest = _resumable(out, job, current)
        stats = _complete_stats(out, manifest)  # a complete job's: nothing runs
        if manifest is None:
            manifest = _first_manifest(plan, out, current, notify)
        scan = _scanned(plan, manifest)
        notes = input_notes(plan, scan)
        complete = stats is not None
        if not complete:
            pending = Pending(plan, scan, rows.open(out), out, manifest, lock, notify)
            run = _run(rows, pending, notes)
            stats = _commit(job, out, run, time.perf_counter() - started, len(plan.broken))
        else:
            run = RunRecord(job.name, stats[0]["rows"], stats[0]["rows"], notify)
            _refresh_openai_files(job, out)
    notify(_done_event(job.name, stats[0]["rows"], run))
    return _summary(plan, out, run, stats, scan, notes, complete)


def _unheard(update: JobProgress) -> None:
    """The progress callback of a caller that listens to none."""


def _locked(job: JobConfig, out: Path | FsDir) -> Any:
    """The output's lock, to hold while the run works (``lock.output_lock``)."""
    try:
        return output_lock(out)
    except OutputError as exc:
        raise job_error(job, exc) from exc


@contextlib.contextmanager
def _as_job_error(job: JobConfig) -> Iterator[None]:
    """What a bad job raises (``check.JOB_ERRORS``: a refused output, an input unreadable
    midway, a model the engine cannot load) as the job's ``JobError``."""
    try:
        yield
    except JOB_ERRORS as exc:
        raise job_error(job, exc) from exc


def _resumable(out: Path | FsDir, job: JobConfig, current: dict[str, Any]) -> dict[str, Any] | None:
    """The output's manifest when the job resumes under it, else None (a first run)."""
    manifest = resumable_manifest(out, job.name, job.columns, current)
    if manifest is not None and limit_changed(manifest, job.limit):
        logger.info("job %s: limit is %s now: scanning the input again", job.name, job.limit)
        remove_file(out, SUCCESS_FILE)  # first: complete no more
        return None
    return manifest


def _complete_stats(
    out: Path | FsDir, manifest: dict[str, Any] | None
) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """The stats of a job complete already (``_SUCCESS`` under its manifest), else None (also
    when they cannot be read: then the job runs, with nothing left but the stats)."""
    if manifest is None or read_success(out) is None:
        return None
    try:
        return read_stats(out)
    except (OSError, pa.ArrowException):
        return None


def _first_manifest(
    plan: JobPlan, out: Path | FsDir, current: dict[str, Any], notify: ProgressCallback
) -> dict[str, Any]:
    """The manifest of the output's first run (the input scanned), written."""
    job = plan.job
    notify(JobProgress(job.name, "scanning", 0, None, 0, 0.0, 0))
    manifest = new_manifest(job.name, job.columns, current, scan_for_run(plan))
    write_manifest(out, manifest)
    return manifest


def scan_for_run(plan: JobPlan) -> InputScan:
    """The job's input scan (on the input's filesystem); duplicate rows fail the job."""
    job = plan.job
    logger.info("job %s: scanning %s", job.name, _count(len(plan.files), "input file"))
    scan = scan_input(
        plan.files,
        job.columns,
        kept_columns(job.keep_columns, plan.openai),
        plan.sweep is not None,
        reserved=OUTPUT_COLUMNS,
        fs=plan.input_fs,
        openai=plan.openai,
        fields=plan.prompts.fields,
        limit=job.limit,
    )
    check_scan(plan, scan, "; nothing was run")  # duplicates, a template's missing column
    return scan


def _scanned(plan: JobPlan, manifest: dict[str, Any]) -> InputScan:
    """The manifest's input scan, its output rows per adapter taken into the plan."""
    scan = InputScan.from_json(manifest["scan"])
    plan.scanned(scan)
    return scan


def _run(rows: Rows, pending: Pending, notes: list[str]) -> RunRecord:
    """The rows left, run: the input's loud notes logged first (an OpenAI body field the engine
    does not read, raw chat prompts, no prompt column; an input without rows) and what is to
    do."""
    name, done, total = pending.plan.job.name, len(pending.done), pending.plan.total or 0
    for note in notes:
        if note.startswith(LOUD_NOTES):
            logger.warning("job %s: %s", name, note)
    if pending.scan.rows == 0:
        logger.warning("job %s: %s", name, notes[0])
    earlier = f" ({done:,} of {total:,} already in {pending.out})" if done else ""
    logger.info("job %s: %s to do%s", name, _count(max(total - done, 0), "row"), earlier)
    return rows.run(pending)


def _commit(
    job: JobConfig, out: Path | FsDir, run: RunRecord, wall_s: float, broken: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The run's stats, the OpenAI files (from the parts: whole after any kill, each id once),
    then the complete marker; the stats' job row and adapter rows. ``broken``: the job's
    adapters that cannot run."""
    job_row, adapter_rows = stats_rows(out, run, wall_s, broken, job.engine)
    write_stats(out, job_row, adapter_rows)
    if job.output_format == "openai" and isinstance(out, Path):
        write_openai_files(out, job.name, base_model_name(job.model))
    elif job.output_format == "openai":
        logger.warning("job %s: output_format openai writes a local output only", job.name)
    write_success(out, job.name, rows=job_row["rows"])
    return job_row, adapter_rows


def _refresh_openai_files(job: JobConfig, out: Path | FsDir) -> None:
    """A complete OpenAI output's files, rewritten when they carry an earlier version's names."""
    if job.output_format == "openai" and isinstance(out, Path) and openai_stale(out):
        write_openai_files(out, job.name, base_model_name(job.model))


def _done_event(name: str, rows: int, run: RunRecord) -> JobProgress:
    """The last progress event: the output complete with what it holds (an error row stands for
    its samples), at the stats' rates."""
    return JobProgress(
        name,
        "done",
        rows,
        rows,
        run.tokens,
        run.engine_s,
        run.resident,
        run.rows,
        run.computed,
        run.row_tokens,
    )


def _summary(
    plan: JobPlan,
    out: Path | FsDir,
    run: RunRecord,
    stats: tuple[dict[str, Any], list[dict[str, Any]]],
    scan: InputScan,
    notes: list[str],
    complete: bool,
) -> JobSummary:
    """The run's summary (``complete``: the job was complete already, nothing ran); what it
    did logged, and the empty-text warning when most generated rows are empty."""
    job_row, adapter_rows = stats
    name = plan.job.name
    summary = JobSummary(
        job=name,
        output=shown_output(out),
        stats=job_row,
        adapters=adapter_rows,
        rows_skipped=run.skipped,
        rows_this_run=run.rows,
        errors=run.errors,
        error_rows_this_run=run.error_rows,
        prompt_tokens_this_run=run.prompt_tokens,
        completion_tokens_this_run=run.tokens,
        notes=notes,
        broken=plan.broken,
        complete_already=complete,
        choice_labels=plan.job.choice_labels or scan.choices,
        generated_rows_this_run=run.generated_rows,
        empty_rows_this_run=run.empty_rows,
        raw_prompts_this_run=2 * run.raw_prompts > run.requests,
    )
    if complete:
        logger.info(
            "job %s: complete already (%s in %s); nothing to do",
            name,
            _count(job_row["rows"], "row"),
            out,
        )
        return summary
    logger.info("job %s: %s this run, %.1f s", name, _count(run.rows, "row"), job_row["wall_s"])
    empty = summary.empty_text_note()
    if empty is not None:
        logger.warning("job %s: %s", name, empty)
    return summary


def _count(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"
