"""Triton LoRA shrink and expand: adapter rows gathered straight from pool pages, a different rank
per adapter, no padding to the largest rank (S-LoRA's MBGMM/MBGMV, tiled as SGLang's chunked SGMV).

Page layout (``kernels.ref.gather_lora_rows``): row j of slot s's factor lies in the pages
slot_pages[s, start + j * per_row + c], c = 0 .. per_row - 1, with start = slot_offsets[s, target,
which] and per_row = ceil(width / page_size); element k of the row is at offset k % page_size of
page c = k // page_size. Running example: page_size 4096, gate (d_in 4096, d_out 11008): an A row
is 1 page, a B^T row 3 pages (the third holds 2816 elements, then zeros). Blocks along a row
(BLOCK_K, BLOCK_N) divide page_size, so a block of a row lies in one page: one page index per row.

Two kernel families, split by segment length (``LoraMeta.vector_max``, 8 tokens by default):

Tiled (MBGMM), for segments longer than vector_max: the step's tokens, in ``token_order``
(sorted by slot, base tokens last), are cut into blocks of BLOCK_T. A program takes one block,
finds its first segment in ``pos_seg`` and walks the segments it overlaps, one ``tl.dot`` per
segment on the rows of that segment (the others masked, so never loaded). Example, BLOCK_T 16,
segments of 20 (slot 3), 1 (slot 7) and 1 (slot 0) tokens: block 0 = 16 tokens of slot 3, block 1
= 4 tokens of slot 3, then slot 7, then slot 0. A popular adapter's rows are read once per 16-32 of
its tokens; a decode token alone on its adapter costs its own rows. Blocks past the adapter tokens
return at once. The grid depends on T, max_rank and the widths only, never on the segment count,
so a captured decode step (segments padded with empty slot -1 ones) replays for any mix. Eager
steps put their long segments first and pass ``LoraMeta.tiled_tokens``: the grid then covers only
those tokens, and no block walks the short segments the vector kernels own (in a step of 16
prompt chunks and 248 decode rows on their own adapters, about 15 of them between two chunks).

Vector (MBGMV), for segments of at most vector_max tokens: one program per token (and target,
and split of d_in, or block of output columns), reading its own adapter's rows, stepping through
its own rank. A step of 256 tokens on 200 adapters needs no segment walk; in CUDA-graph decode
steps (vector_max = VECTOR_ALL) program t is token t and reads its slot from b_slot. Eager steps
that list their vector tokens (``LoraMeta.vector_tokens``: a step's 248 decode rows next to its
prefill chunks) run one program per listed token.

Either shrink splits the long reduction (d_in) over programs when the grid alone would leave the
GPU idle, writing fp32 partial sums that a second kernel adds into ``out``. A group of up to three
targets sharing one input (q, k, v; gate, up) is one launch of each kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention import sm_count
from kernels.meta import VECTOR_ALL, LoraMeta
from kernels.ref import lora_group

# Block sizes; the tests shrink them to reach every branch on tiny shapes. Blocks along a row are
# also capped by the largest power of two dividing page_size; tl.dot blocks stay >= 16. The
# sizes keep sm_90 builds spill-free (tests/test_kernels_build.py). Picked from sweeps on the
# H200 (benchmarks/h200-tuning/): decode steps of 256 and 128 tokens on 1000 adapters, and a
# step of 248 decode rows with 16 prompt chunks of 280 tokens.
BLOCKS = {
    "rank": 32,  # shrink: rank columns per program
    "k": 128,  # shrink: row elements per loop step
    "n": 64,  # expand: columns per program
    "split_min_k": 256,  # shrink: the fewest row elements a split reduces
    "vk": 256,  # vector shrink: row elements per loop step (at 64 rank rows; scaled to keep
    # the [rank, vk] tile at 16K elements)
    "vn": 256,  # vector expand: columns per program (likewise)
    "vwarps": 4,  # vector shrink: warps per program
    "vnwarps": 4,  # vector expand: warps per program
    "vwaves": 4,  # vector shrink: split d_in until the grid holds this many programs per SM
    "et": 64,  # tiled expand: tokens per block in prefill-sized steps
    "dt": 16,  # tiled shrink: tokens per block in decode-sized steps (at most 256 tokens)
    "det": 16,  # tiled expand: tokens per block in decode-sized steps
    "vr": 16,  # vector kernels: rank rows per step (0: the largest rank of the step at once)
    "vgrid": 1,  # vector shrink: 1 puts the rank-row blocks in the grid instead of a loop
    "vstages": 2,  # vector shrink: software-pipeline stages of the d_in loop (0: plain loop)
    "twarps": 4,  # tiled kernels: warps per program
    "er": 16,  # tiled expand: rank rows per dot, looped to each segment's own rank (0: the
    # step's largest rank in one dot, every segment padded to it: 26% slower in the mixed step)
}


# The most splits of d_in a shrink uses (tiled, vector). The reduction kernel's split block is
# that bound, not the step's count, so steps of any size share its two builds.
MAX_SPLITS, MAX_VECTOR_SPLITS = 64, 16


def block_tokens(num_tokens: int, expand: bool = False) -> int:
    """Tokens per block of the tiled shrink (expand): BLOCKS["dt"] (["det"]) in decode-sized
    steps, at most 256 tokens; in prefills 32 (64 spilled on sm_90 at BLOCK_K 128 and 4 warps)
    (BLOCKS["et"])."""
    if num_tokens <= 256:
        return BLOCKS["det" if expand else "dt"]
    return BLOCKS["et"] if expand else 32


@triton.jit
def _factor(slot, rank_ptr, pages_ptr, pages_stride, offsets_ptr, target, which, rank_cap,
            NUM_TARGETS: tl.constexpr):  # fmt: skip
    """(start in slot_pages, -1 without the target; rank; pointer to slot_pages[slot, start])."""
    start = tl.load(offsets_ptr + (slot * NUM_TARGETS + target) * 2 + which)
    rank = tl.minimum(tl.load(rank_ptr + slot), rank_cap)
    return start, rank, pages_ptr + slot.to(tl.int64) * pages_stride + start


@triton.jit(do_not_specialize=["num_tokens", "num_segs", "target0", "target1", "target2",
                               "out_stride", "rank_cap", "vector_max", "rank_blocks"])  # fmt: skip
def _shrink_kernel(x_ptr, x_stride, pool_ptr, token_order_ptr, seg1_start_ptr, seg_slot_ptr,
                   pos_seg_ptr, num_tokens, num_segs, rank_ptr, scale_ptr, pages_ptr,
                   pages_stride, offsets_ptr, target0, target1, target2, rank_blocks, out_ptr,
                   out_stride, rank_cap, d_in, k_per_split, vector_max, PAGE: tl.constexpr,
                   NUM_TARGETS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
                   PRECISION: tl.constexpr):  # fmt: skip
    b0 = tl.program_id(0) * BLOCK_T
    j = tl.program_id(1) // rank_blocks  # the group's j-th target; its rows at columns j * rank_cap
    r0 = (tl.program_id(1) % rank_blocks) * BLOCK_R
    target = tl.where(j == 0, target0, tl.where(j == 1, target1, target2))
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(d_in, k_lo + k_per_split)
    seg = tl.load(pos_seg_ptr + b0)  # the first segment ending after b0
    if seg >= num_segs:
        return
    ii = b0 + tl.arange(0, BLOCK_T)
    tok = tl.load(token_order_ptr + ii, mask=ii < num_tokens, other=0).to(tl.int64)
    rows = r0 + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_K)
    if not PARTIAL:
        dst = out_ptr + tok[:, None] * out_stride + j * rank_cap + rows[None, :]
    else:  # partial sums [splits, T, out_stride], added up by _shrink_reduce_kernel
        part = tl.program_id(2) * num_tokens + tok
        dst = out_ptr + part[:, None] * out_stride + j * rank_cap + rows[None, :]
    lo = tl.load(seg1_start_ptr + seg)
    hi = tl.load(seg1_start_ptr + seg + 1)
    while (lo < b0 + BLOCK_T) & (lo < hi):
        slot = tl.load(seg_slot_ptr + seg)
        start, rank, slot_pages = _factor(
            slot, rank_ptr, pages_ptr, pages_stride, offsets_ptr, target, 0, rank_cap, NUM_TARGETS
        )
        if (slot >= 0) & (start >= 0) & (r0 < rank) & (hi - lo > vector_max):
            in_seg = (ii >= lo) & (ii < hi)
            row_live = rows < rank
            row_pages = slot_pages + rows * tl.cdiv(d_in, PAGE)  # element k: row_pages[k // PAGE]
            acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                col_live = k0 + cols < k_hi
                x_ptrs = x_ptr + tok[:, None] * x_stride + k0 + cols[None, :]
                xt = tl.load(x_ptrs, mask=in_seg[:, None] & col_live[None, :], other=0.0)
                page = tl.load(row_pages + k0 // PAGE, mask=row_live, other=0).to(tl.int64)
                k_in_page = tl.multiple_of(k0 % PAGE, BLOCK_K)  # keeps 16-byte loads
                a_ptrs = pool_ptr + page[:, None] * PAGE + k_in_page + cols[None, :]
                a = tl.load(a_ptrs, mask=row_live[:, None] & col_live[None, :], other=0.0)
                acc = tl.dot(xt, tl.trans(a), acc, input_precision=PRECISION)
            tl.store(dst, acc, mask=in_seg[:, None] & row_live[None, :])
        seg += 1
        lo = hi
        hi = tl.load(seg1_start_ptr + tl.minimum(seg + 1, num_segs))


@triton.jit(do_not_specialize=["num_splits", "num_tokens", "num_segs", "target0", "target1",
                               "target2", "part_stride", "rank_cap", "vector_max"])  # fmt: skip
def _shrink_reduce_kernel(part_ptr, part_stride, num_splits, num_tokens, b_slot_ptr,
                          token_order_ptr, seg1_start_ptr, seg_slot_ptr, pos_seg_ptr, num_segs,
                          rank_ptr, offsets_ptr, target0, target1, target2, out_ptr, out_stride,
                          rank_cap, vector_max, NUM_TARGETS: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_SPLIT: tl.constexpr, VECTOR: tl.constexpr, ALL: tl.constexpr,
                          INDEXED: tl.constexpr):  # fmt: skip
    """Adds the fp32 partial sums of the tokens one path (VECTOR: short segments) computed."""
    i = tl.program_id(0)  # sorted position (token with ALL)
    j = tl.program_id(1)
    target = tl.where(j == 0, target0, tl.where(j == 1, target1, target2))
    if VECTOR:
        t, slot = _vector_token(b_slot_ptr, token_order_ptr, seg1_start_ptr, seg_slot_ptr,
                                pos_seg_ptr, num_segs, vector_max, i, ALL, INDEXED)  # fmt: skip
    else:
        seg = tl.load(pos_seg_ptr + i)
        safe = tl.minimum(seg, num_segs - 1)
        length = tl.load(seg1_start_ptr + safe + 1) - tl.load(seg1_start_ptr + safe)
        t = tl.load(token_order_ptr + i).to(tl.int64)
        slot = tl.where((seg < num_segs) & (length > vector_max), tl.load(seg_slot_ptr + safe), -1)
    if slot < 0:
        return
    start = tl.load(offsets_ptr + (slot * NUM_TARGETS + target) * 2)
    rank = tl.minimum(tl.load(rank_ptr + slot), rank_cap)
    if start < 0:
        return
    rows = tl.arange(0, BLOCK_R)
    splits = tl.arange(0, BLOCK_SPLIT)
    part_ptrs = (part_ptr + (splits[:, None] * num_tokens + t).to(tl.int64) * part_stride
                 + j * rank_cap + rows)  # fmt: skip
    live = (splits < num_splits)[:, None] & (rows < rank)[None, :]
    total = tl.sum(tl.load(part_ptrs, mask=live, other=0.0), 0)
    tl.store(out_ptr + t.to(tl.int64) * out_stride + j * rank_cap + rows, total, mask=rows < rank)


@triton.jit
def _vector_token(b_slot_ptr, token_order_ptr, seg1_start_ptr, seg_slot_ptr, pos_seg_ptr, num_segs,
                  vector_max, i, ALL: tl.constexpr, INDEXED: tl.constexpr):  # fmt: skip
    """(token, slot) of program i when the vector path owns that token, else (_, -1). ALL: every
    adapter token is on the vector path (CUDA-graph decode steps) and program i is token i, its
    slot one load away. INDEXED: token_order_ptr holds the vector path's tokens
    (``LoraMeta.vector_tokens``) and program i takes the i-th. Else i is a sorted position, owned
    when its segment (one load from pos_seg) has at most vector_max tokens and an adapter."""
    if ALL:
        tok = i.to(tl.int64)
        slot = tl.load(b_slot_ptr + i)
    elif INDEXED:
        tok = tl.load(token_order_ptr + i).to(tl.int64)
        slot = tl.load(b_slot_ptr + tok)
    else:
        seg = tl.load(pos_seg_ptr + i)
        safe = tl.minimum(seg, num_segs - 1)
        length = tl.load(seg1_start_ptr + safe + 1) - tl.load(seg1_start_ptr + safe)
        mine = (seg < num_segs) & (length <= vector_max)
        tok = tl.load(token_order_ptr + i).to(tl.int64)
        slot = tl.where(mine, tl.load(seg_slot_ptr + safe), -1)
    return tok, slot


@triton.jit(do_not_specialize=["num_segs", "num_tokens", "target0", "target1", "target2",
                               "out_stride", "rank_cap", "vector_max", "rank_blocks"])  # fmt: skip
def _shrink_vector_kernel(x_ptr, x_stride, pool_ptr, b_slot_ptr, token_order_ptr, seg1_start_ptr,
                          seg_slot_ptr, pos_seg_ptr, num_tokens, num_segs, rank_ptr, pages_ptr,
                          pages_stride, offsets_ptr, target0, target1, target2, rank_blocks, r_span,
                          out_ptr, out_stride, rank_cap, d_in, k_per_split, vector_max,
                          PAGE: tl.constexpr,
                          NUM_TARGETS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                          PARTIAL: tl.constexpr, ALL: tl.constexpr, INDEXED: tl.constexpr,
                          STAGES: tl.constexpr, ONE_PAGE: tl.constexpr):  # fmt: skip
    """One token (program_id(0), see _vector_token) of a short segment, one target of the group
    and one span of r_span rank rows (program_id(1) = target * rank_blocks + span), one split of
    d_in (program_id(2)): acc[r] = sum_k x[k] A[r, k]. With rank_blocks 1 the span is the whole
    rank, walked BLOCK_R rows at a time."""
    tok, slot = _vector_token(b_slot_ptr, token_order_ptr, seg1_start_ptr, seg_slot_ptr,
                              pos_seg_ptr, num_segs, vector_max, tl.program_id(0), ALL,
                              INDEXED)  # fmt: skip
    if slot < 0:
        return
    j = tl.program_id(1) // rank_blocks
    r_first = (tl.program_id(1) % rank_blocks) * r_span
    target = tl.where(j == 0, target0, tl.where(j == 1, target1, target2))
    start, rank, slot_pages = _factor(
        slot, rank_ptr, pages_ptr, pages_stride, offsets_ptr, target, 0, rank_cap, NUM_TARGETS
    )
    if start < 0:
        return
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(d_in, k_lo + k_per_split)
    cols = tl.arange(0, BLOCK_K)
    row = tok
    if PARTIAL:  # partial sums [splits, T, out_stride], added up by _shrink_reduce_kernel
        row = tl.program_id(2) * num_tokens + tok
    r_stop = tl.minimum(rank, r_first + r_span)
    for r0 in range(r_first, r_stop, BLOCK_R):  # the adapter's own rank, BLOCK_R rows at a time
        rows = r0 + tl.arange(0, BLOCK_R)
        row_live = rows < rank
        row_pages = slot_pages + rows * tl.cdiv(d_in, PAGE)
        # ONE_PAGE (d_in <= PAGE): a row is one page, looked up once instead of per chunk
        if ONE_PAGE:
            first = tl.load(row_pages, mask=row_live, other=0).to(tl.int64)
        else:
            first = rows.to(tl.int64) * 0  # unused
        x_row = x_ptr + tok * x_stride
        acc = tl.zeros([BLOCK_R], tl.float32)
        if STAGES > 0:
            for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
                acc += _row_dots(x_row, pool_ptr, row_pages, first, row_live, k0, k_hi, cols,
                                 PAGE, BLOCK_K, ONE_PAGE)  # fmt: skip
        else:
            for k0 in range(k_lo, k_hi, BLOCK_K):
                acc += _row_dots(x_row, pool_ptr, row_pages, first, row_live, k0, k_hi, cols,
                                 PAGE, BLOCK_K, ONE_PAGE)  # fmt: skip
        tl.store(out_ptr + row * out_stride + j * rank_cap + rows, acc, mask=row_live)


@triton.jit
def _row_dots(x_row, pool_ptr, row_pages, first, row_live, k0, k_hi, cols, PAGE: tl.constexpr,
              BLOCK_K: tl.constexpr, ONE_PAGE: tl.constexpr):  # fmt: skip
    """sum_k x[k0 + k] A[r, k0 + k] over one chunk of columns, for each row r of a block."""
    col_live = k0 + cols < k_hi
    xv = tl.load(x_row + k0 + cols, mask=col_live, other=0.0).to(tl.float32)
    if ONE_PAGE:
        page = first
    else:
        page = tl.load(row_pages + k0 // PAGE, mask=row_live, other=0).to(tl.int64)
    k_in_page = tl.multiple_of(k0 % PAGE, BLOCK_K)  # a block start: keeps 16-byte loads
    a_ptrs = pool_ptr + page[:, None] * PAGE + k_in_page + cols[None, :]
    a = tl.load(a_ptrs, mask=row_live[:, None] & col_live[None, :], other=0.0)
    return tl.sum(a.to(tl.float32) * xv[None, :], 1)


@triton.jit(do_not_specialize=["num_segs", "target0", "target1", "target2", "v_stride",
                               "rank_cap", "vector_max"])  # fmt: skip
def _expand_vector_kernel(v_ptr, v_stride, pool_ptr, b_slot_ptr, token_order_ptr, seg1_start_ptr,
                          seg_slot_ptr, pos_seg_ptr, num_segs, rank_ptr, scale_ptr, pages_ptr,
                          pages_stride, offsets_ptr, target0, target1, target2, col0, col1, col2,
                          width0, width1, width2, blocks1, blocks2, out_ptr, out_stride, rank_cap,
                          vector_max, PAGE: tl.constexpr, NUM_TARGETS: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ALL: tl.constexpr,
                          INDEXED: tl.constexpr):  # fmt: skip
    """One token of a short segment, one block of BLOCK_N output columns of one target:
    out[n] += scale * sum_r v[r] B^T[r, n]."""
    tok, slot = _vector_token(b_slot_ptr, token_order_ptr, seg1_start_ptr, seg_slot_ptr,
                              pos_seg_ptr, num_segs, vector_max, tl.program_id(0), ALL,
                              INDEXED)  # fmt: skip
    if slot < 0:
        return
    nb = tl.program_id(1)
    j = (nb >= blocks1).to(tl.int32) + (nb >= blocks2).to(tl.int32)
    target = tl.where(j == 0, target0, tl.where(j == 1, target1, target2))
    start, rank, slot_pages = _factor(
        slot, rank_ptr, pages_ptr, pages_stride, offsets_ptr, target, 1, rank_cap, NUM_TARGETS
    )
    if start < 0:
        return
    col = tl.where(j == 0, col0, tl.where(j == 1, col1, col2))
    d_out = tl.where(j == 0, width0, tl.where(j == 1, width1, width2))
    n0 = (nb - tl.where(j == 0, 0, tl.where(j == 1, blocks1, blocks2))) * BLOCK_N
    cols = tl.arange(0, BLOCK_N)
    col_live = n0 + cols < d_out
    delta = tl.zeros([BLOCK_N], tl.float32)
    # The adapter's own rank, BLOCK_R rows at a time. (Software-pipelining this loop in 2 stages
    # timed the same on the H200, 3 stages slower: benchmarks/h200-knobs-9e7231f.)
    for r0 in range(0, rank, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_live = rows < rank
        vv = tl.load(v_ptr + tok * v_stride + j * rank_cap + rows, mask=row_live, other=0.0)
        page_ptrs = slot_pages + rows * tl.cdiv(d_out, PAGE) + n0 // PAGE
        page = tl.load(page_ptrs, mask=row_live, other=0)
        n_in_page = tl.multiple_of(n0 % PAGE, BLOCK_N)  # a block start: keeps 16-byte loads
        b_ptrs = pool_ptr + page.to(tl.int64)[:, None] * PAGE + n_in_page + cols[None, :]
        b = tl.load(b_ptrs, mask=row_live[:, None] & col_live[None, :], other=0.0)
        delta += tl.sum(b.to(tl.float32) * vv.to(tl.float32)[:, None], 0)
    delta = delta * tl.load(scale_ptr + slot)
    o_ptrs = out_ptr + tok * out_stride + col + n0 + cols
    tl.store(o_ptrs, tl.load(o_ptrs, mask=col_live).to(tl.float32) + delta, mask=col_live)


@triton.jit(do_not_specialize=["num_tokens", "num_segs", "target0", "target1", "target2",
                               "v_stride", "rank_cap", "vector_max"])  # fmt: skip
def _expand_kernel(v_ptr, v_stride, pool_ptr, token_order_ptr, seg1_start_ptr, seg_slot_ptr,
                   pos_seg_ptr, num_tokens, num_segs, rank_ptr, scale_ptr, pages_ptr,
                   pages_stride, offsets_ptr, target0, target1, target2, col0, col1, col2, width0,
                   width1, width2, blocks1, blocks2, out_ptr, out_stride, rank_cap, vector_max,
                   PAGE: tl.constexpr,
                   NUM_TARGETS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    b0 = tl.program_id(0) * BLOCK_T
    seg = tl.load(pos_seg_ptr + b0)  # the first segment ending after b0
    if seg >= num_segs:
        return
    # Column blocks of the group's targets one after another: target j owns blocks
    # [blocks_j, blocks_j+1) (blocks_0 = 0) and writes columns col_j .. col_j + width_j of out.
    nb = tl.program_id(1)
    j = (nb >= blocks1).to(tl.int32) + (nb >= blocks2).to(tl.int32)
    target = tl.where(j == 0, target0, tl.where(j == 1, target1, target2))
    col = tl.where(j == 0, col0, tl.where(j == 1, col1, col2))
    d_out = tl.where(j == 0, width0, tl.where(j == 1, width1, width2))
    n0 = (nb - tl.where(j == 0, 0, tl.where(j == 1, blocks1, blocks2))) * BLOCK_N
    ii = b0 + tl.arange(0, BLOCK_T)
    tok = tl.load(token_order_ptr + ii, mask=ii < num_tokens, other=0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    col_live = n0 + cols < d_out
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    touched = ii < 0  # rows whose adapter has the target: the only rows written
    lo = tl.load(seg1_start_ptr + seg)
    hi = tl.load(seg1_start_ptr + seg + 1)
    while (lo < b0 + BLOCK_T) & (lo < hi):
        slot = tl.load(seg_slot_ptr + seg)
        start, rank, slot_pages = _factor(
            slot, rank_ptr, pages_ptr, pages_stride, offsets_ptr, target, 1, rank_cap, NUM_TARGETS
        )
        if (slot >= 0) & (start >= 0) & (hi - lo > vector_max):
            in_seg = (ii >= lo) & (ii < hi)
            delta = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
            for r0 in range(0, rank, BLOCK_R):  # this adapter's own rank, BLOCK_R rows a dot
                rows = r0 + tl.arange(0, BLOCK_R)
                row_live = rows < rank
                v_ptrs = v_ptr + tok[:, None] * v_stride + j * rank_cap + rows[None, :]
                vt = tl.load(v_ptrs, mask=in_seg[:, None] & row_live[None, :], other=0.0)
                page_ptrs = slot_pages + rows * tl.cdiv(d_out, PAGE) + n0 // PAGE
                page = tl.load(page_ptrs, mask=row_live, other=0).to(tl.int64)
                n_in_page = tl.multiple_of(n0 % PAGE, BLOCK_N)  # keeps 16-byte loads
                b_ptrs = pool_ptr + page[:, None] * PAGE + n_in_page + cols[None, :]
                b = tl.load(b_ptrs, mask=row_live[:, None] & col_live[None, :], other=0.0)
                delta = tl.dot(vt.to(tl.float32), b.to(tl.float32), delta,
                               input_precision=PRECISION)  # fmt: skip
            acc += delta * tl.load(scale_ptr + slot)
            touched = touched | in_seg
        seg += 1
        lo = hi
        hi = tl.load(seg1_start_ptr + tl.minimum(seg + 1, num_segs))
    o_ptrs = out_ptr + tok[:, None] * out_stride + col + n0 + cols[None, :]
    live = touched[:, None] & col_live[None, :]
    tl.store(o_ptrs, tl.load(o_ptrs, mask=live).to(tl.float32) + acc, mask=live)


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
    if meta.vector_tokens is not None:
        assert meta.vector_tokens.dtype == torch.int32 and meta.vector_tokens.is_contiguous()
    if meta.tiled_tokens is not None:
        assert 0 <= meta.tiled_tokens <= x.shape[0], (meta.tiled_tokens, x.shape[0])
    assert meta.b_slot.shape[0] == x.shape[0] == meta.token_order.shape[0]


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _padded(targets: tuple[int, ...]) -> tuple[int, int, int]:
    """A group of targets padded to 3 for the kernels' scalar arguments."""
    return targets + (targets[-1],) * (3 - len(targets))


