"""What an engine is built from and what it builds on its device, alike on one device and on
each tensor-parallel rank: the adapter store and its check, the model, the page pool(s), the
residency, and the runner.

``EngineParts`` are the pieces a user never chooses: the model's tensors, the kernel backend,
the pool factory and the grammar's token table. ``Engine(...)`` takes the defaults; the
benchmark and the tests hand in others through ``engine.assemble`` (random weights, the
padded-bmm and split-pool ablations, a token table for a model without a tokenizer).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch

from slora_batch.engine.adapters.adapter_files import AdapterError
from slora_batch.engine.adapters.residency import AdapterResidency
from slora_batch.engine.adapters.store import AdapterStore
from slora_batch.engine.config import AUTO_MAX_SEQS, AUTO_MIN_SEQS, ConfigError, EngineConfig
from slora_batch.engine.device import check_fp8_settings
from slora_batch.engine.execution.memory import PoolFactory, num_pages, unified_pool
from slora_batch.engine.execution.runner import ModelRunner
from slora_batch.engine.execution.seats import auto_num_seqs, resolved
from slora_batch.engine.models.decoder import DecoderModel
from slora_batch.engine.models.loader import load_model
from slora_batch.engine.models.quant import fp8_matmul_supported
from slora_batch.engine.models.shard import RankGroup
from slora_batch.engine.models.spec import ModelSpec
from slora_batch.engine.pool import PagePool
from slora_batch.engine.resolution import backend_name
from slora_batch.engine.scheduling.kv_pages import PAGES_PER_TOKEN
from slora_kernels.fp8 import KV_GROUP


class TensorSource(Protocol):
    """A model's tensors by Hugging Face name, taken one at a time (``models.loader``): a dict,
    or an object that makes each on demand (the benchmark's random weights)."""

    def pop(self, name: str, default: Any = None) -> torch.Tensor | None: ...

    def keys(self) -> Iterable[str]: ...


@dataclass(frozen=True)
class EngineParts:
    """The pieces an engine is assembled from; the defaults are what ``Engine(...)`` builds.

    Data-parallel workers and tensor-parallel ranks are handed the same parts, pickled: a dict
    of tensors is copied to each (a source that makes tensors on demand suits best), and
    ``ops``, a module, does not pickle, so an engine of several processes keeps ``ops`` None."""

    weights: TensorSource | None = None  # None: the model directory's safetensors
    ops: ModuleType | None = None  # kernels with ``slora_kernels.ref``'s functions; None: backend
    pools: PoolFactory = unified_pool  # (KV pool, adapter pool): one pool twice, unified paging
    grammar_tokens: Any = None  # an ``xgrammar.TokenizerInfo``; None: from the model's tokenizer

    def kernels(self, backend: str, device: torch.device) -> ModuleType:
        """``ops``, else the configured backend's kernels for ``device``."""
        return self.ops or pick_backend(backend, device)


class RankSetup(RankGroup, Protocol):
    """What building a rank's parts reads of its group (``execution.tp.TensorParallel``, which
    builds them through ``build_parts``, is one): the models' ``RankGroup`` and an agreement on
    the pool's size."""

    def min_over_ranks(self, value: int) -> int: ...


@dataclass
class DeviceParts:
    store: AdapterStore
    broken: dict[str, AdapterError]  # adapters whose rows become error rows
    model: DecoderModel
    pool: PagePool  # KV cache
    lora_pool: PagePool  # adapter rows: ``pool`` itself under unified paging
    residency: AdapterResidency
    pool_spec: ModelSpec  # the spec the pages follow: the shard's under tensor parallelism
    config: EngineConfig  # the engine's, ``max_num_seqs: auto`` resolved


def build_parts(
    spec: ModelSpec,
    adapters,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    given: EngineParts,
    tp: RankSetup | None = None,
) -> DeviceParts:
    """The device side of an engine. Under tensor parallelism (``tp``) every rank calls it in
    the same order: its shard of the model and of each adapter, and the page count of the
    rank with the fewest free pages, so that rank 0's page numbers hold on every rank.
    ``max_num_seqs: auto`` resolves here, from that page count (alike on every rank); on cuda
    the pool then takes the reserve that the resolved cap leaves (more pages, never fewer).
    ``given``: the model's tensors and the pool factory."""
    check_fp8_settings(config, device)
    rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
    pool_spec = spec.shard(size)
    cuda = device.type == "cuda"
    fp8_rows = config.adapter_dtype == "fp8"
    store = AdapterStore(
        spec, adapters, config.host_cache_bytes, cuda, dtype, (rank, size), fp8=fp8_rows
    )
    _, broken = store.check_all()
    fp8 = config.weights == "fp8"
    if (fp8 or spec.quantization) and device.type == "cuda" and not fp8_matmul_supported(device):
        what = "weights: fp8" if fp8 else f"the FP8 checkpoint {spec.path!r}"
        raise ConfigError(
            f"{what} needs fp8 matmuls (compute capability >= 8.9); {device} has "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}"
        )
    model = load_model(spec, dtype, device, max_model_len, given.weights, tp, fp8)
    if config.max_num_seqs == "auto":
        adapters = [store.pages(name) for name in store.names if name not in broken]
        if config.kv_cache_dtype == "fp8":  # the pool hands out whole groups (``PagePool``)
            adapters = [-(-n // KV_GROUP) * KV_GROUP for n in adapters]
        config, pages = _auto_seats(config, pool_spec, dtype, device, max_model_len, tp, adapters)
    else:
        pages = _pages(config, pool_spec, dtype, device, max_model_len, tp)
    pool, lora_pool = given.pools(pages, pool_spec, dtype, device)
    if config.kv_cache_dtype == "fp8":  # the KV pool; adapter pages: adapter_dtype (store)
        pool.use_fp8_kv(pool_spec.num_kv_heads, pool_spec.kv_dim)
    residency = AdapterResidency(lora_pool, store, config.max_resident_adapters, device)
    return DeviceParts(store, broken, model, pool, lora_pool, residency, pool_spec, config)


def _pages(config, spec, dtype, device, max_model_len, tp, quiet: bool = False) -> int:
    pages = num_pages(config, spec, dtype, device, max_model_len, quiet)
    return tp.min_over_ranks(pages) if tp is not None else pages


def _auto_seats(config, spec, dtype, device, max_model_len, tp, adapters: list[int]):
    """``max_num_seqs: auto`` resolved, and the pool's pages at that cap: (config, pages).

    The reserve for the sampler and the CUDA graphs grows with the cap, so the pool depends on
    the rows it must hold. On cuda (the pool sized from free memory) the cap is the most rows
    whose own reserve leaves a pool that holds them; from the pool at the bound's reserve alone,
    Qwen3-30B-A3B shapes on an H100 planned 94 rows where the pool then held 373. Every
    tensor-parallel rank searches alike (each step takes the minimum over the ranks)."""
    per_token = 1 if config.kv_cache_dtype == "fp8" else PAGES_PER_TOKEN  # K and V share a page

    def fits(seats: int) -> bool:
        pages = _pages(resolved(config, seats), spec, dtype, device, max_model_len, tp, True)
        return auto_num_seqs(config, pages, per_token, adapters, max_model_len, True) >= seats

    if device.type != "cuda" or config.num_pages is not None:
        pages = _pages(config, spec, dtype, device, max_model_len, tp)
        return resolved(
            config, auto_num_seqs(config, pages, per_token, adapters, max_model_len)
        ), pages
    lo, hi = AUTO_MIN_SEQS, AUTO_MAX_SEQS  # lo runs whatever its pool holds (the floor)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    config = resolved(config, lo)
    pages = _pages(config, spec, dtype, device, max_model_len, tp)
    auto_num_seqs(config, pages, per_token, adapters, max_model_len)  # logs the plan
    return config, pages


def make_runner(
    parts: DeviceParts, ops: ModuleType, device: torch.device, max_model_len: int
) -> ModelRunner:
    """The step runner; on cuda it captures the decode CUDA graphs here, up to the resolved
    ``max_num_seqs``."""
    config = parts.config
    return ModelRunner(
        parts.model,
        parts.pool,
        parts.lora_pool,
        parts.residency,
        ops,
        device,
        config.max_num_seqs,
        max_model_len,
        use_graphs=config.cuda_graphs and getattr(ops, "CUDA_GRAPHS", False),
    )


def pick_backend(name: str, device: torch.device) -> ModuleType:
    """The kernel backend: Triton on cuda (``auto``), else the torch twins of ``slora_kernels.ref``."""
    if backend_name(name, device.type) == "triton":
        from slora_kernels import triton_ops

        return triton_ops
    from slora_kernels import ref

    return ref
