"""The roofline floor of a benchmark run: the card's measured peak rates and the run's work.

floor = max(FLOPs / matmul rate, KV bytes read / copy bandwidth), with FLOPs = 2 x parameters x
(prompt + output tokens, less the prompt tokens found in the prefix cache) and KV bytes = the sum over decode steps of context length x 2 x layers
x kv_dim x bytes per element (benchmarks/README.md). The roofline fraction is floor / measured time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# (matmul side, copy bytes, warm-ups, timed iterations) per device type: 8192^3 in bf16 on the
# card, as the workload asks; small enough on the CPU that the tests stay quick.
MEASURE = {"cuda": (8192, 2 << 30, 3, 10), "cpu": (512, 32 << 20, 1, 3)}


@dataclass(frozen=True)
class Rates:
    matmul_flops_per_s: float
    copy_bytes_per_s: float  # read + write bytes of a device-to-device copy


def measure_rates(device: torch.device, dtype: torch.dtype) -> Rates:
    """Times a square matmul and a large copy on ``device``; frees both buffers after."""
    side, copy_bytes, warmup, iters = MEASURE["cuda" if device.type == "cuda" else "cpu"]
    flops = 2 * side**3 / _matmul_seconds(side, device, dtype, warmup, iters)
    bandwidth = 2 * copy_bytes / _copy_seconds(copy_bytes, device, warmup, iters)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Rates(matmul_flops_per_s=flops, copy_bytes_per_s=bandwidth)


def _matmul_seconds(
    side: int, device: torch.device, dtype: torch.dtype, warmup: int, iters: int
) -> float:
    a = torch.randn(side, side, device=device, dtype=dtype)
    b = torch.randn(side, side, device=device, dtype=dtype)
    out = torch.empty(side, side, device=device, dtype=dtype)
    return _seconds_per_call(lambda: torch.matmul(a, b, out=out), device, warmup, iters)


def _copy_seconds(nbytes: int, device: torch.device, warmup: int, iters: int) -> float:
    src = torch.empty(nbytes, device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return _seconds_per_call(lambda: dst.copy_(src), device, warmup, iters)


def _seconds_per_call(
    fn: Callable[[], object], device: torch.device, warmup: int, iters: int
) -> float:
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / iters


def kv_tokens_read(prompt: int, generated: int) -> int:
    """Cached positions the decode steps of one request read, summed over its decode steps.

    The first output token comes from the prefill; the decode step that feeds output token j
    (j = 1 .. generated - 1) attends to prompt + j positions. Example: prompt 3, 4 tokens
    generated: steps read 4 + 5 + 6 = 15 = (4 - 1) * 3 + 3 * 4 / 2.
    """
    steps = max(generated - 1, 0)
    return steps * prompt + steps * (steps + 1) // 2


@dataclass
class Work:
    """What a run computed, summed over requests (finished ones and the part done of the rest)."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    kv_tokens: int = 0  # sum of kv_tokens_read
    cached_tokens: int = 0  # of prompt_tokens, those whose KV came from the prefix cache

    def add(self, prompt: int, generated: int) -> None:
        self.prompt_tokens += prompt
        self.output_tokens += generated
        self.kv_tokens += kv_tokens_read(prompt, generated)

    def flops(self, num_params: int) -> float:
        return 2.0 * num_params * (self.prompt_tokens - self.cached_tokens + self.output_tokens)

    def kv_bytes(self, kv_bytes_per_token: int) -> float:
        return float(self.kv_tokens) * kv_bytes_per_token

    def floor_seconds(self, num_params: int, kv_bytes_per_token: int, rates: Rates) -> float:
        return max(
            self.flops(num_params) / rates.matmul_flops_per_s,
            self.kv_bytes(kv_bytes_per_token) / rates.copy_bytes_per_s,
        )


def kv_bytes_per_token(num_layers: int, kv_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token over all layers: 2 x layers x kv_dim x bytes per element."""
    return 2 * num_layers * kv_dim * (torch.finfo(dtype).bits // 8)
