"""Triton KV store: each token's K and V row into its own pool page (page -1: nothing written);
on fp8 pages (``slora_kernels.fp8``) K and V e4m3 in one page, V optionally in the grouped
layout (``kv_write_fp8``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slora_kernels import fp8


@triton.jit
def _kv_write_kernel(
    pool_ptr,
    k_ptr,
    k_stride,
    v_ptr,
    v_stride,
    pages_ptr,
    kv_dim,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < kv_dim
    page_k = tl.load(pages_ptr + t * 2).to(tl.int64)
    page_v = tl.load(pages_ptr + t * 2 + 1).to(tl.int64)
    if page_k >= 0:
        k = tl.load(k_ptr + t * k_stride + cols, mask=live)
        tl.store(pool_ptr + page_k * PAGE + cols, k, mask=live)
    if page_v >= 0:
        v = tl.load(v_ptr + t * v_stride + cols, mask=live)
        tl.store(pool_ptr + page_v * PAGE + cols, v, mask=live)


def kv_write(
    pool_layer: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_pages: torch.Tensor,
    scales: torch.Tensor | None = None,
    v_group: int = 0,
) -> None:
    """Store the step's keys and values in their pages.

    Semantics: pool_layer[out_pages[t, 0], :kv_dim] = k[t];
      pool_layer[out_pages[t, 1], :kv_dim] = v[t]  (a page -1 writes nothing: padding rows).
    Shape: pool_layer [P, page_size]; k, v [T, kv_dim] (rows may be strided, e.g. column slices
      of the fused qkv output); out_pages [T, 2] int32 (K page, V page).
    Grid (T, ceil(kv_dim / BLOCK)), BLOCK = min(1024, next_pow2(kv_dim)). With scales
    [P, 2 * kv_heads] fp32: fp8 pages (``kv_write_fp8``), V in the grouped layout with
    v_group G > 0.
    """
    assert pool_layer.dim() == 2 and pool_layer.is_contiguous(), "pool_layer: [P, page_size]"
    assert k.dim() == 2 and k.shape == v.shape and k.shape[1] <= pool_layer.shape[1], k.shape
    assert k.stride(1) == 1 and v.stride(1) == 1, "k and v rows must be contiguous"
    assert out_pages.dtype == torch.int32 and out_pages.is_contiguous()
    assert out_pages.shape == (k.shape[0], 2), out_pages.shape
    assert v_group == 0 or scales is not None, "the grouped V layout is one of fp8 pages"
    if scales is not None:
        kv_write_fp8(pool_layer, k, v, out_pages, scales, v_group)
        return
    num_tokens, kv_dim = k.shape
    if num_tokens == 0:
        return
    block = min(1024, triton.next_power_of_2(kv_dim))
    _kv_write_kernel[(num_tokens, triton.cdiv(kv_dim, block))](
        pool_layer,
        k,
        k.stride(0),
        v,
        v.stride(0),
        out_pages,
        kv_dim,
        PAGE=pool_layer.shape[1],
        BLOCK=block,
        num_warps=4,
    )


@triton.jit
def e4m3_round(x, amax):
    """x (fp32) as e4m3 values and its scale: s = amax / 448 (1 where amax is 0), q = e4m3(x /
    s) (``slora_kernels.fp8.quantize``). ``amax`` broadcasts against x: the write's per-head
    row, and the prefill kernel's own K/V rows (``attention``), round the same way."""
    s = amax / 448.0
    s = tl.where(s > 0, s, 1.0)
    return tl.clamp(x / s, -448.0, 448.0).to(tl.float8e4nv), s


