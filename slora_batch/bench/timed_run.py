"""The clock of an engine run: requests fed until ``max_seconds``, results handed to a counter,
the engine's counters over the timed part, and the work done on the rows still running."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass

import torch

from slora_batch.engine.counters import TURN_PHASES
from slora_batch.engine.engine import Engine
from slora_batch.engine.requests.request import Request, Result
from slora_kernels.builds import BuildLog

log = logging.getLogger(__name__)

COUNTERS = (  # the engine's counters every engine row carries, over its timed run
    "steps",
    "decode_steps",
    "decode_tokens",
    "prefill_tokens",
    "preemptions",
    "adapter_loads",
    "disk_loads",  # adapter files read (ids that share a directory share one read)
    "loader_waits",  # admissions that waited for a read
    "adapter_evictions",
    "prefetch_hits",
    "prefetch_misses",
    "graph_steps",
    "host_s",
    "step_s",
    "decode_host_s",
    "decode_step_s",
    "decode_turns",
    *(f"turn_{phase}_s" for phase in TURN_PHASES),
    "prefix_hit_tokens",
    "cached_blocks",
    "block_evictions",
)
GAUGES = ("cached_blocks",)  # reported as their value at the end of the timed run, not a change


@dataclass
class Timed:
    """What ``timed_run`` measured, beside what its callback counted."""

    wall_s: float
    fed: int  # requests handed to the engine before the time limit
    errors: int  # error results
    stopped: bool  # cut at --max-seconds
    partial: list[tuple[int, int]]  # (prompt tokens computed, generated) of unfinished rows
    counters: dict[str, float]  # the engine's COUNTERS over the timed run
    builds: BuildLog  # Triton builds inside it

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV came from the prefix cache (0 where the engine counts none)."""
        hits = self.counters["prefix_hit_tokens"]
        return 0 if math.isnan(hits) else int(hits)


def timed_run(
    ctx, engine: Engine, requests: list[Request], label: str, count: Callable[[Result], None]
) -> Timed:
    """Feeds ``requests`` through ``engine`` on the clock, handing every result that is not an
    error to ``count``; with ``max_seconds`` stops feeding and stops there, and lists the work
    done on the rows still in the engine (``Timed.partial``)."""
    before = _counters(engine, live=True)
    fed, errors, stopped = [0], 0, False
    start = time.perf_counter()
    deadline = start + ctx.config.max_seconds if ctx.config.max_seconds else None
    results = engine.generate(_feed(requests, deadline, fed))
    with BuildLog() as builds:  # Triton builds inside the timed run, which they slow down
        for result in results:
            if result.finish_reason == "error":
                errors += 1
                if errors == 1:
                    log.error("%s: %s", label, result.error)
            else:
                count(result)
            if deadline is not None and time.perf_counter() >= deadline:
                stopped = True
                break
        sync(ctx.model.device)
        wall_s = time.perf_counter() - start
    partial = _partial(engine) if stopped else []
    results.close()
    delta = {k: after - (0 if k in GAUGES else before[k]) for k, after in _counters(engine).items()}
    if builds.count:
        log.info(
            "%s: %d Triton builds in the timed run, %.1f s: %s",
            label,
            builds.count,
            builds.seconds,
            ", ".join(builds.names),
        )
        for detail in builds.details:
            log.info("  built %s", detail)
    return Timed(wall_s, fed[0], errors, stopped, partial, delta, builds)


def _feed(requests: Iterable[Request], deadline: float | None, fed: list[int]) -> Iterator[Request]:
    for request in requests:
        if deadline is not None and time.perf_counter() >= deadline:
            return
        fed[0] += 1
        yield request


def _partial(engine: Engine) -> list[tuple[int, int]]:
    """(prompt tokens computed, tokens generated) of the requests still in the engine."""
    scheduler = getattr(engine, "scheduler", None)
    if scheduler is None:
        log.warning("engine has no scheduler attribute: unfinished requests are not counted")
        return []
    out = []
    for seq in [*scheduler.running, *scheduler.waiting]:
        generated = len(seq.output_ids)
        prompt = len(seq.prompt_ids) if generated else min(seq.num_computed, len(seq.prompt_ids))
        out.append((prompt, generated))
    return out


def _counters(engine: Engine, live: bool = False) -> dict[str, float]:
    """The counters the bench reads; host_s and step_s are NaN where the engine lacks them.

    ``live``: the prefix cache's own counts where the engine has one. The engine's copy catches
    up at each step, so after a stream it lacks the blocks freed at the stream's end (the
    warm-up's, read before the timed run), and keeps the blocks held at its last step (the
    timed run's ``cached_blocks``, read after it)."""
    values = asdict(engine.counters)
    cache = getattr(getattr(engine, "scheduler", None), "cache", None)
    if live and cache is not None:
        values.update(
            prefix_hit_tokens=cache.hit_tokens,
            cached_blocks=len(cache.blocks),
            block_evictions=cache.evictions,
        )
    return {k: float(values.get(k, math.nan)) for k in COUNTERS}


def sync(device: torch.device) -> None:
    """Waits for the device's queued work: the clock reads host time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
