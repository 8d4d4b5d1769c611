"""``JobProgress``: what a progress display is told as a job scans, loads, runs and ends, and what
it derives from it: two token rates and the time left. Rows are output rows: one sample of one
input row for one adapter (``samples.py``).

Both rates are over this run's engine time (``elapsed_s``: since the engine was ready, less
reading input and writing parts), the time ``_stats.parquet``'s ``engine_s`` holds, so the last
progress event of a run and its summary show the same numbers under the same labels
(``RATE_LABELS``):

- generated tok/s: the tokens of this run's finished rows' outputs (``completion_tokens``);
  ``_stats.parquet``'s ``tokens_per_s``;
- prefill+decode tok/s: every token the engine computed this run (prompts less prefix-cache
  hits, outputs, scored continuations; ``EngineCounters``): it moves from the first step on,
  long before the first row finishes, and a job that only scores has one.
  ``_stats.parquet``'s ``computed_tokens_per_s``.

The time left is the work left over the prefill+decode rate: the rows left at this run's start
times the tokens a finished row of this run took (its prompt, output and scored continuations),
less the tokens computed so far."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

GENERATED, COMPUTED = "generated tok/s", "prefill+decode tok/s"
RATE_LABELS = (GENERATED, COMPUTED)  # the rates' labels, in progress lines and summaries


@dataclass
class JobProgress:
    """What a progress display shows; passed to the callback as rows finish."""

    job: str
    phase: str  # "scanning" (the input), "loading" (model and adapters), "running", "done"
    rows_done: int  # rows in the output, earlier runs included
    rows_total: int | None  # None until the input is scanned; lowered as rows fail
    completion_tokens: int  # generated this run
    elapsed_s: float  # this run's engine time: since the engine was ready, less reading/writing
    adapters_resident: int
    rows_this_run: int = 0
    computed_tokens: int = 0  # tokens the engine computed this run: prefill + decode + scored
    row_tokens: int = 0  # tokens this run's finished rows took (error rows: none)


ProgressCallback = Callable[[JobProgress], None]


def per_second(tokens: int | None, seconds: float | None) -> float | None:
    """``tokens`` per second; 0 before any time has passed; None when not counted."""
    if tokens is None:
        return None
    return tokens / seconds if seconds else 0.0


def tokens_per_s(event: JobProgress) -> float:
    """Prefill+decode tokens computed per second of this run's engine time (0 before any)."""
    return per_second(event.computed_tokens, event.elapsed_s) or 0.0


def generated_per_s(event: JobProgress) -> float:
    """Generated tokens of this run's finished rows per second of its engine time."""
    return per_second(event.completion_tokens, event.elapsed_s) or 0.0


def rates_text(generated: float | None, computed: float | None) -> str:
    """ "70.2 generated tok/s, 122.6 prefill+decode tok/s (engine time)": the one wording of
    both rates, in progress lines and summaries ("-" for a rate not counted)."""
    shown = ("-" if rate is None else f"{rate:,.1f}" for rate in (generated, computed))
    rates = ", ".join(f"{value} {label}" for value, label in zip(shown, RATE_LABELS, strict=True))
    return f"{rates} (engine time)"


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
    """ "job x: 1,234/10,000 rows (12.3%), 70.2 generated tok/s, 122.6 prefill+decode tok/s
    (engine time), 3 adapters resident, ETA 0:12:34"; at the end "..., done"."""
    text = f"job {event.job}: {event.rows_done:,}"
    if event.rows_total:
        text += f"/{event.rows_total:,} rows ({100 * event.rows_done / event.rows_total:.1f}%)"
    else:
        text += " rows"
    rates = rates_text(generated_per_s(event), tokens_per_s(event))
    text += f", {rates}, {event.adapters_resident} adapters resident"
    if event.phase == "done":
        return f"{text}, done"
    left = seconds_left(event)
    return text if left is None else f"{text}, ETA {clock(left)}"
