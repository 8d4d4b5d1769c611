"""Triton LoRA shrink and expand: adapter rows gathered straight from pool pages, a different rank
per adapter, no padding to the largest rank (S-LoRA's MBGMV for decode, MBGMM for prefill).

Page layout (``kernels.ref.gather_lora_rows``): row j of slot s's factor lies in the pages
slot_pages[s, start + j * per_row + c], c = 0 .. per_row - 1, with start = slot_offsets[s, target,
which] and per_row = ceil(width / page_size); element k of the row is at offset k % page_size of
page c = k // page_size. Running example: page_size 4096, gate (d_in 4096, d_out 11008): an A row
is 1 page, a B^T row 3 pages (the third holds 2816 elements, then zeros).

Blocks along a row (BLOCK_K, BLOCK_N) divide page_size, so one block of one row lies in one page:
a program loads one page index per row and block, then a contiguous run of elements.

Two shapes, picked from host ints only (T tokens, S segments):
- gemv (few tokens per adapter, decode): a program per (token, rank or column block), tokens taken
  in ``token_order`` so that programs of one adapter run together and share its rows in L2. Reads
  b_slot and token_order only: the grid depends on T and max_rank, so the launch is capturable.
- gemm (segments of many tokens, prefill): a program per (block of BLOCK_T tokens of one segment,
  rank or column block), tiles multiplied with ``tl.dot``. Program p finds its segment block on the
  device with a cumulative sum over segment lengths; programs past the last block return at once.
Rows without an adapter (slot -1) never enter a segment and their gemv programs return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.meta import LoraMeta

# Tokens per segment at or below which the gemv shape is used (decode steps have about 1).
GEMV_MAX_TOKENS_PER_SEGMENT = 2
# Block sizes; the tests shrink them to reach every branch on tiny shapes. Blocks along a row are
# also capped by the largest power of two that divides page_size; tl.dot blocks stay >= 16. The
# gemm tiles keep sm_90 builds under ~100 registers a thread, spill-free (larger ones spilled).
BLOCKS = {
    "gemv_rank": 16,  # shrink: rank rows per program
    "gemv_k": 256,  # shrink: row elements per loop step
    "gemv_tile": 4096,  # expand: rank x columns elements per program ...
    "gemv_n": 256,  # ... and at most this many columns
    "gemm_tokens": 32,  # tokens per tile
    "gemm_rank": 32,  # shrink: rank columns per tile
    "gemm_k": 64,  # shrink: row elements per loop step
    "gemm_n": 64,  # expand: columns per tile
    "segment_chunk": 128,  # segments scanned per loop step of the in-kernel block search
}


@triton.jit
def _segment_block(seg1_start_ptr, num_segs, pid, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    """(segment, block in it) of the pid-th BLOCK_T-token block, segments cut one after the other;
    segment -1 past the last block. Example: lengths 2, 40, 5 and BLOCK_T 32 give the blocks
    (0, 0) (1, 0) (1, 1) (2, 0); pid 2 -> (1, 1), pid 4 -> (-1, 0)."""
    seg = -1
    blk = 0
    base = 0
    for c0 in range(0, num_segs, BLOCK_S):
        idx = c0 + tl.arange(0, BLOCK_S)
        live = idx < num_segs
        lo = tl.load(seg1_start_ptr + idx, mask=live, other=0)
        hi = tl.load(seg1_start_ptr + idx + 1, mask=live, other=0)
        blocks = (hi - lo + BLOCK_T - 1) // BLOCK_T
        incl = tl.cumsum(blocks, 0) + base
        excl = incl - blocks
        hit = (excl <= pid) & (pid < incl)
        seg = tl.maximum(seg, tl.max(tl.where(hit, idx, -1), 0))
        blk += tl.sum(tl.where(hit, pid - excl, 0), 0)
        base += tl.sum(blocks, 0)
    return seg, blk


@triton.jit
def _factor(slot, rank_ptr, pages_ptr, pages_stride, offsets_ptr, target, which, rank_cap,
            NUM_TARGETS: tl.constexpr):  # fmt: skip
    """(start in slot_pages, -1 without the target; rank; pointer to slot_pages[slot, start])."""
    start = tl.load(offsets_ptr + (slot * NUM_TARGETS + target) * 2 + which)
    rank = tl.minimum(tl.load(rank_ptr + slot), rank_cap)
    return start, rank, pages_ptr + slot.to(tl.int64) * pages_stride + start


@triton.jit(do_not_specialize=["target", "out_stride", "rank_cap"])
def _shrink_gemv_kernel(x_ptr, x_stride, pool_ptr, b_slot_ptr, token_order_ptr, rank_ptr,
                        scale_ptr, pages_ptr, pages_stride, offsets_ptr, target, out_ptr,
                        out_stride, rank_cap, d_in, PAGE: tl.constexpr, NUM_TARGETS: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    t = tl.load(token_order_ptr + tl.program_id(0)).to(tl.int64)
    slot = tl.load(b_slot_ptr + t)
    if slot < 0:
        return
    start, rank, slot_pages = _factor(
        slot, rank_ptr, pages_ptr, pages_stride, offsets_ptr, target, 0, rank_cap, NUM_TARGETS
    )
    r0 = tl.program_id(1) * BLOCK_R
    if (start < 0) | (r0 >= rank):
        return
    rows = r0 + tl.arange(0, BLOCK_R)
    row_live = rows < rank
    row_pages = slot_pages + rows * tl.cdiv(d_in, PAGE)  # element k: page row_pages[k // PAGE]
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        col_live = k0 + cols < d_in
        xv = tl.load(x_ptr + t * x_stride + k0 + cols, mask=col_live, other=0.0)
        page = tl.load(row_pages + k0 // PAGE, mask=row_live, other=0).to(tl.int64)
        a_ptrs = pool_ptr + page[:, None] * PAGE + (k0 % PAGE) + cols[None, :]
        a = tl.load(a_ptrs, mask=row_live[:, None] & col_live[None, :], other=0.0)
        acc += a.to(tl.float32) * xv.to(tl.float32)[None, :]
    tl.store(out_ptr + t * out_stride + rows, tl.sum(acc, 1), mask=row_live)


@triton.jit(do_not_specialize=["target", "v_stride", "rank_cap"])
def _expand_gemv_kernel(v_ptr, v_stride, pool_ptr, b_slot_ptr, token_order_ptr, rank_ptr,
                        scale_ptr, pages_ptr, pages_stride, offsets_ptr, target, out_ptr,
                        out_stride, rank_cap, d_out, PAGE: tl.constexpr, NUM_TARGETS: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    t = tl.load(token_order_ptr + tl.program_id(0)).to(tl.int64)
    slot = tl.load(b_slot_ptr + t)
    if slot < 0:
        return
    start, rank, slot_pages = _factor(
        slot, rank_ptr, pages_ptr, pages_stride, offsets_ptr, target, 1, rank_cap, NUM_TARGETS
    )
    if start < 0:
        return
    rows = tl.arange(0, BLOCK_R)
    row_live = rows < rank
    n0 = tl.program_id(1) * BLOCK_N
    cols = tl.arange(0, BLOCK_N)
    col_live = n0 + cols < d_out
    vv = tl.load(v_ptr + t * v_stride + rows, mask=row_live, other=0.0).to(tl.float32)
    page_ptrs = slot_pages + rows * tl.cdiv(d_out, PAGE) + n0 // PAGE
    page = tl.load(page_ptrs, mask=row_live, other=0).to(tl.int64)
    b_ptrs = pool_ptr + page[:, None] * PAGE + (n0 % PAGE) + cols[None, :]
    b = tl.load(b_ptrs, mask=row_live[:, None] & col_live[None, :], other=0.0)
    delta = tl.sum(b.to(tl.float32) * vv[:, None], 0) * tl.load(scale_ptr + slot)
    o_ptrs = out_ptr + t * out_stride + n0 + cols
    tl.store(o_ptrs, tl.load(o_ptrs, mask=col_live).to(tl.float32) + delta, mask=col_live)


@triton.jit
def _segment_tokens(seg1_start_ptr, token_order_ptr, seg, blk, BLOCK_T: tl.constexpr):
    """Token ids [BLOCK_T] (int64) of block blk of segment seg, and which of them are live."""
    ii = tl.load(seg1_start_ptr + seg) + blk * BLOCK_T + tl.arange(0, BLOCK_T)
    live = ii < tl.load(seg1_start_ptr + seg + 1)
    return tl.load(token_order_ptr + ii, mask=live, other=0).to(tl.int64), live


@triton.jit(do_not_specialize=["num_segs", "target", "out_stride", "rank_cap"])
def _shrink_gemm_kernel(x_ptr, x_stride, pool_ptr, token_order_ptr, seg1_start_ptr, seg_slot_ptr,
                        num_segs, rank_ptr, scale_ptr, pages_ptr, pages_stride, offsets_ptr,
                        target, out_ptr, out_stride, rank_cap, d_in, PAGE: tl.constexpr,
                        NUM_TARGETS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                        PRECISION: tl.constexpr):  # fmt: skip
    seg, blk = _segment_block(seg1_start_ptr, num_segs, tl.program_id(0), BLOCK_T, BLOCK_S)
    if seg < 0:
        return
    slot = tl.load(seg_slot_ptr + seg)
    if slot < 0:
        return
    start, rank, slot_pages = _factor(
        slot, rank_ptr, pages_ptr, pages_stride, offsets_ptr, target, 0, rank_cap, NUM_TARGETS
    )
    r0 = tl.program_id(1) * BLOCK_R
    if (start < 0) | (r0 >= rank):
        return
    tok, tok_live = _segment_tokens(seg1_start_ptr, token_order_ptr, seg, blk, BLOCK_T)
    rows = r0 + tl.arange(0, BLOCK_R)
    row_live = rows < rank
    row_pages = slot_pages + rows * tl.cdiv(d_in, PAGE)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        col_live = k0 + cols < d_in
        x_ptrs = x_ptr + tok[:, None] * x_stride + k0 + cols[None, :]
        xt = tl.load(x_ptrs, mask=tok_live[:, None] & col_live[None, :], other=0.0)
        page = tl.load(row_pages + k0 // PAGE, mask=row_live, other=0).to(tl.int64)
        a_ptrs = pool_ptr + page[:, None] * PAGE + (k0 % PAGE) + cols[None, :]
        a = tl.load(a_ptrs, mask=row_live[:, None] & col_live[None, :], other=0.0)
        acc = tl.dot(xt, tl.trans(a), acc, input_precision=PRECISION)  # [BLOCK_T, BLOCK_R]
    out_ptrs = out_ptr + tok[:, None] * out_stride + rows[None, :]
    tl.store(out_ptrs, acc, mask=tok_live[:, None] & row_live[None, :])


@triton.jit(do_not_specialize=["num_segs", "target", "v_stride", "rank_cap"])
def _expand_gemm_kernel(v_ptr, v_stride, pool_ptr, token_order_ptr, seg1_start_ptr, seg_slot_ptr,
                        num_segs, rank_ptr, scale_ptr, pages_ptr, pages_stride, offsets_ptr,
                        target, out_ptr, out_stride, rank_cap, d_out, PAGE: tl.constexpr,
                        NUM_TARGETS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                        PRECISION: tl.constexpr):  # fmt: skip
    seg, blk = _segment_block(seg1_start_ptr, num_segs, tl.program_id(0), BLOCK_T, BLOCK_S)
    if seg < 0:
        return
    slot = tl.load(seg_slot_ptr + seg)
    if slot < 0:
        return
    start, rank, slot_pages = _factor(
        slot, rank_ptr, pages_ptr, pages_stride, offsets_ptr, target, 1, rank_cap, NUM_TARGETS
    )
    if start < 0:
        return
    tok, tok_live = _segment_tokens(seg1_start_ptr, token_order_ptr, seg, blk, BLOCK_T)
    rows = tl.arange(0, BLOCK_R)
    row_live = rows < rank
    n0 = tl.program_id(1) * BLOCK_N
    cols = tl.arange(0, BLOCK_N)
    col_live = n0 + cols < d_out
    v_ptrs = v_ptr + tok[:, None] * v_stride + rows[None, :]
    vt = tl.load(v_ptrs, mask=tok_live[:, None] & row_live[None, :], other=0.0)
    page_ptrs = slot_pages + rows * tl.cdiv(d_out, PAGE) + n0 // PAGE
    page = tl.load(page_ptrs, mask=row_live, other=0).to(tl.int64)
    b_ptrs = pool_ptr + page[:, None] * PAGE + (n0 % PAGE) + cols[None, :]
    b = tl.load(b_ptrs, mask=row_live[:, None] & col_live[None, :], other=0.0)
    delta = tl.dot(vt.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    delta *= tl.load(scale_ptr + slot)
    o_ptrs = out_ptr + tok[:, None] * out_stride + n0 + cols[None, :]
    live = tok_live[:, None] & col_live[None, :]
    tl.store(o_ptrs, tl.load(o_ptrs, mask=live).to(tl.float32) + delta, mask=live)


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n (example: 4096, 256 -> 256; 192, 256 -> 64)."""
    block = 1
    while block * 2 <= cap and n % (block * 2) == 0:
        block *= 2
    return block


