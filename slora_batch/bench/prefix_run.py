"""The prefix cache's systems, each ``run_engine`` on requests of its own (benchmarks/README.md).

- ``prefix`` / ``prefix-off``: the shared-prefix rows (``workload.PrefixWorkload``) with the
  cache on / off, in the order ``slora-batch run`` gives them (``ordering.sort_key``: by
  adapter, then by prompt), so an adapter's rows run one after another.
- ``samples`` / ``samples-separate``: ``samples_prompts`` prompts of the standard workload's
  shapes, each one request of ``samples_n`` samples at temperature 1, against the same prompts
  as ``samples_n`` separate requests each (ids of their own, so noise of their own); both
  grouped by adapter, a prompt's copies next to each other. Each sample is one result.

``slora-off`` (the standard workload with the cache off) is plain ``run_engine``.
"""

from __future__ import annotations

from dataclasses import replace

from slora_batch.bench.engine_run import run_engine
from slora_batch.bench.workload import group_by_adapter
from slora_batch.engine.requests.request import Request
from slora_batch.jobs.ordering import sort_key

PREFIX_ROWS = ("prefix", "prefix-off")
SAMPLES = ("samples", "samples-separate")
SAMPLE_TEMPERATURE = 1.0


def run_prefix(ctx, system: str, n: int) -> dict:
    requests = sorted(ctx.prefix_workload.requests(n), key=sort_key)
    return run_engine(ctx, system, n, requests)


def run_samples(ctx, system: str, n: int) -> dict:
    k = ctx.config.samples_n
    prompts = ctx.samples_workload.requests(n)
    requests = sample_requests(prompts, k, separate=system == "samples-separate")
    row = run_engine(ctx, system, n, group_by_adapter(requests))
    row["samples_n"] = k
    return row


def sample_requests(prompts: list[Request], k: int, separate: bool) -> list[Request]:
    """Each prompt as one request of ``k`` samples, or as ``k`` requests; all at temperature 1.

    Example: k 3, prompts of ids 0 and 1 -> two requests with n 3 (ids 0, 1); separate: ids 0,
    1, 2 (prompt 0), then 3, 4, 5 (prompt 1)."""
    if not separate:
        return [replace(r, n=k, temperature=SAMPLE_TEMPERATURE) for r in prompts]
    return [
        replace(r, id=r.id * k + j, temperature=SAMPLE_TEMPERATURE)
        for r in prompts
        for j in range(k)
    ]
