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

from slora_batch.jobs.check import JOB_ERRORS, LOUD_NOTES, JobPlan, input_notes, job_error
from slora_batch.jobs.config import JobConfig
from slora_batch.jobs.feed import RunRecord
from slora_batch.jobs.fsio import FsDir
from slora_batch.jobs.lock import output_lock
from slora_batch.jobs.manifest import fingerprint, first_manifest, run_manifest
from slora_batch.jobs.openai_output import job_openai_files
from slora_batch.jobs.outdir import OutputError, clear_output, part_files, write_success
from slora_batch.jobs.progress import JobProgress, ProgressCallback
from slora_batch.jobs.samples import DoneSamples
from slora_batch.jobs.scan import InputScan
from slora_batch.jobs.stats import complete_stats, write_run_stats
from slora_batch.jobs.summary import JobSummary, run_summary

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
        resumed = run_manifest(out, job.name, job.columns, current, job.limit)
        if resumed is None:
            notify(JobProgress(job.name, "scanning", 0, None, 0, 0.0, 0))
            resumed = (*first_manifest(plan, out, current), False)
        manifest, scan, marked = resumed
        stats = complete_stats(out) if marked else None  # a complete job's
        plan.scanned(scan)
        notes = input_notes(plan, scan)
        complete = stats is not None  # nothing runs and nothing is written
        if complete:
            run = RunRecord(job.name, stats[0]["rows"], stats[0]["rows"], notify)
        else:
            pending = Pending(plan, scan, rows.open(out), out, manifest, lock, notify)
            run = _run(rows, pending, notes)
        parts = part_files(out)  # as committed: what the stats count, what the OpenAI files hold
        if not complete:
            wall_s = time.perf_counter() - started
            stats = write_run_stats(out, parts, run, wall_s, len(plan.broken), job.engine)
        if job.output_format == "openai":  # from the parts: whole after any kill, each id once
            job_openai_files(out, parts, job.name, job.model, complete)
        if not complete:
            write_success(out, job.name, rows=stats[0]["rows"])
    notify(run.finished(stats[0]["rows"]))
    choice_labels = job.choice_labels or scan.choices
    return run_summary(run, stats, out, notes, plan.broken, choice_labels, complete)


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


def _run(rows: Rows, pending: Pending, notes: list[str]) -> RunRecord:
    """The rows left, run: first the input's loud notes logged as warnings (an OpenAI body
    field the engine does not read, raw chat prompts, no prompt column; an input without rows)
    and what is to do."""
    name, done, total = pending.plan.job.name, len(pending.done), pending.plan.total or 0
    for note in notes:
        if note.startswith(LOUD_NOTES):
            logger.warning("job %s: %s", name, note)
    if pending.scan.rows == 0:
        logger.warning("job %s: %s", name, notes[0])
    earlier = f" ({done:,} of {total:,} already in {pending.out})" if done else ""
    left = max(total - done, 0)
    logger.info("job %s: %s row%s to do%s", name, f"{left:,}", "" if left == 1 else "s", earlier)
    return rows.run(pending)
