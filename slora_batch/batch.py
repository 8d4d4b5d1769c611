"""Turns a scheduled step (host bookkeeping) into the flat tensors the model and kernels read.

This is the one place per-step tensors are built. Running example: sequence A decodes its 17th
token with adapter slot 2, sequence B prefills a 3-token chunk at positions 5..7 on the base model.
  input_ids   [a16, b5, b6, b7]      positions [16, 5, 6, 7]
  b1_start    [0, 1, 4]              b_seq_len [17, 8]
  b_slot      [2, -1, -1, -1]        token_order [0, 1, 2, 3], seg1_start [0, 1], seg_slot [2]
  logits_index [0, 3] if B's chunk ends its prompt, else [0]
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.meta import AttnMeta, LoraMeta
from slora_batch.model import StepInput
from slora_batch.residency import AdapterResidency
from slora_batch.scheduler import ScheduledStep


def build_step(step: ScheduledStep, residency: AdapterResidency, device: torch.device) -> tuple[StepInput, list[int]]:
    """Returns the step's tensors and, per sequence, its row in the logits (-1: no token drawn)."""
    ids, positions, slots, out_pages = [], [], [], []
    b1_start, seq_lens, logit_rows, logits_index = [0], [], [], []
    for seq, n in zip(step.seqs, step.num_new, strict=True):
        start = seq.num_computed
        positions.append(np.arange(start, start + n))
        ids.append([seq.token(p) for p in range(start, start + n)])
        out_pages.append(seq.pages[start:start + n])
        slots.append(np.full(n, seq.slot, dtype=np.int64))
        b1_start.append(b1_start[-1] + n)
        seq_lens.append(start + n)
        if start + n == seq.num_tokens:  # the chunk reaches the end: a token is drawn
            logit_rows.append(len(logits_index))
            logits_index.append(b1_start[-1] - 1)
        else:
            logit_rows.append(-1)
    max_ctx = max(seq_lens)
    table = np.full((len(step.seqs), max_ctx, 2), -1, dtype=np.int32)
    for b, seq in enumerate(step.seqs):
        table[b, :seq_lens[b]] = seq.pages[:seq_lens[b]]
    b_slot = np.concatenate(slots)

    def dev(array, dtype=torch.int64) -> torch.Tensor:
        return torch.as_tensor(np.asarray(array), dtype=dtype).to(device, non_blocking=True)

    attn = AttnMeta(b1_start=dev(b1_start, torch.int32), b_seq_len=dev(seq_lens, torch.int32),
                    page_table=dev(table, torch.int32), max_new=max(step.num_new))
    step_input = StepInput(
        input_ids=dev([t for chunk in ids for t in chunk]),
        positions=dev(np.concatenate(positions)),
        out_pages=dev(np.concatenate(out_pages), torch.int32),
        attn=attn,
        lora=_lora_meta(b_slot, residency, dev),
        logits_index=dev(logits_index),
        decode_only=max(step.num_new) == 1,
    )
    return step_input, logit_rows


def _lora_meta(b_slot: np.ndarray, residency: AdapterResidency, dev) -> LoraMeta | None:
    """Segments of tokens sharing an adapter; None when the step is base-model only."""
    if (b_slot < 0).all():
        return None
    # Stable sort with base tokens (-1) moved last, so adapter segments come first and contiguous.
    key = np.where(b_slot < 0, np.iinfo(np.int64).max, b_slot)
    order = np.argsort(key, kind="stable")
    sorted_slots = b_slot[order]
    used = sorted_slots[sorted_slots >= 0]
    change = np.flatnonzero(np.diff(used)) + 1
    seg_start = np.concatenate([[0], change, [used.size]])
    seg_slot = used[seg_start[:-1]]
    return LoraMeta(
        b_slot=dev(b_slot, torch.int32), token_order=dev(order, torch.int32),
        seg1_start=dev(seg_start, torch.int32), seg_slot=dev(seg_slot, torch.int32),
        slot_rank=residency.dev_rank, slot_scale=residency.dev_scale,
        slot_pages=residency.dev_pages, slot_offsets=residency.dev_offsets,
        max_rank=int(residency.slot_rank[seg_slot].max()),
    )
