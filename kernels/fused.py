"""Small fused Triton ops: residual add + RMSNorm, RoPE in place, SiLU-and-multiply and
GELU(tanh)-and-multiply.

Each rounds where its torch twin in ``slora_kernels.ref`` rounds (to the activation dtype after the add,
after the normalization and after the activation), computing in fp32 in between.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    x_stride,
    res_ptr,
    res_stride,
    r_ptr,
    y_ptr,
    w_ptr,
    eps,
    hidden,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    _rms_norm_row(
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


@triton.jit
def _rms_norm_row(
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
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row t of ``rms_norm``: stores r (with a residual) and y; returns y as stored, in fp32, and
    its columns and their mask (``slora_kernels.act_quant`` quantizes it)."""
    cols = tl.arange(0, BLOCK)
    live = cols < hidden
    x = tl.load(x_ptr + t * x_stride + cols, mask=live, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + t * res_stride + cols, mask=live, other=0.0)
        r = (x.to(tl.float32) + res.to(tl.float32)).to(r_ptr.dtype.element_ty)
        tl.store(r_ptr + t * hidden + cols, r, mask=live)
        h = r.to(tl.float32)
    else:
        h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / hidden + eps)
    normed = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded, as ref does
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    y = (w * normed).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + t * hidden + cols, y, mask=live)
    return y.to(tl.float32), cols, live


@triton.jit
def _rotate(
    base_ptr,
    head_stride,
    num_heads,
    cos,
    sin,
    cols,
    col_live,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Rotate-half of one token's heads in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    heads = tl.arange(0, BLOCK_H)
    live = (heads < num_heads)[:, None] & col_live[None, :]
    lo_ptrs = base_ptr + heads[:, None] * head_stride + cols[None, :]
    x1 = tl.load(lo_ptrs, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(lo_ptrs + HALF, mask=live, other=0.0).to(tl.float32)
    tl.store(lo_ptrs, x1 * cos[None, :] - x2 * sin[None, :], mask=live)
    tl.store(lo_ptrs + HALF, x2 * cos[None, :] + x1 * sin[None, :], mask=live)


@triton.jit
def _rope_kernel(
    q_ptr,
    q_stride_t,
    q_stride_h,
    k_ptr,
    k_stride_t,
    k_stride_h,
    pos_ptr,
    cs_ptr,
    cs_stride,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    col_live = cols < HALF
    cos = tl.load(cs_ptr + pos * cs_stride + cols, mask=col_live, other=0.0)
    sin = tl.load(cs_ptr + pos * cs_stride + HALF + cols, mask=col_live, other=0.0)
    q_base, k_base = q_ptr + t * q_stride_t, k_ptr + t * k_stride_t
    _rotate(q_base, q_stride_h, num_q_heads, cos, sin, cols, col_live, HALF, BLOCK_HQ)
    _rotate(k_base, k_stride_h, num_k_heads, cos, sin, cols, col_live, HALF, BLOCK_HK)


@triton.jit
def _act_mul_kernel(gu_ptr, gu_stride, out_ptr, inter, ACT: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < inter
    a = _act_mul_block(gu_ptr + t * gu_stride, cols, live, inter, ACT)
    tl.store(out_ptr + t * inter + cols, a, mask=live)


@triton.jit
def _act_mul_block(gu_row, cols, live, inter, ACT: tl.constexpr):
    """act(gate) * up at ``cols`` of one row of gate_up, in fp32 (act rounded to the input
    dtype first, as F.silu and F.gelu round)."""
    gate = tl.load(gu_row + cols, mask=live, other=0.0).to(tl.float32)
    up = tl.load(gu_row + inter + cols, mask=live, other=0.0)
    if ACT == "silu":
        act = gate / (1.0 + tl.exp(-gate))
    else:  # "gelu_tanh": 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)  # +-1 at large |x|: e^2x is inf or 0
        act = 0.5 * gate * (1.0 + tanh)
    act = act.to(up.dtype)  # F.silu and F.gelu round to the input dtype
    return act.to(tl.float32) * up.to(tl.float32)


def rms_norm_buffers(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None):
    """``rms_norm``'s checks and outputs: (y, r, the residual operand, BLOCK); r is x itself
    without a residual."""
    assert x.dim() == 2 and x.stride(1) == 1 and weight.shape == (x.shape[1],), (x.shape, weight)
    assert weight.is_contiguous()
    num_tokens, hidden = x.shape
    r = x
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype
        r = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    y_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(num_tokens, hidden, dtype=y_dtype, device=x.device)
    res = x if residual is None else residual
    return y, r, res, triton.next_power_of_2(hidden)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm, as Hugging Face Llama computes it (fp32 inside).

    Semantics: r = x + residual (or x); y = weight * (r / sqrt(mean(r^2) + eps)).
    Shape: x, residual [T, H]; weight [H]. Returns (y, r).
    Grid (T,): one row per program, BLOCK = next_pow2(H).
    """
    y, r, res, block = rms_norm_buffers(x, weight, residual)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return y, r
    _rms_norm_kernel[(num_tokens,)](
        x,
        x.stride(0),
        res,
        res.stride(0),
        r,
        y,
        weight,
        eps,
        hidden,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(4, block // 512)),
    )
    return y, r


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotary embedding in place (the rotate-half convention of Hugging Face Llama).

    Shape: q [T, num_heads, head_dim]; k [T, num_kv_heads, head_dim]; positions [T] int;
    cos_sin [max_pos, head_dim] fp32 holding cos in the first half, sin in the second.
    Grid (T,): all heads of q and k of one token per program.
    """
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] == positions.shape[0]
    assert q.shape[2] == k.shape[2] == cos_sin.shape[1] and q.shape[2] % 2 == 0
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin.stride(1) == 1
    assert cos_sin.dtype == torch.float32 and positions.is_contiguous()
    num_tokens, half = q.shape[0], q.shape[2] // 2
    if num_tokens == 0:
        return
    _rope_kernel[(num_tokens,)](
        q,
        q.stride(0),
        q.stride(1),
        k,
        k.stride(0),
        k.stride(1),
        positions,
        cos_sin,
        cos_sin.stride(0),
        q.shape[1],
        k.shape[1],
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        num_warps=4,
    )


def _act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _act_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        gate_up, gate_up.stride(0), out, inter, ACT=act, BLOCK=block, num_warps=4
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up. Shape: gate_up [T, 2 * I] -> [T, I].
    Grid (T, ceil(I / BLOCK)), BLOCK = min(1024, next_pow2(I))."""
    return _act_mul(gate_up, "silu")


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate, tanh approximation) * up: Gemma's GeGLU. Shape: gate_up [T, 2 * I] -> [T, I].
    Grid (T, ceil(I / BLOCK)), BLOCK = min(1024, next_pow2(I))."""
    return _act_mul(gate_up, "gelu_tanh")
