"""Dynamic per-token e4m3 quantization of activations for the fp8 projections (W8A8): alone
(``quantize_rows``), and fused into the ops that produce the activations (``rms_norm_fp8``,
``silu_mul_fp8``, ``gelu_tanh_mul_fp8``: the op's output and its quantization in one launch, the
twins in ``slora_kernels.ref``).

Semantics: for row t of x [T, K]: s[t] = max(amax_k |x[t, k]| / 448, 1e-12) (fp32) and
q[t, k] = e4m3(clamp(x[t, k] / s[t], -448, 448)) (fp32 division rounded to nearest, then round to
nearest even into e4m3); rows T .. T + pad - 1 (pad = -T % pad_to: the fp8 GEMM wants every
dimension a multiple of 16) are zeros with scale 1. Shapes: q [T + pad, K] float8_e4m3fn, s
[T + pad, 1] fp32. Running example: x = [[1, -2], [0, 0]], pad_to 4: s = [2/448, 1e-12, 1, 1],
q = [[224, -448], [0, 0], [0, 0], [0, 0]].

Unfused, the same arithmetic is six elementwise kernels and a concatenation per projection; on
Llama-3-8B shapes at 1022 rows (H200) they took 15.5 ms of a 49.7 ms decode step, more than the
fp8 GEMMs saved. ``quantize_rows`` makes it one launch that reads the activations once more;
the fused ops quantize the row they have just computed, so the qkv, gate_up and down inputs
cost no launch and no read of their own (o's input, the attention's output, still does).

The fused ops quantize their output as stored (rounded to the activation dtype), so
``rms_norm_fp8(x, ...)`` is ``rms_norm(x, ...)`` and ``quantize_rows`` of its y, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slora_kernels.fused import _act_mul_block, _rms_norm_row, rms_norm_buffers

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
def _pad_row(q_row, s_ptr, r, K, BLOCK: tl.constexpr):
    """A padding row: zeros, scale 1."""
    for k0 in range(0, K, BLOCK):
        kk = k0 + tl.arange(0, BLOCK)
        tl.store(q_row + kk, tl.zeros([BLOCK], tl.float32).to(tl.float8e4nv), mask=kk < K)
    tl.store(s_ptr + r, 1.0)


@triton.jit
def _row_scale(amax):
    return tl.maximum(amax / 448.0, 1e-12)


@triton.jit
def _e4m3(x, s):
    return tl.clamp(tl.math.div_rn(x, s), -448.0, 448.0).to(tl.float8e4nv)


@triton.jit
def _quantize_rows_kernel(x_ptr, x_stride, q_ptr, s_ptr, rows, K, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    q_row = q_ptr + r.to(tl.int64) * K
    if r >= rows:
        _pad_row(q_row, s_ptr, r, K, BLOCK)
        return
    x_row = x_ptr + r.to(tl.int64) * x_stride
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        kk = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    s = _row_scale(tl.max(amax, 0))
    for k0 in range(0, K, BLOCK):  # the row again, from L2
        kk = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)
        tl.store(q_row + kk, _e4m3(x, s), mask=kk < K)
    tl.store(s_ptr + r, s)


def _quantized(rows: int, k: int, pad_to: int, device: torch.device):
    """The (q, scale) buffers of ``rows`` rows of k columns padded to a multiple of pad_to."""
    total = rows + (-rows % pad_to)
    q = torch.empty(total, k, dtype=FP8, device=device)
    return q, torch.empty(total, 1, dtype=torch.float32, device=device)


def quantize_rows(x: torch.Tensor, pad_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_ref`` in one launch. Grid (T + pad,): a program per row, BLOCK columns
    per step, two passes over the row (its amax, then the quantized values)."""
    assert x.dim() == 2 and x.stride(1) == 1, "x: [T, K] with contiguous rows"
    rows, k = x.shape
    q, scale = _quantized(rows, k, pad_to, x.device)
    if q.shape[0]:
        block = min(2048, triton.next_power_of_2(k))
        _quantize_rows_kernel[(q.shape[0],)](
            x, x.stride(0), q, scale, rows, k, BLOCK=block, num_warps=4
        )
    return q, scale


