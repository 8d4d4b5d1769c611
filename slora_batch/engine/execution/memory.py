"""How much of the device an engine's page pool takes.

The pool gets what is left of the device after the weights, minus a reserve for one step's
temporaries at the configured limits (``reserve_bytes``; under ``max_num_seqs: auto``, at the
cap it resolves to: ``parts._auto_seats``), times ``memory_fraction``. Memory the caching
allocator holds but no tensor uses (an earlier engine's pool, say) counts as free: the allocator
hands it out before asking CUDA for more.

An engine that cannot fit fails before it allocates (``min_engine_bytes`` against
``device_memory``), or, where the estimate passed and CUDA still ran out, with the same
``DeviceMemoryError`` (``live_engines`` names the engines of this process that hold the device).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

import torch

from slora_batch.engine.config import AUTO_MIN_SEQS, EngineConfig
from slora_batch.engine.models.spec import ModelSpec
from slora_batch.engine.pool import PagePool

log = logging.getLogger(__name__)

GIB = 2**30
MIN_PAGES = 64  # the smallest pool an engine starts with


class DeviceMemoryError(torch.cuda.OutOfMemoryError):
    """An engine does not fit in its device's memory. An ``OutOfMemoryError``, so that code
    that catches CUDA's catches it too; its message names what holds the memory."""


# (pages, spec, dtype, device) -> (KV pool, adapter pool). The engine's default returns one pool
# twice: S-LoRA's unified paging. The bench's no-unified ablation hands in a factory of two.
PoolFactory = Callable[[int, ModelSpec, torch.dtype, torch.device], tuple[PagePool, PagePool]]


def unified_pool(
    pages: int, spec: ModelSpec, dtype: torch.dtype, device: torch.device
) -> tuple[PagePool, PagePool]:
    """One pool for KV cache and adapter weights alike."""
    pool = PagePool(pages, spec.page_size, spec.num_layers, dtype, device)
    return pool, pool


