"""Torch twins of every kernel: the CPU backend and the oracle the Triton kernels are tested against.

The pool is one tensor per layer view, ``pool_layer: [num_pages, page_size]``; a page is one
vector of ``page_size`` elements (the model's kv_dim) in every layer. A token's K and V each take
one page; an adapter's LoRA rows take whole pages (a row of width d takes ceil(d / page_size)).

Sentinels: slot -1 means "no adapter", page -1 means "no page"; both cost nothing.

FP8 KV cache: ``kv_write``, ``attention`` and ``attention_decode`` take ``scales`` (the pool's
per token and head scale table, ``slora_kernels.fp8``); with it a page holds a token's K and V in e4m3
and the attention dequantizes them (scores and softmax in fp32). Without it, the model dtype.

FP8 adapter rows (``LoraMeta.fp8_rows``, ``slora_kernels.lora_fp8``): ``gather_lora_rows``
dequantizes e4m3 A and B^T rows with their per row scales to fp32, so ``lora_shrink`` and
``lora_expand`` compute on the rows fp8 storage gives; vector rows stay in the pool's dtype.

Each function below has a Triton counterpart in ``kernels/`` with the same signature.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slora_kernels import act_quant, fp8, lora_fp8
from slora_kernels.meta import AttnMeta, LoraMeta


def kv_write(
    pool_layer: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_pages: torch.Tensor,
    scales: torch.Tensor | None = None,
    v_group: int = 0,
) -> None:
    """Store the step's keys and values in their pages.

    Semantics: pool_layer[out_pages[t, 0], :kv_dim] = k[t]; pool_layer[out_pages[t, 1], :kv_dim] = v[t]
      for every t whose page is not -1 (the sentinel writes nothing).
    Shape: pool_layer [P, page_size]; k, v [T, kv_dim]; out_pages [T, 2] int32 (K page, V page).
    With scales [P, 2 * kv_heads] fp32: e4m3 pages (``slora_kernels.fp8.kv_write``), V in
    the grouped layout with v_group G > 0.
    """
    if scales is not None:
        fp8.kv_write(pool_layer, k, v, out_pages, scales, v_group)
        return
    kv_dim = k.shape[1]
    pages = out_pages.long()
    for which, rows in enumerate((k, v)):
        keep = pages[:, which] >= 0
        pool_layer[pages[keep, which], :kv_dim] = rows[keep].to(pool_layer.dtype)


def gather_kv(
    pool_layer: torch.Tensor,
    pages: torch.Tensor,
    kv_dim: int,
    scales: torch.Tensor | None = None,
    v_group: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V at pages [..., 2] (K page, V page) -> k, v [..., kv_dim] in fp32 (fp8 pages:
    ``slora_kernels.fp8.gather``)."""
    if scales is not None:
        return fp8.gather(pool_layer, scales, pages, kv_dim, v_group)
    pages = pages.long()
    return pool_layer[pages[..., 0], :kv_dim].float(), pool_layer[pages[..., 1], :kv_dim].float()


def _as_paged(rows: torch.Tensor, kv_heads: int, scales: torch.Tensor | None) -> torch.Tensor:
    """K or V rows [n, kv_dim] as fp32 values as the pages hold them: rounded through e4m3
    (``fp8.quantize``) on fp8 pages, else as they are."""
    if scales is None:
        return rows.float()
    return fp8.dequantize(*fp8.quantize(rows, kv_heads))