def _check(x: torch.Tensor, pool_layer: torch.Tensor, meta: LoraMeta, out: torch.Tensor) -> None:
    assert pool_layer.dim() == 2 and pool_layer.is_contiguous(), "pool_layer: [P, page_size]"
    assert pool_layer.shape[1] % 16 == 0, f"page_size {pool_layer.shape[1]}: a multiple of 16"
    assert x.dim() == 2 and out.dim() == 2 and x.shape[0] == out.shape[0], (x.shape, out.shape)
    assert x.stride(1) == 1 and out.stride(1) == 1, "rows must be contiguous"
    for name in ("b_slot", "token_order", "seg1_start", "seg_slot", "slot_rank", "slot_pages"):
        tensor = getattr(meta, name)
        assert tensor.dtype == torch.int32 and tensor.is_contiguous(), f"{name}: contiguous int32"
    assert meta.slot_offsets.dtype == torch.int32 and meta.slot_offsets.is_contiguous()
    assert meta.slot_scale.dtype == torch.float32
    assert meta.b_slot.shape[0] == x.shape[0] == meta.token_order.shape[0]


def _launch(kernel, grid, src, pool_layer, tokens, meta, target, out, rank_cap, width, warps,
            **blocks):  # fmt: skip
    """A LoRA kernel launch, in the argument order the four kernels share."""
    kernel[grid](src, src.stride(0), pool_layer, *tokens, meta.slot_rank, meta.slot_scale,
                 meta.slot_pages, meta.slot_pages.stride(0), meta.slot_offsets, target, out,
                 out.stride(0), rank_cap, width, PAGE=pool_layer.shape[1],
                 NUM_TARGETS=meta.slot_offsets.shape[1], num_warps=warps, **blocks)  # fmt: skip


