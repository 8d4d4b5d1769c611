"""Tensor parallelism's cuts of the base model that need no process group (``execution.tp``
holds the ranks, their group and the Megatron cuts' rationale)."""

from __future__ import annotations

from typing import Protocol

import torch


class RankGroup(Protocol):
    """What the models read of a tensor-parallel rank's group (``execution.tp.TensorParallel``
    is one): its rank and size, and the two collectives of a step."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> None: ...

    def gather_vocab(self, logits: torch.Tensor, vocab: int) -> torch.Tensor: ...


def vocab_shard(head: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The rank's rows of the LM head; the vocabulary padded with zero rows to a multiple of
    ``size`` (their logits are cut off after the gather)."""
    per = -(-head.shape[0] // size)
    rows = head[rank * per : (rank + 1) * per]
    if rows.shape[0] < per:
        rows = torch.cat([rows, rows.new_zeros(per - rows.shape[0], head.shape[1])])
    return rows.contiguous()
