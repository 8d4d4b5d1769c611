"""LoRA expand, the second factor (scale * v B^T per token's adapter, added in place into the
base projection's output): the vector kernel (``_expand_vector_kernel``), the tiled kernel
(``_expand_kernel``) and the launcher ``lora_expand``. The paths and the page layout:
``slora_kernels.lora_paths``.

Adapters with vector rows (``LoraMeta.slot_vectors``) use them where B's output is added:
lora_B's bias inside the scale, and DoRA's g and c per output channel, out = g * out + c +
g * delta for each row of a DoRA adapter (the base output rescaled, its bias kept: PEFT's DoRA),
in the same pass over the rows (a DoRA segment of the tiled kernel is written as it is met, the
others at the end). A step without such an adapter (``LoraMeta.has_vectors`` False) runs the
kernels built without those reads; a plain row of a step with them pays two table loads.
With fp8 rows (``slora_kernels.lora_paths``) the B^T rows are e4m3 while the vector rows stay in
the model dtype: the kernels read them through ``vec_ptr``, the pool in its own dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slora_kernels.lora_blocks import (
    BLOCKS,
    _pow2_divisor,
    block_tokens,
    expand_rank_block,
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


@triton.jit(
    do_not_specialize=[
        "num_segs",
        "target0",
        "target1",
        "target2",
        "v_stride",
        "rank_cap",
        "vector_max",
        "rank_slot_stride",
        "rank_target_stride",
    ]
)
def _expand_vector_kernel(
    v_ptr,
    v_stride,
    pool_ptr,
    row_scale_ptr,
    vec_ptr,
    b_slot_ptr,
    token_order_ptr,
    seg1_start_ptr,
    seg_slot_ptr,
    pos_seg_ptr,
    num_segs,
    rank_ptr,
    scale_ptr,
    rank_slot_stride,
    rank_target_stride,
    pages_ptr,
    pages_stride,
    offsets_ptr,
    vectors_ptr,
    target0,
    target1,
    target2,
    col0,
    col1,
    col2,
    width0,
    width1,
    width2,
    blocks1,
    blocks2,
    out_ptr,
    out_stride,
    rank_cap,
    vector_max,
    PAGE: tl.constexpr,
    NUM_TARGETS: tl.constexpr,
    VECTORS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALL: tl.constexpr,
    INDEXED: tl.constexpr,
):
    """One token of a short segment, one block of BLOCK_N output columns of one target:
    out[n] += scale * sum_r v[r] B^T[r, n]."""
    FP8: tl.constexpr = pool_ptr.dtype.element_ty == tl.float8e4nv  # ``row_source``
    SUB: tl.constexpr = vec_ptr.dtype.element_ty.primitive_bitwidth // 8 if FP8 else 1
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
    nb = tl.program_id(1)
    j = (nb >= blocks1).to(tl.int32) + (nb >= blocks2).to(tl.int32)
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
        1,
        rank_cap,
        NUM_TARGETS,
    )
    if (start < 0) | (rank == 0):
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
        if FP8:  # each row's scale on its rank element: sum_r (v_r s_r) q_r
            vv = vv * _row_scales(row_scale_ptr, slot_pages, rows, row_live, PAGE, SUB)
        sub = rows * tl.cdiv(d_out, PAGE) + n0 // PAGE
        at = _row_page(slot_pages, sub, row_live, PAGE, SUB)
        n_in_page = tl.multiple_of(n0 % PAGE, BLOCK_N)  # a block start: keeps 16-byte loads
        b_ptrs = pool_ptr + at[:, None] + n_in_page + cols[None, :]
        b = tl.load(b_ptrs, mask=row_live[:, None] & col_live[None, :], other=0.0)
        delta += tl.sum(b.to(tl.float32) * vv.to(tl.float32)[:, None], 0)
    scale = tl.load(scale_ptr + slot * rank_slot_stride + target * rank_target_stride)
    o_ptrs = out_ptr + tok * out_stride + col + n0 + cols
    o = tl.load(o_ptrs, mask=col_live).to(tl.float32)
    if VECTORS:  # lora_B's bias inside the scale; DoRA: g * out + c + g * delta
        slot_row = pages_ptr + slot.to(tl.int64) * pages_stride
        vectors = vectors_ptr + (slot * NUM_TARGETS + target) * 2
        bias_at = tl.load(vectors)
        if bias_at >= 0:
            delta += _vector_block(vec_ptr, slot_row + bias_at, n0, cols, col_live, PAGE, BLOCK_N)
        delta = delta * scale
        dora_at = tl.load(vectors + 1)
        if dora_at >= 0:
            g = _vector_block(vec_ptr, slot_row + dora_at, n0, cols, col_live, PAGE, BLOCK_N)
            c_row = slot_row + dora_at + tl.cdiv(d_out, PAGE)
            c = _vector_block(vec_ptr, c_row, n0, cols, col_live, PAGE, BLOCK_N)
            o = o * g + c
            delta = delta * g
    else:
        delta = delta * scale
    tl.store(o_ptrs, o + delta, mask=col_live)


@triton.jit(
    do_not_specialize=[
        "num_tokens",
        "num_segs",
        "target0",
        "target1",
        "target2",
        "v_stride",
        "rank_cap",
        "vector_max",
        "rank_slot_stride",
        "rank_target_stride",
    ]
)
def _expand_kernel(
    v_ptr,
    v_stride,
    pool_ptr,
    row_scale_ptr,
    vec_ptr,
    token_order_ptr,
    seg1_start_ptr,
    seg_slot_ptr,
    pos_seg_ptr,
    num_tokens,
    num_segs,
    rank_ptr,
    scale_ptr,
    rank_slot_stride,
    rank_target_stride,
    pages_ptr,
    pages_stride,
    offsets_ptr,
    vectors_ptr,
    target0,
    target1,
    target2,
    col0,
    col1,
    col2,
    width0,
    width1,
    width2,
    blocks1,
    blocks2,
    out_ptr,
    out_stride,
    rank_cap,
    vector_max,
    PAGE: tl.constexpr,
    NUM_TARGETS: tl.constexpr,
    VECTORS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """A block of BLOCK_T sorted positions (program_id(0)) and one of BLOCK_N columns, its
    segments walked one dot each; ALIGNED: as ``_shrink_kernel``'s, one adapter chunk a
    program."""
    FP8: tl.constexpr = pool_ptr.dtype.element_ty == tl.float8e4nv  # ``row_source``
    SUB: tl.constexpr = vec_ptr.dtype.element_ty.primitive_bitwidth // 8 if FP8 else 1
    b0 = tl.program_id(0) if ALIGNED else tl.program_id(0) * BLOCK_T
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
    touched = ii < 0  # rows added to at the end: those whose adapter has the target (not DoRA)
    o_ptrs = out_ptr + tok[:, None] * out_stride + col + n0 + cols[None, :]
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
            1,
            rank_cap,
            NUM_TARGETS,
        )
        if (slot >= 0) & (start >= 0) & (rank > 0) & (hi - lo > vector_max):
            in_seg = (ii >= lo) & (ii < hi)
            delta = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
            for r0 in range(0, rank, BLOCK_R):  # this adapter's own rank, BLOCK_R rows a dot
                rows = r0 + tl.arange(0, BLOCK_R)
                row_live = rows < rank
                v_ptrs = v_ptr + tok[:, None] * v_stride + j * rank_cap + rows[None, :]
                vt = tl.load(v_ptrs, mask=in_seg[:, None] & row_live[None, :], other=0.0)
                if FP8:  # each row's scale on its rank column: sum_r (v_r s_r) q_r
                    row_scales = _row_scales(row_scale_ptr, slot_pages, rows, row_live, PAGE, SUB)
                    vt = vt * row_scales[None, :]
                sub = rows * tl.cdiv(d_out, PAGE) + n0 // PAGE
                at = _row_page(slot_pages, sub, row_live, PAGE, SUB)
                n_in_page = tl.multiple_of(n0 % PAGE, BLOCK_N)  # keeps 16-byte loads
                b_ptrs = pool_ptr + at[:, None] + n_in_page + cols[None, :]
                b = tl.load(b_ptrs, mask=row_live[:, None] & col_live[None, :], other=0.0)
                delta = tl.dot(
                    vt.to(tl.float32), b.to(tl.float32), delta, input_precision=PRECISION
                )
            scale = tl.load(scale_ptr + slot * rank_slot_stride + target * rank_target_stride)
            if VECTORS:  # on the segment's rows: lora_B's bias inside the scale; DoRA
                slot_row = pages_ptr + slot.to(tl.int64) * pages_stride
                vectors = vectors_ptr + (slot * NUM_TARGETS + target) * 2
                bias_at = tl.load(vectors)
                if bias_at >= 0:
                    bias = _vector_block(
                        vec_ptr, slot_row + bias_at, n0, cols, col_live, PAGE, BLOCK_N
                    )
                    delta += tl.where(in_seg[:, None], bias[None, :], 0.0)
                delta = delta * scale
                dora_at = tl.load(vectors + 1)
                if dora_at >= 0:  # g * out + c + g * delta, written for the segment's rows here
                    g = _vector_block(
                        vec_ptr, slot_row + dora_at, n0, cols, col_live, PAGE, BLOCK_N
                    )
                    c_row = slot_row + dora_at + tl.cdiv(d_out, PAGE)
                    c = _vector_block(vec_ptr, c_row, n0, cols, col_live, PAGE, BLOCK_N)
                    seg_live = in_seg[:, None] & col_live[None, :]
                    o = tl.load(o_ptrs, mask=seg_live).to(tl.float32)
                    tl.store(
                        o_ptrs, o * g[None, :] + c[None, :] + delta * g[None, :], mask=seg_live
                    )
                else:
                    acc += delta
                    touched = touched | in_seg
            else:
                acc += delta * scale
                touched = touched | in_seg
        seg += 1
        lo, hi = _next_segment(seg1_start_ptr, seg, hi, num_segs, ALIGNED)
    live = touched[:, None] & col_live[None, :]
    tl.store(o_ptrs, tl.load(o_ptrs, mask=live).to(tl.float32) + acc, mask=live)


@triton.jit
def _vector_block(
    pool_ptr, row_pages, n0, cols, col_live, PAGE: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Elements n0 .. n0 + BLOCK_N of a vector row (one row of d_out laid out as a B^T row,
    ``LoraMeta.slot_vectors``) whose pages are listed from ``row_pages``: fp32, 0 past d_out."""
    page = tl.load(row_pages + n0 // PAGE).to(tl.int64)
    n_in_page = tl.multiple_of(n0 % PAGE, BLOCK_N)  # a block start: keeps 16-byte loads
    values = tl.load(pool_ptr + page * PAGE + n_in_page + cols, mask=col_live, other=0.0)
    return values.to(tl.float32)


def _column_blocks(widths: list[int], block_n: int) -> tuple[int, int, int]:
    """(first block of target 1, first block of target 2, all blocks) when the group's targets'
    columns are cut into blocks of block_n one target after another; a target the group lacks
    starts at the end, so no block reaches it."""
    blocks = [triton.cdiv(w, block_n) for w in widths]
    total = sum(blocks)
    first1 = blocks[0] if len(blocks) > 1 else total
    first2 = blocks[0] + blocks[1] if len(blocks) > 2 else total
    return first1, first2, total


def lora_expand(
    v: torch.Tensor,
    pool_layer: torch.Tensor,
    meta: LoraMeta,
    target: int | tuple[int, ...],
    out: torch.Tensor,
    cols: tuple[tuple[int, int], ...] | None = None,
) -> None:
    """Second LoRA factor, added in place into the base projection's output: the semantics of
    ``slora_kernels.ref.lora_expand``, in one launch of each kernel family for the whole group.

    Vector grid (tokens, see ``_vector_pick``; column blocks of all G targets), one token each,
    stepping through its adapter's rank. Tiled grid (ceil(T / BLOCK_T), column blocks of all G
    targets; in an aligned step, ``aligned_step``, T programs a column block, one adapter chunk
    each): tl.dot tiles [BLOCK_T, R'] x [R', BLOCK_N] (R' from ``expand_rank_block``: the
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
    rows_pool, row_scales = row_source(pool_layer, meta)
    span = _tiled_span(meta, num_tokens)
    block_t, block_n = block_tokens(span, expand=True), _pow2_divisor(page, BLOCKS["n"])
    widths = [hi - lo for lo, hi in cols]
    starts = [lo for lo, _ in cols]
    vectors = meta.has_vectors and meta.slot_vectors is not None
    common = (
        *module_tables(meta),
        meta.slot_pages,
        meta.slot_pages.stride(0),
        meta.slot_offsets,
        meta.slot_vectors if vectors else meta.slot_offsets,  # read only with VECTORS
        *targets,
        *_padded(tuple(starts)),
        *_padded(tuple(widths)),
    )
    aligned = aligned_step(meta)
    if aligned:  # one program a sorted position, working where an adapter chunk starts
        span, block_t = num_tokens, BLOCKS["at"]
        block_n = _pow2_divisor(page, BLOCKS["an"])
    if aligned or (meta.longest > meta.vector_max and span > 0):
        first1, first2, total = _column_blocks(widths, block_n)
        grid = (span if aligned else triton.cdiv(span, block_t), total)
        _expand_kernel[grid](
            v,
            v.stride(0),
            rows_pool,
            row_scales,
            pool_layer,  # vector rows: the pool's dtype
            meta.token_order,
            meta.seg1_start,
            meta.seg_slot,
            position_segments(meta, num_tokens),
            num_tokens,
            num_segs,
            *common,
            first1,
            first2,
            out,
            out.stride(0),
            rank_cap,
            0 if aligned else meta.vector_max,  # aligned: every segment
            PAGE=page,
            NUM_TARGETS=meta.slot_offsets.shape[1],
            VECTORS=vectors,
            BLOCK_T=block_t,
            BLOCK_R=expand_rank_block(max_rank),
            BLOCK_N=block_n,
            PRECISION=_precision(pool_layer.dtype),
            ALIGNED=aligned,
            num_warps=BLOCKS["twarps"],
        )
    if not aligned and meta.shortest <= meta.vector_max:
        block_r, block_n = vector_block(page, max_rank, "vn")
        first1, first2, total = _column_blocks(widths, block_n)
        rows, picked, pick, pos_seg = _vector_pick(meta, num_tokens)
        if rows == 0:
            return
        _expand_vector_kernel[(rows, total)](
            v,
            v.stride(0),
            rows_pool,
            row_scales,
            pool_layer,  # vector rows: the pool's dtype
            meta.b_slot,
            picked,
            meta.seg1_start,
            meta.seg_slot,
            pos_seg,
            num_segs,
            *common,
            first1,
            first2,
            out,
            out.stride(0),
            rank_cap,
            meta.vector_max,
            PAGE=page,
            NUM_TARGETS=meta.slot_offsets.shape[1],
            VECTORS=vectors,
            BLOCK_R=block_r,
            BLOCK_N=block_n,
            **pick,
            num_warps=BLOCKS["vnwarps"],
        )
