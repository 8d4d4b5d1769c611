"""The factors of LoRA on embed_tokens and lm_head (``head_files``) and the saved copies of
those modules (``modules_to_save``, ``saved_modules``) in an adapter's pages, and the per-step
work that applies them.

They live in the adapter's pool pages after its linear targets: one flat block per adapter,
laid over every layer of the pages it takes (``head_files.head_pages``), holding per module
in ``HEAD_MODULES`` order either its LoRA, its A side then its B^T rows times s (embed's A^T
[V, r], a row per token for ``F.embedding``, and B^T [r, H]; lm_head's A [r, H] and B^T
[r, V]), or its saved copy W [V, H]. A step gathers from the pool only the part of a block it
reads (``HeadStep``): a LoRA's factors (a few MB: r * (V + H) a module), a saved embedding's
rows of the step's tokens, a saved lm_head [V, H] a slice of ``GATHER_ELEMENTS`` at a time
(a full copy is as large as the base's matrix, and the pool leaves no room for a copy of it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from slora_batch.engine.adapters.head_files import HeadFactor
from slora_batch.engine.device import to_device
from slora_batch.engine.models.spec import ModelSpec

GATHER_ELEMENTS = 1 << 24  # a saved lm_head's rows gathered at a time (32 MB in bf16)
INDEX_ELEMENTS = 1 << 20  # a saved embedding's elements gathered at a time (by int64 index)


def head_block(heads: tuple[HeadFactor, ...], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The flat head block (module order, each its A side then its B^T rows times its scale,
    or its saved weight) from PEFT's tensors: ``tensors`` maps (module, factor)
    "embed_tokens.A" (or "lm_head.W": a saved copy) to the tensor."""
    parts = []
    for head in heads:
        if head.saved:
            parts.append(tensors[f"{head.module}.W"].reshape(-1))
            continue
        a, b = tensors[f"{head.module}.A"].float(), tensors[f"{head.module}.B"].float()
        a_side = a.t() if head.module == "embed_tokens" else a  # [V, r] or [r, H]
        parts += [a_side.reshape(-1), (b.t() * head.scale).reshape(-1)]
    return torch.cat(parts)


