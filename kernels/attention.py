"""Triton attention over the paged KV cache: the prefill kernel (prefill with earlier context,
chunked prefill), and what it shares with the split-KV decode of ``slora_kernels.attention_decode``.

Keys and values of sequence b at position j live in pages page_table[b, j, 0] (K) and
page_table[b, j, 1] (V); KV head h occupies elements h * head_dim .. (h + 1) * head_dim of a page.
Page indices are widened to int64 before the multiply by page_size (pools pass 2^31 elements).
Softmax runs in fp32 with exp2 (scores pre-multiplied by scale * log2(e); with a soft-cap the
natural-domain logit is capped first, ``_logits``). A sliding window (window > 0: a query at
position p sees keys p - window < j <= p) and the soft-cap are constexpr switches (HAS_WINDOW,
SOFTCAP) set on the host, so a model without them runs the kernels it ran before; with a window
the kernels skip the key blocks wholly before it.

FP8 KV pages (``slora_kernels.fp8``; constexpr FP8, set when the launcher gets ``scales``): the kernels
read the pool as e4m3 bytes, K of a token at bytes 0 .. kv_dim of its page and V at kv_dim ..
2 * kv_dim, upcast them to q's dtype (exact: every e4m3 value is a bf16, fp16 and fp32 value)
and fold the per-key scales in where they cost one multiply per key, not per element: the K
scale into the raw scores (q . (s_k * k) = s_k * (q . k)), the V scale into the probabilities
before p . V (sum_j p_j * s_j * v_j), while the softmax sums use the unscaled p.

With a 16-bit q (constexpr F16, ``FP8_F16``) the tensor-core dots run in fp16, not bf16: e4m3
widens to fp16 in one instruction per pair (to bf16 it goes through fp32), and fp16 holds every
e4m3 value and every bf16 q under 65504 exactly (q is clamped to +-65504 first). fp16's range is
narrow where p * s_v is small, so each key block's p * s_v is divided by the block's largest s_v
before the dot and the dot's result multiplied by it: p_j * s_j / max(s) stays in [0, 1].

Grouped V (``v_group`` G > 0, constexpr V_GROUP; fp8 pages): V in the layout of
``slora_kernels.fp8`` (G consecutive keys on G aligned pages, V column-major within the
group), which ``_grouped_values`` loads a whole group at a time with each column's G keys
adjacent, the K-major operand of p . V; K and the scales are read as on per-token pages. The
key loops over pages then start at a multiple of G (``group_start``), the keys before the
window masked as keys past the end are.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from slora_kernels import fp8
from slora_kernels.kv import e4m3_round
from slora_kernels.meta import AttnMeta

LOG2E = 1.4426950408889634
# Prefill: queries per tile and warps (the kernel also runs 128 on 8, as the interpreter tests
# check); benchmarks/h200 was measured with (64, 4). 64 keys per step, 2 stages.
PREFILL_TILE = (64, 4)
WIDE_HEAD_DIM = 128  # head_dim past it (Gemma 2: 256) takes the wide tiles
# Wide heads: (queries, keys per step, warps, stages). H200, Gemma-2-9B's 16/8 heads of 256,
# bf16, window 4096, softcap 50: 8 x 1024 new + 4 x 512 new on 5000 ran in 0.96 ms, where
# (64, 64, 4, 2) (the head_dim 128 tile) took 1.78 ms and (64, 32, 4, 3) 1.04 ms.
PREFILL_WIDE = (128, 64, 8, 2)
FP8_F16 = True  # fp8 pages under a 16-bit q: fp16 dots (module doc); False: q's dtype


@triton.jit
def _logits(raw, qk_scale, cap_log2, SOFTCAP: tl.constexpr):
    """exp2-domain logits of the raw q.k products: raw * scale * log2(e) (qk_scale = scale *
    log2(e)), or with a soft-cap softcap * tanh(raw * scale / softcap) * log2(e) (qk_scale =
    scale / softcap, cap_log2 = softcap * log2(e)); tanh(x) = 1 - 2 / (e^2x + 1) in fp32, which
    tends to +-1 at large |x| (e^2x: inf or 0) instead of inf / inf."""
    x = raw * qk_scale
    if SOFTCAP:
        x = (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * cap_log2
    return x


@triton.jit
def _kv_scale(scale_ptr, page, kv_head, live, WHICH: tl.constexpr, KV_HEADS: tl.constexpr):
    """fp8 pages: the scales of one KV head at a block of keys' pages, K's (WHICH 0) or V's
    (WHICH 1), from the table [P, 2 * KV_HEADS]; 0 for keys past the end (masked anyway)."""
    return tl.load(
        scale_ptr + page * (2 * KV_HEADS) + WHICH * KV_HEADS + kv_head, mask=live, other=0.0
    )


@triton.jit
def _f16_query(q):
    """q as fp16 for the dots on fp8 pages (module doc), clamped to fp16's finite range."""
    return tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


