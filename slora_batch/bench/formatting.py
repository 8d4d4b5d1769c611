"""How a figure is written in results.md and its acceptance lines: blank or n/a where missing."""

from __future__ import annotations

import math


def missing(x) -> bool:
    """None, or NaN (a figure a system does not have: a scoring row's output tok/s)."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def num(x: float, digits: int = 2) -> str:
    return "" if missing(x) else f"{x:.{digits}f}"


def pct(x: float) -> str:
    return "n/a" if missing(x) else f"{100 * x:.1f}%"
