"""Tensor parallelism's cuts of the base model that need no process group (``execution.tp``
holds the ranks, their group and the Megatron cuts' rationale)."""

from __future__ import annotations

import torch


def vocab_shard(head: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The rank's rows of the LM head; the vocabulary padded with zero rows to a multiple of
    ``size`` (their logits are cut off after the gather)."""
    per = -(-head.shape[0] // size)
    rows = head[rank * per : (rank + 1) * per]
    if rows.shape[0] < per:
        rows = torch.cat([rows, rows.new_zeros(per - rows.shape[0], head.shape[1])])
    return rows.contiguous()
