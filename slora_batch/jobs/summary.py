"""What a job run returns: its summary (``run_summary`` makes it from the run's account and its
stats), or the failure of a job ``run_jobs`` could not run."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slora_batch.jobs.fsio import FsDir

if TYPE_CHECKING:
    from slora_batch.jobs.feed import RunRecord

logger = logging.getLogger(__name__)


@dataclass
class JobSummary:
    """A finished job: the stats rows as written to ``_stats.parquet`` and this run's share."""

    job: str
    output: Path
    stats: dict[str, Any]
    adapters: list[dict[str, Any]]
    rows_skipped: int  # already in the output when this run started
    rows_this_run: int
    errors: list[str] = field(default_factory=list)  # a few error messages of this run
    error_rows_this_run: int = 0  # all of them: ``errors`` holds the first few
    # this run's share of the stats' whole-output token counts (error rows compute nothing)
    prompt_tokens_this_run: int = 0
    completion_tokens_this_run: int = 0
    notes: list[str] = field(default_factory=list)  # input columns neither used nor kept, ...
    broken: dict[str, str] = field(default_factory=dict)  # adapter -> why it cannot run
    complete_already: bool = False  # the job was complete: nothing ran, nothing was written
    # the preference table's column labels: the job's choice_labels, else the choices every
    # choices row shares (None: the columns are headed by index)
    choice_labels: list[str] | None = None
    eval_results: list[dict[str, Any]] | None = None  # an eval job's ``_eval_results.parquet`` rows
    generated_rows_this_run: int = 0  # ok rows of this run that generated text (not scored)
    empty_rows_this_run: int = 0  # those of them whose text is empty (or only whitespace)
    raw_prompts_this_run: bool = False  # most of this run's rows were raw text prompts

    def empty_text_note(self) -> str | None:
        """What to say when most of this run's generated rows are empty, else None."""
        return empty_text_note(
            self.generated_rows_this_run, self.empty_rows_this_run, self.raw_prompts_this_run
        )


def run_summary(
    run: RunRecord,
    stats: tuple[dict[str, Any], list[dict[str, Any]]],
    out: Path | FsDir,
    notes: list[str],
    broken: dict[str, str],
    choice_labels: list[str] | None,
    complete: bool,
) -> JobSummary:
    """The summary of ``run`` over output ``out`` with its ``stats`` (job row, adapter rows):
    ``complete``, the job was complete already and nothing ran. What the run did is logged,
    and a warning when most of its generated rows are empty."""
    job_row, adapter_rows = stats
    summary = JobSummary(
        job=run.job,
        output=out.resolve() if isinstance(out, Path) else Path(out.path),
        stats=job_row,
        adapters=adapter_rows,
        rows_skipped=run.skipped,
        rows_this_run=run.rows,
        errors=run.errors,
        error_rows_this_run=run.error_rows,
        prompt_tokens_this_run=run.prompt_tokens,
        completion_tokens_this_run=run.tokens,
        notes=notes,
        broken=broken,
        complete_already=complete,
        choice_labels=choice_labels,
        generated_rows_this_run=run.generated_rows,
        empty_rows_this_run=run.empty_rows,
        raw_prompts_this_run=2 * run.raw_prompts > run.requests,
    )
    rows = f"{job_row['rows']:,} row{'' if job_row['rows'] == 1 else 's'}"
    if complete:
        logger.info("job %s: complete already (%s in %s); nothing to do", run.job, rows, out)
        return summary
    this_run = f"{run.rows:,} row{'' if run.rows == 1 else 's'}"
    logger.info("job %s: %s this run, %.1f s", run.job, this_run, job_row["wall_s"])
    empty = summary.empty_text_note()
    if empty is not None:
        logger.warning("job %s: %s", run.job, empty)
    return summary


def empty_text_note(generated: int, empty: int, raw_prompts: bool) -> str | None:
    """When more than half of ``generated`` ok rows have empty text: how many, and the likely
    cause: with ``raw_prompts`` (most rows were raw text, no chat template applied), an
    instruct model that answers a raw prompt with its end token at once."""
    if not generated or 2 * empty <= generated:
        return None
    if raw_prompts:
        cause = (
            "a chat (instruct) model given raw prompts often ends at once: set "
            "'apply_chat_template: true' on the job, or give 'messages' rows instead of 'prompt'"
        )
    else:
        cause = "check the job's 'stop' strings and the model's chat template"
    share = f"{empty:,} of {generated:,} generated rows ({empty / generated:.0%})"
    return f"{share} have empty text; {cause}"


@dataclass
class JobFailure:
    """A job of ``run_jobs`` that failed; the message names the job and the reason."""

    job: str
    error: str
