"""Split-KV ("flash-decoding") attention over the paged KV cache: one new query per sequence.

The page layout, the exp2 softmax, the soft-cap and the fp8 pages (FP8: K scales folded into
the scores, V scales into p) are those of ``slora_kernels.attention``. Stage 1 runs the query heads
of one KV head over one split of the sequence's keys and writes the normalized partial output
and its log2-sum-exp; stage 2 merges the splits.

Running example (2 splits, BLOCK_N 64): sequence b has b_seq_len 300: split_len =
ceil(ceil(300 / 2) / 64) * 64 = 192, split 0 reads keys 0..191, split 1 keys 192..299; the merge
weighs each split's normalized output by 2^(lse_split - max lse). With window 100 only the keys
200..299 are split: split_len = ceil(ceil(100 / 2) / 64) * 64 = 64, split 0 reads keys 200..263,
split 1 keys 264..299 (``_decode_span``, which the merge calls too). In the grouped V layout
(v_group 16, the grouped values of ``slora_kernels.attention``) the split keys start at 192,
the first key of 200's group: split_len = ceil(ceil(108 / 2) / 64) * 64 = 64, split 0 reads
keys 192..255 with 192..199 masked, split 1 keys 256..299.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slora_kernels.attention import (
    WIDE_HEAD_DIM,
    _check,
    _f16_query,
    _grouped_values,
    _kv_scale,
    _logit_args,
    _logits,
    _precision,
    _v_scaled,
    fp8_f16,
    group_start,
    kv_pointers,
    sm_count,
)
from slora_kernels.meta import AttnMeta

MIN_KEYS_PER_SPLIT = 256  # a split reads at least this many keys
MAX_SPLITS = 64
# Tiles: keys per loop step (MHA: CUDA-core dot products; GQA: tensor-core tiles), warps
# and software-pipeline stages; benchmarks/kernels.py sweeps them on the card.
# mha_dot: MHA on tensor cores too, the one query row padded to a 16-row tile (as GQA groups
# under 16 are); False: CUDA-core dot products (H200, B=256, contexts 256-1024: 0.54 of the copy
# bandwidth for every tile tried, where GQA's tensor-core path reached 0.83).
# fp8_f16: fp8 pages under a 16-bit q take fp16 dots (``slora_kernels.attention``'s FP8_F16);
# heads_fastest: the grid (KV heads, B, splits), so a sequence's heads run in adjacent programs
# and share the L2 sectors of its page-table and fp8 scale rows (a 4-byte scale a key and head
# otherwise costs a 32-byte sector: up to a quarter more than fp8 K/V's 256 bytes).
# fp8_stages: the stages on fp8 pages. H200, B=256, contexts 256-1024 (benchmarks/fp8_kernels.py):
# MHA 737 us with 3 stages, 703 with 4, 811 with bf16 dots; bf16 pages 659 us. The fp8 kernel
# reads half the bytes in about the same time. Triton loads V (the B operand of p . V, reduced
# along the keys) byte by byte from shared memory (128 ld.shared.b8 a thread and block of keys,
# where bf16 takes ldmatrix.trans); neither PV on CUDA cores (830 us) nor V converted along its
# rows and staged as fp16 in shared memory for ldmatrix.trans (1016 us) was faster.
DECODE = {
    "mha_block_n": 32,
    "gqa_block_n": 128,
    "warps": 4,
    "stages": 3,
    "mha_dot": True,
    "fp8_f16": True,
    "fp8_stages": 4,
    "heads_fastest": True,
}
# head_dim past WIDE_HEAD_DIM (Gemma 2: 256): DECODE with these overrides. H200, 16/8 heads of
# 256, bf16, B=64 at 8192 keys (window 4096): 0.52 ms, 4.1 TB/s of K/V read; GQA blocks of 128
# keys and 3 stages took 0.67 ms, 64 keys and 2 stages 0.73 ms.
DECODE_WIDE = {"gqa_block_n": 32, "stages": 3}


@triton.jit
def _decode_span(
    ctx,
    window,
    NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    V_GROUP: tl.constexpr,
):
    """(first key, keys per split) of a decode query at position ctx - 1: the keys
    [max(0, ctx - window), ctx) (all ctx without a window) cut in NUM_SPLITS runs of whole
    BLOCK_N blocks; with V_GROUP from the start of the first key's group (``group_start``, the
    keys before the window masked by ``_decode_seen``). The split kernel and the merge both
    call it, so they agree on the splits."""
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(ctx - window, 0)
    first = group_start(first, V_GROUP)
    split_len = tl.cdiv(tl.cdiv(ctx - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    return first, split_len


@triton.jit
def _decode_seen(jj, k_live, ctx, window, HAS_WINDOW: tl.constexpr, V_GROUP: tl.constexpr):
    """Which keys jj of a block the query at ctx - 1 sees: the live ones (before the split's
    end), and with V_GROUP and a window not those before the window, which the group-aligned
    span (``_decode_span``) reads."""
    seen = k_live
    if HAS_WINDOW and V_GROUP > 0:
        seen = seen & (jj >= ctx - window)
    return seen


@triton.jit
def _decode_program(HEADS_FASTEST: tl.constexpr):
    """(sequence, KV head) of this program: grid (B, KV heads, splits), or (KV heads, B, splits)
    with HEADS_FASTEST, so a sequence's heads run in adjacent programs (DECODE's note)."""
    if HEADS_FASTEST:
        return tl.program_id(1), tl.program_id(0)
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _decode_pages(pt_row, jj, live, FP8: tl.constexpr):
    """The K and V pages of keys jj; on fp8 pages one page holds a token's K and V (the table
    names it twice), so V's entry is not read."""
    page_k = tl.load(pt_row + jj * 2, mask=live, other=0).to(tl.int64)
    if FP8:
        return page_k, page_k
    return page_k, tl.load(pt_row + jj * 2 + 1, mask=live, other=0).to(tl.int64)


