"""How a figure is written in results.md and its checks against the targets: blank or n/a
where missing."""

from __future__ import annotations

import math


def missing(x) -> bool:
    """None, or NaN (a figure a system does not have: a scoring row's output tok/s)."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def num(x: float, digits: int = 2) -> str:
    return "" if missing(x) else f"{x:.{digits}f}"


def pct(x: float) -> str:
    return "n/a" if missing(x) else f"{100 * x:.1f}%"


def brief(row: dict) -> str:
    """A run's row in one log line: its rate, wall seconds and roofline fraction."""
    if row.get("error"):
        return f"FAILED ({row['error']})"
    if "rows_per_s" in row:  # a scoring run: no output tokens
        return (
            f"{row['rows_per_s']:.2f} rows/s, {row['scored_tokens_per_s']:.1f} scored tok/s, "
            f"{row['wall_s']:.1f} s, roofline {row['roofline_fraction']:.3f}"
            f"{' (cut at the time limit)' if row['truncated'] else ''}"
        )
    return (
        f"{row['output_tokens_per_s']:.1f} output tok/s, {row['requests_per_s']:.2f} req/s, "
        f"{row['wall_s']:.1f} s, roofline {row['roofline_fraction']:.3f}"
        f"{' (cut at the time limit)' if row['truncated'] else ''}"
    )
