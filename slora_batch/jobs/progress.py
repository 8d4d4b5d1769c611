"""``JobProgress``: what a progress display is told as a job scans, loads, runs and ends. Rows
are output rows: one sample of one input row for one adapter (``samples.py``)."""

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
    elapsed_s: float  # since this run's generation started
    adapters_resident: int
    rows_this_run: int = 0


ProgressCallback = Callable[[JobProgress], None]