@triton.jit
def _values(
    pool_ptr,
    page_v,
    v_cols,
    kv_mask,
    pt_row,
    j0,
    k_hi,
    kv_cols,
    d_live,
    KV_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    V_GROUP: tl.constexpr,
):
    """V [BLOCK_N, BLOCK_D] of keys j0 .. j0 + BLOCK_N (those before k_hi live): each key's row
    of its V page (columns v_cols), or with V_GROUP the grouped V layout (``_grouped_values`` of
    ``slora_kernels.attention``, which the prefill kernel reads it with too)."""
    if V_GROUP == 0:
        v = tl.load(pool_ptr + page_v[:, None] * PAGE + v_cols[None, :], mask=kv_mask, other=0.0)
    else:
        v = _grouped_values(
            pool_ptr, pt_row, j0, k_hi, kv_cols, d_live, KV_DIM, PAGE, BLOCK_N, V_GROUP
        )
    return v


@triton.jit(do_not_specialize=["pt_stride"])
def _decode_split_kernel(
    q_ptr,
    q_stride_t,
    q_stride_h,
    pool_ptr,
    scale_ptr,
    b_seq_len_ptr,
    pt_ptr,
    pt_stride,
    qk_scale,
    cap_log2,
    window,
    part_o_ptr,
    part_lse_ptr,
    o_ptr,
    NUM_HEADS: tl.constexpr,
    PAGE: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,
    F16: tl.constexpr,
    PRECISION: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
    V_GROUP: tl.constexpr,
):
    b, kv_head = _decode_program(HEADS_FASTEST)
    split = tl.program_id(2)
    ctx = tl.load(b_seq_len_ptr + b)
    first, split_len = _decode_span(ctx, window, NUM_SPLITS, BLOCK_N, HAS_WINDOW, V_GROUP)
    k_lo = first + split * split_len
    if k_lo >= ctx:
        return
    k_hi = tl.minimum(ctx, k_lo + split_len)
    g = tl.arange(0, BLOCK_G)
    g_live = g < GROUP
    heads = kv_head * GROUP + g  # the query heads that share this KV head
    d = tl.arange(0, BLOCK_D)
    d_live = d < HEAD_DIM
    q_rows = b.to(tl.int64) * q_stride_t + heads * q_stride_h
    q = tl.load(
        q_ptr + q_rows[:, None] + d[None, :], mask=g_live[:, None] & d_live[None, :], other=0.0
    )
    if F16:
        q = _f16_query(q)
    kv_cols = kv_head * HEAD_DIM + d
    v_cols = kv_cols
    if FP8:  # V after the token's K bytes
        v_cols = kv_cols + KV_HEADS * HEAD_DIM
    pt_row = pt_ptr + b.to(tl.int64) * pt_stride
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for j0 in range(k_lo, k_hi, BLOCK_N):
        jj = j0 + tl.arange(0, BLOCK_N)
        k_live = jj < k_hi
        kv_mask = k_live[:, None] & d_live[None, :]
        page_k, page_v = _decode_pages(pt_row, jj, k_live, FP8)
        k = tl.load(pool_ptr + page_k[:, None] * PAGE + kv_cols[None, :], mask=kv_mask, other=0.0)
        v = _values(
            pool_ptr,
            page_v,
            v_cols,
            kv_mask,
            pt_row,
            j0,
            k_hi,
            kv_cols,
            d_live,
            KV_HEADS * HEAD_DIM,
            PAGE,
            BLOCK_N,
            V_GROUP,
        )
        if USE_DOT:  # GQA: the group's query heads form the rows of one tensor-core tile
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
        else:  # one query head per KV head: a dot product per key on CUDA cores
            s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(q.dtype).to(tl.float32)[None, :, :], 2)
        if FP8:
            s = s * _kv_scale(scale_ptr, page_k, kv_head, k_live, 0, KV_HEADS)[None, :]
        seen = _decode_seen(jj, k_live, ctx, window, HAS_WINDOW, V_GROUP)
        s = tl.where(seen[None, :], _logits(s, qk_scale, cap_log2, SOFTCAP), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        factor = 1.0
        if FP8:
            sv = _kv_scale(scale_ptr, page_v, kv_head, k_live, 1, KV_HEADS)
            p, factor = _v_scaled(p, sv, F16)
        if USE_DOT:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        else:
            pv = tl.sum(p[:, :, None] * v.to(q.dtype).to(tl.float32)[None, :, :], 1)
        acc = acc * alpha[:, None] + pv * factor
        m_i = m_new
    out = acc / l_i[:, None]
    live = g_live[:, None] & d_live[None, :]
    if NUM_SPLITS == 1:
        tl.store(o_ptr + q_rows[:, None] + d[None, :], out, mask=live)
    else:
        part = (b * NUM_HEADS + heads).to(tl.int64) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(part_o_ptr + part[:, None] * BLOCK_D + d[None, :], out, mask=live)
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=g_live)


