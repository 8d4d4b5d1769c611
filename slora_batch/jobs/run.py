"""Running jobs: input rows -> sorted windows -> engine -> parts, then stats and the marker.

``run_jobs`` checks every job (``check_job``: model config, adapter headers, input files, output
directory, fan-out; no weights), then runs the good ones one after another; a job that fails
(at the check or while it runs) is reported and the next one runs. A run takes the output
directory's lock and then:

- compares the job's ``fingerprint`` (input files with sizes and mtimes, model and adapter files,
  sampling, and the job keys that decide rows) with the one in the output's manifest: a
  directory holding rows of other inputs or settings is refused, naming what changed;
- returns at once when the job is complete (``_SUCCESS``): no engine, nothing written;
- scans the input once (``scan.scan_input``: id type, kept columns, duplicates, unused columns)
  unless the manifest holds the scan, and refuses a job whose (id, adapter) rows repeat;
- skips the rows already in committed parts (resume; a row of n samples is done when all n
  are, and one partly done asks for the rest), builds the engine only when a row is left, writes
  parts (by rows and by time, of the columns the manifest records) and ends with
  ``_stats.parquet`` and the marker.

A row is an output row: one sample of one input row for one adapter (``samples.py``); progress,
stats and the summary count those.

Stats are ``stats.py``'s; the fingerprint and the manifest ``manifest.py``'s.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from itertools import chain
from pathlib import Path
from typing import Any

import pyarrow as pa

from slora_batch.engine.requests.request import Result
from slora_batch.jobs.check import (
    JOB_ERRORS,
    LOUD_NOTES,
    JobError,
    JobPlan,
    check_job,
    check_scan,
    input_notes,
    job_error,
)
from slora_batch.jobs.config import JobConfig
from slora_batch.jobs.feed import RunRecord
from slora_batch.jobs.lock import OutputLock
from slora_batch.jobs.manifest import (
    fingerprint,
    new_manifest,
    output_schema,
    resumable_manifest,
    write_manifest,
)
from slora_batch.jobs.openai_input import base_model_name, kept_columns
from slora_batch.jobs.openai_output import openai_stale, write_openai_files
from slora_batch.jobs.ordering import adapter_group, sort_key, sorted_windows
from slora_batch.jobs.outdir import (
    SUCCESS_FILE,
    OutputError,
    clear_output,
    read_success,
    write_success,
)
from slora_batch.jobs.progress import JobProgress, ProgressCallback
from slora_batch.jobs.resume import done_samples, pending_items
from slora_batch.jobs.scan import InputScan, limit_changed, scan_input
from slora_batch.jobs.schema import OUTPUT_COLUMNS
from slora_batch.jobs.stats import read_stats, stats_rows, write_stats
from slora_batch.jobs.summary import JobFailure, JobSummary
from slora_batch.jobs.writer import OutputWriter

logger = logging.getLogger(__name__)


def run_jobs(
    jobs: list[JobConfig], overwrite: bool = False, progress: ProgressCallback | None = None
) -> Iterator[JobSummary | JobFailure]:
    """Check every job, then run the good ones one by one, yielding each one's summary or
    failure: first the jobs that failed their check, then the runs in order. A job that fails
    while it runs does not stop the jobs after it."""
    plans: list[JobPlan | JobConfig] = []
    for job in jobs:
        try:  # an eval job is checked when it runs: its input is built then (``eval/sweep``)
            plans.append(job if job.eval is not None else check_job(job))
        except JobError as exc:
            yield JobFailure(job.name, str(exc))
    for plan in plans:
        try:
            if isinstance(plan, JobConfig):
                yield run_job(plan, overwrite=overwrite, progress=progress)
                continue
            yield run_plan(plan, overwrite=overwrite, progress=progress)
        except JobError as exc:
            yield JobFailure(getattr(plan, "job", plan).name, str(exc))
        except Exception as exc:  # the engine or the disk: this job is lost, the next may run
            name = getattr(plan, "job", plan).name
            logger.error("job %s failed", name, exc_info=True)
            yield JobFailure(name, f"job {name!r} failed: {type(exc).__name__}: {exc}")


def run_job(
    job: JobConfig, overwrite: bool = False, progress: ProgressCallback | None = None
) -> JobSummary:
    if job.eval is not None:  # lm-eval tasks: the ``[eval]`` extra, imported only here
        from slora_batch.eval.sweep import run_eval

        return run_eval(job, run_plan, overwrite=overwrite, progress=progress)
    return run_plan(check_job(job), overwrite=overwrite, progress=progress)


def _build_engine(plan: JobPlan):
    """An ``Engine``, or a ``DataParallelEngine`` of ``engine.data_parallel`` workers."""
    from slora_batch.engine.parallel.data_parallel import (
        open_engine,  # imports torch and the model code
    )

    job = plan.job
    return open_engine(plan.model_path, plan.sources, job.engine, job.sampling)


def run_plan(
    plan: JobPlan,
    overwrite: bool = False,
    progress: ProgressCallback | None = None,
    on_result: Callable[[Result], None] | None = None,
    build_engine: Callable[[JobPlan], Any] | None = None,
) -> JobSummary:
    """Run a checked job over its output directory: resume unless ``overwrite``. ``on_result``
    is handed every result of this run once it is written (an eval job's scoring);
    ``build_engine`` gives the engine when a row is left (an eval job's, built beside lm-eval's
    preparation), else ``_build_engine``; either way the run closes it."""
    job, started = plan.job, time.perf_counter()
    notify = progress or (lambda update: None)
    out = Path(job.output)
    created = not out.exists()  # a job refused before any work leaves no directory behind
    try:
        lock = OutputLock(out)
    except OutputError as exc:
        raise job_error(job, exc) from exc
    with lock:
        try:
            if overwrite:
                clear_output(out)
            current = plan.taken if plan.taken is not None else fingerprint(plan)
            manifest = resumable_manifest(plan, current)
            if manifest is not None and limit_changed(manifest, job.limit):
                logger.info(
                    "job %s: limit is %s now: scanning the input again", job.name, job.limit
                )
                (out / SUCCESS_FILE).unlink(missing_ok=True)  # first: complete no more
                manifest = None
            if manifest is not None and read_success(out) is not None:
                complete = complete_summary(plan, manifest)
                if complete is not None and job.output_format == "openai" and openai_stale(out):
                    write_openai_files(out, job.name, base_model_name(job.model))
                if complete is not None:
                    rows = complete.stats["rows"]
                    notify(JobProgress(job.name, "done", rows, rows, 0, 0.0, 0))
                    return complete
            if manifest is None:
                notify(JobProgress(job.name, "scanning", 0, None, 0, 0.0, 0))
                try:
                    manifest = new_manifest(plan, current, scan_for_run(plan))
                except BaseException:
                    lock.release()  # the lock file goes first, then the empty directory
                    if created:
                        _remove_empty(out)
                    raise
                write_manifest(out, manifest)
            scan = InputScan.from_json(manifest["scan"])
            plan.scanned(scan)
            done = done_samples(out)
        except JOB_ERRORS as exc:
            raise job_error(job, exc) from exc
        notes = input_notes(plan, scan)
        for note in notes:  # an OpenAI body field the engine does not read, raw chat prompts
            if note.startswith(LOUD_NOTES):
                logger.warning("job %s: %s", job.name, note)
        if scan.rows == 0:
            logger.warning("job %s: %s", job.name, notes[0])
        total = plan.total
        left = _count(max((total or 0) - len(done), 0), "row")
        earlier = f" ({len(done):,} of {total or 0:,} already in {out})" if done else ""
        logger.info("job %s: %s to do%s", job.name, left, earlier)
        schema = output_schema(manifest)  # the recorded columns: one schema per output
        items = pending_items(plan, scan, done)
        if job.eval is None:  # an eval job's come in order already (``resume.adapter_major``)
            items = sorted_windows(
                items,
                window=job.window,
                key=lambda pair: sort_key(pair[0]),
                group=lambda pair: adapter_group(pair[0]),
            )
        run = RunRecord(job.name, len(done), total, notify, on_result)
        with OutputWriter(
            out, job.part_rows, lock=lock, schema=schema, part_seconds=job.part_seconds
        ) as writer:
            try:
                pulled = time.perf_counter()
                first = next(items, None)  # the engine is built only when a row is left
                run.read_s = time.perf_counter() - pulled
                if first is not None:
                    notify(JobProgress(job.name, "loading", len(done), total, 0, 0.0, 0))
                    built = time.perf_counter()
                    engine = (build_engine or _build_engine)(plan)
                    run.load_s = time.perf_counter() - built
                    with contextlib.closing(engine):  # frees the device for the next job
                        check_resolution(job, engine, manifest["fingerprint"]["engine"])
                        run.feed(engine, chain([first], items), writer)
            except JOB_ERRORS as exc:  # a model the engine cannot load, a file unreadable midway
                raise job_error(job, exc) from exc
        run.write_s = writer.write_s
        wall_s = time.perf_counter() - started
        job_row, adapter_rows = stats_rows(out, plan, run, wall_s)
        write_stats(out, job_row, adapter_rows)
        if job.output_format == "openai":  # from the parts: whole after any kill, each id once
            write_openai_files(out, job.name, base_model_name(job.model))
        write_success(out, job.name, rows=job_row["rows"])
        notify(
            JobProgress(
                job.name,
                "done",
                job_row["rows"],
                job_row["rows"],  # complete: what it holds (error rows stand for their samples)
                run.tokens,
                run.engine_s,  # the stats' time: the summary's rates are this event's
                run.resident,
                run.rows,
                run.computed,
                run.row_tokens,
            )
        )
    logger.info("job %s: %s this run, %.1f s", job.name, _count(writer.rows_written, "row"), wall_s)
    summary = JobSummary(
        job=job.name,
        output=out.resolve(),
        stats=job_row,
        adapters=adapter_rows,
        rows_skipped=len(done),
        rows_this_run=writer.rows_written,
        errors=run.errors,
        error_rows_this_run=run.error_rows,
        prompt_tokens_this_run=run.prompt_tokens,
        completion_tokens_this_run=run.tokens,
        notes=notes,
        broken=plan.broken,
        choice_labels=job.choice_labels or scan.choices,
        generated_rows_this_run=run.generated_rows,
        empty_rows_this_run=run.empty_rows,
        raw_prompts_this_run=2 * run.raw_prompts > run.requests,
    )
    empty = summary.empty_text_note()
    if empty is not None:
        logger.warning("job %s: %s", job.name, empty)
    return summary


def check_resolution(job: JobConfig, engine, recorded: dict[str, str]) -> None:
    """Refuse to feed an engine that runs on another device kind or dtype than the manifest
    records (``resolution.resolve`` decided it before the engine was built): a safeguard, so
    rows of two precisions never share an output."""
    built = {
        "device": str(engine.device).split(":")[0].split()[0],  # "cuda:0", "cuda x2" -> "cuda"
        "dtype": str(engine.dtype).removeprefix("torch."),
    }
    wrong = [
        f"{key} {recorded[key]} -> {built[key]}" for key in built if built[key] != recorded[key]
    ]
    if wrong:
        raise JobError(
            f"job {job.name!r}: output {job.output!r} records rows made on {recorded['device']} "
            f"in {recorded['dtype']}, but the engine built for this run differs: "
            f"{'; '.join(wrong)}. Nothing was run"
        )


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


def complete_summary(
    plan: JobPlan, manifest: dict[str, Any], out=None, output: Path | str | None = None
) -> JobSummary | None:
    """The summary of a complete job from its stats, or None when they cannot be read. ``out``:
    the output directory when it is not ``job.output`` on the local disk (an ``FsDir``), and
    ``output`` the name to show for it."""
    job = plan.job
    try:
        stats = read_stats(out if out is not None else job.output)
    except (OSError, pa.ArrowException):
        stats = None
    if stats is None:
        return None
    job_row, adapter_rows = stats
    scan = InputScan.from_json(manifest["scan"])
    plan.scanned(scan)
    logger.info(
        "job %s: complete already (%s in %s); nothing to do",
        job.name,
        _count(job_row["rows"], "row"),
        job.output,
    )
    return JobSummary(
        job=job.name,
        output=output if output is not None else Path(job.output).resolve(),
        stats=job_row,
        adapters=adapter_rows,
        rows_skipped=job_row["rows"],
        rows_this_run=0,
        notes=input_notes(plan, scan),
        broken=plan.broken,
        complete_already=True,
        choice_labels=job.choice_labels or scan.choices,
    )


def _remove_empty(out: Path) -> None:
    """Remove ``out`` when nothing is in it (what a refused job created), else leave it."""
    with contextlib.suppress(OSError):
        out.rmdir()  # fails on a directory that holds anything


def _count(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"