@triton.jit
def _v_offsets(g0, slot, cols, KV_DIM: tl.constexpr, PAGE: tl.constexpr, V_GROUP: tl.constexpr):
    """Byte offsets (from the pool's start) of V columns ``cols`` of the tokens in slots
    ``slot`` of the group whose first page is g0, in the grouped V layout of
    ``slora_kernels.fp8`` (column c of slot i at c * V_GROUP + i of the group's run of
    V_GROUP * KV_DIM bytes, the V halves of its pages); slot and cols broadcast."""
    run = cols * V_GROUP + slot
    return (g0 + run // KV_DIM) * PAGE + KV_DIM + run % KV_DIM


@triton.jit
def _zero_after(
    data_ptr,
    pages_ptr,
    t,
    num_tokens,
    page,
    cols,
    live,
    KV_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    V_GROUP: tl.constexpr,
):
    """``slora_kernels.fp8._zero_after`` for token t (V page ``page``) and one head's columns:
    when t is the launch's last token in its group (the next token's V page is not page + 1)
    and the launch wrote the group's slot 0 too (token t - slot at page - slot), zeros the V
    of slots slot + 1 .. V_GROUP - 1, where no token of the launch writes."""
    slot = page % V_GROUP
    nxt = tl.load(pages_ptr + (t + 1) * 2 + 1, mask=t + 1 < num_tokens, other=-1)
    head = tl.load(pages_ptr + (t - slot) * 2 + 1, mask=t >= slot, other=-1)
    if (slot < V_GROUP - 1) & (nxt != page + 1) & (head == page - slot):
        after = tl.arange(0, V_GROUP)
        offs = _v_offsets(page - slot, after[:, None], cols[None, :], KV_DIM, PAGE, V_GROUP)
        zeros = tl.zeros(offs.shape, data_ptr.dtype.element_ty)
        tl.store(data_ptr + offs, zeros, mask=(after > slot)[:, None] & live[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _kv_write_fp8_kernel(
    data_ptr,
    scale_ptr,
    k_ptr,
    k_stride,
    v_ptr,
    v_stride,
    pages_ptr,
    num_tokens,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    V_GROUP: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    live = d < HEAD_DIM
    cols = h * HEAD_DIM + d
    KV_DIM: tl.constexpr = KV_HEADS * HEAD_DIM
    for which in tl.static_range(2):  # K into bytes 0 .. kv_dim, V into kv_dim .. 2 * kv_dim
        page = tl.load(pages_ptr + t * 2 + which).to(tl.int64)
        if page >= 0:
            if which == 0:
                x = tl.load(k_ptr + t * k_stride + cols, mask=live, other=0.0).to(tl.float32)
            else:
                x = tl.load(v_ptr + t * v_stride + cols, mask=live, other=0.0).to(tl.float32)
            q, s = e4m3_round(x, tl.max(tl.abs(x), 0))
            offs = page * PAGE + which * KV_DIM + cols
            if which == 1 and V_GROUP > 0:  # V in the grouped layout, the group's tail zeroed
                slot = page % V_GROUP
                offs = _v_offsets(page - slot, slot, cols, KV_DIM, PAGE, V_GROUP)
                _zero_after(
                    data_ptr, pages_ptr, t, num_tokens, page, cols, live, KV_DIM, PAGE, V_GROUP
                )
            tl.store(data_ptr + offs, q, mask=live)
            tl.store(scale_ptr + page * 2 * KV_HEADS + which * KV_HEADS + h, s)


def kv_write_fp8(
    pool_layer: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_pages: torch.Tensor,
    scales: torch.Tensor,
    v_group: int = 0,
) -> None:
    """``slora_kernels.fp8.kv_write``: e4m3 K and V of a token side by side in one page, scales per
    token and KV head; v_group G > 0: V in the grouped layout, the rest of each group the launch
    starts zeroed after its last token (``fp8._zero_after``; the launch's tokens of a group on
    distinct pages, as a step's are). Grid (T, kv_heads): one program quantizes one head of K
    and of V (and zeroes that head's columns of the group's tail)."""
    data = fp8.bytes_view(pool_layer)
    kv_heads, kv_dim = scales.shape[1] // 2, k.shape[1]
    assert scales.dtype == torch.float32 and scales.is_contiguous()
    assert scales.shape[0] == pool_layer.shape[0] and data.shape[1] >= 2 * kv_dim
    assert v_group >= 0 and kv_dim % max(v_group, 1) == 0, f"kv_dim {kv_dim}, v_group {v_group}"
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    head_dim = kv_dim // kv_heads
    _kv_write_fp8_kernel[(num_tokens, kv_heads)](
        data,
        scales,
        k,
        k.stride(0),
        v,
        v.stride(0),
        out_pages,
        num_tokens,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        PAGE=data.shape[1],
        BLOCK_D=triton.next_power_of_2(head_dim),
        V_GROUP=v_group,
        num_warps=1,
    )
