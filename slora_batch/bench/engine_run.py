"""One timed engine run of the bench: ``slora``, ``base``, the ablations ``bmm``,
``no-unified`` and ``arrival``, and ``slora-off`` (``slora`` without the prefix cache).

The ablations are composed from engine parts handed to ``Engine`` (its ``ops`` and ``pools``
seams), never flags inside the engine: ``bmm`` swaps the backend's LoRA ops for the padded
batched matmul of ``kernels.bmm``; ``no-unified`` gives adapters a pool of their own.

``score`` (bench/score_run.py) runs the scoring workload through the same pieces: a fresh
engine (``open_bench_engine``), the warm-up groups (``warm_up``), the clock (``timed_run``) and
the row's common fields (``engine_row``, ``step_fields``, ``build_counts``). The prefix
cache's systems (bench/prefix_run.py) hand ``run_engine`` requests of their own."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import ModuleType

import torch

from kernels.builds import BuildLog
from slora_batch.bench.roofline import Work
from slora_batch.bench.workload import RandomWeights, adapter_sources
from slora_batch.engine.adapters import AdapterStore
from slora_batch.engine.config import EngineConfig, SamplingConfig
from slora_batch.engine.data_parallel import open_engine
from slora_batch.engine.engine import Engine, pick_backend
from slora_batch.engine.pool import PagePool
from slora_batch.engine.request import Request, Result
from slora_batch.jobs.ordering import sort_key

log = logging.getLogger(__name__)

ENGINE_SYSTEMS = ("slora", "base", "bmm", "no-unified", "arrival", "slora-off")  # base: no adapters
ABLATIONS = ("bmm", "no-unified", "arrival")  # slora with one thing changed
ADAPTER_POOL_FRACTION = 0.25  # no-unified: the adapters' share of the pages, KV the rest
CACHE_OFF = ("slora-off", "prefix-off")  # EngineConfig(prefix_caching=False); others: on


def bmm_ops(ops: ModuleType) -> ModuleType:
    """The backend ``ops`` with its LoRA ops replaced by the padded-bmm ablation; no CUDA
    graphs (its per-step copies allocate)."""
    from kernels import bmm

    mixed = ModuleType(f"{ops.__name__}+bmm")
    mixed.__dict__.update({k: v for k, v in vars(ops).items() if not k.startswith("__")})
    mixed.lora_shrink, mixed.lora_expand = bmm.lora_shrink, bmm.lora_expand
    mixed.CUDA_GRAPHS = False
    return mixed


def separate_pools(
    pages: int, spec, dtype: torch.dtype, device: torch.device
) -> tuple[PagePool, PagePool]:
    """The no-unified ablation's pools: KV cache and adapters apart, a fixed split of pages."""
    adapter_pages = max(1, int(pages * ADAPTER_POOL_FRACTION))
    kv = PagePool(pages - adapter_pages, spec.page_size, spec.num_layers, dtype, device)
    return kv, PagePool(adapter_pages, spec.page_size, spec.num_layers, dtype, device)


def engine_parts(system: str, backend: str, device: torch.device) -> dict:
    """The ``ops`` and ``pools`` an ablation hands to ``Engine`` (none for the others)."""
    if system == "bmm":
        return {"ops": bmm_ops(pick_backend(backend, device))}
    if system == "no-unified":
        return {"pools": separate_pools}
    return {}


# Systems fed the workload in its generated order. The others get it grouped by adapter, the
# clustering that `slora-batch run` gives its rows by sorting them (ordering.sort_key: adapter,
# then prompt length) before they reach the engine; see group_by_adapter.
ARRIVAL_ORDER = ("arrival",)
WARMUP_PROMPT = 64  # warm-up requests: prompts cut to this, a few new tokens each
WARMUP_NEW_TOKENS = 8
COUNTERS = (
    "steps",
    "decode_steps",
    "decode_tokens",
    "prefill_tokens",
    "preemptions",
    "adapter_loads",
    "adapter_evictions",
    "prefetch_hits",
    "prefetch_misses",
    "graph_steps",
    "host_s",
    "step_s",
    "decode_host_s",
    "decode_step_s",
    "prefix_hit_tokens",
    "cached_blocks",
    "block_evictions",
)
GAUGES = ("cached_blocks",)  # reported as their value at the end of the timed run, not a change


