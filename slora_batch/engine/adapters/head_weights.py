"""The factors of LoRA on embed_tokens and lm_head (``head_files``) in an adapter's pages, and
the per-step work that applies them.

They live in the adapter's pool pages after its linear targets: one flat block per adapter,
laid over every layer of the pages it takes (``head_files.head_pages``), holding per module its
A side then its B^T rows times s: embed's A^T [V, r] (a row per token, for ``F.embedding``)
and B^T [r, H]; lm_head's A [r, H] and B^T [r, V]. A step gathers the block of each adapter
it runs from the pool and applies it per adapter with torch ops (``HeadStep``); the block is
a few MB (r * (V + H) per module), so its gather costs little beside the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from slora_batch.engine.adapters.head_files import HeadFactor
from slora_batch.engine.device import to_device
from slora_batch.engine.models.spec import ModelSpec


def head_block(heads: tuple[HeadFactor, ...], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The flat head block (module order, each its A side then its B^T rows times its scale)
    from PEFT's tensors: ``tensors`` maps (module, factor) "embed_tokens.A" to the tensor."""
    parts = []
    for head in heads:
        a, b = tensors[f"{head.module}.A"].float(), tensors[f"{head.module}.B"].float()
        a_side = a.t() if head.module == "embed_tokens" else a  # [V, r] or [r, H]
        parts += [a_side.reshape(-1), (b.t() * head.scale).reshape(-1)]
    return torch.cat(parts)


def split_block(
    block: torch.Tensor, heads: tuple[HeadFactor, ...], spec: ModelSpec
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``head_block``'s inverse on a flat block (at least its length): module -> (A side,
    B^T rows times the scale), views."""
    vocab, hidden = spec.vocab_size, spec.hidden_size
    out, at = {}, 0
    for head in heads:
        r = head.rank
        rows, width = (vocab, hidden) if head.module == "embed_tokens" else (hidden, vocab)
        a_shape = (vocab, r) if head.module == "embed_tokens" else (r, hidden)
        a = block[at : at + rows * r].view(a_shape)
        b_t = block[at + rows * r : at + r * (rows + width)].view(r, width)
        out[head.module] = (a, b_t)
        at += r * (rows + width)
    return out


@dataclass
class SlotHeads:
    """A resident adapter's head block in the pool: its pages (device, int64) and modules."""

    pages: torch.Tensor  # [P] int64
    heads: tuple[HeadFactor, ...]


@dataclass
class HeadStep:
    """One step's head LoRA: per adapter of the step that has one, its slot's ``SlotHeads``,
    the tokens that use it (embed_tokens) and the logits rows that do (lm_head), on the device.
    Built by ``head_step``; applied by the model (``add_embed``, ``add_logits``)."""

    segments: list[tuple[SlotHeads, torch.Tensor, torch.Tensor]]  # (slot, [n] tokens, [m] rows)

    def factors(self, pool_data: torch.Tensor, slot: SlotHeads, spec: ModelSpec) -> dict:
        """The slot's factors gathered from the pool's pages ``pool_data`` [L, pages, page]."""
        block = pool_data[:, slot.pages].reshape(-1)  # [L * P * page_size], layer-major
        return split_block(block, slot.heads, spec)

    def add_embed(self, x: torch.Tensor, ids: torch.Tensor, pool_data, spec: ModelSpec) -> None:
        """x [T, H] += each token's s * A[:, id]^T B^T, for the tokens of adapters on
        embed_tokens."""
        for slot, tokens, _ in self.segments:
            if tokens.numel() and any(h.module == "embed_tokens" for h in slot.heads):
                a_t, b_t = self.factors(pool_data, slot, spec)["embed_tokens"]
                delta = F.embedding(ids[tokens], a_t).float() @ b_t.float()
                x.index_add_(0, tokens, delta.to(x.dtype))

    def add_logits(self, logits: torch.Tensor, h: torch.Tensor, pool_data, spec) -> None:
        """logits [S, V] fp32 += s * (h A^T) B^T at the rows of adapters on lm_head
        (h [S, H]: the normed hidden states of those rows)."""
        for slot, _, rows in self.segments:
            if rows.numel() and any(head.module == "lm_head" for head in slot.heads):
                a, b_t = self.factors(pool_data, slot, spec)["lm_head"]
                delta = (h[rows].float() @ a.float().t()) @ b_t.float()  # [m, V]
                logits.index_add_(0, rows, delta)


def head_step(
    slots: dict[int, SlotHeads], b_slot: np.ndarray, logits_index: np.ndarray, device
) -> HeadStep | None:
    """The step's ``HeadStep`` from each token's slot ``b_slot`` [T] (-1: none) and the tokens
    whose logits it computes ``logits_index`` [S]; None when no slot of the step has head LoRA
    (``slots``: slot -> its heads, the residency's). Example: b_slot [3, -1, 3, 5], logits at
    tokens [2, 3], slot 3 on embed_tokens: tokens [0, 2] and rows [0] of slot 3."""
    if not slots:
        return None
    segments = []
    row_slot = b_slot[logits_index]
    for slot in np.unique(b_slot[b_slot >= 0]):
        heads = slots.get(int(slot))
        if heads is None:
            continue
        tokens = np.flatnonzero(b_slot == slot)
        rows = np.flatnonzero(row_slot == slot)
        segments.append((heads, to_device(tokens, device), to_device(rows, device)))
    return HeadStep(segments) if segments else None
