"""LoRA shrink, the first factor (x A^T per token's adapter): the tiled kernel
(``_shrink_kernel``), the vector kernel (``_shrink_vector_kernel`` and its ``_row_dots``), the
split reduction (``_shrink_reduce_kernel``) and the launcher ``lora_shrink``. The paths and the
page layout: ``slora_kernels.lora_paths``.

Either shrink splits the long reduction (d_in) over programs when the grid alone would leave the
GPU idle, writing fp32 partial sums that a second kernel adds into ``out``; with fp8 rows each
partial carries its rows' scales, so the sum does too.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from slora_kernels.attention import sm_count
from slora_kernels.lora_blocks import (
    BLOCKS,
    _pow2_divisor,
    aligned_rank_block,
    block_tokens,
    tiled_rank_block,
    vector_block,
)
from slora_kernels.lora_paths import (
    _check,
    _factor,
    _next_segment,
    _padded,
    _precision,
    _row_page,
    _row_scales,
    _segment_chunk,
    _tiled_span,
    _vector_pick,
    _vector_token,
    aligned_step,
    module_tables,
    position_segments,
    row_source,
)
from slora_kernels.meta import LoraMeta
from slora_kernels.ref import lora_group

# The most splits of d_in a shrink uses (tiled, vector). The reduction kernel's split block is
# that bound, not the step's count, so steps of any size share its two builds.
MAX_SPLITS, MAX_VECTOR_SPLITS = 64, 16


@triton.jit(
    do_not_specialize=[
        "num_tokens",
        "num_segs",
        "target0",
        "target1",
        "target2",
        "out_stride",
        "rank_cap",
        "vector_max",
        "rank_blocks",
        "rank_slot_stride",
        "rank_target_stride",
    ]
)
def _shrink_kernel(
    x_ptr,
    x_stride,
    pool_ptr,
    row_scale_ptr,
    token_order_ptr,
    seg1_start_ptr,
    seg_slot_ptr,
    pos_seg_ptr,
    num_tokens,
    num_segs,
    rank_ptr,
    rank_slot_stride,
    rank_target_stride,
    pages_ptr,
    pages_stride,
    offsets_ptr,
    target0,
    target1,
    target2,
    rank_blocks,
    out_ptr,
    out_stride,
    rank_cap,
    d_in,
    k_per_split,
    vector_max,
    PAGE: tl.constexpr,
    NUM_TARGETS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr,
    PRECISION: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """A block of BLOCK_T sorted positions (program_id(0)), its segments walked one dot each;
    ALIGNED: program i is sorted position i, working only where a chunk of BLOCK_T of its
    segment begins, on that chunk (``lora_paths``: one program per adapter chunk)."""
    FP8: tl.constexpr = pool_ptr.dtype.element_ty == tl.float8e4nv  # ``row_source``
    SUB: tl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth // 8 if FP8 else 1
    b0 = tl.program_id(0) if ALIGNED else tl.program_id(0) * BLOCK_T
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
    lo, hi = _segment_chunk(seg1_start_ptr, seg, b0, BLOCK_T, ALIGNED)
    while (lo < b0 + BLOCK_T) & (lo < hi):
        slot = tl.load(seg_slot_ptr + seg)
        start, rank, slot_pages = _factor(
            slot,
            rank_ptr,
            rank_slot_stride,
            rank_target_stride,
            pages_ptr,
            pages_stride,
            offsets_ptr,
            target,
            0,
            rank_cap,
            NUM_TARGETS,
        )
        if (slot >= 0) & (start >= 0) & (r0 < rank) & (hi - lo > vector_max):
            in_seg = (ii >= lo) & (ii < hi)
            row_live = rows < rank
            row_sub = rows * tl.cdiv(d_in, PAGE)  # element k: sub-page row_sub + k // PAGE
            acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                col_live = k0 + cols < k_hi
                x_ptrs = x_ptr + tok[:, None] * x_stride + k0 + cols[None, :]
                xt = tl.load(x_ptrs, mask=in_seg[:, None] & col_live[None, :], other=0.0)
                at = _row_page(slot_pages, row_sub + k0 // PAGE, row_live, PAGE, SUB)
                k_in_page = tl.multiple_of(k0 % PAGE, BLOCK_K)  # keeps 16-byte loads
                a_ptrs = pool_ptr + at[:, None] + k_in_page + cols[None, :]
                a = tl.load(a_ptrs, mask=row_live[:, None] & col_live[None, :], other=0.0)
                if FP8:  # e4m3 -> x's dtype is exact; the row scales after the sum
                    a = a.to(xt.dtype)
                acc = tl.dot(xt, tl.trans(a), acc, input_precision=PRECISION)
            if FP8:
                scales = _row_scales(row_scale_ptr, slot_pages, rows, row_live, PAGE, SUB)
                acc = acc * scales[None, :]
            tl.store(dst, acc, mask=in_seg[:, None] & row_live[None, :])
        seg += 1
        lo, hi = _next_segment(seg1_start_ptr, seg, hi, num_segs, ALIGNED)


@triton.jit(
    do_not_specialize=[
        "num_segs",
        "num_tokens",
        "target0",
        "target1",
        "target2",
        "out_stride",
        "rank_cap",
        "vector_max",
        "rank_blocks",
        "rank_slot_stride",
        "rank_target_stride",
    ]
)
def _shrink_vector_kernel(
    x_ptr,
    x_stride,
    pool_ptr,
    row_scale_ptr,
    b_slot_ptr,
    token_order_ptr,
    seg1_start_ptr,
    seg_slot_ptr,
    pos_seg_ptr,
    num_tokens,
    num_segs,
    rank_ptr,
    rank_slot_stride,
    rank_target_stride,
    pages_ptr,
    pages_stride,
    offsets_ptr,
    target0,
    target1,
    target2,
    rank_blocks,
    r_span,
    out_ptr,
    out_stride,
    rank_cap,
    d_in,
    k_per_split,
    vector_max,
    PAGE: tl.constexpr,
    NUM_TARGETS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr,
    ALL: tl.constexpr,
    INDEXED: tl.constexpr,
    STAGES: tl.constexpr,
    ONE_PAGE: tl.constexpr,
):
    """One token (program_id(0), see _vector_token) of a short segment, one target of the group
    and one span of r_span rank rows (program_id(1) = target * rank_blocks + span), one split of
    d_in (program_id(2)): acc[r] = sum_k x[k] A[r, k]. With rank_blocks 1 the span is the whole
    rank, walked BLOCK_R rows at a time."""
    FP8: tl.constexpr = pool_ptr.dtype.element_ty == tl.float8e4nv  # ``row_source``
    SUB: tl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth // 8 if FP8 else 1
    tok, slot = _vector_token(
        b_slot_ptr,
        token_order_ptr,
        seg1_start_ptr,
        seg_slot_ptr,
        pos_seg_ptr,
        num_segs,
        vector_max,
        tl.program_id(0),
        ALL,
        INDEXED,
    )
    if slot < 0:
        return
    j = tl.program_id(1) // rank_blocks
    r_first = (tl.program_id(1) % rank_blocks) * r_span
    target = tl.where(j == 0, target0, tl.where(j == 1, target1, target2))
    start, rank, slot_pages = _factor(
        slot,
        rank_ptr,
        rank_slot_stride,
        rank_target_stride,
        pages_ptr,
        pages_stride,
        offsets_ptr,
        target,
        0,
        rank_cap,
        NUM_TARGETS,
    )
    if (start < 0) | (rank == 0):
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
        row_sub = rows * tl.cdiv(d_in, PAGE)
        # ONE_PAGE (d_in <= PAGE): a row is one (sub-)page, looked up once instead of per chunk
        if ONE_PAGE:
            first = _row_page(slot_pages, row_sub, row_live, PAGE, SUB)
        else:
            first = rows.to(tl.int64) * 0  # unused
        x_row = x_ptr + tok * x_stride
        if FP8:  # the rows' scales, loaded before the d_in loop so their latency hides in it
            row_scale = _row_scales(row_scale_ptr, slot_pages, rows, row_live, PAGE, SUB)
        acc = tl.zeros([BLOCK_R], tl.float32)
        if STAGES > 0:
            for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
                acc += _row_dots(
                    x_row,
                    pool_ptr,
                    slot_pages,
                    row_sub,
                    first,
                    row_live,
                    k0,
                    k_hi,
                    cols,
                    PAGE,
                    BLOCK_K,
                    ONE_PAGE,
                    SUB,
                )
        else:
            for k0 in range(k_lo, k_hi, BLOCK_K):
                acc += _row_dots(
                    x_row,
                    pool_ptr,
                    slot_pages,
                    row_sub,
                    first,
                    row_live,
                    k0,
                    k_hi,
                    cols,
                    PAGE,
                    BLOCK_K,
                    ONE_PAGE,
                    SUB,
                )
        if FP8:
            acc = acc * row_scale
        tl.store(out_ptr + row * out_stride + j * rank_cap + rows, acc, mask=row_live)


@triton.jit
def _row_dots(
    x_row,
    pool_ptr,
    slot_pages,
    row_sub,
    first,
    row_live,
    k0,
    k_hi,
    cols,
    PAGE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_PAGE: tl.constexpr,
    SUB: tl.constexpr,
):
    """sum_k x[k0 + k] A[r, k0 + k] over one chunk of columns, for each row r of a block
    (row r's sub-pages from row_sub[r]; ``first``: where they start, with ONE_PAGE)."""
    col_live = k0 + cols < k_hi
    xv = tl.load(x_row + k0 + cols, mask=col_live, other=0.0).to(tl.float32)
    at = first if ONE_PAGE else _row_page(slot_pages, row_sub + k0 // PAGE, row_live, PAGE, SUB)
    k_in_page = tl.multiple_of(k0 % PAGE, BLOCK_K)  # a block start: keeps 16-byte loads
    a_ptrs = pool_ptr + at[:, None] + k_in_page + cols[None, :]
    a = tl.load(a_ptrs, mask=row_live[:, None] & col_live[None, :], other=0.0)
    return tl.sum(a.to(tl.float32) * xv[None, :], 1)


@triton.jit(
    do_not_specialize=[
        "num_splits",
        "num_tokens",
        "num_segs",
        "target0",
        "target1",
        "target2",
        "part_stride",
        "rank_cap",
        "vector_max",
        "rank_slot_stride",
        "rank_target_stride",
    ]
)
def _shrink_reduce_kernel(
    part_ptr,
    part_stride,
    num_splits,
    num_tokens,
    b_slot_ptr,
    token_order_ptr,
    seg1_start_ptr,
    seg_slot_ptr,
    pos_seg_ptr,
    num_segs,
    rank_ptr,
    rank_slot_stride,
    rank_target_stride,
    offsets_ptr,
    target0,
    target1,
    target2,
    out_ptr,
    out_stride,
    rank_cap,
    vector_max,
    NUM_TARGETS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_SPLIT: tl.constexpr,
    VECTOR: tl.constexpr,
    ALL: tl.constexpr,
    INDEXED: tl.constexpr,
):
    """Adds the fp32 partial sums of the tokens one path (VECTOR: short segments) computed."""
    i = tl.program_id(0)  # sorted position (token with ALL)
    j = tl.program_id(1)
    target = tl.where(j == 0, target0, tl.where(j == 1, target1, target2))
    if VECTOR:
        t, slot = _vector_token(
            b_slot_ptr,
            token_order_ptr,
            seg1_start_ptr,
            seg_slot_ptr,
            pos_seg_ptr,
            num_segs,
            vector_max,
            i,
            ALL,
            INDEXED,
        )
    else:
        seg = tl.load(pos_seg_ptr + i)
        safe = tl.minimum(seg, num_segs - 1)
        length = tl.load(seg1_start_ptr + safe + 1) - tl.load(seg1_start_ptr + safe)
        t = tl.load(token_order_ptr + i).to(tl.int64)
        slot = tl.where((seg < num_segs) & (length > vector_max), tl.load(seg_slot_ptr + safe), -1)
    if slot < 0:
        return
    start = tl.load(offsets_ptr + (slot * NUM_TARGETS + target) * 2)
    rank = tl.load(rank_ptr + slot * rank_slot_stride + target * rank_target_stride)
    rank = tl.minimum(rank, rank_cap)
    if (start < 0) | (rank == 0):
        return
    rows = tl.arange(0, BLOCK_R)
    splits = tl.arange(0, BLOCK_SPLIT)
    part_ptrs = (
        part_ptr
        + (splits[:, None] * num_tokens + t).to(tl.int64) * part_stride
        + j * rank_cap
        + rows
    )
    live = (splits < num_splits)[:, None] & (rows < rank)[None, :]
    total = tl.sum(tl.load(part_ptrs, mask=live, other=0.0), 0)
    tl.store(out_ptr + t.to(tl.int64) * out_stride + j * rank_cap + rows, total, mask=rows < rank)


def shrink_splits(
    device: torch.device, num_tokens: int, max_rank: int, d_in: int, num_targets: int = 1
) -> int:
    """Splits of the reduction, from host ints only: enough programs for ~4 waves of the SMs,
    each split at least BLOCKS["split_min_k"] elements long."""
    block_r = tiled_rank_block(max_rank)
    programs = (
        triton.cdiv(num_tokens, block_tokens(num_tokens))
        * triton.cdiv(max_rank, block_r)
        * num_targets
    )
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
    of ``slora_kernels.ref.lora_shrink``, in one launch of each kernel family for the whole group.

    Tiled grid (ceil(T / BLOCK_T), G * ceil(max_rank / BLOCK_R), splits): tl.dot tiles
    [BLOCK_T, BLOCK_K] x [BLOCK_K, BLOCK_R] on BLOCKS["twarps"] warps; in an aligned step
    (``aligned_step``) T programs a rank block, one adapter chunk each. Vector grid (tokens, see
    ``_vector_pick``; G * rank blocks, or G with ``vgrid`` 0; splits). With splits > 1 a second
    kernel, grid (tokens, G), adds the fp32 partial sums into out.
    """
    _check(x, pool_layer, meta, out)
    assert x.dtype == pool_layer.dtype, "x and the pool must share a dtype for tl.dot"
    targets = lora_group(target)
    group, targets = len(targets), _padded(targets)
    num_tokens = x.shape[0]
    rank_cap = out.shape[1] // group
    max_rank = min(meta.max_rank, rank_cap)
    if num_tokens == 0 or meta.seg_slot.shape[0] == 0 or max_rank == 0:
        return
    launch = _Launch(x, pool_layer, meta, targets, group, out, rank_cap, max_rank)
    aligned = aligned_step(meta)
    if aligned or (meta.longest > meta.vector_max and _tiled_span(meta, num_tokens) > 0):
        _tiled(launch, aligned)
    if not aligned and meta.shortest <= meta.vector_max:  # vector: one token per program
        _vector(launch)


@dataclasses.dataclass
class _Launch:
    """One lora_shrink call's operands, as its two kernel families take them."""

    x: torch.Tensor
    pool_layer: torch.Tensor
    meta: LoraMeta
    targets: tuple[int, int, int]
    group: int
    out: torch.Tensor
    rank_cap: int
    max_rank: int

    def ranks(self) -> tuple:
        rank_table, _, slot_stride, target_stride = module_tables(self.meta)
        return rank_table, slot_stride, target_stride


def _tiled(launch: _Launch, aligned: bool) -> None:
    """The tiled kernel on the step's long segments, or in an aligned step on all of them (one
    program a sorted position, the split count as the vector kernel's, its reduction too)."""
    x, meta, group = launch.x, launch.meta, launch.group
    num_tokens, d_in = x.shape
    page = launch.pool_layer.shape[1]
    rows_pool, scales = row_source(launch.pool_layer, meta)
    span = num_tokens if aligned else _tiled_span(meta, num_tokens)
    block_k = _pow2_divisor(page, BLOCKS["k"])
    if aligned:
        block_t, block_r = BLOCKS["at"], aligned_rank_block(launch.max_rank)
        rank_blocks = triton.cdiv(launch.max_rank, block_r)
        splits = _vector_splits(x.device, span * group * rank_blocks, d_in)
    else:
        block_t, block_r = block_tokens(span), tiled_rank_block(launch.max_rank)
        rank_blocks = triton.cdiv(launch.max_rank, block_r)
        splits = shrink_splits(x.device, span, launch.max_rank, d_in, group)
    k_per_split, splits = _split_k(d_in, splits, block_k)
    dst = _partials(launch.out, splits)
    grid = (span if aligned else triton.cdiv(span, block_t), group * rank_blocks, splits)
    _shrink_kernel[grid](
        x,
        x.stride(0),
        rows_pool,
        scales,
        meta.token_order,
        meta.seg1_start,
        meta.seg_slot,
        position_segments(meta, num_tokens),
        num_tokens,
        meta.seg_slot.shape[0],
        *launch.ranks(),
        meta.slot_pages,
        meta.slot_pages.stride(0),
        meta.slot_offsets,
        *launch.targets,
        rank_blocks,
        dst,
        dst.stride(-2),
        launch.rank_cap,
        d_in,
        k_per_split,
        0 if aligned else meta.vector_max,  # aligned: every segment
        PAGE=page,
        NUM_TARGETS=meta.slot_offsets.shape[1],
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        PARTIAL=splits > 1,
        PRECISION=_precision(x.dtype),
        ALIGNED=aligned,
        num_warps=BLOCKS["twarps"],
    )
    _reduce(dst, splits, meta, launch.targets, group, launch.out, launch.rank_cap, aligned)


def _split_k(d_in: int, splits: int, block_k: int) -> tuple[int, int]:
    """(elements a split reduces, splits): ``splits`` cuts of d_in rounded up to whole blocks,
    then as many splits as that leaves work for (d_in 4096, 3 splits, blocks 256 -> 1536, 3)."""
    k_per_split = triton.cdiv(triton.cdiv(d_in, splits), block_k) * block_k
    return k_per_split, triton.cdiv(d_in, k_per_split)


def _vector_splits(device: torch.device, programs: int, d_in: int) -> int:
    """Splits of d_in for the vector shrink (and an aligned step's tiled one): until the grid
    holds BLOCKS["vwaves"] programs an SM, each split at least BLOCKS["split_min_k"] long."""
    want = triton.cdiv(BLOCKS["vwaves"] * sm_count(device), max(programs, 1))
    return max(1, min(want, d_in // BLOCKS["split_min_k"], MAX_VECTOR_SPLITS))


def _vector(launch: _Launch) -> None:
    x, meta, group = launch.x, launch.meta, launch.group
    num_tokens, d_in = x.shape
    page = launch.pool_layer.shape[1]
    rows_pool, scales = row_source(launch.pool_layer, meta)
    block_r, block_k = vector_block(page, launch.max_rank, "vk")
    # the rank as one span walked block by block, or each block its own program
    rank_blocks = triton.cdiv(launch.max_rank, block_r) if BLOCKS["vgrid"] else 1
    r_span = block_r if BLOCKS["vgrid"] else launch.rank_cap
    rows, picked, pick, pos_seg = _vector_pick(meta, num_tokens)
    splits = _vector_splits(x.device, rows * group * rank_blocks, d_in)
    k_per_split, splits = _split_k(d_in, splits, block_k)
    dst = _partials(launch.out, splits)
    if rows == 0:
        return
    _shrink_vector_kernel[(rows, group * rank_blocks, splits)](
        x,
        x.stride(0),
        rows_pool,
        scales,
        meta.b_slot,
        picked,
        meta.seg1_start,
        meta.seg_slot,
        pos_seg,
        num_tokens,
        meta.seg_slot.shape[0],
        *launch.ranks(),
        meta.slot_pages,
        meta.slot_pages.stride(0),
        meta.slot_offsets,
        *launch.targets,
        rank_blocks,
        r_span,
        dst,
        dst.stride(-2),
        launch.rank_cap,
        d_in,
        k_per_split,
        meta.vector_max,
        PAGE=page,
        NUM_TARGETS=meta.slot_offsets.shape[1],
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        PARTIAL=splits > 1,
        **pick,
        STAGES=BLOCKS["vstages"],
        ONE_PAGE=d_in <= page,
        num_warps=BLOCKS["vwarps"],
    )
    _reduce(dst, splits, meta, launch.targets, group, launch.out, launch.rank_cap, vector=True)


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
    rank_table, _, slot_stride, target_stride = module_tables(meta)
    ranks = (rank_table, slot_stride, target_stride)
    _shrink_reduce_kernel[(rows, group)](
        dst,
        dst.stride(1),
        splits,
        num_tokens,
        meta.b_slot,
        picked,
        meta.seg1_start,
        meta.seg_slot,
        pos_seg,
        meta.seg_slot.shape[0],
        *ranks,
        meta.slot_offsets,
        *targets,
        out,
        out.stride(0),
        rank_cap,
        meta.vector_max,
        NUM_TARGETS=meta.slot_offsets.shape[1],
        BLOCK_R=triton.next_power_of_2(rank_cap),
        BLOCK_SPLIT=MAX_VECTOR_SPLITS if vector else MAX_SPLITS,
        VECTOR=vector,
        **pick,
        num_warps=4,
    )