def run_engine(ctx, system: str, n: int, requests: list[Request] | None = None) -> dict:
    """Builds an engine on the shared weights, warms it up, then times ``requests`` (in their
    order) through it; None: the workload, grouped by adapter unless ``system`` keeps arrival
    order. A request of n samples counts as n requests.

    With ``max_seconds`` the run stops feeding requests and stops at the limit; the work counted
    is every token computed by then: finished requests plus the done part of running ones. The
    prompt tokens that came from the prefix cache count in the rows' prompt tokens and not in the
    FLOPs of the roofline floor.
    """
    engine, sources, setup = open_bench_engine(ctx, system, n)
    if requests is None:
        requests = ctx.workload.requests(0 if system.startswith("base") else n)
        if system not in ARRIVAL_ORDER:
            requests = group_by_adapter(requests)
    warmup_builds = warm_up(ctx, engine, requests, sources)
    setup_s = time.perf_counter() - setup
    asked = {r.id: r.max_new_tokens for r in requests}
    outputs = sum(r.n or 1 for r in requests)
    work, finished, mismatches = Work(), 0, 0

    def count(result: Result) -> None:
        nonlocal finished, mismatches
        finished += 1
        mismatches += result.completion_tokens != asked[result.id]
        work.add(result.prompt_tokens, result.completion_tokens)

    timed = timed_run(ctx, engine, requests, f"{system}@{n}", count)
    for prompt, generated in timed.partial:
        work.add(prompt, generated)
    hits = timed.counters["prefix_hit_tokens"]
    work.cached_tokens = 0 if math.isnan(hits) else int(hits)
    if system.endswith("-par"):
        engine.close()
    del engine
    row = engine_row(ctx, system, n, len(requests), finished, mismatches, setup_s, timed)
    if outputs != len(requests):  # requests of n samples: a result per sample
        row.update(prompts=len(requests), requests=outputs)
    cuda = ctx.model.device.type == "cuda"
    devices = row["tensor_parallel"] * row["data_parallel"] if cuda else 1
    row.update(figures(ctx, work, finished, timed.wall_s, devices))
    row.update(step_fields(timed))
    row.update(build_counts(warmup_builds, timed.builds))
    return row


def open_bench_engine(ctx, system: str, n: int) -> tuple[Engine, dict[str, Path], float]:
    """A fresh engine on the shared weights for one run, its adapter sources and the time its
    setup started (after resetting the peak-memory counter): the -par systems at the
    configured layout (``open_engine``), the others on the bench's device with their parts."""
    cfg, model = ctx.config, ctx.model
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(model.device)
    start = time.perf_counter()
    sources = adapter_sources(n, ctx.rank_dirs) if n else {}
    dtype = str(model.dtype).removeprefix("torch.")
    caching = system not in CACHE_OFF
    if system.endswith("-par"):  # base or slora at the configured layout
        config = EngineConfig(
            device="cuda" if cuda else "cpu",
            backend=cfg.backend,
            dtype=dtype,
            tensor_parallel=cfg.tensor_parallel,
            data_parallel=cfg.data_parallel,
            prefix_caching=caching,
        )
        weights = model.weights
        if isinstance(weights, dict):  # transformers' tensors do not travel: make them there
            weights = RandomWeights(model.spec, cfg.seed, model.dtype)
        engine = open_engine(model.model_dir, sources, config, SamplingConfig(ignore_eos=True),
                             weights)  # fmt: skip
    else:
        engine = Engine(
            model.model_dir,
            adapters=sources,
            config=EngineConfig(
                device=str(model.device), backend=cfg.backend, dtype=dtype, prefix_caching=caching
            ),
            sampling=SamplingConfig(ignore_eos=True),
            weights=model.weights,
            **engine_parts(system, cfg.backend, model.device),
        )
    return engine, sources, start


def warm_up(ctx, engine: Engine, requests: list[Request], sources: dict[str, Path]) -> BuildLog:
    """The untimed warm-up groups of ``requests`` through ``engine`` (see ``warmup_groups``);
    returns the Triton builds it made."""
    store = AdapterStore(ctx.model.spec, sources)  # the adapters' ranks, for the groups
    with BuildLog() as builds:
        for group, whole in warmup_groups(requests, store, ctx.config.warmup_requests):
            for _ in engine.generate(_warmup(group, whole)):
                pass
        _sync(ctx.model.device)
    return builds


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
        _sync(ctx.model.device)
        wall_s = time.perf_counter() - start
    partial = _partial(engine) if stopped else []
    results.close()
    delta = {k: after - (0 if k in GAUGES else before[k]) for k, after in _counters(engine).items()}
    if builds.count:
        log.info("%s: %d Triton builds in the timed run, %.1f s: %s", label, builds.count,
                 builds.seconds, ", ".join(builds.names))  # fmt: skip
        for detail in builds.details:
            log.info("  built %s", detail)
    return Timed(wall_s, fed[0], errors, stopped, partial, delta, builds)


def engine_row(
    ctx, system: str, n: int, requests: int, finished: int, mismatches: int, setup_s: float,
    timed: Timed,
) -> dict:  # fmt: skip
    """The first fields of every engine run's row, whatever its workload."""
    cfg, parallel = ctx.config, system.endswith("-par")
    return dict(
        system=system,
        adapters=n,
        requests=requests,
        fed=timed.fed,
        finished=finished,
        error_rows=timed.errors,
        length_mismatches=mismatches,
        truncated=timed.stopped or timed.fed < requests,
        setup_s=setup_s,
        peak_mem_gib=_peak_gib(ctx.model.device),
        tensor_parallel=cfg.tensor_parallel if parallel else 1,
        data_parallel=cfg.data_parallel if parallel else 1,
    )