@triton.jit
def _v_scaled(p, sv, F16: tl.constexpr):
    """(p * s_v, factor) for the p . V dot on fp8 pages: factor 1, or with F16 the block's
    largest s_v, p * s_v divided by it (module doc); the dot's result is multiplied by factor."""
    if F16:
        top = tl.maximum(tl.max(sv, 0), 1e-30)
        return p * (sv / top)[None, :], top
    return p * sv[None, :], 1.0


@triton.jit
def _seen(jj, k_live, q_pos, window, HAS_WINDOW: tl.constexpr):
    """[BLOCK_M, BLOCK_N]: which of a block's keys (positions jj, k_live where real) each query
    (at q_pos) sees: causal, and within the window."""
    seen = (jj[None, :] <= q_pos[:, None]) & k_live[None, :]
    if HAS_WINDOW:
        seen = seen & (q_pos[:, None] - jj[None, :] < window)
    return seen


@triton.jit
def _probs(
    q,
    k,
    sk,
    m_i,
    l_i,
    seen,
    qk_scale,
    cap_log2,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SCALED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """A block of keys (``seen``: which each query sees) in the online softmax of a query
    tile: (p, alpha, m, l), the block's probabilities under the new running max m, the factor
    of the earlier sums and l updated. SCALED: k is e4m3 with per-key scales sk (module doc)."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    if SCALED:
        s = s * sk[None, :]
    s = tl.where(seen, _logits(s, qk_scale, cap_log2, SOFTCAP), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = m_new
    if HAS_WINDOW:  # a later query's window may start past this block: no key seen yet
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _add_values(
    acc, alpha, p, v, sv, q, SCALED: tl.constexpr, F16: tl.constexpr, PRECISION: tl.constexpr
):
    """acc after a block: the earlier sum times alpha plus p . V (SCALED: V e4m3 with per-key
    scales sv, folded into p; the dot in q's dtype)."""
    factor = 1.0
    if SCALED:
        p, factor = _v_scaled(p, sv, F16)
    pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION) * factor
    return acc * alpha[:, None] + pv


@triton.jit
def _own_rows(ptr, stride, rows, cols, mask, FP8: tl.constexpr, BLOCK_N: tl.constexpr):
    """A block of the step's own K or V rows [BLOCK_N, BLOCK_D] and their per-key scales: with
    FP8, rounded through e4m3 in registers as kv_write rounded them into the pages (the
    scales those pages hold), else as they are (scale 1, unused)."""
    x = tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0)
    scale = 1.0
    if FP8:
        x = x.to(tl.float32)
        x, scale = e4m3_round(x, tl.max(tl.abs(x), 1)[:, None])
        scale = tl.reshape(scale, [BLOCK_N])
    return x, scale