def _scores(raw: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """Attention logits: q.k * scale, soft-capped to (-softcap, softcap) by softcap * tanh(s /
    softcap) when softcap > 0 (Gemma 2)."""
    s = raw * scale
    return s if softcap <= 0 else torch.tanh(s / softcap) * softcap


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
      position p = L_b - n_b + i and attends to keys 0 .. p, read through page_table[b]; with a
      sliding window (window > 0) only to keys j with p - j < window (Mistral, Gemma's local
      layers: the query and the window - 1 keys before it). Logits are q.k * scale, soft-capped
      when softcap > 0 (``_scores``).
    Shape: q [T, num_heads, head_dim]; pool_layer [P, page_size]; meta.b1_start [B+1];
      meta.b_seq_len [B]; meta.page_table [B, max_ctx, 2] int32 (-1 past the end).
    Returns [T, num_heads, head_dim] in q's dtype; softmax in fp32. scales: fp8 pages (module doc).
    own: (k, v) [T, kv_dim], the step's own tokens' K and V (row t for query t), which
      kv_write put in the pages: the keys at positions L_b - n_b .. L_b - 1 are read from them,
      as the pages hold them (on fp8 pages rounded through e4m3 the way kv_write rounds): the
      same values, without the page gathers. v_group: fp8 pages with V in the grouped layout
      (``slora_kernels.fp8``).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    kv_dim = num_kv_heads * head_dim
    out = torch.empty_like(q)
    starts = meta.b1_start.tolist()
    seq_lens = meta.b_seq_len.tolist()
    for b, ctx in enumerate(seq_lens):
        lo, hi = starts[b], starts[b + 1]
        n = hi - lo
        if n == 0:
            continue
        k, v = gather_kv(pool_layer, meta.page_table[b, :ctx], kv_dim, scales, v_group)
        if own is not None:  # gather's tensors are its own: written in place
            k[ctx - n :], v[ctx - n :] = (_as_paged(x[lo:hi], num_kv_heads, scales) for x in own)
        k = k.view(ctx, num_kv_heads, head_dim)
        v = v.view(ctx, num_kv_heads, head_dim)
        qb = q[lo:hi].float().view(n, num_kv_heads, group, head_dim)
        raw = torch.einsum("qhgd,khd->hgqk", qb, k)  # [kv_heads, group, n, ctx]
        scores = _scores(raw, scale, softcap)
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        hidden = k_pos > q_pos
        if window > 0:
            hidden |= q_pos - k_pos >= window
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[lo:hi] = (
            torch.einsum("hgqk,khd->qhgd", probs, v).reshape(n, num_heads, head_dim).to(q.dtype)
        )
    return out


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
    """``attention`` when every sequence has exactly one new token (b1_start = 0, 1, ..., B),
    batched over sequences: keys past a sequence's length (and, with a window, keys j <
    L_b - window) are masked out."""
    batch, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    kv_dim = num_kv_heads * head_dim
    ctx = int(meta.b_seq_len.max())
    pages = meta.page_table[:, :ctx].long().clamp(min=0)  # [B, ctx, 2]
    k, v = gather_kv(pool_layer, pages, kv_dim, scales, v_group)
    k = k.view(batch, ctx, num_kv_heads, head_dim)
    v = v.view(batch, ctx, num_kv_heads, head_dim)
    qb = q.float().view(batch, num_kv_heads, group, head_dim)
    scores = _scores(torch.einsum("bhgd,bkhd->bhgk", qb, k), scale, softcap)  # [B, kvh, g, ctx]
    k_pos = torch.arange(ctx, device=q.device)[None, :]
    seq_len = meta.b_seq_len.long()[:, None]
    hidden = k_pos >= seq_len
    if window > 0:
        hidden |= k_pos < seq_len - window
    scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # keys past a sequence's length read page 0, whatever it holds: as e4m3 bytes an adapter's
    # (or noise's) 0x7f is NaN, and 0 x NaN would reach the output
    v = v.masked_fill((k_pos >= seq_len)[:, :, None, None], 0.0)
    return torch.einsum("bhgk,bkhd->bhgd", probs, v).reshape(batch, num_heads, head_dim).to(q.dtype)


def _module_rank(meta: LoraMeta, slot: int, target: int) -> int:
    """The rank of one module (slot, ``meta.layer``, target): ``layer_rank``'s, 0 where the
    adapter leaves the module out, else the slot's rank."""
    if meta.layer_rank is None:
        return int(meta.slot_rank[slot])
    return int(meta.layer_rank[slot, meta.layer, target])


def _module_scale(meta: LoraMeta, slot: int, target: int) -> float:
    """The LoRA scale of one module, as ``_module_rank`` reads its rank."""
    if meta.layer_scale is None:
        return float(meta.slot_scale[slot])
    return float(meta.layer_scale[slot, meta.layer, target])


def gather_lora_rows(
    pool_layer: torch.Tensor, meta: LoraMeta, slot: int, target: int, which: int, width: int
) -> torch.Tensor:
    """The rank rows of one adapter's A (which=0, rows of d_in) or B^T (which=1, rows of d_out).

    Row j of the matrix lies in pages slot_pages[slot, start + j * pages_per_row + c],
    c = 0 .. pages_per_row - 1, with start = slot_offsets[slot, target, which] and
    pages_per_row = ceil(width / page_size). Returns [rank, width], the module's own rank at
    ``meta.layer`` (``_module_rank``). With ``meta.fp8_rows`` the rows are e4m3, page_size
    counting bytes, and come dequantized in fp32 (``slora_kernels.lora_fp8``).
    """
    page_size = pool_layer.shape[1]
    rank = _module_rank(meta, slot, target)
    start = int(meta.slot_offsets[slot, target, which])
    if meta.fp8_rows:
        return lora_fp8.gather_rows(pool_layer, meta.slot_pages[slot], start, rank, width)
    per_row = -(-width // page_size)
    pages = meta.slot_pages[slot, start : start + rank * per_row].long()
    return pool_layer[pages].reshape(rank, per_row * page_size)[:, :width]


def _gather_vector(
    pool_layer: torch.Tensor, meta: LoraMeta, slot: int, target: int, which: int, width: int
) -> torch.Tensor | None:
    """One adapter's vector rows of a target, ``width`` elements each, laid out like B^T rows
    from slot_vectors[slot, target, which]: which=0 lora_B's bias [width], which=1 DoRA's g and
    c [2, width]; None where it has none."""
    if meta.slot_vectors is None or int(meta.slot_vectors[slot, target, which]) < 0:
        return None
    rows = 1 + which
    per_row = -(-width // pool_layer.shape[1])
    start = int(meta.slot_vectors[slot, target, which])
    pages = meta.slot_pages[slot, start : start + rows * per_row].long()
    vectors = pool_layer[pages].reshape(rows, -1)[:, :width]
    return vectors[0] if which == 0 else vectors


def lora_group(target: int | tuple[int, ...]) -> tuple[int, ...]:
    """The targets of one LoRA launch: a target index, or a group of up to 3 sharing an input."""
    targets = (target,) if isinstance(target, int) else tuple(target)
    assert 1 <= len(targets) <= 3, f"1 to 3 targets per launch, got {targets}"
    return targets


def lora_shrink(
    x: torch.Tensor,
    pool_layer: torch.Tensor,
    meta: LoraMeta,
    target: int | tuple[int, ...],
    out: torch.Tensor,
) -> None:
    """First LoRA factor, gathered from pool pages, a different rank per adapter.

    Semantics: ``target`` is one target index or a group of up to 3 that share the input x (q, k,
    v or gate, up); target j of the group writes columns j * R .. j * R + rank of out, with
    R = out.shape[1] // len(group). For each token t with slot s = b_slot[t] >= 0 and target
    present in s:  out[t, j*R : j*R + rank[s]] = x[t] @ A_s^T  (A_s: rank[s] rows of d_in, read
    from pages). Rows without adapter (slot -1) or whose adapter lacks the target are untouched.
    Shape: x [T, d_in]; pool_layer [P, page_size]; out [T, G * R] (fp32 or x's dtype).
    """
    targets = lora_group(target)
    width = out.shape[1] // len(targets)
    for s, lo, hi in meta.segments():
        idx = meta.token_order[lo:hi].long()
        for j, t in enumerate(targets):
            if int(meta.slot_offsets[s, t, 0]) < 0 or _module_rank(meta, s, t) == 0:
                continue
            a = gather_lora_rows(pool_layer, meta, s, t, 0, x.shape[1])[:width]
            out[idx, j * width : j * width + a.shape[0]] = (x[idx].float() @ a.float().T).to(
                out.dtype
            )


def lora_expand(
    v: torch.Tensor,
    pool_layer: torch.Tensor,
    meta: LoraMeta,
    target: int | tuple[int, ...],
    out: torch.Tensor,
    cols: tuple[tuple[int, int], ...] | None = None,
) -> None:
    """Second LoRA factor, added in place into the base projection's output.

    Semantics: ``target`` is one target index or a group of up to 3 (as in ``lora_shrink``, whose
    out is v); target j adds into columns cols[j] = (lo, hi) of out (default: all of out, for
    one target). For each token t with slot s = b_slot[t] >= 0 and target present in s:
      delta = (v[t, j*R : j*R + rank[s]] @ B_s^T + bias_s) * scale[s]
      out[t, lo:hi] = out[t, lo:hi] + delta                 (LoRA)
      out[t, lo:hi] = g_s * out[t, lo:hi] + c_s + g_s * delta  (DoRA)
    (B_s^T: rank[s] rows of hi - lo, from pages; R = v.shape[1] // len(group); rank[s] and
    scale[s]: the module's at meta.layer, ``_module_rank`` and ``_module_scale``; rank 0: no add;
    bias_s: lora_B's bias where the adapter has one, else 0; g_s, c_s: the DoRA rows, where it
    has them: ``_gather_vector``).
    Shape: v [T, G * R]; pool_layer [P, page_size]; out [T, D] (may be a column slice).
    """
    targets = lora_group(target)
    cols = cols if cols is not None else ((0, out.shape[1]),)
    assert len(cols) == len(targets), f"{len(targets)} targets, {len(cols)} column ranges"
    width = v.shape[1] // len(targets)
    for s, lo, hi in meta.segments():
        idx = meta.token_order[lo:hi].long()
        for j, t in enumerate(targets):
            if int(meta.slot_offsets[s, t, 1]) < 0 or _module_rank(meta, s, t) == 0:
                continue
            c0, c1 = cols[j]
            b = gather_lora_rows(pool_layer, meta, s, t, 1, c1 - c0)[:width]
            vs = v[idx, j * width : j * width + b.shape[0]].float()
            delta = vs @ b.float()
            bias = _gather_vector(pool_layer, meta, s, t, 0, c1 - c0)
            if bias is not None:
                delta = delta + bias.float()
            delta = delta * _module_scale(meta, s, t)
            base = out[idx, c0:c1].float()
            dora = _gather_vector(pool_layer, meta, s, t, 1, c1 - c0)
            if dora is not None:
                g, c = dora.float()
                base, delta = base * g + c, delta * g
            out[idx, c0:c1] = (base + delta).to(out.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm, as Hugging Face Llama computes it (fp32 inside).

    Semantics: r = x + residual (or x); y = weight * (r / sqrt(mean(r^2) + eps)).
    Shape: x, residual [T, H]; weight [H]. Returns (y, r).
    """
    r = x if residual is None else x + residual
    h = r.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), r


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotary embedding in place (the rotate-half convention of Hugging Face Llama).

    Shape: q [T, num_heads, head_dim]; k [T, num_kv_heads, head_dim]; positions [T] int;
    cos_sin [max_pos, head_dim] fp32 holding cos in the first half, sin in the second.
    """
    half = q.shape[-1] // 2
    cs = cos_sin[positions.long()]
    cos = torch.cat([cs[:, :half], cs[:, :half]], dim=-1)[:, None, :]
    sin = torch.cat([cs[:, half:], cs[:, half:]], dim=-1)[:, None, :]
    for t in (q, k):
        rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        t.copy_((t.float() * cos + rotated.float() * sin).to(t.dtype))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up. Shape: gate_up [T, 2 * I] -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate, tanh approximation) * up: Gemma's GeGLU (``gelu_pytorch_tanh``).
    Shape: gate_up [T, 2 * I] -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    pad_to: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``rms_norm`` and the per-token e4m3 quantization of its y for an fp8 projection (y, r,
    (q, scale)): ``slora_kernels.act_quant.quantize_rows_ref(y, pad_to)``."""
    y, r = rms_norm(x, weight, eps, residual)
    return y, r, act_quant.quantize_rows_ref(y, pad_to)


def silu_mul_fp8(gate_up: torch.Tensor, pad_to: int = 1):
    """``silu_mul`` and the per-token e4m3 quantization of its output: (a, (q, scale))."""
    a = silu_mul(gate_up)
    return a, act_quant.quantize_rows_ref(a, pad_to)


def gelu_tanh_mul_fp8(gate_up: torch.Tensor, pad_to: int = 1):
    """``gelu_tanh_mul`` and the per-token e4m3 quantization of its output: (a, (q, scale))."""
    a = gelu_tanh_mul(gate_up)
    return a, act_quant.quantize_rows_ref(a, pad_to)


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Mixture of experts: each token through its top-k SwiGLU experts, weighted and summed.

    Semantics: for token t and j < K with e = topk_ids[t, j] >= 0 (-1: no expert, adds nothing),
      g, u = x[t] @ w_gate_up[e, :I]^T, x[t] @ w_gate_up[e, I:]^T   (rounded to x's dtype)
      a = silu(g) * u                                             (rounded to x's dtype)
      y_tj = topk_weights[t, j] * (a @ w_down[e]^T)               (fp32, rounded to x's dtype)
      out[t] = sum_j y_tj                                         (fp32, in x's dtype at the end)
    Experts run in ascending order, each on its tokens together (transformers' order).
    Shape: x [T, H]; w_gate_up [E, 2 * I, H]; w_down [E, H, I]; topk_weights [T, K] fp32;
      topk_ids [T, K] int32 or int64. Returns [T, H] in x's dtype.
    """
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    weights = topk_weights.reshape(-1).float()
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    for e in flat[flat >= 0].unique().tolist():
        slots = (flat == e).nonzero()[:, 0]  # [n_e] flat indices t * K + j, ascending
        tokens = slots // top_k
        a = silu_mul(F.linear(x[tokens], w_gate_up[e]))
        y = F.linear(a, w_down[e]).float() * weights[slots, None]
        out.index_add_(0, tokens, y.to(x.dtype).float())
    return out.to(x.dtype)


def gather_expert_rows(
    pool_layer: torch.Tensor,
    meta: LoraMeta,
    slot: int,
    target: int,
    which: int,
    expert: int,
    dims: tuple[int, int],
    num_experts: int,
) -> torch.Tensor:
    """One expert's rows of an adapter's expert target: A (which=0, rows of d_in) or B^T
    (which=1, rows of d_out), ``dims`` = (d_in, d_out). Returns [r_t, width].

    An expert target's factor holds E blocks of r_t rows, expert by expert: row j of expert e's
    A lies in pages slot_pages[slot, a0 + (e * r_t + j) * per_in + c] with a0 the A offset and
    per_in = ceil(d_in / page_size); likewise B^T from its offset b0. The A block of every
    expert comes before b0, so r_t = (b0 - a0) / (E * per_in). Example: E 8, d_in 64, pages of
    32, a0 0, b0 96: per_in 2, r_t = 96 / 16 = 6.
    """
    page_size = pool_layer.shape[1]
    per_in = -(-dims[0] // page_size)
    a0, b0 = (int(v) for v in meta.slot_offsets[slot, target])
    rank = (b0 - a0) // (num_experts * per_in)
    per_row = -(-dims[which] // page_size)
    start = (b0 if which else a0) + expert * rank * per_row
    pages = meta.slot_pages[slot, start : start + rank * per_row].long()
    return pool_layer[pages].reshape(rank, per_row * page_size)[:, : dims[which]]


def _add_expert_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    slots: torch.Tensor,
    pool_layer: torch.Tensor,
    meta: LoraMeta,
    target: int,
    expert: int,
    num_experts: int,
) -> None:
    """out[i] += (x[i] @ A^T) @ B^T of row i's adapter slot ``slots[i]`` and ``expert``, in
    fp32, rounded to out's dtype once; rows of slot -1 or of an adapter without ``target`` are
    untouched."""
    dims = (x.shape[1], out.shape[1])
    for s in slots.unique().tolist():
        if s < 0 or int(meta.slot_offsets[s, target, 0]) < 0:
            continue
        rows = slots == s
        a = gather_expert_rows(pool_layer, meta, s, target, 0, expert, dims, num_experts)
        b = gather_expert_rows(pool_layer, meta, s, target, 1, expert, dims, num_experts)
        delta = (x[rows].float() @ a.float().T) @ b.float()
        out[rows] = (out[rows].float() + delta).to(out.dtype)


def fused_moe_lora(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    pool_layer: torch.Tensor,
    meta: LoraMeta,
    targets: tuple[int, int],
) -> torch.Tensor:
    """``fused_moe`` with each (token, expert) slot's LoRA on that expert, of the token's
    adapter (slot s = b_slot[t]), gathered from pool pages at the adapter's own rank per target.

    Semantics: for token t, j < K with e = topk_ids[t, j] >= 0 and s = b_slot[t]:
      gu = x[t] @ w_gate_up[e]^T                                   (rounded to x's dtype)
      gu += (x[t] @ A_gu[s, e]^T) @ Bt_gu[s, e]                    (fp32, rounded to x's dtype)
      a = silu(gu[:I]) * gu[I:]                                    (rounded to x's dtype)
      y = a @ w_down[e]^T; y += (a @ A_d[s, e]^T) @ Bt_d[s, e]     (as gu)
      out[t] = sum_j topk_weights[t, j] * y                        (as ``fused_moe``)
    with targets = (gate_up's index, down's index) into slot_offsets; a slot of -1 or an
    adapter without the target adds nothing (``gather_expert_rows`` says where the rows lie;
    their B^T rows carry the target's LoRA scale: no slot_scale here).
    Shape: as ``fused_moe``; pool_layer [P, page_size]; meta.b_slot [T].
    """
    num_tokens, top_k = topk_ids.shape
    num_experts = w_gate_up.shape[0]
    flat = topk_ids.reshape(-1).long()
    weights = topk_weights.reshape(-1).float()
    b_slot = meta.b_slot.long().repeat_interleave(top_k)  # [T * K]: each slot's adapter
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    for e in flat[flat >= 0].unique().tolist():
        slots = (flat == e).nonzero()[:, 0]  # [n_e] flat indices t * K + j, ascending
        tokens = slots // top_k
        lora = (b_slot[slots], pool_layer, meta)
        gate_up = F.linear(x[tokens], w_gate_up[e])
        _add_expert_lora(gate_up, x[tokens], *lora, targets[0], e, num_experts)
        a = silu_mul(gate_up)
        y = F.linear(a, w_down[e])
        _add_expert_lora(y, a, *lora, targets[1], e, num_experts)
        y = y.float() * weights[slots, None]
        out.index_add_(0, tokens, y.to(x.dtype).float())
    return out.to(x.dtype)
