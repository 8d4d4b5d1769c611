"""What one forward step reads besides the weights; ``execution.batch`` builds it, every model
family reads it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slora_kernels.meta import AttnMeta, LoraMeta


@dataclass
class StepInput:
    """Everything one forward step reads besides the weights, built by ``execution.batch``."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_pages: torch.Tensor  # [T, 2] int32: where each token's K and V go
    attn: AttnMeta
    lora: LoraMeta | None  # None when no token of the step uses an adapter
    logits_index: torch.Tensor  # [S] int64: tokens whose next-token logits are needed
    decode_only: bool  # every sequence has exactly one new token
    # Mixed steps whose first d sequences bring one token each: (d, their AttnMeta, the rest's),
    # so decode rows take the decode kernel; None: the whole step on the prefill kernel.
    attn_split: tuple[int, AttnMeta, AttnMeta] | None = None
    # [T] int64: each token's sequence's prompt length, for models whose RoPE depends on it
    # (longrope); None: not needed (decode steps, where the position decides alone).
    prompt_lens: torch.Tensor | None = None
