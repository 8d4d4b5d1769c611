"""Expert LoRA inside the fused MoE block (``fused_moe_lora``; its torch twin is
``ref.fused_moe_lora``): each (token, expert) slot the router chose adds the LoRA of its token's
adapter on that expert, read from the pool pages of that (adapter, expert) pair only, at the
adapter's own rank per target, to its gate_up and down outputs.

A step's N = T * K slots run four launches, the base GEMMs in ``moe``'s expert-sorted blocks:

1. ``_shrink_kernel`` (gate_up's A), one program per slot: v_gu[slot, :r] = x[token] @ A^T,
   r rows of the pair's A read from its pages, the rank in blocks of BLOCK_R (fp32).
2. ``_gate_up_lora_kernel``: ``moe._gate_up_tile``, then per row of the block the expand
   v_gu[slot, :r] @ B^T of the row's own adapter and the block's expert, gate columns and up
   columns, added before SiLU-and-mul.
3. ``_shrink_kernel`` (down's A) on the activation rows: v_d[slot, :r].
4. ``_down_lora_kernel``: ``moe._down_tile``, plus v_d @ B^T, before the routing weight.

A block of ``moe_align`` holds one expert's slots of any adapters: the base weights are read once
per block as without LoRA, and the expand is a per-row gather (each row its own B^T rows, rank
step by rank step up to the block's largest rank), the right shape for decode steps, where most
(adapter, expert) pairs have one slot. Slots without adapter (b_slot -1), with an adapter lacking
the target, or with expert -1 add nothing.

Where the rows lie (``ref.gather_expert_rows``): an expert target's factor holds E blocks of r_t
rows expert by expert, so row j of expert e's A starts at slot_pages[s, a0 + (e * r_t + j) *
PER_IN], and r_t = (b0 - a0) / (E * PER_IN) from the target's (A, B^T) offsets. The B^T rows
carry the target's scale. v's width is a static bound on r_t: the slot-pages table's width over
E x (PER_IN + PER_OUT) (an adapter's pages hold at least its target's), so grids and buffers
depend on T, K and the tables' shapes only: a decode step is capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slora_kernels.lora_blocks import _pow2_divisor
from slora_kernels.meta import LoraMeta
from slora_kernels.moe import (
    BLOCK_K,
    BLOCK_N,
    WARPS,
    _down_tile,
    _gate_up_tile,
    block_m_for,
    moe_align,
)

BLOCK_R = 16  # shrink: rank rows per step
SHRINK_K = 64  # shrink: row elements per step, capped by what divides the page


@triton.jit
def _pair(
    offsets_ptr,
    slot,
    target,
    live,
    NUM_EXPERTS: tl.constexpr,
    NUM_TARGETS: tl.constexpr,
    PER_IN: tl.constexpr,
):
    """(A offset, B^T offset, rank r_t, whether the slot's adapter has the target) of adapter
    slots ``slot`` where ``live``."""
    safe = tl.where(live, slot, 0)
    entry = offsets_ptr + (safe * NUM_TARGETS + target) * 2
    a0 = tl.load(entry, mask=live, other=-1)
    b0 = tl.load(entry + 1, mask=live, other=-1)
    has = live & (a0 >= 0)
    rank = tl.where(has, (b0 - a0) // (NUM_EXPERTS * PER_IN), 0)
    return a0, b0, rank, has


@triton.jit(do_not_specialize=["num_slots", "target"])
def _shrink_kernel(
    x_ptr,
    x_stride,
    v_ptr,
    v_stride,
    ids_ptr,
    b_slot_ptr,
    pool_ptr,
    pages_ptr,
    pages_stride,
    offsets_ptr,
    target,
    num_slots,
    TOP_K: tl.constexpr,
    PER_SLOT: tl.constexpr,
    D_IN: tl.constexpr,
    PAGE: tl.constexpr,
    PER_IN: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    NUM_TARGETS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """v[n, :r] = x[row] @ A[s, e]^T for slot n (row: the slot with PER_SLOT, else its token)."""
    n = tl.program_id(0)
    expert = tl.load(ids_ptr + n).to(tl.int64)
    token = n // TOP_K
    slot = tl.load(b_slot_ptr + token).to(tl.int64)
    if (expert < 0) | (slot < 0):
        return
    entry = offsets_ptr + (slot * NUM_TARGETS + target) * 2
    a0 = tl.load(entry)
    if a0 < 0:
        return
    rank = (tl.load(entry + 1) - a0) // (NUM_EXPERTS * PER_IN)
    row = n if PER_SLOT else token
    first = pages_ptr + slot * pages_stride + a0 + expert * rank * PER_IN  # the expert's A rows
    for r0 in range(0, rank, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        live_r = rs < rank
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, D_IN, BLOCK_K):  # BLOCK_K divides PAGE: one page per row and step
            ks = k0 + tl.arange(0, BLOCK_K)
            live_k = ks < D_IN
            xk = tl.load(x_ptr + row * x_stride + ks, mask=live_k, other=0.0).to(tl.float32)
            page = tl.load(first + rs * PER_IN + k0 // PAGE, mask=live_r, other=0).to(tl.int64)
            a = tl.load(
                pool_ptr + page[:, None] * PAGE + (k0 % PAGE) + tl.arange(0, BLOCK_K)[None, :],
                mask=live_r[:, None] & live_k[None, :],
                other=0.0,
            )
            acc += tl.sum(a.to(tl.float32) * xk[None, :], axis=1)
        tl.store(v_ptr + n * v_stride + rs, acc, mask=live_r)


@triton.jit
def _expand_rows(
    v_ptr,
    v_stride,
    slots,
    tokens,
    live_m,
    cols,
    live_n,
    expert,
    b_slot_ptr,
    pool_ptr,
    pages_ptr,
    pages_stride,
    offsets_ptr,
    target,
    NUM_EXPERTS: tl.constexpr,
    NUM_TARGETS: tl.constexpr,
    PAGE: tl.constexpr,
    PER_IN: tl.constexpr,
    PER_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """[BLOCK_M, BLOCK_N] fp32: row m's v[slot_m, :r_m] @ B^T[s_m, expert][:, cols], each row its
    own adapter s_m = b_slot[token_m]; 0 for rows without the target."""
    slot = tl.load(b_slot_ptr + tokens, mask=live_m, other=-1).to(tl.int64)
    _, b0, rank, has = _pair(
        offsets_ptr, slot, target, live_m & (slot >= 0), NUM_EXPERTS, NUM_TARGETS, PER_IN
    )
    first = tl.where(has, slot * pages_stride + b0 + expert * rank * PER_OUT, 0)  # [BLOCK_M]
    page_col = (cols // PAGE)[None, :]
    within = (cols % PAGE)[None, :]
    v_rows = v_ptr + slots[:, None] * v_stride  # [BLOCK_M, 1]
    page_rows = pages_ptr + first[:, None] + page_col  # [BLOCK_M, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(0, tl.max(rank, axis=0)):
        live_j = (has & (j < rank))[:, None]
        vj = tl.load(v_rows + j, mask=live_j, other=0.0)  # [BLOCK_M, 1]
        mask = live_j & live_n[None, :]
        page = tl.load(page_rows + j * PER_OUT, mask=mask, other=0)
        b = tl.load(pool_ptr + page.to(tl.int64) * PAGE + within, mask=mask, other=0.0)
        acc += vj * b.to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["num_slots", "target"])
def _gate_up_lora_kernel(
    x_ptr,
    x_stride,
    w_ptr,
    w_stride_e,
    w_stride_n,
    act_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_slots,
    v_ptr,
    v_stride,
    b_slot_ptr,
    pool_ptr,
    pages_ptr,
    pages_stride,
    offsets_ptr,
    target,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    NUM_TARGETS: tl.constexpr,
    PAGE: tl.constexpr,
    PER_IN: tl.constexpr,
    PER_OUT: tl.constexpr,
):
    """``moe._gate_up_kernel`` with each row's expert LoRA added to gate and up."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    slots = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    live_m = slots < num_slots
    tokens = slots // TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of I
    live_n = cols < INTER
    acc_gate, acc_up = _gate_up_tile(
        x_ptr,
        x_stride,
        w_ptr + expert * w_stride_e,
        w_stride_n,
        tokens,
        live_m,
        cols,
        live_n,
        HIDDEN,
        INTER,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        PRECISION,
    )
    lora_gate = _expand_rows(
        v_ptr,
        v_stride,
        slots,
        tokens,
        live_m,
        cols,
        live_n,
        expert,
        b_slot_ptr,
        pool_ptr,
        pages_ptr,
        pages_stride,
        offsets_ptr,
        target,
        NUM_EXPERTS,
        NUM_TARGETS,
        PAGE,
        PER_IN,
        PER_OUT,
        BLOCK_M,
        BLOCK_N,
    )
    lora_up = _expand_rows(
        v_ptr,
        v_stride,
        slots,
        tokens,
        live_m,
        INTER + cols,
        live_n,
        expert,
        b_slot_ptr,
        pool_ptr,
        pages_ptr,
        pages_stride,
        offsets_ptr,
        target,
        NUM_EXPERTS,
        NUM_TARGETS,
        PAGE,
        PER_IN,
        PER_OUT,
        BLOCK_M,
        BLOCK_N,
    )
    dtype = act_ptr.dtype.element_ty
    g = (acc_gate.to(dtype).to(tl.float32) + lora_gate).to(dtype).to(tl.float32)
    u = (acc_up.to(dtype).to(tl.float32) + lora_up).to(dtype).to(tl.float32)
    a = g / (1.0 + tl.exp(-g)) * u
    tl.store(
        act_ptr + slots[:, None] * INTER + cols[None, :],
        a.to(dtype),
        mask=live_m[:, None] & live_n[None, :],
    )


@triton.jit(do_not_specialize=["num_slots", "target"])
def _down_lora_kernel(
    act_ptr,
    w_ptr,
    w_stride_e,
    w_stride_n,
    y_ptr,
    weights_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_slots,
    v_ptr,
    v_stride,
    b_slot_ptr,
    pool_ptr,
    pages_ptr,
    pages_stride,
    offsets_ptr,
    target,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    NUM_TARGETS: tl.constexpr,
    PAGE: tl.constexpr,
    PER_IN: tl.constexpr,
    PER_OUT: tl.constexpr,
):
    """``moe._down_kernel`` with each row's expert LoRA added before the routing weight."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    slots = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    live_m = slots < num_slots
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of H
    live_n = cols < HIDDEN
    acc = _down_tile(
        act_ptr,
        w_ptr + expert * w_stride_e,
        w_stride_n,
        slots,
        live_m,
        cols,
        live_n,
        HIDDEN,
        INTER,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        PRECISION,
    )
    lora = _expand_rows(
        v_ptr,
        v_stride,
        slots,
        slots // TOP_K,
        live_m,
        cols,
        live_n,
        expert,
        b_slot_ptr,
        pool_ptr,
        pages_ptr,
        pages_stride,
        offsets_ptr,
        target,
        NUM_EXPERTS,
        NUM_TARGETS,
        PAGE,
        PER_IN,
        PER_OUT,
        BLOCK_M,
        BLOCK_N,
    )
    dtype = y_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + slots, mask=live_m, other=0.0)  # the routing weight, fp32
    y = (acc.to(dtype).to(tl.float32) + lora).to(dtype).to(tl.float32) * weight[:, None]
    tl.store(
        y_ptr + slots[:, None] * HIDDEN + cols[None, :],
        y.to(dtype),
        mask=live_m[:, None] & live_n[None, :],
    )


def _rank_bound(meta: LoraMeta, num_experts: int, per_in: int, per_out: int) -> int:
    """A static bound on an expert target's rank: an adapter's pages, at most the slot-pages
    table's width, hold E x r_t x (per_in + per_out) of them."""
    return max(1, meta.slot_pages.shape[1] // (num_experts * (per_in + per_out)))


def _check(pool_layer: torch.Tensor, meta: LoraMeta, num_tokens: int) -> None:
    assert pool_layer.dim() == 2 and pool_layer.is_contiguous(), "pool_layer: [P, page_size]"
    for name in ("b_slot", "slot_pages", "slot_offsets"):
        tensor = getattr(meta, name)
        assert tensor.dtype == torch.int32 and tensor.is_contiguous(), f"{name}: contiguous int32"
    assert meta.b_slot.shape[0] == num_tokens, (meta.b_slot.shape, num_tokens)


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
    """``fused_moe`` with each (token, expert) slot's expert LoRA of the token's adapter.

    Semantics: ``ref.fused_moe_lora``'s. targets: (gate_up's, down's) index into slot_offsets.
    Shape: x [T, H]; w_gate_up [E, 2 * I, H]; w_down [E, H, I]; topk_weights [T, K] fp32;
      topk_ids [T, K] int32 or int64; pool_layer [P, page_size]; meta.b_slot [T] int32.
      Returns [T, H] in x's dtype.
    Grids: shrinks (T * K,), GEMMs as ``fused_moe``'s; v buffers [T * K, rank bound] fp32.
    """
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    assert w_gate_up.shape == (num_experts, 2 * inter, hidden), (w_gate_up.shape, x.shape)
    assert w_down.shape == (num_experts, hidden, inter), (w_down.shape, w_gate_up.shape)
    assert x.dtype == w_gate_up.dtype == w_down.dtype, (x.dtype, w_gate_up.dtype, w_down.dtype)
    assert topk_weights.dtype == torch.float32 and topk_weights.shape == topk_ids.shape
    assert topk_ids.shape[0] == num_tokens, (topk_ids.shape, x.shape)
    for t in (x, w_gate_up, w_down, topk_weights, topk_ids):
        assert t.is_contiguous(), "fused_moe_lora takes contiguous tensors"
    _check(pool_layer, meta, num_tokens)
    page = pool_layer.shape[1]
    num_slots = num_tokens * top_k
    block_m = block_m_for(num_slots, num_experts)
    sorted_slots, block_expert = moe_align(topk_ids, num_experts, block_m)
    blocks = block_expert.shape[0]
    common = dict(
        NUM_EXPERTS=num_experts,
        NUM_TARGETS=meta.slot_offsets.shape[1],
        PAGE=page,
    )
    tables = (meta.b_slot, pool_layer, meta.slot_pages, meta.slot_pages.stride(0))
    gemm = dict(
        TOP_K=top_k,
        HIDDEN=hidden,
        INTER=inter,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=WARPS,
        **common,
    )
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    y = torch.zeros(num_slots, hidden, dtype=x.dtype, device=x.device)  # "no expert" slots: 0
    for step, (d_in, d_out) in enumerate(((hidden, 2 * inter), (inter, hidden))):
        per_in, per_out = -(-d_in // page), -(-d_out // page)
        v = torch.empty(
            num_slots,
            _rank_bound(meta, num_experts, per_in, per_out),
            dtype=torch.float32,
            device=x.device,
        )
        source = x if step == 0 else act
        _shrink_kernel[(num_slots,)](
            source,
            source.stride(0),
            v,
            v.stride(0),
            topk_ids,
            meta.b_slot,
            pool_layer,
            meta.slot_pages,
            meta.slot_pages.stride(0),
            meta.slot_offsets,
            targets[step],
            num_slots,
            TOP_K=top_k,
            PER_SLOT=step == 1,
            D_IN=d_in,
            PER_IN=per_in,
            BLOCK_R=BLOCK_R,
            BLOCK_K=_pow2_divisor(page, SHRINK_K),
            **common,
        )
        lora = (v, v.stride(0), *tables, meta.slot_offsets, targets[step])
        if step == 0:
            _gate_up_lora_kernel[(blocks, triton.cdiv(inter, BLOCK_N))](
                x,
                x.stride(0),
                w_gate_up,
                w_gate_up.stride(0),
                w_gate_up.stride(1),
                act,
                sorted_slots,
                block_expert,
                num_slots,
                *lora,
                PER_IN=per_in,
                PER_OUT=per_out,
                **gemm,
            )
        else:
            _down_lora_kernel[(blocks, triton.cdiv(hidden, BLOCK_N))](
                act,
                w_down,
                w_down.stride(0),
                w_down.stride(1),
                y,
                topk_weights,
                sorted_slots,
                block_expert,
                num_slots,
                *lora,
                PER_IN=per_in,
                PER_OUT=per_out,
                **gemm,
            )
    return y.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
