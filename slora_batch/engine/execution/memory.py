"""Where an engine runs, how much of the device its page pool takes, and host-to-device copies
that never wait for the device.

The pool gets what is left of the device after the weights, minus a reserve for one step's
temporaries at the configured limits (``reserve_bytes``), times ``memory_fraction``. Memory the
caching allocator holds but no tensor uses (an earlier engine's pool, say) counts as free: the
allocator hands it out before asking CUDA for more.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import numpy as np
import torch

from slora_batch.engine.config import EngineConfig
from slora_batch.engine.models.spec import ModelSpec
from slora_batch.engine.pool import PagePool

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# (pages, spec, dtype, device) -> (KV pool, adapter pool). The engine's default returns one pool
# twice: S-LoRA's unified paging. The bench's no-unified ablation hands in a factory of two.
PoolFactory = Callable[[int, ModelSpec, torch.dtype, torch.device], tuple[PagePool, PagePool]]


def unified_pool(
    pages: int, spec: ModelSpec, dtype: torch.dtype, device: torch.device
) -> tuple[PagePool, PagePool]:
    """One pool for KV cache and adapter weights alike."""
    pool = PagePool(pages, spec.page_size, spec.num_layers, dtype, device)
    return pool, pool


def to_device(array, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host array (numpy, list, CPU tensor) on ``device``, queued without waiting for it.

    A CUDA copy from pageable memory waits for the work queued before it on the stream (CUDA
    stages pageable memory through a buffer of its own): each such copy made while step N runs
    held the host until step N was done, so step N+1 was not prepared meanwhile (a 7B scoring run
    lost 15 s of 40 that way, in 544 adapter-slot updates). Staged in pinned memory here; the
    caching host allocator keeps the pinned block until the copy has run."""
    tensor = array if isinstance(array, torch.Tensor) else torch.as_tensor(np.asarray(array))
    if dtype is not None:
        tensor = tensor.to(dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.contiguous().pin_memory().to(device, non_blocking=True)


def copy_in(dst: torch.Tensor, array) -> None:
    """``dst.copy_(array)`` from the host under ``to_device``'s rule: the host does not wait."""
    src = array if isinstance(array, torch.Tensor) else torch.as_tensor(np.asarray(array))
    if dst.device.type == "cuda":  # converted first: copy_ would convert into pageable memory
        src = src.to(dst.dtype).contiguous().pin_memory()
    dst.copy_(src, non_blocking=True)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def set_cpu_threads(threads: int | None) -> None:
    """torch's intra-op threads for a CPU engine. By default one core is left to the engine's
    own Python thread and the adapter loader: OpenMP workers spin while they wait, so with as
    many workers as cores, any other busy process (or our own threads) stalls every op. On a
    busy 2-core machine a 6-row job took 197 s with 2 workers and 9 s with 1."""
    if threads is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, (cores or 1) - 1)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
        log.info("cpu: %d torch threads", threads)


def page_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    """Bytes of one page over every layer."""
    return spec.num_layers * spec.page_size * torch.finfo(dtype).bits // 8


def num_pages(
    config: EngineConfig,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> int:
    """Pages of the pool: ``config.num_pages``, ``cpu_pool_bytes`` on the CPU, else what the
    device has free after the weights and the reserve, times ``memory_fraction``."""
    if config.num_pages is not None:
        return config.num_pages
    size = page_bytes(spec, dtype)
    if device.type != "cuda":
        return max(1, config.cpu_pool_bytes // size)
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    reserve = reserve_bytes(config, spec, dtype, max_model_len)
    usable = int(free * config.memory_fraction) - reserve
    if usable < size * 64:
        raise RuntimeError(
            f"only {free >> 20} MiB free on {device} after the weights, {reserve >> 20} MiB of "
            f"it reserved for activations, sampling and CUDA graphs; the pool needs at least "
            f"{size * 64 >> 20} MiB (lower max_num_batched_tokens, max_num_seqs or max_model_len)"
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
    from slora_batch.engine.execution.runner import graph_buckets

    elt = torch.finfo(dtype).bits // 8
    width = 3 * (spec.q_dim + 2 * spec.kv_dim) + 6 * spec.intermediate_size + 8 * spec.hidden_size
    activations = config.max_num_batched_tokens * width * elt
    sampler = config.max_num_seqs * spec.vocab_size * 4 * 12
    graphs = 0
    if config.cuda_graphs:
        graphs = config.max_num_seqs * max_model_len * 2 * 4
        graphs += sum(graph_buckets(config.max_num_seqs)) * spec.vocab_size * 4
    return activations + sampler + graphs
