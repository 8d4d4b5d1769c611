"""Triton attention over the paged KV cache: prefill with earlier context, and split-KV decode.

Keys and values of sequence b at position j live in pages page_table[b, j, 0] (K) and
page_table[b, j, 1] (V); KV head h occupies elements h * head_dim .. (h + 1) * head_dim of a page.
Page indices are widened to int64 before the multiply by page_size (pools pass 2^31 elements).
Softmax runs in fp32 with exp2 (scores pre-multiplied by scale * log2(e)).

Running example (decode, 2 splits): sequence b has b_seq_len 300 and BLOCK_N 64: split_len =
ceil(ceil(300 / 2) / 64) * 64 = 192, split 0 reads keys 0..191, split 1 keys 192..299; the merge
weighs each split's normalized output by 2^(lse_split - max lse).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.meta import AttnMeta

LOG2E = 1.4426950408889634
MIN_KEYS_PER_SPLIT = 256  # a split reads at least this many keys
MAX_SPLITS = 64
# Prefill: queries per tile and warps (the kernel also runs 128 on 8, as the interpreter tests
# check); benchmarks/h200 was measured with (64, 4).
PREFILL_TILE = (64, 4)
# Decode tiles: keys per loop step (MHA: CUDA-core dot products; GQA: tensor-core tiles), warps
# and software-pipeline stages; benchmarks/kernels.py sweeps them on the card.
# mha_dot: MHA on tensor cores too, the one query row padded to a 16-row tile (as GQA groups
# under 16 are); False: CUDA-core dot products (H200, B=256, contexts 256-1024: 0.54 of the copy
# bandwidth for every tile tried, where GQA's tensor-core path reached 0.83).
DECODE = {"mha_block_n": 32, "gqa_block_n": 128, "warps": 4, "stages": 3, "mha_dot": True}


@triton.jit(do_not_specialize=["pt_stride"])
def _prefill_kernel(q_ptr, q_stride_t, q_stride_h, o_ptr, pool_ptr, b1_start_ptr, b_seq_len_ptr,
                    pt_ptr, pt_stride, scale_log2, PAGE: tl.constexpr, GROUP: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    m0 = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1)
    h = tl.program_id(2)
    lo = tl.load(b1_start_ptr + b)
    n = tl.load(b1_start_ptr + b + 1) - lo
    if m0 >= n:
        return
    ctx = tl.load(b_seq_len_ptr + b)
    ii = m0 + tl.arange(0, BLOCK_M)
    q_live = ii < n
    q_pos = ctx - n + ii  # query i sits at position L - n + i
    d = tl.arange(0, BLOCK_D)
    d_live = d < HEAD_DIM
    q_rows = (lo + ii).to(tl.int64) * q_stride_t + h * q_stride_h
    q = tl.load(
        q_ptr + q_rows[:, None] + d[None, :], mask=q_live[:, None] & d_live[None, :], other=0.0
    )
    kv_cols = (h // GROUP) * HEAD_DIM + d
    pt_row = pt_ptr + b.to(tl.int64) * pt_stride
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum(ctx, ctx - n + m0 + BLOCK_M)  # one past the block's last query position
    for j0 in range(0, end, BLOCK_N):
        jj = j0 + tl.arange(0, BLOCK_N)
        k_live = jj < end
        kv_mask = k_live[:, None] & d_live[None, :]
        page_k = tl.load(pt_row + jj * 2, mask=k_live, other=0).to(tl.int64)
        k = tl.load(pool_ptr + page_k[:, None] * PAGE + kv_cols[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        s = tl.where((jj[None, :] <= q_pos[:, None]) & k_live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        page_v = tl.load(pt_row + jj * 2 + 1, mask=k_live, other=0).to(tl.int64)
        v = tl.load(pool_ptr + page_v[:, None] * PAGE + kv_cols[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + q_rows[:, None] + d[None, :], out, mask=q_live[:, None] & d_live[None, :])


@triton.jit(do_not_specialize=["pt_stride"])
def _decode_split_kernel(q_ptr, q_stride_t, q_stride_h, pool_ptr, b_seq_len_ptr, pt_ptr, pt_stride,
                         scale_log2, part_o_ptr, part_lse_ptr, o_ptr, NUM_HEADS: tl.constexpr,
                         PAGE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, USE_DOT: tl.constexpr,
                         PRECISION: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(b_seq_len_ptr + b)
    split_len = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    k_lo = split * split_len
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
    kv_cols = kv_head * HEAD_DIM + d
    pt_row = pt_ptr + b.to(tl.int64) * pt_stride
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for j0 in range(k_lo, k_hi, BLOCK_N):
        jj = j0 + tl.arange(0, BLOCK_N)
        k_live = jj < k_hi
        kv_mask = k_live[:, None] & d_live[None, :]
        page_k = tl.load(pt_row + jj * 2, mask=k_live, other=0).to(tl.int64)
        page_v = tl.load(pt_row + jj * 2 + 1, mask=k_live, other=0).to(tl.int64)
        k = tl.load(pool_ptr + page_k[:, None] * PAGE + kv_cols[None, :], mask=kv_mask, other=0.0)
        v = tl.load(pool_ptr + page_v[:, None] * PAGE + kv_cols[None, :], mask=kv_mask, other=0.0)
        if USE_DOT:  # GQA: the group's query heads form the rows of one tensor-core tile
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        else:  # one query head per KV head: a dot product per key on CUDA cores
            s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], 2)
        s = tl.where(k_live[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if USE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
        acc = acc * alpha[:, None] + pv
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
def _decode_merge_kernel(part_o_ptr, part_lse_ptr, b_seq_len_ptr, o_ptr, o_stride_t, o_stride_h,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(b_seq_len_ptr + b)
    split_len = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    num_live = tl.cdiv(ctx, tl.maximum(split_len, 1))  # the splits that ran (same rule as above)
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


def _check(q: torch.Tensor, pool_layer: torch.Tensor, meta: AttnMeta, num_kv_heads: int) -> None:
    assert q.dim() == 3 and q.is_contiguous(), "q must be a contiguous [T, num_heads, head_dim]"
    assert pool_layer.dim() == 2 and pool_layer.is_contiguous(), "pool_layer must be [P, page_size]"
    assert q.dtype == pool_layer.dtype, (q.dtype, pool_layer.dtype)
    assert q.shape[1] % num_kv_heads == 0, (q.shape, num_kv_heads)
    assert num_kv_heads * q.shape[2] <= pool_layer.shape[1], "K/V of a token must fit a page"
    for name in ("b1_start", "b_seq_len", "page_table"):
        tensor = getattr(meta, name)
        assert tensor.dtype == torch.int32 and tensor.is_contiguous(), f"{name}: contiguous int32"
    assert meta.page_table.dim() == 3 and meta.page_table.shape[2] == 2


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def attention(
    q: torch.Tensor, pool_layer: torch.Tensor, meta: AttnMeta, num_kv_heads: int, scale: float
) -> torch.Tensor:
    """Causal attention of the step's queries over each sequence's paged K/V (prefill with earlier
    context, chunked prefill and decode alike).

    Semantics: for sequence b with n_b = b1_start[b+1] - b1_start[b] new tokens and context
      L_b = b_seq_len[b] (new tokens included, their KV already written), query i of b sits at
      position L_b - n_b + i and attends to keys 0 .. L_b - n_b + i, read through page_table[b].
    Shape: q [T, num_heads, head_dim]; pool_layer [P, page_size]; meta.b1_start [B+1];
      meta.b_seq_len [B]; meta.page_table [B, max_ctx, 2] int32 (-1 past the end).
    Returns [T, num_heads, head_dim] in q's dtype; softmax in fp32.
    Grid (ceil(max_new / BLOCK_M), B, num_heads): BLOCK_M queries x 64 keys per tile, one query
    head; BLOCK_M and warps from PREFILL_TILE.
    """
    _check(q, pool_layer, meta, num_kv_heads)
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = meta.b_seq_len.shape[0], q.shape[1], q.shape[2]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    block_m, warps = PREFILL_TILE
    block_n = 64
    grid = (triton.cdiv(meta.max_new, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](q, q.stride(0), q.stride(1), out, pool_layer, meta.b1_start,
                          meta.b_seq_len, meta.page_table, meta.page_table.stride(0), scale * LOG2E,
                          PAGE=pool_layer.shape[1], GROUP=num_heads // num_kv_heads,
                          HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                          BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_precision(q.dtype),
                          num_warps=warps, num_stages=2)  # fmt: skip
    return out


def attention_decode(
    q: torch.Tensor, pool_layer: torch.Tensor, meta: AttnMeta, num_kv_heads: int, scale: float
) -> torch.Tensor:
    """``attention`` when every sequence has exactly one new token (b1_start = 0, 1, ..., B).

    Split-KV ("flash-decoding"): see ``decode_splits``. Sequences with b_seq_len 0 (padding rows
    of a captured batch) get an unspecified output row.
    """
    return decode_splits(q, pool_layer, meta, num_kv_heads, scale, None)


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a small machine, so that tests see splits
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits_for(device: torch.device, num_seqs: int, num_kv_heads: int, max_ctx: int) -> int:
    """Splits per sequence from host ints only: enough programs for ~4 waves of the SMs, at least
    MIN_KEYS_PER_SPLIT keys of the longest context per split, a power of two <= MAX_SPLITS."""
    want = triton.cdiv(4 * sm_count(device), max(1, num_seqs * num_kv_heads))
    splits = max(1, min(want, max_ctx // MIN_KEYS_PER_SPLIT, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


def decode_splits(
    q: torch.Tensor,
    pool_layer: torch.Tensor,
    meta: AttnMeta,
    num_kv_heads: int,
    scale: float,
    num_splits: int | None,
) -> torch.Tensor:
    """Decode attention in two stages. Stage 1, grid (B, num_kv_heads, num_splits): the query
    heads of one KV head over one split of the keys, 64 keys per step, ``tl.dot`` on a tile of
    max(16, group) query rows (under MHA one live row; with DECODE["mha_dot"] False, MHA takes
    32 keys per step and ``tl.sum`` dot products instead). It
    writes the normalized partial output and its log2-sum-exp. Stage 2, grid (B, num_heads): the
    merge. With one split, stage 1 writes the output and stage 2 is skipped. num_splits None:
    ``num_splits_for``.
    """
    _check(q, pool_layer, meta, num_kv_heads)
    num_seqs, num_heads, head_dim = meta.b_seq_len.shape[0], q.shape[1], q.shape[2]
    assert q.shape[0] == num_seqs, "decode: one query per sequence"
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = num_splits_for(q.device, num_seqs, num_kv_heads, meta.page_table.shape[1])
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, "num_splits: a power of two"
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    use_dot = group > 1 or DECODE["mha_dot"]
    block_n = DECODE["gqa_block_n"] if use_dot else DECODE["mha_block_n"]
    part_o = part_lse = out  # unused with one split
    if num_splits > 1:
        part_o = q.new_empty(num_seqs, num_heads, num_splits, block_d, dtype=torch.float32)
        part_lse = q.new_empty(num_seqs, num_heads, num_splits, dtype=torch.float32)
    block_g = max(16, triton.next_power_of_2(group)) if use_dot else 1
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, q.stride(0), q.stride(1), pool_layer, meta.b_seq_len, meta.page_table,
        meta.page_table.stride(0), scale * LOG2E, part_o, part_lse, out, NUM_HEADS=num_heads,
        PAGE=pool_layer.shape[1], GROUP=group, HEAD_DIM=head_dim, BLOCK_G=block_g,
        BLOCK_D=block_d, BLOCK_N=block_n, NUM_SPLITS=num_splits, USE_DOT=use_dot,
        PRECISION=_precision(q.dtype), num_warps=DECODE["warps"],
        num_stages=DECODE["stages"])  # fmt: skip
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_o, part_lse, meta.b_seq_len, out, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
            NUM_SPLITS=num_splits, num_warps=4)  # fmt: skip
    return out
