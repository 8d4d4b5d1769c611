"""throughput.png: each system's throughput against the number of adapters."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from slora_batch.bench.formatting import missing

log = logging.getLogger(__name__)


@functools.cache
def _pyplot():
    """matplotlib's pyplot on the Agg backend, or None (logged once) where it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning(
            "matplotlib is not installed: no throughput.png (the table and Parquet have the figures)"
        )
        return None
    return plt


def plot(rows: list[dict], path: Path) -> None:
    """Output tokens/s against the number of adapters, one line per system (base: a level);
    beside it, where a scoring system ran, rows/s of score and peft-score the same way."""
    plt = _pyplot()
    if plt is None:
        return
    ok = [r for r in rows if not r.get("error")]
    scoring = any(not missing(r.get("rows_per_s")) for r in ok)
    panels = [("output_tokens_per_s", "output tokens / s", "throughput")]
    if scoring and all(missing(r.get("output_tokens_per_s")) for r in ok):
        panels = []  # only scoring runs
    if scoring:
        panels.append(("rows_per_s", "scored rows / s", "scoring"))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for ax, (key, label, title) in zip(axes[0], panels, strict=True):
        drawn = False
        for system in dict.fromkeys(r["system"] for r in ok):
            points = sorted(
                (r["adapters"], r[key])
                for r in ok
                if r["system"] == system and not missing(r.get(key))
            )  # a scoring row has no output tokens, a generation row no rows/s
            if not points:
                continue
            drawn = True
            if system == "base":
                ax.axhline(points[0][1], linestyle="--", color="gray", label="base (no adapters)")
            else:
                ax.plot(*zip(*points, strict=True), marker="o", label=system)
        ax.set_xscale("log")
        ax.set_yscale("log")  # peft sits one to two orders of magnitude below the engine
        ax.set_xlabel("number of adapters")
        ax.set_ylabel(label)
        ax.set_title(f"slora-batch bench: {title} against the number of adapters")
        ax.grid(True, which="both", alpha=0.3)
        if drawn:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