@triton.jit
def _rms_norm_fp8_kernel(
    x_ptr,
    x_stride,
    res_ptr,
    res_stride,
    r_ptr,
    y_ptr,
    w_ptr,
    q_ptr,
    s_ptr,
    eps,
    rows,
    hidden,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    q_row = q_ptr + t * hidden
    if t >= rows:
        _pad_row(q_row, s_ptr, t, hidden, BLOCK)
        return
    y, cols, live = _rms_norm_row(
        x_ptr,
        x_stride,
        res_ptr,
        res_stride,
        r_ptr,
        y_ptr,
        w_ptr,
        eps,
        hidden,
        t,
        HAS_RESIDUAL,
        BLOCK,
    )
    s = _row_scale(tl.max(tl.where(live, tl.abs(y), 0.0), 0))
    tl.store(q_row + cols, _e4m3(y, s), mask=live)
    tl.store(s_ptr + t, s)


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    pad_to: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``slora_kernels.fused.rms_norm`` and ``quantize_rows`` of its y in one launch: (y, r,
    (q, scale)), q and scale padded to a multiple of pad_to rows. Grid (T + pad,): one row a
    program, as ``rms_norm``'s."""
    y, r, res, block = rms_norm_buffers(x, weight, residual)
    rows, hidden = x.shape
    q, scale = _quantized(rows, hidden, pad_to, x.device)
    if q.shape[0]:
        _rms_norm_fp8_kernel[(q.shape[0],)](
            x,
            x.stride(0),
            res,
            res.stride(0),
            r,
            y,
            weight,
            q,
            scale,
            eps,
            rows,
            hidden,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(4, block // 512)),
        )
    return y, r, (q, scale)


@triton.jit
def _act_mul_fp8_kernel(
    gu_ptr, gu_stride, out_ptr, q_ptr, s_ptr, rows, inter, ACT: tl.constexpr, BLOCK: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    q_row, out_row = q_ptr + t * inter, out_ptr + t * inter
    if t >= rows:
        _pad_row(q_row, s_ptr, t, inter, BLOCK)
        return
    amax = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, inter, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        live = cols < inter
        a = _act_mul_block(gu_ptr + t * gu_stride, cols, live, inter, ACT)
        a = a.to(out_ptr.dtype.element_ty)
        tl.store(out_row + cols, a, mask=live)
        amax = tl.maximum(amax, tl.where(live, tl.abs(a.to(tl.float32)), 0.0))
    s = _row_scale(tl.max(amax, 0))
    for c0 in range(0, inter, BLOCK):  # the row just stored, from L2 (same thread, same columns)
        cols = c0 + tl.arange(0, BLOCK)
        live = cols < inter
        a = tl.load(out_row + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(q_row + cols, _e4m3(a, s), mask=live)
    tl.store(s_ptr + t, s)


# The fused gated activation's tile: columns a step and warps. One program a row walks the row
# twice, so at a few hundred rows each program needs many loads in flight (benchmarks/
# fp8_kernels.py times the choices beside the unfused pair).
ACT_FP8_TILE = {"block": 2048, "warps": 16}


def _act_mul_fp8(gate_up: torch.Tensor, act: str, pad_to: int):
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    q, scale = _quantized(rows, inter, pad_to, gate_up.device)
    if q.shape[0]:
        block = min(ACT_FP8_TILE["block"], triton.next_power_of_2(inter))
        _act_mul_fp8_kernel[(q.shape[0],)](
            gate_up,
            gate_up.stride(0),
            out,
            q,
            scale,
            rows,
            inter,
            ACT=act,
            BLOCK=block,
            num_warps=ACT_FP8_TILE["warps"],
        )
    return out, (q, scale)


def silu_mul_fp8(gate_up: torch.Tensor, pad_to: int = 1):
    """``slora_kernels.fused.silu_mul`` and ``quantize_rows`` of its output in one launch: (a,
    (q, scale)). Grid (T + pad,): a program per row, two passes over it (the products, their
    amax and stores; then the stored row quantized)."""
    return _act_mul_fp8(gate_up, "silu", pad_to)


def gelu_tanh_mul_fp8(gate_up: torch.Tensor, pad_to: int = 1):
    """``silu_mul_fp8`` for ``slora_kernels.fused.gelu_tanh_mul`` (Gemma's GeGLU)."""
    return _act_mul_fp8(gate_up, "gelu_tanh", pad_to)