def _segments(meta: LoraMeta) -> tuple:
    return meta.token_order, meta.seg1_start, meta.seg_slot, meta.seg_slot.shape[0]


def _use_gemv(meta: LoraMeta) -> bool:
    return meta.b_slot.shape[0] <= GEMV_MAX_TOKENS_PER_SEGMENT * max(1, meta.seg_slot.shape[0])


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def lora_shrink(
    x: torch.Tensor, pool_layer: torch.Tensor, meta: LoraMeta, target: int, out: torch.Tensor
) -> None:
    """First LoRA factor, gathered from pool pages, a different rank per adapter.

    Semantics: for each token t with slot s = b_slot[t] >= 0 and target present in s:
      out[t, :rank[s]] = x[t] @ A_s^T   (A_s: rank[s] rows of d_in, read from pages)
    Rows without adapter (slot -1) or whose adapter lacks the target are left untouched.
    Shape: x [T, d_in]; pool_layer [P, page_size]; out [T, max_rank] (fp32 or x's dtype).
    """
    (shrink_gemv if _use_gemv(meta) else shrink_gemm)(x, pool_layer, meta, target, out)


def lora_expand(
    v: torch.Tensor, pool_layer: torch.Tensor, meta: LoraMeta, target: int, out: torch.Tensor
) -> None:
    """Second LoRA factor, added in place into the base projection's output.

    Semantics: for each token t with slot s = b_slot[t] >= 0 and target present in s:
      out[t] += (v[t, :rank[s]] @ B_s^T) * scale[s]   (B_s^T: rank[s] rows of d_out, from pages)
    Shape: v [T, max_rank]; pool_layer [P, page_size]; out [T, d_out] (may be a column slice).
    """
    (expand_gemv if _use_gemv(meta) else expand_gemm)(v, pool_layer, meta, target, out)


