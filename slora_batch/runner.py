"""Jobs of every kind, as the command runs and validates them: an ordinary job through the job
tool (``jobs/run.py``), an eval job through the lm-eval sweep (``eval/sweep.py``), which builds
its input (lm-eval's requests) and plugs its scoring into the same job lifecycle. This module
sits above both packages, so ``jobs/`` never imports ``eval/``; lm-eval (the ``[eval]`` extra) is
imported only when an eval job runs or validates.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

from slora_batch.jobs.check import JobError, JobPlan, check_job
from slora_batch.jobs.config import JobConfig
from slora_batch.jobs.progress import ProgressCallback
from slora_batch.jobs.run import run_plan
from slora_batch.jobs.summary import JobFailure, JobSummary
from slora_batch.jobs.validate import VALIDATE_ROWS, ValidationReport
from slora_batch.jobs.validate import validate_job as validate_rows_job

logger = logging.getLogger(__name__)


def run_jobs(
    jobs: list[JobConfig], overwrite: bool = False, progress: ProgressCallback | None = None
) -> Iterator[JobSummary | JobFailure]:
    """Check every job, then run the good ones one by one, yielding each one's summary or
    failure: first the jobs that failed their check, then the runs in order. A job that fails
    while it runs does not stop the jobs after it. An eval job is checked when it runs: its
    input is built then."""
    runs: list[JobPlan | JobConfig] = []
    for job in jobs:
        try:
            runs.append(job if job.eval is not None else check_job(job))
        except JobError as exc:
            yield JobFailure(job.name, str(exc))
    for planned in runs:
        job = planned if isinstance(planned, JobConfig) else planned.job
        try:
            yield _run(planned, overwrite, progress)
        except JobError as exc:
            yield JobFailure(job.name, str(exc))
        except Exception as exc:  # the engine or the disk: this job is lost, the next may run
            logger.error("job %s failed", job.name, exc_info=True)
            yield JobFailure(job.name, f"job {job.name!r} failed: {type(exc).__name__}: {exc}")


def _run(
    planned: JobPlan | JobConfig, overwrite: bool, progress: ProgressCallback | None
) -> JobSummary:
    if isinstance(planned, JobConfig):
        return run_job(planned, overwrite=overwrite, progress=progress)
    return run_plan(planned, overwrite=overwrite, progress=progress)


def run_job(
    job: JobConfig, overwrite: bool = False, progress: ProgressCallback | None = None
) -> JobSummary:
    """Run one job of any kind; resume unless ``overwrite``."""
    if job.eval is not None:
        from slora_batch.eval.sweep import run_eval  # lm-eval: the [eval] extra

        return run_eval(job, overwrite=overwrite, progress=progress)
    return run_plan(check_job(job), overwrite=overwrite, progress=progress)


def validate_job(job: JobConfig, limit: int | None = VALIDATE_ROWS) -> ValidationReport:
    """``jobs.validate.validate_job`` of a job of any kind: an eval job that has not run yet
    has its requests built into a temporary directory first, its output untouched."""
    if job.eval is not None and not Path(job.input).is_file():
        from slora_batch.eval.sweep import validate_with_requests  # lm-eval: the [eval] extra

        return validate_with_requests(job, limit)
    return validate_rows_job(job, limit)
