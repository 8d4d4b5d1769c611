"""The ``score`` system: the engine on the scoring workload (``workload.ScoreWorkload``).

Each row is a context and its choices; the engine runs one prefill-only sequence per choice in
its continuous batches and joins them into one result (``engine/requests/scoring.py``). The run is
``run_engine``'s: a fresh engine, the untimed warm-up groups on the first scoring rows (cut
contexts, then whole), then the rows grouped by adapter on the clock.

The figures: ``rows_per_s`` (= ``requests_per_s``), finished rows over wall seconds; and
``scored_tokens_per_s``, tokens computed over wall seconds: per row its context once per
choice and every choice, plus, in a run cut at ``max_seconds``, the computed part of the
sequences still in the engine. The roofline floor counts those tokens' FLOPs (no decode, so no
KV reads). No tokens are generated: ``output_tokens_per_s`` is NaN.
"""

from __future__ import annotations

import math
import time

from slora_batch.bench.engine_run import open_bench_engine
from slora_batch.bench.roofline import Work
from slora_batch.bench.row_fields import build_counts, engine_row, figures, step_fields
from slora_batch.bench.timed_run import timed_run
from slora_batch.bench.warmup import warm_up
from slora_batch.bench.workload import group_by_adapter
from slora_batch.engine.requests.request import Result


def computed_tokens(result: Result) -> int:
    """A scored row's fed tokens: its context once per choice, then every choice but its last
    token, which is never fed (a row of one continuation: the context and the continuation)."""
    if result.choice_tokens is None:
        return result.prompt_tokens + (result.continuation_tokens or 0) - 1
    choices = len(result.choice_tokens)
    return choices * (result.prompt_tokens - 1) + sum(result.choice_tokens)


def run_score(ctx, n: int, requests: list | None = None, system: str = "score") -> dict:
    """``system``'s row: ``requests`` (None: the scoring workload at ``n`` adapters) grouped
    by adapter through a fresh engine, timed (``eval-score`` hands in an lm-eval sweep's)."""
    engine, sources, setup = open_bench_engine(ctx, system, n)
    requests = group_by_adapter(ctx.score_workload.requests(n) if requests is None else requests)
    warmup_builds = warm_up(ctx, engine, requests, sources)
    setup_s = time.perf_counter() - setup
    work, finished = Work(), 0

    def count(result: Result) -> None:
        nonlocal finished
        finished += 1
        work.add(computed_tokens(result), 0)

    timed = timed_run(ctx, engine, requests, f"{system}@{n}", count)
    for computed, _ in timed.partial:  # generated is 0: nothing is drawn
        work.add(computed, 0)
    work.cached_tokens = timed.cached_tokens  # the contexts the choices after the first shared
    del engine
    row = engine_row(ctx, system, n, len(requests), finished, 0, setup_s, timed)
    row.update(figures(ctx, work, finished, timed.wall_s))
    row.update(
        output_tokens_per_s=math.nan,
        rows_per_s=row["requests_per_s"],
        scored_tokens=work.prompt_tokens,
        scored_tokens_per_s=work.prompt_tokens / timed.wall_s,
    )
    row.update(step_fields(timed))
    steps = timed.counters["steps"]
    tokens = timed.counters["prefill_tokens"] + timed.counters["decode_tokens"]
    row.update(
        decode_batch=math.nan,  # no decode: a one-token chunk of a choice is no decode step
        step_tokens=tokens / steps if steps else math.nan,
    )
    row.update(build_counts(warmup_builds, timed.builds))
    return row
