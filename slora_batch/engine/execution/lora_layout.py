"""Where each token's adapter rows are, for the LoRA kernels: tokens grouped into segments by
adapter slot (long segments first for the tiled kernels), the hints that let a launch skip empty
work, and ``LoraMeta`` over the residency's slot tables. ``batch`` builds a step with these."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slora_batch.engine.adapters.residency import AdapterResidency
from slora_kernels.meta import LoraMeta


def lora_segments(
    b_slot: np.ndarray, pad_to: int | None = None, vector_max: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token_order, seg1_start, seg_slot) of the step's adapter tokens.

    Tokens are stably sorted by slot with base tokens (-1) last, so each adapter's tokens form one
    contiguous segment. With ``vector_max``, the segments longer than that come first, then the
    others, each part by slot: the tiled kernels' tokens are then a prefix of token_order
    (``LoraMeta.tiled_tokens``) and their blocks never walk the vector kernels' short segments.
    Example: b_slot [5, 2, 2, 2, -1, 1], vector_max 2 -> order [1, 2, 3, 5, 0, 4], seg1_start
    [0, 3, 4, 5], seg_slot [2, 1, 5]. ``pad_to`` pads the segment arrays to a fixed length (CUDA
    graphs) with empty segments of slot -1, which kernels skip.
    """
    key = np.where(b_slot < 0, np.iinfo(np.int64).max, b_slot)
    order = np.argsort(key, kind="stable")
    used = b_slot[order]
    used = used[used >= 0]
    change = np.flatnonzero(np.diff(used)) + 1
    seg1_start = (
        np.concatenate([[0], change, [used.size]]).astype(np.int32)
        if used.size
        else np.zeros(1, np.int32)
    )
    seg_slot = used[seg1_start[:-1]]
    if vector_max is not None and used.size:
        lengths = np.diff(seg1_start)
        short = lengths <= vector_max
        if short.any() and not short.all():  # long segments first; a stable sort keeps slots
            seg_order = np.argsort(short, kind="stable")
            positions = np.argsort(np.repeat(short, lengths), kind="stable")
            order[: used.size] = order[: used.size][positions]
            seg_slot = seg_slot[seg_order]
            seg1_start = np.concatenate([[0], np.cumsum(lengths[seg_order])]).astype(np.int32)
    if pad_to is not None:
        extra = pad_to - seg_slot.size
        seg_slot = np.concatenate([seg_slot, np.full(extra, -1)])
        seg1_start = np.concatenate([seg1_start, np.full(extra, seg1_start[-1], dtype=np.int32)])
    return order.astype(np.int32), seg1_start, seg_slot.astype(np.int32)


def tiled_tokens(seg1_start: np.ndarray, vector_max: int) -> int:
    """The adapter tokens in segments longer than ``vector_max``: with ``lora_segments``'s
    long-first order, the length of the token_order prefix the tiled kernels cover."""
    lengths = np.diff(seg1_start)
    return int(lengths[lengths > vector_max].sum())


def vector_tokens(order: np.ndarray, seg1_start: np.ndarray, vector_max: int) -> np.ndarray:
    """The tokens of the segments of at most ``vector_max`` tokens, in ``order`` (the vector
    kernels' tokens: ``LoraMeta.vector_tokens``). Example: order [4, 0, 2, 1, 3], segments of 1,
    3 and 1 tokens, vector_max 2 -> [4, 3]."""
    lengths = np.diff(seg1_start)
    short = np.repeat(lengths <= vector_max, lengths)
    return order[: seg1_start[-1]][short].astype(np.int32)


def position_segments(seg1_start: np.ndarray, num_tokens: int) -> np.ndarray:
    """The first segment ending after each sorted position (``LoraMeta.pos_seg``), S past the
    adapter tokens. Example: segments [0, 2) and [2, 3), 5 tokens -> [0, 0, 1, 2, 2]."""
    return np.searchsorted(seg1_start[1:], np.arange(num_tokens), side="right").astype(np.int32)


