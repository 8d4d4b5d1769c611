"""Fused mixture of experts: every token through its top-k SwiGLU experts in two grouped GEMM
launches over the experts the step touches (``fused_moe``; its torch twin is ``ref.fused_moe``).

A step's T tokens with K experts each make N = T * K slots, slot s = t * K + j for token t's
j-th expert. The launcher:

1. ``moe_align`` sorts the slots by expert and pads each expert's segment to a multiple of
   BLOCK_M, so that every block of BLOCK_M sorted slots belongs to one expert (torch ops on the
   device: no host sync, capturable in a CUDA graph, grids sized from T alone).
2. ``_gate_up_kernel``, one program per (block, BLOCK_N columns of I): the block's token rows
   of x times its expert's gate and up rows, SiLU(gate) * up written to ``act[slot]``.
3. ``_down_kernel``, one program per (block, BLOCK_N columns of H): ``act`` rows times the
   expert's down rows, times the slot's routing weight in the epilogue, written to ``y[slot]``.
4. ``out[t] = sum_j y[t * K + j]`` in fp32.

The GEMM loops of steps 2 and 3 are ``_gate_up_tile`` and ``_down_tile``, which the expert LoRA
kernels (``moe_lora``) share. Blocks past the last expert's segment (block expert -1) and padding
slots (slot N) write nothing; so do slots whose expert is -1 ("no expert"). Both kernels
accumulate in fp32 and round where the twin rounds: gate and up, the activation, each slot's
weighted output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N, BLOCK_K, WARPS = 64, 64, 4


@triton.jit
def _gate_up_tile(
    x_ptr,
    x_stride,
    w_expert,
    w_stride_n,
    tokens,
    live_m,
    cols,
    live_n,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """(gate, up) [BLOCK_M, BLOCK_N] fp32: the ``tokens`` rows of x times the expert's gate and
    up rows ``cols`` (``w_expert``: the expert's [2 * I, H] weights)."""
    w_gate = w_expert + cols[None, :] * w_stride_n  # rows of gate
    w_up = w_gate + INTER * w_stride_n  # the same columns' rows of up
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        live_k = ks < HIDDEN
        xt = tl.load(
            x_ptr + tokens[:, None] * x_stride + ks[None, :],
            mask=live_m[:, None] & live_k[None, :],
            other=0.0,
        )
        w_live = live_k[:, None] & live_n[None, :]
        gate = tl.load(w_gate + ks[:, None], mask=w_live, other=0.0)  # [BLOCK_K, BLOCK_N]
        up = tl.load(w_up + ks[:, None], mask=w_live, other=0.0)
        acc_gate = tl.dot(xt, gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(xt, up, acc_up, input_precision=PRECISION)
    return acc_gate, acc_up


@triton.jit
def _down_tile(
    act_ptr,
    w_expert,
    w_stride_n,
    slots,
    live_m,
    cols,
    live_n,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """[BLOCK_M, BLOCK_N] fp32: the ``slots`` rows of act times the expert's down rows
    ``cols`` (``w_expert``: the expert's [H, I] weights)."""
    w_rows = w_expert + cols[None, :] * w_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        live_k = ks < INTER
        a = tl.load(
            act_ptr + slots[:, None] * INTER + ks[None, :],
            mask=live_m[:, None] & live_k[None, :],
            other=0.0,
        )
        w = tl.load(w_rows + ks[:, None], mask=live_k[:, None] & live_n[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["num_slots"])
def _gate_up_kernel(
    x_ptr,
    x_stride,
    w_ptr,
    w_stride_e,
    w_stride_n,
    act_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_slots,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    slots = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    live_m = slots < num_slots  # padding slots hold num_slots
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
    dtype = act_ptr.dtype.element_ty
    g = acc_gate.to(dtype).to(tl.float32)  # rounded as the twin's projections are
    u = acc_up.to(dtype).to(tl.float32)
    a = g / (1.0 + tl.exp(-g)) * u
    tl.store(
        act_ptr + slots[:, None] * INTER + cols[None, :],
        a.to(dtype),
        mask=live_m[:, None] & live_n[None, :],
    )


@triton.jit(do_not_specialize=["num_slots"])
def _down_kernel(
    act_ptr,
    w_ptr,
    w_stride_e,
    w_stride_n,
    y_ptr,
    weights_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_slots,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
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
    dtype = y_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + slots, mask=live_m, other=0.0)  # the routing weight, fp32
    y = acc.to(dtype).to(tl.float32) * weight[:, None]
    tl.store(
        y_ptr + slots[:, None] * HIDDEN + cols[None, :],
        y.to(dtype),
        mask=live_m[:, None] & live_n[None, :],
    )


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's slots sorted by expert, each expert's segment padded to whole blocks.

    Semantics: slot s = t * K + j has expert topk_ids[t, j]; the slots of expert e, ascending,
      fill blocks block_end[e-1] .. block_end[e] - 1 (block_end: the cumulative
      ceil(count_e / block_m)), the rest of its last block padded with N = T * K; the blocks
      after the last expert's, up to the static bound ceil(N / block_m) + min(E, N), have
      expert -1. Slots whose expert is -1 are left out.
    Example: ids [[2, 0], [0, 1], [1, 2]] (slots 0..5 of experts 2, 0, 0, 1, 1, 2), block_m 4:
      sorted_slots = [1, 2, 6, 6,  3, 4, 6, 6,  0, 5, 6, 6,  6, 6, 6, 6, ...]
      block_expert = [0, 1, 2, -1, -1]   (bound: ceil(6 / 4) + 3 = 5 blocks)
    Shape: topk_ids [T, K] int32 or int64. Returns sorted_slots [blocks * block_m] int32 and
      block_expert [blocks] int32.
    """
    flat = topk_ids.reshape(-1).long()
    n, device = flat.numel(), flat.device
    max_blocks = -(-n // block_m) + min(num_experts, n)
    key = torch.where(flat >= 0, flat, num_experts)  # "no expert" sorts last, into a dropped bucket
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    block_end = torch.cumsum(-(-counts[:num_experts] // block_m), 0)  # [E]
    seg_start = torch.cat(  # [E + 1] first padded position of each expert's segment
        [
            torch.zeros(1, dtype=torch.int64, device=device),
            block_end[:-1] * block_m,
            torch.full((1,), max_blocks * block_m, dtype=torch.int64, device=device),
        ]
    )
    order = torch.sort(key, stable=True).indices  # [N] slots, by expert
    first = torch.cumsum(counts, 0) - counts  # [E + 1] each expert's first place in ``order``
    sorted_key = key[order]
    dest = seg_start[sorted_key] + torch.arange(n, device=device) - first[sorted_key]
    sorted_slots = torch.full((max_blocks * block_m + n,), n, dtype=torch.int32, device=device)
    sorted_slots.scatter_(0, dest, order.to(torch.int32))  # "no expert" lands past the bound
    blocks = torch.arange(max_blocks, device=device)
    block_expert = torch.searchsorted(block_end, blocks, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_slots[: max_blocks * block_m], block_expert


def block_m_for(num_slots: int, num_experts: int) -> int:
    """Rows of one tile: 16 when experts get a few slots each (decode), up to 64 in prefill."""
    per_expert = num_slots / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Mixture of experts: each token through its top-k SwiGLU experts, weighted and summed.

    Semantics: ``ref.fused_moe``'s (expert -1: nothing added).
    Shape: x [T, H]; w_gate_up [E, 2 * I, H]; w_down [E, H, I]; topk_weights [T, K] fp32;
      topk_ids [T, K] int32 or int64. Returns [T, H] in x's dtype.
    Grids (blocks, ceil(I / BLOCK_N)) and (blocks, ceil(H / BLOCK_N)), blocks from
    ``moe_align``'s bound: fixed by T, K, E and BLOCK_M (``block_m_for``).
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
        assert t.is_contiguous(), "fused_moe takes contiguous tensors"
    num_slots = num_tokens * top_k
    block_m = block_m_for(num_slots, num_experts)
    sorted_slots, block_expert = moe_align(topk_ids, num_experts, block_m)
    blocks = block_expert.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks, triton.cdiv(inter, BLOCK_N))](
        x,
        x.stride(0),
        w_gate_up,
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        act,
        sorted_slots,
        block_expert,
        num_slots,
        TOP_K=top_k,
        HIDDEN=hidden,
        INTER=inter,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        PRECISION=precision,
        num_warps=WARPS,
    )
    y = torch.zeros(num_slots, hidden, dtype=x.dtype, device=x.device)  # "no expert" slots: 0
    _down_kernel[(blocks, triton.cdiv(hidden, BLOCK_N))](
        act,
        w_down,
        w_down.stride(0),
        w_down.stride(1),
        y,
        topk_weights,
        sorted_slots,
        block_expert,
        num_slots,
        HIDDEN=hidden,
        INTER=inter,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        PRECISION=precision,
        num_warps=WARPS,
    )
    return y.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