def shrink_gemv(x, pool_layer, meta: LoraMeta, target: int, out) -> None:
    """``lora_shrink``, a program per (token, 16 rank rows): grid (T, ceil(max_rank / 16)),
    row steps of BLOCK_K = min(256, pow2 part of page_size) elements."""
    _check(x, pool_layer, meta, out)
    max_rank = min(meta.max_rank, out.shape[1])
    if x.shape[0] == 0 or max_rank == 0:
        return
    block_r = min(BLOCKS["gemv_rank"], triton.next_power_of_2(max_rank))
    block_k = _pow2_divisor(pool_layer.shape[1], BLOCKS["gemv_k"])
    grid = (x.shape[0], triton.cdiv(max_rank, block_r))
    tokens = (meta.b_slot, meta.token_order)
    _launch(_shrink_gemv_kernel, grid, x, pool_layer, tokens, meta, target, out, out.shape[1],
            x.shape[1], 4, BLOCK_R=block_r, BLOCK_K=block_k)  # fmt: skip


def expand_gemv(v, pool_layer, meta: LoraMeta, target: int, out) -> None:
    """``lora_expand``, a program per (token, BLOCK_N columns): grid (T, ceil(d_out / BLOCK_N)),
    the whole rank in one tile of next_pow2(max_rank) x BLOCK_N (about 4096 elements)."""
    _check(v, pool_layer, meta, out)
    max_rank = min(meta.max_rank, v.shape[1])
    if v.shape[0] == 0 or max_rank == 0:
        return
    block_r = triton.next_power_of_2(max_rank)
    block_n = min(BLOCKS["gemv_n"], max(16, BLOCKS["gemv_tile"] // block_r))
    block_n = _pow2_divisor(pool_layer.shape[1], block_n)
    grid = (v.shape[0], triton.cdiv(out.shape[1], block_n))
    tokens = (meta.b_slot, meta.token_order)
    _launch(_expand_gemv_kernel, grid, v, pool_layer, tokens, meta, target, out, v.shape[1],
            out.shape[1], 4, BLOCK_R=block_r, BLOCK_N=block_n)  # fmt: skip


def shrink_gemm(x, pool_layer, meta: LoraMeta, target: int, out) -> None:
    """``lora_shrink`` in tl.dot tiles [32 tokens of one segment] x [BLOCK_R <= 32 rank rows]:
    grid (ceil(T / 32) + S, ceil(max_rank / BLOCK_R)), an upper bound on the segment blocks."""
    _check(x, pool_layer, meta, out)
    assert x.dtype == pool_layer.dtype, "x and the pool must share a dtype for tl.dot"
    max_rank, num_segs = min(meta.max_rank, out.shape[1]), meta.seg_slot.shape[0]
    if x.shape[0] == 0 or num_segs == 0 or max_rank == 0:
        return
    block_t = BLOCKS["gemm_tokens"]
    block_r = min(BLOCKS["gemm_rank"], max(16, triton.next_power_of_2(max_rank)))
    block_k = _pow2_divisor(pool_layer.shape[1], BLOCKS["gemm_k"])
    grid = (triton.cdiv(x.shape[0], block_t) + num_segs, triton.cdiv(max_rank, block_r))
    _launch(_shrink_gemm_kernel, grid, x, pool_layer, _segments(meta), meta, target, out,
            out.shape[1], x.shape[1], 4, BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=block_k,
            BLOCK_S=BLOCKS["segment_chunk"], PRECISION=_precision(x.dtype))  # fmt: skip


def expand_gemm(v, pool_layer, meta: LoraMeta, target: int, out) -> None:
    """``lora_expand`` in tl.dot tiles [32 tokens of one segment] x [64 columns], the whole rank
    (next_pow2(max_rank), at least 16) in one step, 8 warps: grid (ceil(T / 32) + S, ceil(d_out /
    64)). v is fp32: the dot runs in tf32 (ieee for fp32 pools)."""
    _check(v, pool_layer, meta, out)
    max_rank, num_segs = min(meta.max_rank, v.shape[1]), meta.seg_slot.shape[0]
    if v.shape[0] == 0 or num_segs == 0 or max_rank == 0:
        return
    block_t = BLOCKS["gemm_tokens"]
    block_r = max(16, triton.next_power_of_2(max_rank))
    block_n = _pow2_divisor(pool_layer.shape[1], BLOCKS["gemm_n"])
    grid = (triton.cdiv(v.shape[0], block_t) + num_segs, triton.cdiv(out.shape[1], block_n))
    _launch(_expand_gemm_kernel, grid, v, pool_layer, _segments(meta), meta, target, out,
            v.shape[1], out.shape[1], 8, BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_N=block_n,
            BLOCK_S=BLOCKS["segment_chunk"], PRECISION=_precision(pool_layer.dtype))  # fmt: skip