def spans(heads: tuple[HeadFactor, ...], spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """module -> (first, past last) element of its part of the flat head block."""
    out, at = {}, 0
    for head in heads:
        out[head.module] = (at, at + head.numel(spec))
        at += head.numel(spec)
    return out


def lora_factors(
    flat: torch.Tensor, head: HeadFactor, spec: ModelSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """A LoRA module's (A side, B^T rows times the scale), views of its part ``flat`` of the
    head block (``head_block``'s layout)."""
    vocab, hidden, r = spec.vocab_size, spec.hidden_size, head.rank
    rows, width = (vocab, hidden) if head.module == "embed_tokens" else (hidden, vocab)
    a_shape = (vocab, r) if head.module == "embed_tokens" else (r, hidden)
    return flat[: rows * r].view(a_shape), flat[rows * r : r * (rows + width)].view(r, width)


@dataclass
class SlotHeads:
    """A resident adapter's head block in the pool: its pages (device, int64) and modules."""

    pages: torch.Tensor  # [P] int64
    heads: tuple[HeadFactor, ...]

    def gather(self, pool_data: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the flat block, from the pool's pages ``pool_data``
        [L, pages, page]. The block lies layer-major over the slot's P pages: its element f
        is at layer f // (P * page), page pages[f // page % P], offset f % page. Example, P 2,
        page 4: elements 9..14 are block rows 2 and 3 (layer 1, pages[0] and pages[1]),
        offsets 1..3 and 0..2."""
        page, count = pool_data.shape[2], self.pages.numel()
        first, last = start // page, -(-stop // page)  # block rows [first, last)
        rows = torch.arange(first, last, device=self.pages.device)
        data = pool_data[rows // count, self.pages[rows % count]].reshape(-1)
        return data[start - first * page : stop - first * page]

    def elements(self, pool_data: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The flat block's elements at ``index`` (int64, any shape), ``gather``'s mapping."""
        page, count = pool_data.shape[2], self.pages.numel()
        rows = index // page
        return pool_data[rows // count, self.pages[rows % count], index % page]


@dataclass
class HeadStep:
    """One step's head modules: per adapter of the step that has one, its slot's ``SlotHeads``,
    the tokens that use it (embed_tokens) and the logits rows that do (lm_head), on the device.
    Built by ``head_step``; applied by the model (``add_embed``, ``add_logits``)."""

    segments: list[tuple[SlotHeads, torch.Tensor, torch.Tensor]]  # (slot, [n] tokens, [m] rows)

    def _modules(self, module: str, spec: ModelSpec, which: int):
        """Per segment whose adapter has LoRA or a saved copy on ``module`` and tokens
        (``which`` 1) or logits rows (2) for it: (slot, the module's HeadFactor, its (start,
        stop) in the slot's block, those tokens or rows)."""
        for segment in self.segments:
            slot, where = segment[0], segment[which]
            for head in slot.heads:
                if head.module == module and where.numel():
                    yield slot, head, spans(slot.heads, spec)[module], where

    def add_embed(self, x: torch.Tensor, ids: torch.Tensor, pool_data, spec: ModelSpec) -> None:
        """x [T, H], for the tokens of adapters on embed_tokens: += each token's
        s * A[:, id]^T B^T (LoRA), or = W[id] (a saved copy, PEFT's module in place of the
        base's)."""
        for slot, head, (start, stop), tokens in self._modules("embed_tokens", spec, 1):
            if head.saved:
                x[tokens] = saved_rows(slot, pool_data, start, ids[tokens], spec).to(x.dtype)
                continue
            a_t, b_t = lora_factors(slot.gather(pool_data, start, stop), head, spec)
            delta = F.embedding(ids[tokens], a_t).float() @ b_t.float()
            x.index_add_(0, tokens, delta.to(x.dtype))

    def add_logits(self, logits: torch.Tensor, h: torch.Tensor, pool_data, spec) -> None:
        """logits [S, V] fp32 at the rows of adapters on lm_head (h [S, H]: the normed hidden
        states): += s * (h A^T) B^T (LoRA), or = h W^T (a saved copy, computed in h's dtype
        like the base's logits)."""
        for slot, head, (start, stop), rows in self._modules("lm_head", spec, 2):
            if head.saved:
                logits[rows] = saved_logits(slot, pool_data, start, h[rows], spec)
                continue
            a, b_t = lora_factors(slot.gather(pool_data, start, stop), head, spec)
            delta = (h[rows].float() @ a.float().t()) @ b_t.float()  # [m, V]
            logits.index_add_(0, rows, delta)


def saved_rows(
    slot: SlotHeads, pool_data: torch.Tensor, start: int, ids: torch.Tensor, spec: ModelSpec
) -> torch.Tensor:
    """Rows ``ids`` [n] of a saved [V, H] matrix at element ``start`` of the slot's block:
    [n, H] in the pool's dtype, ``INDEX_ELEMENTS`` at a time."""
    hidden, ids = spec.hidden_size, ids.long()  # int32 ids would overflow past 2^31 elements
    cols = torch.arange(hidden, device=ids.device)
    step = max(1, INDEX_ELEMENTS // hidden)
    parts = [
        slot.elements(pool_data, start + ids[i : i + step, None] * hidden + cols)
        for i in range(0, ids.numel(), step)
    ]
    return torch.cat(parts)


def saved_logits(
    slot: SlotHeads, pool_data: torch.Tensor, start: int, h: torch.Tensor, spec: ModelSpec
) -> torch.Tensor:
    """h [m, H] times a saved [V, H] matrix at element ``start`` of the slot's block,
    transposed: fp32 [m, V], its rows gathered ``GATHER_ELEMENTS`` at a time."""
    vocab, hidden = spec.vocab_size, spec.hidden_size
    out = torch.empty(h.shape[0], vocab, dtype=torch.float32, device=h.device)
    step = max(1, GATHER_ELEMENTS // hidden)
    for lo in range(0, vocab, step):
        hi = min(vocab, lo + step)
        w = slot.gather(pool_data, start + lo * hidden, start + hi * hidden).view(hi - lo, hidden)
        out[:, lo:hi] = F.linear(h, w.to(h.dtype)).float()
    return out


def head_step(
    slots: dict[int, SlotHeads], b_slot: np.ndarray, logits_index: np.ndarray, device
) -> HeadStep | None:
    """The step's ``HeadStep`` from each token's slot ``b_slot`` [T] (-1: none) and the tokens
    whose logits it computes ``logits_index`` [S]; None when no slot of the step has head LoRA
    or a saved head module (``slots``: slot -> its heads, the residency's). Example: b_slot
    [3, -1, 3, 5], logits at tokens [2, 3], slot 3 on embed_tokens: tokens [0, 2] and rows [0]
    of slot 3."""
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