@triton.jit
def _decode_merge_kernel(
    part_o_ptr,
    part_lse_ptr,
    b_seq_len_ptr,
    window,
    o_ptr,
    o_stride_t,
    o_stride_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    V_GROUP: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(b_seq_len_ptr + b)
    first, split_len = _decode_span(ctx, window, NUM_SPLITS, BLOCK_N, HAS_WINDOW, V_GROUP)
    num_live = tl.cdiv(ctx - first, tl.maximum(split_len, 1))  # the splits that ran
    sp = tl.arange(0, NUM_SPLITS)
    sp_live = sp < num_live
    part = (b * NUM_HEADS + h).to(tl.int64) * NUM_SPLITS + sp
    lse = tl.load(part_lse_ptr + part, mask=sp_live, other=float("-inf"))
    w = tl.where(sp_live, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    d = tl.arange(0, BLOCK_D)
    d_live = d < HEAD_DIM
    parts = tl.load(
        part_o_ptr + part[:, None] * BLOCK_D + d[None, :],
        mask=sp_live[:, None] & d_live[None, :],
        other=0.0,
    )
    denom = tl.sum(w, 0)
    out = tl.sum(w[:, None] * parts, 0) / tl.where(denom > 0, denom, 1.0)
    o_ptrs = o_ptr + b.to(tl.int64) * o_stride_t + h * o_stride_h + d
    tl.store(o_ptrs, out, mask=d_live)


def num_splits_for(device: torch.device, num_seqs: int, num_kv_heads: int, max_ctx: int) -> int:
    """Splits per sequence from host ints only: enough programs for ~4 waves of the SMs, at least
    MIN_KEYS_PER_SPLIT keys of the longest context (or window) per split, a power of two <=
    MAX_SPLITS."""
    want = triton.cdiv(4 * sm_count(device), max(1, num_seqs * num_kv_heads))
    splits = max(1, min(want, max_ctx // MIN_KEYS_PER_SPLIT, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


def attention_decode(
    q: torch.Tensor,
    pool_layer: torch.Tensor,
    meta: AttnMeta,
    num_kv_heads: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    scales: torch.Tensor | None = None,
    v_group: int = 0,
) -> torch.Tensor:
    """``attention`` when every sequence has exactly one new token (b1_start = 0, 1, ..., B):
    the query of sequence b at position L_b - 1 sees keys max(0, L_b - window) .. L_b - 1 (all
    with window 0), logits soft-capped when softcap > 0.

    Split-KV: see ``decode_splits``. Sequences with b_seq_len 0 (padding rows of a captured
    batch) get an unspecified output row. window and softcap are per-layer constants: the
    splits depend on host ints only, so a CUDA graph captures the step (with fp8 pages the
    scale table too: the pool's own buffer, at a fixed address). scales and v_group:
    ``attention``'s.
    """
    return decode_splits(
        q, pool_layer, meta, num_kv_heads, scale, None, window, softcap, scales, v_group
    )


def decode_splits(
    q: torch.Tensor,
    pool_layer: torch.Tensor,
    meta: AttnMeta,
    num_kv_heads: int,
    scale: float,
    num_splits: int | None,
    window: int = 0,
    softcap: float = 0.0,
    scales: torch.Tensor | None = None,
    v_group: int = 0,
) -> torch.Tensor:
    """Decode attention in two stages. Stage 1, grid (B, num_kv_heads, num_splits): the query
    heads of one KV head over one split of the keys (``_decode_span``), DECODE["gqa_block_n"]
    keys per step, ``tl.dot`` on a tile of max(16, group) query rows (under MHA one live row;
    with DECODE["mha_dot"] False, MHA takes DECODE["mha_block_n"] keys per step and ``tl.sum``
    dot products instead; head_dim > WIDE_HEAD_DIM: DECODE_WIDE's overrides). It writes the
    normalized partial output and its log2-sum-exp. Stage 2, grid (B, num_heads): the merge.
    With one split, stage 1 writes the output and stage 2 is skipped. num_splits None:
    ``num_splits_for`` over the longest context, or the window when shorter. v_group G > 0:
    fp8 pages in the grouped V layout of ``slora_kernels.fp8``, the keys split from the start
    of the window's first group (``_decode_span``).
    """
    _check(q, pool_layer, meta, num_kv_heads, scales, v_group)
    kv = kv_pointers(pool_layer, scales)
    num_seqs, num_heads, head_dim = meta.b_seq_len.shape[0], q.shape[1], q.shape[2]
    assert q.shape[0] == num_seqs, "decode: one query per sequence"
    assert window >= 0, f"window {window}: 0 (none) or the keys a query sees"
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if num_splits is None:
        keys = meta.page_table.shape[1] if window == 0 else min(window, meta.page_table.shape[1])
        num_splits = num_splits_for(q.device, num_seqs, num_kv_heads, keys)
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, "num_splits: a power of two"
    tiles = DECODE if head_dim <= WIDE_HEAD_DIM else {**DECODE, **DECODE_WIDE}
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    use_dot = group > 1 or tiles["mha_dot"]
    block_n = tiles["gqa_block_n"] if use_dot else tiles["mha_block_n"]
    assert block_n % max(v_group, 1) == 0, f"{block_n} keys a step: whole groups of {v_group}"
    part_o = part_lse = out  # unused with one split
    if num_splits > 1:
        part_o = q.new_empty(num_seqs, num_heads, num_splits, block_d, dtype=torch.float32)
        part_lse = q.new_empty(num_seqs, num_heads, num_splits, dtype=torch.float32)
    block_g = max(16, triton.next_power_of_2(group)) if use_dot else 1
    qk_scale, cap_log2 = _logit_args(scale, softcap)
    grid = (num_seqs, num_kv_heads, num_splits)
    if tiles["heads_fastest"]:
        grid = (num_kv_heads, num_seqs, num_splits)
    _decode_split_kernel[grid](
        q,
        q.stride(0),
        q.stride(1),
        kv["pool"],
        kv["scales"],
        meta.b_seq_len,
        meta.page_table,
        meta.page_table.stride(0),
        qk_scale,
        cap_log2,
        window,
        part_o,
        part_lse,
        out,
        NUM_HEADS=num_heads,
        PAGE=kv["page"],
        KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_G=block_g,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        USE_DOT=use_dot,
        HAS_WINDOW=window > 0,
        SOFTCAP=softcap > 0,
        FP8=kv["fp8"],
        F16=fp8_f16(kv["fp8"], q.dtype, tiles["fp8_f16"]),
        PRECISION=_precision(q.dtype),
        HEADS_FASTEST=tiles["heads_fastest"],
        V_GROUP=v_group,
        num_warps=tiles["warps"],
        num_stages=tiles["fp8_stages" if kv["fp8"] else "stages"],
    )
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_o,
            part_lse,
            meta.b_seq_len,
            window,
            out,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_N=block_n,
            NUM_SPLITS=num_splits,
            HAS_WINDOW=window > 0,
            V_GROUP=v_group,
            num_warps=4,
        )
    return out