def page_bytes(spec: ModelSpec, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one page over every layer, with an fp8 KV cache its row of the scale table
    (``PagePool.use_fp8_kv``: 2 * kv_heads fp32)."""
    scales = 2 * spec.num_kv_heads * 4 if kv_cache_dtype == "fp8" else 0
    return spec.num_layers * (spec.page_size * torch.finfo(dtype).bits // 8 + scales)


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of ``device`` for a new engine's tensors, None where nothing is
    counted (the CPU). Free counts the caching allocator's unused blocks (a closed engine's)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), total


def allocated_bytes(device: torch.device) -> int | None:
    """Bytes the tensors of this process take on ``device``; None where nothing is counted."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def weight_bytes(spec: ModelSpec, dtype: torch.dtype, fp8: bool = False) -> int:
    """Bytes of the model's weights on one device (``spec``: a rank's shard under tensor
    parallelism): the projections (in fp8, one byte an element), the embeddings and an untied
    LM head (a rank's share of its rows). Norms and biases are left out: a lower bound."""
    elt = torch.finfo(dtype).bits // 8
    h = spec.hidden_size
    projection_elt = 1 if fp8 or spec.quantization else elt
    embed = spec.vocab_size * h * elt
    head = 0 if spec.tie_word_embeddings else embed // spec.tp_size
    return spec.projection_params * projection_elt + embed + head


def min_engine_bytes(
    config: EngineConfig,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> int:
    """The least an engine takes on ``device`` beside its weights. A pool sized from free
    memory (``num_pages``) needs the step's reserve (``max_num_seqs: auto`` at its floor) and
    ``MIN_PAGES`` pages out of ``memory_fraction`` of what the weights leave; a fixed one
    (``num_pages``, ``cpu_pool_bytes``) needs its pages."""
    size = page_bytes(spec, dtype, config.kv_cache_dtype)
    if config.num_pages is not None:
        return config.num_pages * size
    if device.type != "cuda":
        return max(1, config.cpu_pool_bytes // size) * size
    if config.max_num_seqs == "auto":  # the least it resolves to: the floor's reserve
        config = dataclasses.replace(
            config, max_num_seqs=max(AUTO_MIN_SEQS, config.admit_batch or 1)
        )
    need = reserve_bytes(config, spec, dtype, max_model_len) + MIN_PAGES * size
    return math.ceil(need / config.memory_fraction)  # free * fraction - reserve >= MIN_PAGES pages


def num_pages(
    config: EngineConfig,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    quiet: bool = False,
) -> int:
    """Pages of the pool: ``config.num_pages``, ``cpu_pool_bytes`` on the CPU, else what the
    device has free after the weights and the reserve, times ``memory_fraction``. ``quiet``: a
    trial that neither logs nor raises (0 pages where the reserve leaves none)."""
    if config.num_pages is not None:
        return config.num_pages
    size = page_bytes(spec, dtype, config.kv_cache_dtype)
    if device.type != "cuda":
        return max(1, config.cpu_pool_bytes // size)
    free, _ = device_memory(device)
    reserve = reserve_bytes(config, spec, dtype, max_model_len)
    usable = int(free * config.memory_fraction) - reserve
    if quiet:  # a trial (``max_num_seqs: auto`` weighing caps): no pool is no error yet
        return max(0, usable) // size
    if usable < size * MIN_PAGES:
        raise DeviceMemoryError(
            f"only {free / GIB:.2f} GiB free on {device} after the weights, "
            f"{reserve / GIB:.2f} GiB of it reserved for activations, sampling and CUDA graphs; "
            f"the pool needs at least {size * MIN_PAGES / GIB:.2f} GiB more of the "
            f"{100 * config.memory_fraction:.0f}% it may take"
        )
    log.info(
        "pool: %d MiB free on %s, %d MiB reserved for activations, sampling and CUDA graphs, "
        "%.0f%% of the rest for pages",
        free >> 20,
        device,
        reserve >> 20,
        100 * config.memory_fraction,
    )
    return usable // size


def reserve_bytes(
    config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, max_model_len: int
) -> int:
    """Device memory the pool leaves for a step's temporaries at the configured limits.

    - Activations of a prefill step of ``max_num_batched_tokens``: q/k/v, the MLP's gate/up and
      activation, residuals and norms in the model dtype (the widths below, with head room for
      LoRA's shrink outputs and the attention's scratch).
    - Logits and the sampler's temporaries for ``max_num_seqs`` rows: fp32 logits, the scaled
      copy, the sorted copy and its int64 order, the softmax, the cumulative sum and masks:
      about 12 fp32 copies of [rows, vocab].
    - CUDA graphs: one static page table [max_num_seqs, max_model_len, 2] int32 shared by every
      bucket, and each bucket's logits [bucket, vocab] fp32.
    """
    elt = torch.finfo(dtype).bits // 8
    width = 3 * (spec.q_dim + 2 * spec.kv_dim) + spec.mlp_step_width + 8 * spec.hidden_size
    activations = config.max_num_batched_tokens * width * elt
    sampler = config.seats_bound * spec.vocab_size * 4 * 12
    graphs = 0
    if config.cuda_graphs:
        graphs = config.seats_bound * max_model_len * 2 * 4
        graphs += sum(graph_buckets(config.seats_bound)) * spec.vocab_size * 4
    return activations + sampler + graphs


def graph_buckets(max_batch: int) -> list[int]:
    """The decode batch sizes a CUDA graph is captured for: 1, 2, 4, 8, every 16 to 256, every
    32 to 512, every 64 beyond, and ``max_batch``: a padded step wastes under 1/8 of its rows
    past 256 while 1024 rows take 36 buckets, not 64."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, min(max_batch, 256), 16))
    sizes += list(range(256, min(max_batch, 512), 32))
    sizes += list(range(512, max_batch, 64))
    return sizes + [max_batch]