def step_fields(timed: Timed) -> dict[str, float]:
    """The engine's counters over the timed run, its host shares and mean decode batch."""
    delta = timed.counters
    steps = delta["steps"]
    return dict(
        delta,
        host_share=_share(delta["host_s"], delta["step_s"]),
        decode_host_share=_share(delta["decode_host_s"], delta["decode_step_s"]),
        decode_batch=delta["decode_tokens"] / steps if steps else math.nan,
    )


def figures(ctx, work: Work, finished: int, wall_s: float, devices: int = 1) -> dict:
    """The rates and the roofline fraction of a run that did ``work`` in ``wall_s`` seconds
    (on ``devices`` cards like the one measured: their floor is 1/devices of one card's)."""
    model = ctx.model
    floor_s = work.floor_seconds(model.num_params, model.kv_bytes_per_token, ctx.rates) / devices
    return dict(
        prompt_tokens=work.prompt_tokens,
        output_tokens=work.output_tokens,
        wall_s=wall_s,
        requests_per_s=finished / wall_s,
        output_tokens_per_s=work.output_tokens / wall_s,
        flops=work.flops(model.num_params),
        kv_bytes=work.kv_bytes(model.kv_bytes_per_token),
        floor_s=floor_s,
        roofline_fraction=floor_s / wall_s,
    )


def group_by_adapter(requests: list[Request]) -> list[Request]:
    """The requests stably sorted by adapter (base-model rows first), arrival order within an
    adapter: the job's sort without its second key, prompt length, so that a run cut at its time
    limit still sees the workload's mix of lengths. Example: adapters [b, a, None, b] -> [None, a,
    b, b], the two b rows in their order."""
    return sorted(requests, key=lambda r: sort_key(r)[:3])  # (kind, has adapter, adapter)


def warmup_groups(requests: list[Request], store, count: int) -> list[tuple[list[Request], bool]]:
    """The untimed warm-up, one engine.generate per group, each (requests, whole prompts; else
    cut to WARMUP_PROMPT): for each adapter rank in the workload its first request alone and its
    first 8 together, cut, and its first ``count`` whole; then the first 8 of every rank
    together, whole; then the workload's first ``count``, cut and whole.

    Triton builds a kernel per block shape, and the shapes of a step without CUDA graph follow
    its largest rank and its size (a prefill of thousands of tokens needs no split reduction;
    attention's prefill blocks follow the context). Grouped by adapter, the first requests may
    all share one rank (10 adapters: the first 200 are rank 8), and short prompts reach no long
    context, so without these groups those builds would land inside the timed run (the bench
    counts them: kernel_builds). Example: ranks 8 and 16 -> [r8 first], [r16 first], [r8 first
    8], [r16 first 8], [r8 first count, whole], [r16 first count, whole], [r8 and r16 first 8,
    whole], [first count], [first count, whole]. No warm-up when count is 0."""
    if count == 0:
        return []
    by_rank: dict[int, list[Request]] = {}
    for request in requests:
        if request.adapter is not None:
            by_rank.setdefault(store.info(request.adapter).rank, []).append(request)
    ranks = sorted(by_rank)
    groups = [(by_rank[rank][:1], False) for rank in ranks]
    groups += [(by_rank[rank][:8], False) for rank in ranks]
    groups += [(by_rank[rank][:count], True) for rank in ranks]
    if len(ranks) > 1:
        groups.append(([r for rank in ranks for r in by_rank[rank][:8]], True))
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
        out.append(Request(id=f"warmup-{r.id}", adapter=r.adapter, prompt_token_ids=prompt,
                           max_new_tokens=WARMUP_NEW_TOKENS, ignore_eos=True,
                           temperature=r.temperature or 0.0, n=r.n))  # fmt: skip
    return out


def _feed(requests: Iterable[Request], deadline: float | None, fed: list[int]) -> Iterator[Request]:
    for request in requests:
        if deadline is not None and time.perf_counter() >= deadline:
            return
        fed[0] += 1
        yield request


def build_counts(warmup: BuildLog, timed: BuildLog) -> dict[str, float]:
    """Triton builds in the warm-up and in the timed run (NaN where Triton has no JIT hooks)."""
    if not timed.available:
        return dict.fromkeys(("warmup_builds", "kernel_builds", "kernel_build_s"), math.nan)
    return dict(warmup_builds=warmup.count, kernel_builds=timed.count,
                kernel_build_s=timed.seconds)  # fmt: skip


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
        values.update(prefix_hit_tokens=cache.hit_tokens, cached_blocks=len(cache.blocks),
                      block_evictions=cache.evictions)  # fmt: skip
    return {k: float(values.get(k, math.nan)) for k in COUNTERS}


def _share(part: float, whole: float) -> float:
    """part / whole; NaN where the engine lacks the counters or ran no such step."""
    return part / whole if whole > 0 else math.nan


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device: torch.device) -> float:
    if device.type != "cuda":
        return math.nan
    return torch.cuda.max_memory_allocated(device) / 2**30
