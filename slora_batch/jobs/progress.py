"""``JobProgress``: what a progress display is told as a job scans, loads, runs and ends, and what
it derives from it: the rate of tokens computed and the time left. Rows are output rows: one
sample of one input row for one adapter (``samples.py``).

The rate counts every token the engine computed this run (prefill, decode and the scored
continuations, ``EngineCounters``), so it moves from the first step on, long before the first
row finishes, and a job that only scores has one. The time left is the work left over that rate:
the rows left at this run's start times the tokens a finished row of this run took (its prompt,
output and scored continuations), less the tokens computed so far."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class JobProgress:
    """What a progress display shows; passed to the callback as rows finish."""

    job: str
    phase: str  # "scanning" (the input), "loading" (model and adapters), "running", "done"
    rows_done: int  # rows in the output, earlier runs included
    rows_total: int | None  # None until the input is scanned; lowered as rows fail
    completion_tokens: int  # generated this run
    elapsed_s: float  # since this run's engine was ready
    adapters_resident: int
    rows_this_run: int = 0
    computed_tokens: int = 0  # tokens the engine computed this run: prefill + decode + scored
    row_tokens: int = 0  # tokens this run's finished rows took (error rows: none)


ProgressCallback = Callable[[JobProgress], None]


def tokens_per_s(event: JobProgress) -> float:
    """Tokens computed per second of this run's engine time (0 before any)."""
    return event.computed_tokens / event.elapsed_s if event.elapsed_s > 0 else 0.0


def seconds_left(event: JobProgress) -> float | None:
    """The work left over the current rate; None until a row of this run has finished (the
    tokens a row takes are not known before) or while nothing is computed."""
    rate = tokens_per_s(event)
    if event.rows_total is None or event.rows_this_run == 0 or rate <= 0:
        return None
    rows_left_at_start = event.rows_total - (event.rows_done - event.rows_this_run)
    work = rows_left_at_start * event.row_tokens / event.rows_this_run
    if event.rows_done >= event.rows_total:
        return 0.0
    return max(work - event.computed_tokens, 0.0) / rate


def clock(seconds: float | None) -> str:
    """ "0:12:34", or "-:--:--" when not known."""
    if seconds is None:
        return "-:--:--"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def progress_line(event: JobProgress) -> str:
    """ "job x: 1,234/10,000 rows (12.3%), 345.6 tok/s, 3 adapters resident, ETA 0:12:34"."""
    text = f"job {event.job}: {event.rows_done:,}"
    if event.rows_total:
        text += f"/{event.rows_total:,} rows ({100 * event.rows_done / event.rows_total:.1f}%)"
    else:
        text += " rows"
    text += f", {tokens_per_s(event):.1f} tok/s, {event.adapters_resident} adapters resident"
    left = seconds_left(event)
    return text if left is None else f"{text}, ETA {clock(left)}"
