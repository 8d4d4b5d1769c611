"""The paper's ``bmm`` ablation: LoRA with each step's adapters copied contiguous, padded to the
largest rank in the step, and applied by a padded batched matmul (torch.bmm).

This is what S-LoRA's heterogeneous kernels avoid: the copies (every layer, every target, every
step) and the arithmetic on padding. Same signatures and semantics as ``slora_kernels.ref``'s LoRA ops.
"""

from __future__ import annotations

import torch

from slora_kernels.meta import LoraMeta
from slora_kernels.ref import lora_group


def _padded_weights(
    pool_layer: torch.Tensor, meta: LoraMeta, target: int, which: int, width: int
) -> torch.Tensor:
    """Every segment's factor rows, contiguous and zero-padded to max_rank: [S, max_rank, width]."""
    page_size = pool_layer.shape[1]
    per_row = -(-width // page_size)
    slots = meta.seg_slot.long().clamp(min=0)
    start = meta.slot_offsets[slots, target, which].long()  # [S], -1 when absent
    rank = torch.where((meta.seg_slot >= 0) & (start >= 0), meta.slot_rank[slots].long(), 0)
    cols = torch.arange(meta.max_rank * per_row, device=pool_layer.device)
    index = (start[:, None] + cols[None, :]).clamp(0, meta.slot_pages.shape[1] - 1)
    pages = meta.slot_pages[slots[:, None], index].long().clamp(min=0)  # [S, R * per_row]
    rows = pool_layer[pages].reshape(len(slots), meta.max_rank, per_row * page_size)[:, :, :width]
    keep = torch.arange(meta.max_rank, device=rows.device)[None, :] < rank[:, None]
    return rows * keep[:, :, None].to(rows.dtype)


def _padded_tokens(meta: LoraMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """Token index per (segment, position), padded to the longest segment, and its validity."""
    starts = meta.seg1_start.long()
    lengths = starts[1:] - starts[:-1]
    longest = int(lengths.max()) if lengths.numel() else 0
    pos = torch.arange(longest, device=starts.device)
    valid = pos[None, :] < lengths[:, None]
    flat = (starts[:-1, None] + pos[None, :]).clamp(max=max(0, meta.token_order.numel() - 1))
    return meta.token_order.long()[flat], valid


def lora_shrink(
    x: torch.Tensor,
    pool_layer: torch.Tensor,
    meta: LoraMeta,
    target: int | tuple[int, ...],
    out: torch.Tensor,
) -> None:
    """Semantics of ``slora_kernels.ref.lora_shrink``, by padded bmm (one per target of the group)."""
    if meta.seg_slot.numel() == 0:
        return
    targets = lora_group(target)
    width = out.shape[1] // len(targets)
    rank = min(meta.max_rank, width)
    tokens, valid = _padded_tokens(meta)  # [S, Lmax]
    for j, t in enumerate(targets):
        weights = _padded_weights(pool_layer, meta, t, 0, x.shape[1])[:, :rank]  # [S, R, d_in]
        xs = x[tokens].to(weights.dtype) * valid[:, :, None].to(weights.dtype)
        y = torch.bmm(xs, weights.transpose(1, 2)).float()  # [S, Lmax, R]
        keep = valid & _has(meta, t, 0)[:, None]
        out[tokens[keep], j * width : j * width + rank] = y[keep].to(out.dtype)


def lora_expand(
    v: torch.Tensor,
    pool_layer: torch.Tensor,
    meta: LoraMeta,
    target: int | tuple[int, ...],
    out: torch.Tensor,
    cols: tuple[tuple[int, int], ...] | None = None,
) -> None:
    """Semantics of ``slora_kernels.ref.lora_expand``, by padded bmm (one per target of the group)."""
    if meta.seg_slot.numel() == 0:
        return
    targets = lora_group(target)
    cols = cols if cols is not None else ((0, out.shape[1]),)
    width = v.shape[1] // len(targets)
    rank = min(meta.max_rank, width)
    tokens, valid = _padded_tokens(meta)
    scale = meta.slot_scale[meta.seg_slot.long().clamp(min=0)].float()
    for j, t in enumerate(targets):
        c0, c1 = cols[j]
        weights = _padded_weights(pool_layer, meta, t, 1, c1 - c0)[:, :rank]  # [S, R, d_out]
        vs = v[tokens, j * width : j * width + rank].to(weights.dtype)
        vs = vs * valid[:, :, None].to(weights.dtype)
        delta = torch.bmm(vs, weights).float() * scale[:, None, None]  # [S, Lmax, d_out]
        keep = valid & _has(meta, t, 1)[:, None]
        rows = tokens[keep]
        out[rows, c0:c1] = (out[rows, c0:c1].float() + delta[keep]).to(out.dtype)


def _has(meta: LoraMeta, target: int, which: int) -> torch.Tensor:
    """[S] bool: the segment's adapter has the target (rows of the others stay untouched)."""
    slots = meta.seg_slot.long().clamp(min=0)
    return (meta.seg_slot >= 0) & (meta.slot_offsets[slots, target, which] >= 0)
