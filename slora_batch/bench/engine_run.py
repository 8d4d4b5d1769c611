"""One timed engine run of the bench: ``slora``, ``base``, the ablations ``bmm``,
``no-unified`` and ``arrival``, ``slora-off`` (``slora`` without the prefix cache), and
``slora-dora`` (``slora``'s requests and adapter ids, one id in four a DoRA adapter of its rank:
``workload.is_dora``) and ``slora-fp8a`` (``slora`` with its adapters' A and B rows stored in
e4m3, ``adapter_dtype: fp8``).

The ablations are composed from engine parts (``EngineParts``: its ``ops`` and ``pools``) handed
to ``engine.assemble``, never flags inside the engine: ``bmm`` swaps the backend's LoRA ops for
the padded batched matmul of ``slora_kernels.bmm``; ``no-unified`` gives adapters a pool of
their own.

A run is the same pieces for every engine system: a fresh engine (``open_bench_engine``), the
untimed warm-up (bench/warmup.py), the clock (bench/timed_run.py) and the row's fields
(bench/row_fields.py); ``score`` (bench/score_run.py) puts them together on the scoring rows.
The prefix cache's systems (bench/prefix_run.py) hand ``run_engine`` requests of their own."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import ModuleType

import torch

from slora_batch.bench.floor import Routing, trace_steps
from slora_batch.bench.json_run import free_requests, grammar_tokens, json_requests
from slora_batch.bench.model import RandomWeights
from slora_batch.bench.roofline import Work
from slora_batch.bench.row_fields import (
    build_counts,
    engine_row,
    figures,
    floor_fields,
    step_fields,
)
from slora_batch.bench.timed_run import timed_run
from slora_batch.bench.warmup import warm_up
from slora_batch.bench.workload import adapter_sources, group_by_adapter
from slora_batch.engine.config import EngineConfig, SamplingConfig
from slora_batch.engine.engine import Engine, assemble
from slora_batch.engine.execution.parts import EngineParts, pick_backend
from slora_batch.engine.parallel.data_parallel import open_engine
from slora_batch.engine.pool import PagePool
from slora_batch.engine.requests.request import Request, Result

ENGINE_SYSTEMS = (
    "slora",
    "base",
    "bmm",
    "no-unified",
    "arrival",
    "slora-off",
    "slora-dora",
    "slora-fp8a",
)
DORA_SYSTEMS = ("slora-dora",)  # slora with one adapter id in four DoRA (workload.is_dora)
FP8_ADAPTER_SYSTEMS = ("slora-fp8a",)  # slora with adapter_dtype: fp8
ABLATIONS = ("bmm", "no-unified", "arrival")  # slora with one thing changed
ADAPTER_POOL_FRACTION = 0.25  # no-unified: the adapters' share of the pages, KV the rest
CACHE_OFF = ("slora-off", "prefix-off")  # EngineConfig(prefix_caching=False); others: on
# Systems fed the workload in its generated order. The others get it grouped by adapter, the
# clustering that `slora-batch run` gives its rows by sorting them (ordering.sort_key: adapter,
# then prompt length) before they reach the engine; see group_by_adapter.
ARRIVAL_ORDER = ("arrival",)


def bmm_ops(ops: ModuleType) -> ModuleType:
    """The backend ``ops`` with its LoRA ops replaced by the padded-bmm ablation; no CUDA
    graphs (its per-step copies allocate)."""
    from slora_kernels import bmm

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


def engine_parts(system: str, backend: str, device: torch.device) -> EngineParts:
    """The parts an ablation swaps, ``ops`` or ``pools``; the defaults for the other systems."""
    if system == "bmm":
        return EngineParts(ops=bmm_ops(pick_backend(backend, device)))
    if system == "no-unified":
        return EngineParts(pools=separate_pools)
    return EngineParts()


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
        requests = workload_requests(ctx, system, n)
    dora = dora_ids(engine, sources)
    warmup_builds = warm_up(ctx, engine, requests, sources)
    traced = hasattr(engine, "_launch")  # the timed steps (not a data-parallel driver's)
    trace = trace_steps(engine, Routing.of(ctx.model.spec)) if traced else None
    setup_s = time.perf_counter() - setup
    asked = {r.id: r.max_new_tokens for r in requests}
    outputs = sum(r.n or 1 for r in requests)
    work, finished, mismatches, dora_rows = Work(), 0, 0, 0
    produced: dict[int, int] = {}

    def count(result: Result) -> None:
        nonlocal finished, mismatches, dora_rows
        finished += 1
        dora_rows += result.adapter in dora
        mismatches += result.completion_tokens != asked[result.id]
        produced[result.id] = result.completion_tokens
        work.add(result.prompt_tokens, result.completion_tokens)

    timed = timed_run(ctx, engine, requests, f"{system}@{n}", count)
    for prompt, generated in timed.partial:
        work.add(prompt, generated)
    if system == "json" and not timed.partial:  # json-free's lengths: only from a whole run
        ctx.json_lengths[n] = produced
    work.cached_tokens = timed.cached_tokens
    grammar = {k: getattr(engine.counters, k, 0) for k in ("grammar_rows", "grammar_mask_s")}
    max_seqs = engine.counters.max_num_seqs  # max_num_seqs: auto resolved
    if system.endswith("-par"):
        engine.close()
    del engine
    row = engine_row(ctx, system, n, len(requests), finished, mismatches, setup_s, timed)
    if outputs != len(requests):  # requests of n samples: a result per sample
        row.update(prompts=len(requests), requests=outputs)
    cuda = ctx.model.device.type == "cuda"
    devices = row["tensor_parallel"] * row["data_parallel"] if cuda else 1
    row.update(figures(ctx, work, finished, timed.wall_s, devices))
    row.update(floor_fields(ctx, trace, timed.wall_s, devices))
    row.update(step_fields(timed), max_num_seqs=max_seqs)
    row.update(build_counts(warmup_builds, timed.builds))
    if grammar["grammar_rows"]:  # the json system: constrained draws and their host mask time
        row.update(grammar)
    if dora:  # slora-dora: the ids the engine runs as DoRA, and their finished rows
        row.update(dora_adapters=len(dora), dora_rows=dora_rows)
    return row


def workload_requests(ctx, system: str, n: int) -> list[Request]:
    """The standard workload at n adapters (none for base), grouped by adapter unless ``system``
    keeps arrival order; json's under its schema, json-free's at the lengths json produced."""
    requests = ctx.workload.requests(0 if system.startswith("base") else n)
    if system not in ARRIVAL_ORDER:
        requests = group_by_adapter(requests)
    if system in ("json", "json-free"):
        requests = json_requests(requests)
    if system == "json-free":  # json's requests at the lengths json produced, unconstrained
        if n not in ctx.json_lengths:
            raise ValueError(f"json-free@{n} needs json@{n} to run first (add json)")
        requests = free_requests(requests, ctx.json_lengths[n])
    return requests


def run_sources(ctx, system: str, n: int) -> dict[str, Path]:
    """The adapter id -> directory map of a run at n adapters: the rank directories, and for
    the DORA_SYSTEMS the DoRA directories for the ids ``workload.is_dora`` names."""
    dora_dirs = ctx.dora_dirs if system in DORA_SYSTEMS else None
    return adapter_sources(n, ctx.rank_dirs, dora_dirs)


def dora_ids(engine: Engine, sources: dict[str, Path]) -> set[str]:
    """The ids of ``sources`` that the engine parsed as DoRA adapters (``AdapterInfo.dora``);
    none where the engine has no store of its own (a data-parallel driver) or it refused them."""
    store = getattr(engine, "store", None)
    if store is None:
        return set()
    return {name for name in sources if name in store and store.info(name).dora}


def open_bench_engine(ctx, system: str, n: int) -> tuple[Engine, dict[str, Path], float]:
    """A fresh engine on the shared weights for one run, its adapter sources and the time its
    setup started (after resetting the peak-memory counter): the -par systems at the
    configured layout (``open_engine``), the others on the bench's device with their parts."""
    cfg, model = ctx.config, ctx.model
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(model.device)
    start = time.perf_counter()
    sources = run_sources(ctx, system, n)
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
            max_num_seqs=cfg.max_num_seqs,
            kv_cache_dtype=cfg.kv_cache_dtype,
            weights=cfg.weights,
            max_adapters_per_batch=cfg.max_adapters_per_batch,
        )
        weights = model.weights
        if isinstance(weights, dict):  # transformers' tensors do not travel: make them there
            weights = RandomWeights(model.spec, cfg.seed, model.dtype)
        engine = open_engine(
            model.model_dir, sources, config, SamplingConfig(ignore_eos=True), EngineParts(weights)
        )
    else:
        parts = dataclasses.replace(
            engine_parts(system, cfg.backend, model.device),
            weights=model.weights,
            grammar_tokens=grammar_tokens(model.spec.vocab_size) if system == "json" else None,
        )
        engine = assemble(
            model.model_dir,
            sources,
            EngineConfig(
                device=str(model.device),
                backend=cfg.backend,
                dtype=dtype,
                prefix_caching=caching,
                max_num_seqs=cfg.max_num_seqs,
                kv_cache_dtype=cfg.kv_cache_dtype,
                weights=cfg.weights,
                max_adapters_per_batch=cfg.max_adapters_per_batch,
                adapter_dtype="fp8" if system in FP8_ADAPTER_SYSTEMS else "auto",
            ),
            SamplingConfig(ignore_eos=True),
            parts,
        )
    return engine, sources, start
