"""Triton KV store: each token's K and V row into its own pool page (page -1: nothing written)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(pool_ptr, k_ptr, k_stride, v_ptr, v_stride, pages_ptr, kv_dim,
                     PAGE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
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
    pool_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_pages: torch.Tensor
) -> None:
    """Store the step's keys and values in their pages.

    Semantics: pool_layer[out_pages[t, 0], :kv_dim] = k[t];
      pool_layer[out_pages[t, 1], :kv_dim] = v[t]  (a page -1 writes nothing: padding rows).
    Shape: pool_layer [P, page_size]; k, v [T, kv_dim] (rows may be strided, e.g. column slices
      of the fused qkv output); out_pages [T, 2] int32 (K page, V page).
    Grid (T, ceil(kv_dim / BLOCK)), BLOCK = min(1024, next_pow2(kv_dim)).
    """
    assert pool_layer.dim() == 2 and pool_layer.is_contiguous(), "pool_layer: [P, page_size]"
    assert k.dim() == 2 and k.shape == v.shape and k.shape[1] <= pool_layer.shape[1], k.shape
    assert k.stride(1) == 1 and v.stride(1) == 1, "k and v rows must be contiguous"
    assert out_pages.dtype == torch.int32 and out_pages.is_contiguous()
    assert out_pages.shape == (k.shape[0], 2), out_pages.shape
    num_tokens, kv_dim = k.shape
    if num_tokens == 0:
        return
    block = min(1024, triton.next_power_of_2(kv_dim))
    _kv_write_kernel[(num_tokens, triton.cdiv(kv_dim, block))](
        pool_layer, k, k.stride(0), v, v.stride(0), out_pages, kv_dim, PAGE=pool_layer.shape[1],
        BLOCK=block, num_warps=4)  # fmt: skip
