"""The untimed warm-up before an engine run's clock starts: groups of the run's own requests
that make Triton build, and CUDA graphs capture, every shape the timed run will meet."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from slora_batch.bench.timed_run import sync
from slora_batch.engine.adapters.store import AdapterStore
from slora_batch.engine.engine import Engine
from slora_batch.engine.requests.request import Request
from slora_kernels.builds import BuildLog

WARMUP_PROMPT = 64  # warm-up requests: prompts cut to this, a few new tokens each
WARMUP_NEW_TOKENS = 8


def warm_up(ctx, engine: Engine, requests: list[Request], sources: dict[str, Path]) -> BuildLog:
    """The untimed warm-up groups of ``requests`` through ``engine`` (see ``warmup_groups``);
    returns the Triton builds it made."""
    store = AdapterStore(ctx.model.spec, sources)  # the adapters' ranks, for the groups
    with BuildLog() as builds:
        for group, whole in warmup_groups(requests, store, ctx.config.warmup_requests):
            for _ in engine.generate(_warmup(group, whole)):
                pass
        sync(ctx.model.device)
    return builds


def warmup_groups(requests: list[Request], store, count: int) -> list[tuple[list[Request], bool]]:
    """The untimed warm-up, one engine.generate per group, each (requests, whole prompts; else
    cut to WARMUP_PROMPT): for each adapter kind in the workload (its rank, and whether it is
    DoRA) its first request alone and its first 8 together, cut, and its first ``count`` whole;
    then the first 8 of every kind together, whole; then the workload's first ``count``, cut and
    whole.

    Triton builds a kernel per block shape, and the shapes of a step without CUDA graph follow
    its largest rank and its size (a prefill of thousands of tokens needs no split reduction;
    attention's prefill blocks follow the context), and whether some adapter of the step has
    vector rows (DoRA's: ``LoraMeta.has_vectors``). Grouped by adapter, the first requests may
    all share one rank (10 adapters: the first 200 are rank 8), and short prompts reach no long
    context, so without these groups those builds would land inside the timed run (the bench
    counts them: kernel_builds). Example: ranks 8 and 16 -> [r8 first], [r16 first], [r8 first
    8], [r16 first 8], [r8 first count, whole], [r16 first count, whole], [r8 and r16 first 8,
    whole], [first count], [first count, whole]; with DoRA adapters of rank 8 beside plain ones,
    rank 8 plain and rank 8 DoRA are two kinds. No warm-up when count is 0."""
    if count == 0:
        return []
    by_kind: dict[tuple[int, bool], list[Request]] = {}
    for request in requests:
        if request.adapter is not None:
            info = store.info(request.adapter)
            by_kind.setdefault((info.rank, info.dora), []).append(request)
    kinds = sorted(by_kind)
    groups = [(by_kind[kind][:1], False) for kind in kinds]
    groups += [(by_kind[kind][:8], False) for kind in kinds]
    groups += [(by_kind[kind][:count], True) for kind in kinds]
    if len(kinds) > 1:
        groups.append(([r for kind in kinds for r in by_kind[kind][:8]], True))
    return groups + [(requests[:count], False), (requests[:count], True)]


def _warmup(requests: list[Request], whole: bool) -> list[Request]:
    """Warm-up copies of ``requests``: a generated row makes WARMUP_NEW_TOKENS tokens (its
    samples and temperature kept), a scored row stays scored (its choices whole); cut prompts
    keep their first WARMUP_PROMPT tokens."""
    out = []
    for r in requests:
        prompt = r.prompt_token_ids if whole else r.prompt_token_ids[:WARMUP_PROMPT]
        if r.scored:
            out.append(replace(r, id=f"warmup-{r.id}", prompt_token_ids=prompt))
            continue
        out.append(
            Request(
                id=f"warmup-{r.id}",
                adapter=r.adapter,
                prompt_token_ids=prompt,
                max_new_tokens=WARMUP_NEW_TOKENS,
                ignore_eos=True,
                temperature=r.temperature or 0.0,
                n=r.n,
            )
        )
    return out