@triton.jit
def _grouped_values(
    pool_ptr,
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
    """V [BLOCK_N, BLOCK_D] of keys j0 .. j0 + BLOCK_N in the grouped V layout of
    ``slora_kernels.fp8``, j0 a multiple of V_GROUP (the compiler is told so: the loads are
    vectorized on it) and BLOCK_N of whole groups: loaded as [BLOCK_D, BLOCK_N], each group's
    keys adjacent bytes of a column (the p . V dot's K-major operand), the groups whose first
    key is before k_hi whole, found from that key's page-table entry. Their slots at and past
    k_hi hold later keys' V or zeros (``kv.kv_write`` zeroes a group's tail): finite values,
    which the callers give p 0."""
    jj = tl.multiple_of(j0, V_GROUP) + tl.arange(0, BLOCK_N)
    first = (jj // V_GROUP) * V_GROUP  # each key's group's first position
    g_live = first < k_hi
    g0 = tl.load(pt_row + first * 2, mask=g_live, other=0).to(tl.int64)  # its page
    per_page: tl.constexpr = KV_DIM // V_GROUP  # columns of a group a page holds
    rows = (g0[None, :] + (kv_cols // per_page)[:, None]) * PAGE + KV_DIM
    offs = rows + (kv_cols % per_page)[:, None] * V_GROUP + (jj % V_GROUP)[None, :]
    offs = tl.max_contiguous(tl.multiple_of(offs, [V_GROUP, V_GROUP]), [1, V_GROUP])
    vt = tl.load(pool_ptr + offs, mask=d_live[:, None] & g_live[None, :], other=0.0)
    return tl.trans(vt)


@triton.jit
def group_start(first, V_GROUP: tl.constexpr):
    """The first key a loop over keys reads: ``first``, or with V_GROUP aligned down to a
    multiple of it (the grouped loader reads whole groups; the callers mask the keys before
    ``first``)."""
    if V_GROUP > 0:
        first = first // V_GROUP * V_GROUP
    return first


@triton.jit(do_not_specialize=["pt_stride"])
def _prefill_kernel(
    q_ptr,
    q_stride_t,
    q_stride_h,
    o_ptr,
    pool_ptr,
    scale_ptr,
    own_k_ptr,
    own_k_stride,
    own_v_ptr,
    own_v_stride,
    b1_start_ptr,
    b_seq_len_ptr,
    pt_ptr,
    pt_stride,
    qk_scale,
    cap_log2,
    window,
    PAGE: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,
    F16: tl.constexpr,
    OWN: tl.constexpr,
    PRECISION: tl.constexpr,
    V_GROUP: tl.constexpr,
):
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
    q_mask = q_live[:, None] & d_live[None, :]
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=q_mask, other=0.0)
    if F16:
        q = _f16_query(q)
    kv_head = h // GROUP
    kv_cols = kv_head * HEAD_DIM + d
    pt_row = pt_ptr + b.to(tl.int64) * pt_stride
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum(ctx, ctx - n + m0 + BLOCK_M)  # one past the block's last query position
    start = 0
    if HAS_WINDOW:  # the first key the tile's first query sees: the blocks before it are skipped
        start = tl.maximum(ctx - n + m0 - window + 1, 0)
    own_from = ctx - n  # the step's own keys, positions L - n .. L - 1
    page_end = end
    if OWN:  # read from the step's K/V rows, not the pages (launcher doc)
        page_end = tl.minimum(end, own_from)
    for j0 in range(group_start(start, V_GROUP), page_end, BLOCK_N):  # keys before start: unseen
        jj = j0 + tl.arange(0, BLOCK_N)
        k_live = jj < page_end
        kv_mask = k_live[:, None] & d_live[None, :]
        page_k = tl.load(pt_row + jj * 2, mask=k_live, other=0).to(tl.int64)
        k = tl.load(pool_ptr + page_k[:, None] * PAGE + kv_cols[None, :], mask=kv_mask, other=0.0)
        sk = 1.0
        if FP8:
            sk = _kv_scale(scale_ptr, page_k, kv_head, k_live, 0, KV_HEADS)
        seen = _seen(jj, k_live, q_pos, window, HAS_WINDOW)
        p, alpha, m_i, l_i = _probs(
            q, k, sk, m_i, l_i, seen, qk_scale, cap_log2, HAS_WINDOW, SOFTCAP, FP8, PRECISION
        )
        page_v = tl.load(pt_row + jj * 2 + 1, mask=k_live, other=0).to(tl.int64)
        v_cols = kv_cols
        if FP8:  # V after the token's K bytes
            v_cols = kv_cols + KV_HEADS * HEAD_DIM
        if V_GROUP > 0:
            v = _grouped_values(
                pool_ptr,
                pt_row,
                j0,
                page_end,
                kv_cols,
                d_live,
                KV_HEADS * HEAD_DIM,
                PAGE,
                BLOCK_N,
                V_GROUP,
            )
        else:
            v = tl.load(
                pool_ptr + page_v[:, None] * PAGE + v_cols[None, :], mask=kv_mask, other=0.0
            )
        sv = 1.0
        if FP8:
            sv = _kv_scale(scale_ptr, page_v, kv_head, k_live, 1, KV_HEADS)
        acc = _add_values(acc, alpha, p, v, sv, q, FP8, F16, PRECISION)
    if OWN:
        for j0 in range(tl.maximum(start, own_from), end, BLOCK_N):
            jj = j0 + tl.arange(0, BLOCK_N)
            k_live = jj < end
            kv_mask = k_live[:, None] & d_live[None, :]
            rows = (lo + jj - own_from).to(tl.int64)
            k, sk = _own_rows(own_k_ptr, own_k_stride, rows, kv_cols, kv_mask, FP8, BLOCK_N)
            seen = _seen(jj, k_live, q_pos, window, HAS_WINDOW)
            p, alpha, m_i, l_i = _probs(
                q, k, sk, m_i, l_i, seen, qk_scale, cap_log2, HAS_WINDOW, SOFTCAP, FP8, PRECISION
            )
            v, sv = _own_rows(own_v_ptr, own_v_stride, rows, kv_cols, kv_mask, FP8, BLOCK_N)
            acc = _add_values(acc, alpha, p, v, sv, q, FP8, F16, PRECISION)
    out = acc / l_i[:, None]
    tl.store(o_ptr + q_rows[:, None] + d[None, :], out, mask=q_mask)


def _check(
    q: torch.Tensor,
    pool_layer: torch.Tensor,
    meta: AttnMeta,
    num_kv_heads: int,
    scales: torch.Tensor | None,
    v_group: int = 0,
) -> None:
    assert q.dim() == 3 and q.is_contiguous(), "q must be a contiguous [T, num_heads, head_dim]"
    assert pool_layer.dim() == 2 and pool_layer.is_contiguous(), "pool_layer must be [P, page_size]"
    assert q.dtype == pool_layer.dtype, (q.dtype, pool_layer.dtype)
    assert q.shape[1] % num_kv_heads == 0, (q.shape, num_kv_heads)
    assert num_kv_heads * q.shape[2] <= pool_layer.shape[1], "K/V of a token must fit a page"
    for name in ("b1_start", "b_seq_len", "page_table"):
        tensor = getattr(meta, name)
        assert tensor.dtype == torch.int32 and tensor.is_contiguous(), f"{name}: contiguous int32"
    assert meta.page_table.dim() == 3 and meta.page_table.shape[2] == 2
    if scales is not None:
        kv_dim, page_bytes = num_kv_heads * q.shape[2], pool_layer.shape[1] * q.element_size()
        assert scales.dtype == torch.float32 and scales.is_contiguous(), "scales: contiguous fp32"
        assert scales.shape == (pool_layer.shape[0], 2 * num_kv_heads), (scales.shape, num_kv_heads)
        assert page_bytes >= 2 * kv_dim, f"an fp8 page of {page_bytes} B holds K and V of {kv_dim}"
    if v_group:  # the grouped loader reads a column's keys as one aligned run of v_group bytes
        kv_dim, page_bytes = num_kv_heads * q.shape[2], pool_layer.shape[1] * q.element_size()
        assert v_group > 0 and scales is not None, f"v_group {v_group}: a layout of fp8 pages"
        assert kv_dim % v_group == 0 and page_bytes % v_group == 0, (kv_dim, page_bytes, v_group)


def kv_pointers(pool_layer: torch.Tensor, scales: torch.Tensor | None) -> dict:
    """The pool and scale arguments of the attention kernels: the pool as e4m3 bytes and its
    scale table with fp8 pages (PAGE in bytes), else the pool itself (the scale pointer unused)."""
    if scales is None:
        return dict(pool=pool_layer, scales=pool_layer, page=pool_layer.shape[1], fp8=False)
    data = fp8.bytes_view(pool_layer)
    return dict(pool=data, scales=scales, page=data.shape[1], fp8=True)


def fp8_f16(fp8_pages: bool, dtype: torch.dtype, enabled: bool) -> bool:
    """The kernels' F16 switch: fp8 pages under a 16-bit q, when ``enabled``."""
    return fp8_pages and enabled and dtype != torch.float32


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _logit_args(scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, cap_log2) for ``_logits``: softcap 0 (none) leaves cap_log2 unused."""
    assert softcap >= 0, f"softcap {softcap}: 0 (none) or the cap of the logits"
    if softcap > 0:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 0.0


def attention(
    q: torch.Tensor,
    pool_layer: torch.Tensor,
    meta: AttnMeta,
    num_kv_heads: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    scales: torch.Tensor | None = None,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
    v_group: int = 0,
) -> torch.Tensor:
    """Causal attention of the step's queries over each sequence's paged K/V (prefill with earlier
    context, chunked prefill and decode alike).

    Semantics: for sequence b with n_b = b1_start[b+1] - b1_start[b] new tokens and context
      L_b = b_seq_len[b] (new tokens included, their KV already written), query i of b sits at
      position p = L_b - n_b + i and attends to keys 0 .. p, read through page_table[b]; with
      window > 0 only to keys j with p - window < j. Logits q.k * scale, soft-capped to
      softcap * tanh(q.k * scale / softcap) when softcap > 0.
    Shape: q [T, num_heads, head_dim]; pool_layer [P, page_size]; meta.b1_start [B+1];
      meta.b_seq_len [B]; meta.page_table [B, max_ctx, 2] int32 (-1 past the end);
      scales [P, 2 * num_kv_heads] fp32: fp8 pages (module doc), None: the model dtype.
      own (k, v), each [T, kv_dim] of q's dtype, rows of unit column stride: the step's own
      tokens' K and V (row t for query t), which kv_write put in the pages. Given, the keys at
      positions L_b - n_b .. L_b - 1 are read from these rows instead of the pages, on fp8
      pages rounded in registers as kv_write rounds them (``kv.e4m3_round``): the values the
      pages hold, read contiguously in the model dtype, without the page table, the scale
      table or e4m3 bytes in the operand layouts.
      v_group G > 0: fp8 pages with V in the grouped layout of ``slora_kernels.fp8``.
    Returns [T, num_heads, head_dim] in q's dtype; softmax in fp32.
    Grid (ceil(max_new / BLOCK_M), B, num_heads): BLOCK_M queries x 64 keys per tile, one query
    head; BLOCK_M and warps from PREFILL_TILE (head_dim > WIDE_HEAD_DIM: PREFILL_WIDE). With a
    window a tile's key loop starts at its first query's first key (v_group G: at the start of
    its group, the keys before it masked).
    """
    _check(q, pool_layer, meta, num_kv_heads, scales, v_group)
    assert window >= 0, f"window {window}: 0 (none) or the keys a query sees"
    own_k, own_v = own if own is not None else (q, q)  # (q, q): pointers the kernel never reads
    if own is not None:
        for x in own:
            assert x.dtype == q.dtype and x.shape == (q.shape[0], num_kv_heads * q.shape[2]), (
                f"own K/V {tuple(x.shape)} {x.dtype}: [T, kv_dim] of q's dtype"
            )
            assert x.stride(1) == 1, "own K/V rows: unit column stride"
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = meta.b_seq_len.shape[0], q.shape[1], q.shape[2]
    kv = kv_pointers(pool_layer, scales)
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    if head_dim <= WIDE_HEAD_DIM:
        (block_m, warps), block_n, stages = PREFILL_TILE, 64, 2
    else:
        block_m, block_n, warps, stages = PREFILL_WIDE
    assert block_n % max(v_group, 1) == 0, f"{block_n} keys a step: whole groups of {v_group}"
    qk_scale, cap_log2 = _logit_args(scale, softcap)
    grid = (triton.cdiv(meta.max_new, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q,
        q.stride(0),
        q.stride(1),
        out,
        kv["pool"],
        kv["scales"],
        own_k,
        own_k.stride(0),
        own_v,
        own_v.stride(0),
        meta.b1_start,
        meta.b_seq_len,
        meta.page_table,
        meta.page_table.stride(0),
        qk_scale,
        cap_log2,
        window,
        PAGE=kv["page"],
        KV_HEADS=num_kv_heads,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_WINDOW=window > 0,
        SOFTCAP=softcap > 0,
        FP8=kv["fp8"],
        F16=fp8_f16(kv["fp8"], q.dtype, FP8_F16),
        OWN=own is not None,
        PRECISION=_precision(q.dtype),
        V_GROUP=v_group,
        num_warps=warps,
        num_stages=stages,
    )
    return out


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a small machine, so that tests see splits
    return torch.cuda.get_device_properties(device).multi_processor_count
