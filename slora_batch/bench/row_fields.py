"""The fields of a run's results row: who ran and how it ended, the engine's step counters,
the rates, roofline fraction and step-by-step floor of the work done, and the Triton builds."""

from __future__ import annotations

import math

import torch

from slora_batch.bench.floor import PARTS, StepWork, WeightBytes, floor_parts
from slora_batch.bench.roofline import Work
from slora_batch.bench.timed_run import Timed
from slora_kernels.builds import BuildLog


def engine_row(
    ctx,
    system: str,
    n: int,
    requests: int,
    finished: int,
    mismatches: int,
    setup_s: float,
    timed: Timed,
) -> dict:
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
    (on ``devices`` cards like the one measured: their floor is 1/devices of one card's). FLOPs
    count the active parameters (a mixture of experts runs k of its E experts a token)."""
    model = ctx.model
    params = model.active_params
    floor_s = work.floor_seconds(params, model.kv_bytes_per_token, ctx.rates) / devices
    return dict(
        prompt_tokens=work.prompt_tokens,
        output_tokens=work.output_tokens,
        wall_s=wall_s,
        requests_per_s=finished / wall_s,
        output_tokens_per_s=work.output_tokens / wall_s,
        flops=work.flops(params),
        kv_bytes=work.kv_bytes(model.kv_bytes_per_token),
        floor_s=floor_s,
        roofline_fraction=floor_s / wall_s,
    )


def floor_fields(
    ctx, trace: list[StepWork] | None, wall_s: float, devices: int = 1
) -> dict[str, float]:
    """The step-by-step floor of a traced run (``floor.py``) and ``floor_fraction`` = its
    seconds over ``wall_s``; NaN for a run whose steps were not traced (data-parallel)."""
    if trace is None:
        return dict.fromkeys((*PARTS, "floor2_s", "floor_fraction"), math.nan)
    model = ctx.model
    weights = WeightBytes.of(model.spec, model.num_params, torch.finfo(model.dtype).bits // 8)
    parts = floor_parts(
        trace, weights, model.kv_bytes_per_token, model.active_params, ctx.rates, devices
    )
    parts["floor_fraction"] = parts["floor2_s"] / wall_s
    return parts


def build_counts(warmup: BuildLog, timed: BuildLog) -> dict[str, float]:
    """Triton builds in the warm-up and in the timed run (NaN where Triton has no JIT hooks)."""
    if not timed.available:
        return dict.fromkeys(("warmup_builds", "kernel_builds", "kernel_build_s"), math.nan)
    return dict(warmup_builds=warmup.count, kernel_builds=timed.count, kernel_build_s=timed.seconds)


def _share(part: float, whole: float) -> float:
    """part / whole; NaN where the engine lacks the counters or ran no such step."""
    return part / whole if whole > 0 else math.nan


def _peak_gib(device: torch.device) -> float:
    if device.type != "cuda":
        return math.nan
    return torch.cuda.max_memory_allocated(device) / 2**30