def _column_blocks(widths: list[int], block_n: int) -> tuple[int, int, int]:
    """(first block of target 1, first block of target 2, all blocks) when the group's targets'
    columns are cut into blocks of block_n one target after another; a target the group lacks
    starts at the end, so no block reaches it."""
    blocks = [triton.cdiv(w, block_n) for w in widths]
    total = sum(blocks)
    first1 = blocks[0] if len(blocks) > 1 else total
    first2 = blocks[0] + blocks[1] if len(blocks) > 2 else total
    return first1, first2, total


def shrink_splits(device: torch.device, num_tokens: int, max_rank: int, d_in: int,
                  num_targets: int = 1) -> int:  # fmt: skip
    """Splits of the reduction, from host ints only: enough programs for ~4 waves of the SMs,
    each split at least BLOCKS["split_min_k"] elements long."""
    block_r = tiled_rank_block(max_rank)
    programs = (triton.cdiv(num_tokens, block_tokens(num_tokens))
                * triton.cdiv(max_rank, block_r) * num_targets)  # fmt: skip
    want = triton.cdiv(4 * sm_count(device), programs)
    return max(1, min(want, d_in // BLOCKS["split_min_k"], MAX_SPLITS))


def lora_shrink(
    x: torch.Tensor,
    pool_layer: torch.Tensor,
    meta: LoraMeta,
    target: int | tuple[int, ...],
    out: torch.Tensor,
) -> None:
    """First LoRA factor, gathered from pool pages, a different rank per adapter: the semantics
    of ``kernels.ref.lora_shrink``, in one launch of each kernel family for the whole group.

    Tiled grid (ceil(T / BLOCK_T), G * ceil(max_rank / BLOCK_R), splits): tl.dot tiles
    [BLOCK_T, BLOCK_K] x [BLOCK_K, BLOCK_R] on BLOCKS["twarps"] warps. Vector grid (tokens, see
    ``_vector_pick``; G * rank blocks, or G with ``vgrid`` 0; splits). With splits > 1 a second
    kernel, grid (tokens, G), adds the fp32 partial sums into out.
    """
    _check(x, pool_layer, meta, out)
    assert x.dtype == pool_layer.dtype, "x and the pool must share a dtype for tl.dot"
    targets = lora_group(target)
    group, targets = len(targets), _padded(targets)
    num_tokens, d_in = x.shape
    rank_cap = out.shape[1] // group
    max_rank, num_segs = min(meta.max_rank, rank_cap), meta.seg_slot.shape[0]
    if num_tokens == 0 or num_segs == 0 or max_rank == 0:
        return
    page = pool_layer.shape[1]
    span = _tiled_span(meta, num_tokens)
    if meta.longest > meta.vector_max and span > 0:  # tiled: segments longer than vector_max
        common = (meta.token_order, meta.seg1_start, meta.seg_slot,
                  position_segments(meta, num_tokens), num_tokens, num_segs)  # fmt: skip
        block_t, block_k = block_tokens(span), _pow2_divisor(page, BLOCKS["k"])
        block_r = tiled_rank_block(max_rank)
        rank_blocks = triton.cdiv(max_rank, block_r)
        splits = shrink_splits(x.device, span, max_rank, d_in, group)
        k_per_split = triton.cdiv(triton.cdiv(d_in, splits), block_k) * block_k
        splits = triton.cdiv(d_in, k_per_split)  # every split has work
        dst = _partials(out, splits)
        grid = (triton.cdiv(span, block_t), group * rank_blocks, splits)
        _shrink_kernel[grid](
            x, x.stride(0), pool_layer, *common, meta.slot_rank, meta.slot_scale,
            meta.slot_pages, meta.slot_pages.stride(0), meta.slot_offsets, *targets, rank_blocks,
            dst, dst.stride(-2), rank_cap, d_in, k_per_split, meta.vector_max, PAGE=page,
            NUM_TARGETS=meta.slot_offsets.shape[1], BLOCK_T=block_t, BLOCK_R=block_r,
            BLOCK_K=block_k, PARTIAL=splits > 1, PRECISION=_precision(x.dtype),
            num_warps=BLOCKS["twarps"])  # fmt: skip
        _reduce(dst, splits, meta, targets, group, out, rank_cap, vector=False)
    if meta.shortest <= meta.vector_max:  # vector: one token per program
        block_r, block_k = vector_block(page, max_rank, "vk")
        # the rank as one span walked block by block, or each block its own program
        rank_blocks = triton.cdiv(max_rank, block_r) if BLOCKS["vgrid"] else 1
        r_span = block_r if BLOCKS["vgrid"] else rank_cap
        rows, picked, pick, pos_seg = _vector_pick(meta, num_tokens)
        programs = rows * group * rank_blocks
        want = triton.cdiv(BLOCKS["vwaves"] * sm_count(x.device), max(programs, 1))
        splits = max(1, min(want, d_in // BLOCKS["split_min_k"], MAX_VECTOR_SPLITS))
        k_per_split = triton.cdiv(triton.cdiv(d_in, splits), block_k) * block_k
        splits = triton.cdiv(d_in, k_per_split)
        dst = _partials(out, splits)
        if rows == 0:
            return
        _shrink_vector_kernel[(rows, group * rank_blocks, splits)](
            x, x.stride(0), pool_layer, meta.b_slot, picked, meta.seg1_start, meta.seg_slot,
            pos_seg, num_tokens, num_segs, meta.slot_rank,
            meta.slot_pages, meta.slot_pages.stride(0), meta.slot_offsets, *targets, rank_blocks,
            r_span, dst, dst.stride(-2), rank_cap, d_in, k_per_split, meta.vector_max, PAGE=page,
            NUM_TARGETS=meta.slot_offsets.shape[1], BLOCK_R=block_r, BLOCK_K=block_k,
            PARTIAL=splits > 1, **pick, STAGES=BLOCKS["vstages"], ONE_PAGE=d_in <= page,
            num_warps=BLOCKS["vwarps"])  # fmt: skip
        _reduce(dst, splits, meta, targets, group, out, rank_cap, vector=True)


def _vector_pick(meta: LoraMeta, num_tokens: int) -> tuple[int, torch.Tensor, dict, torch.Tensor]:
    """How the vector kernels find their tokens: (programs, the array passed as token_order,
    the ALL/INDEXED flags, the array passed as pos_seg). Graph decode steps: every token, its
    slot from b_slot. Steps with ``vector_tokens``: just those tokens. Else every sorted
    position, its segment from ``position_segments``. pos_seg is read only in the last case."""
    if meta.vector_max >= VECTOR_ALL:
        return num_tokens, meta.token_order, {"ALL": True, "INDEXED": False}, meta.seg1_start
    if meta.vector_tokens is not None:
        picked = meta.vector_tokens
        return picked.shape[0], picked, {"ALL": False, "INDEXED": True}, meta.seg1_start
    pick = {"ALL": False, "INDEXED": False}
    return num_tokens, meta.token_order, pick, position_segments(meta, num_tokens)


def position_segments(meta: LoraMeta, num_tokens: int) -> torch.Tensor:
    """``meta.pos_seg``: the first segment ending after each sorted position, so a program finds
    its segment with one load instead of a binary search of seg1_start (9 dependent loads at 264
    segments). When the step did not bring it, a fresh one is built from seg1_start on the device
    at each call and never kept in meta: a CUDA graph captured from such a meta rebuilds it at
    every replay instead of replaying one built from the warm-up's segments."""
    if meta.pos_seg is not None:
        return meta.pos_seg
    positions = torch.arange(num_tokens, dtype=torch.int32, device=meta.seg1_start.device)
    return torch.searchsorted(meta.seg1_start[1:], positions, right=True).to(torch.int32)


def _tiled_span(meta: LoraMeta, num_tokens: int) -> int:
    """The sorted positions the tiled kernels cover: ``meta.tiled_tokens`` when the step brings
    it (its long segments first), else all of them."""
    return num_tokens if meta.tiled_tokens is None else meta.tiled_tokens


def vector_block(page: int, max_rank: int, knob: str) -> tuple[int, int]:
    """The vector kernels' tile (rank rows, row elements): the whole largest rank at once, or
    with BLOCKS["vr"] > 0 that many rows at a time, so an adapter's loop runs to its own rank
    only; and BLOCKS[knob] ("vk": shrink, "vn": expand) row elements at 64 rows, scaled to keep
    the tile's size, capped by what divides page."""
    whole = _whole_rank(max_rank)
    block_r = min(whole, BLOCKS["vr"]) if BLOCKS["vr"] else whole
    return block_r, _pow2_divisor(page, max(16, BLOCKS[knob] * 64 // block_r))


def expand_rank_block(max_rank: int) -> int:
    """Rank rows per dot of the tiled expand: the step's largest rank at once (at least 16, as
    tl.dot needs), or with BLOCKS["er"] that many, looped to each segment's own rank."""
    whole = _whole_rank(max_rank)
    return min(whole, max(16, BLOCKS["er"])) if BLOCKS["er"] else whole


def tiled_rank_block(max_rank: int) -> int:
    """Rank columns per program of the tiled shrink."""
    return min(BLOCKS["rank"], _whole_rank(max_rank))


def _whole_rank(max_rank: int) -> int:
    """The step's largest rank as one tile: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(max_rank))


def _partials(out: torch.Tensor, splits: int) -> torch.Tensor:
    """Where a shrink writes: out itself, or fp32 partial sums [splits, T, width] to reduce."""
    if splits == 1:
        return out
    return out.new_empty(splits, out.shape[0], out.shape[1], dtype=torch.float32)


def _reduce(dst, splits, meta, targets, group, out, rank_cap, vector: bool) -> None:
    if splits == 1:
        return
    num_tokens = out.shape[0]
    if vector:
        rows, picked, pick, pos_seg = _vector_pick(meta, num_tokens)
    else:
        rows, picked = _tiled_span(meta, num_tokens), meta.token_order
        pick, pos_seg = {"ALL": False, "INDEXED": False}, position_segments(meta, num_tokens)
    _shrink_reduce_kernel[(rows, group)](
        dst, dst.stride(1), splits, num_tokens, meta.b_slot, picked, meta.seg1_start,
        meta.seg_slot, pos_seg, meta.seg_slot.shape[0], meta.slot_rank, meta.slot_offsets,
        *targets, out, out.stride(0), rank_cap, meta.vector_max,
        NUM_TARGETS=meta.slot_offsets.shape[1], BLOCK_R=triton.next_power_of_2(rank_cap),
        BLOCK_SPLIT=MAX_VECTOR_SPLITS if vector else MAX_SPLITS, VECTOR=vector, **pick,
        num_warps=4)  # fmt: skip


def lora_expand(
    v: torch.Tensor,
    pool_layer: torch.Tensor,
    meta: LoraMeta,
    target: int | tuple[int, ...],
    out: torch.Tensor,
    cols: tuple[tuple[int, int], ...] | None = None,
) -> None:
    """Second LoRA factor, added in place into the base projection's output: the semantics of
    ``kernels.ref.lora_expand``, in one launch of each kernel family for the whole group.

    Vector grid (tokens, see ``_vector_pick``; column blocks of all G targets), one token each,
    stepping through its adapter's rank. Tiled grid (ceil(T / BLOCK_T), column blocks of all G
    targets): tl.dot tiles [BLOCK_T, R'] x [R', BLOCK_N] (R' from ``expand_rank_block``: the
    step's largest rank, or BLOCKS["er"] rows a dot up to each segment's own rank), on
    BLOCKS["twarps"] warps. v is fp32: the dot runs in tf32 (ieee for fp32 pools).
    """
    _check(v, pool_layer, meta, out)
    targets = lora_group(target)
    group, targets = len(targets), _padded(targets)
    cols = cols if cols is not None else ((0, out.shape[1]),)
    assert len(cols) == group, f"{group} targets, {len(cols)} column ranges"
    num_tokens = out.shape[0]
    rank_cap = v.shape[1] // group
    max_rank, num_segs = min(meta.max_rank, rank_cap), meta.seg_slot.shape[0]
    if num_tokens == 0 or num_segs == 0 or max_rank == 0:
        return
    page = pool_layer.shape[1]
    span = _tiled_span(meta, num_tokens)
    block_t, block_n = block_tokens(span, expand=True), _pow2_divisor(page, BLOCKS["n"])
    widths = [hi - lo for lo, hi in cols]
    starts = [lo for lo, _ in cols]
    common = (meta.slot_rank, meta.slot_scale, meta.slot_pages, meta.slot_pages.stride(0),
              meta.slot_offsets, *targets, *_padded(tuple(starts)),
              *_padded(tuple(widths)))  # fmt: skip
    if meta.longest > meta.vector_max and span > 0:
        first1, first2, total = _column_blocks(widths, block_n)
        grid = (triton.cdiv(span, block_t), total)
        _expand_kernel[grid](
            v, v.stride(0), pool_layer, meta.token_order, meta.seg1_start, meta.seg_slot,
            position_segments(meta, num_tokens), num_tokens, num_segs, *common, first1, first2,
            out, out.stride(0), rank_cap, meta.vector_max, PAGE=page,
            NUM_TARGETS=meta.slot_offsets.shape[1], BLOCK_T=block_t,
            BLOCK_R=expand_rank_block(max_rank), BLOCK_N=block_n,
            PRECISION=_precision(pool_layer.dtype), num_warps=BLOCKS["twarps"])  # fmt: skip
    if meta.shortest <= meta.vector_max:
        block_r, block_n = vector_block(page, max_rank, "vn")
        first1, first2, total = _column_blocks(widths, block_n)
        rows, picked, pick, pos_seg = _vector_pick(meta, num_tokens)
        if rows == 0:
            return
        _expand_vector_kernel[(rows, total)](
            v, v.stride(0), pool_layer, meta.b_slot, picked, meta.seg1_start, meta.seg_slot,
            pos_seg, num_segs, *common, first1, first2, out, out.stride(0), rank_cap,
            meta.vector_max, PAGE=page, NUM_TARGETS=meta.slot_offsets.shape[1], BLOCK_R=block_r,
            BLOCK_N=block_n, **pick, num_warps=BLOCKS["vnwarps"])  # fmt: skip