@dataclass
class LoraLayout:
    """A step's LoRA segments on the host, and the hints the launchers read (LoraMeta's
    longest, shortest, vector_tokens, tiled_tokens and pos_seg), built once for ``upload`` and for
    the benchmarks and tests that need a step laid out as it does."""

    order: np.ndarray  # token_order
    seg1_start: np.ndarray
    seg_slot: np.ndarray
    vector_max: int
    long_first: bool

    def hint(self, meta: LoraMeta, to_device) -> None:
        """Sets the hints on ``meta``; ``to_device`` turns an int32 host array into its tensor.
        vector_tokens when a segment has at most vector_max tokens, pos_seg (and, long segments
        first, tiled_tokens) when one is longer."""
        lengths = np.diff(self.seg1_start)
        meta.longest, meta.shortest = int(lengths.max()), int(lengths.min())
        if meta.shortest <= self.vector_max:
            meta.vector_tokens = to_device(
                vector_tokens(self.order, self.seg1_start, self.vector_max)
            )
        if meta.longest > self.vector_max:  # the tiled kernels run: where each block starts
            if self.long_first:
                meta.tiled_tokens = tiled_tokens(self.seg1_start, self.vector_max)
            meta.pos_seg = to_device(position_segments(self.seg1_start, self.order.size))


def lora_layout(b_slot: np.ndarray, vector_max: int, long_first: bool = True) -> LoraLayout:
    """The segments of an eager step with adapter tokens, long ones first unless
    ``long_first`` is False (slot order alone, as before tiled_tokens existed)."""
    order, seg1_start, seg_slot = lora_segments(
        b_slot, vector_max=vector_max if long_first else None
    )
    return LoraLayout(order, seg1_start, seg_slot, vector_max, long_first)


def lora_meta(
    b_slot: torch.Tensor,
    token_order: torch.Tensor,
    seg1_start: torch.Tensor,
    seg_slot: torch.Tensor,
    residency: AdapterResidency,
    max_rank: int,
    targets: tuple[int, ...],
    layer_targets: tuple[tuple[int, ...], ...] | None = None,
    has_vectors: bool = False,
) -> LoraMeta:
    return LoraMeta(
        b_slot=b_slot,
        token_order=token_order,
        seg1_start=seg1_start,
        seg_slot=seg_slot,
        slot_rank=residency.dev_rank,
        slot_scale=residency.dev_scale,
        slot_pages=residency.dev_pages,
        slot_offsets=residency.dev_offsets,
        max_rank=max_rank,
        targets=targets,
        layer_rank=residency.dev_layer_rank,
        layer_scale=residency.dev_layer_scale,
        layer_targets=layer_targets,
        slot_vectors=residency.dev_vectors,
        has_vectors=has_vectors,
        fp8_rows=residency.store.fp8,
    )


def step_vectors(residency: AdapterResidency, seg_slot: np.ndarray) -> bool:
    """Whether some adapter of the step has vector rows (``LoraMeta.has_vectors``)."""
    return bool((residency.slot_vectors[seg_slot[seg_slot >= 0]] >= 0).any())


def step_targets(
    residency: AdapterResidency, seg_slot: np.ndarray
) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The targets some adapter of the step has (``LoraMeta.targets``), and those it has in each
    layer (``LoraMeta.layer_targets``: a layer that ``layers_to_transform`` leaves out launches
    nothing). Example: one adapter on q and v, another on q in layer 1 only: (0, 2) and
    ((0, 2), (0, 2)) on 2 layers; the second alone: (0,) and ((), (0,))."""
    slots = seg_slot[seg_slot >= 0]
    present = (residency.layer_rank[slots] > 0).any(axis=0)  # [L, targets]
    targets = np.flatnonzero((residency.slot_offsets[slots, :, 0] >= 0).any(axis=0))
    return tuple(targets.tolist()), tuple(tuple(np.flatnonzero(row).tolist()) for row in present)
