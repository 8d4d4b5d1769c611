"""Dynamic per-token e4m3 quantization of activations for the fp8 projections (W8A8), in one
pass: a Triton kernel and its torch twin with the same semantics.

Semantics: for row t of x [T, K]: s[t] = max(amax_k |x[t, k]| / 448, 1e-12) (fp32) and
q[t, k] = e4m3(clamp(x[t, k] / s[t], -448, 448)) (fp32 division rounded to nearest, then round to
nearest even into e4m3); rows T .. T + pad - 1 (pad = -T % pad_to: the fp8 GEMM wants every
dimension a multiple of 16) are zeros with scale 1. Shapes: q [T + pad, K] float8_e4m3fn, s
[T + pad, 1] fp32. Running example: x = [[1, -2], [0, 0]], pad_to 4: s = [2/448, 1e-12, 1, 1],
q = [[224, -448], [0, 0], [0, 0], [0, 0]].

Unfused, the same arithmetic is six elementwise kernels and a concatenation per projection; on
Llama-3-8B shapes at 1022 rows (H200) they took 15.5 ms of a 49.7 ms decode step, more than the
fp8 GEMMs saved.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TINY = 1e-12


def quantize_rows_ref(x: torch.Tensor, pad_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin (module doc)."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=TINY)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    pad = -x.shape[0] % pad_to
    if pad:
        q = torch.cat([q, q.new_zeros(pad, q.shape[1])])
        scale = torch.cat([scale, scale.new_ones(pad, 1)])
    return q, scale


@triton.jit
def _quantize_rows_kernel(x_ptr, x_stride, q_ptr, s_ptr, rows, K, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    q_row = q_ptr + r.to(tl.int64) * K
    if r >= rows:  # a padding row: zeros, scale 1
        for k0 in range(0, K, BLOCK):
            kk = k0 + tl.arange(0, BLOCK)
            tl.store(q_row + kk, tl.zeros([BLOCK], tl.float32).to(tl.float8e4nv), mask=kk < K)
        tl.store(s_ptr + r, 1.0)
        return
    x_row = x_ptr + r.to(tl.int64) * x_stride
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        kk = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    s = tl.maximum(tl.max(amax, 0) / 448.0, 1e-12)
    for k0 in range(0, K, BLOCK):  # the row again, from L2
        kk = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, s), -448.0, 448.0).to(tl.float8e4nv)
        tl.store(q_row + kk, q, mask=kk < K)
    tl.store(s_ptr + r, s)


def quantize_rows(x: torch.Tensor, pad_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_ref`` in one launch. Grid (T + pad,): a program per row, BLOCK columns
    per step, two passes over the row (its amax, then the quantized values)."""
    assert x.dim() == 2 and x.stride(1) == 1, "x: [T, K] with contiguous rows"
    rows, k = x.shape
    total = rows + (-rows % pad_to)
    q = torch.empty(total, k, dtype=FP8, device=x.device)
    scale = torch.empty(total, 1, dtype=torch.float32, device=x.device)
    if total:
        block = min(2048, triton.next_power_of_2(k))
        _quantize_rows_kernel[(total,)](x, x.stride(0), q, scale, rows, k, BLOCK=block, num_warps=4)
    return q, scale
