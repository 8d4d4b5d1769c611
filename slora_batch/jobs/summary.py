"""What a job run returns: its summary, or the failure of a job ``run_jobs`` could not run
(apart from ``run.py``, so that the eval sweep, which ``run_job`` calls, names them too)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
