"""Where an engine runs (device, dtype, CPU threads) and host-to-device copies that never wait
for the device. Shared by every room: the sampler, adapter residency and the step planner copy
through it.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from slora_batch.engine.resolution import dtype_name

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
    return DTYPES[dtype_name(name, device.type)]


FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first cards with e4m3 conversions


def check_fp8_settings(config, device: torch.device) -> None:
    """Refuses ``kv_cache_dtype: fp8`` and ``adapter_dtype: fp8`` on a CUDA card without fp8
    (compute capability below 8.9), before any work. On the CPU the torch twins emulate e4m3."""
    keys = [key for key in ("kv_cache_dtype", "adapter_dtype") if getattr(config, key) == "fp8"]
    if not keys or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"engine setting {keys[0]}: fp8 needs a card with fp8 (compute capability 8.9 or "
            f"later); {device} is {name} with {capability[0]}.{capability[1]} (use {keys[0]}: "
            "auto)"
        )


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
