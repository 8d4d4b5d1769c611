"""Grammar masks of a step: the constrained rows' allowed tokens, filled on the host, applied to
those rows' logits on the device before sampling. Rows without a grammar pay nothing.

Running example (overlapped loop): step 8 is queued (its forward runs on the device) while step
7's tokens are still on the device. Row r drew in step 7 (``pending`` 1, ``last_row`` 3), so
its matcher first takes step 7's row-3 token, read back now, then fills r's mask for step 8's
draw; ``Scheduler.postprocess`` later skips that token (already taken), a preempted row's
recomputed tokens likewise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class GrammarMasks:
    """bitmask [D, ceil(vocab / 32)] int32 on the logits' device, one row per drawn row (all
    bits set where the row has no grammar); rows: the drawn rows whose mask is filled;
    host_s: seconds spent filling on the host."""

    bitmask: torch.Tensor
    rows: list[int]
    host_s: float

    def apply(self, logits: torch.Tensor) -> None:
        """Sets the forbidden logits of ``rows`` to -inf. logits [D, vocab], in place."""
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, self.bitmask, indices=self.rows)


def grammar_masks(drawn: list, prev, grammars, device: torch.device) -> GrammarMasks | None:
    """The masks of a step's drawn rows (``drawn``; ``prev``: the step in flight before this
    one, an ``outputs.Inflight`` or None; ``grammars``: the engine's ``GrammarService``), or
    None when no drawn row has a grammar."""
    if not grammars.active:  # no row ever asked for a format: nothing to look for
        return None
    rows = [i for i, seq in enumerate(drawn) if seq.grammar is not None]
    if not rows:
        return None
    import xgrammar as xgr

    began = time.perf_counter()
    bitmask = xgr.allocate_token_bitmask(len(drawn), grammars.vocab_size)
    pending_tokens = None
    filled = []
    for i in rows:
        seq = drawn[i]
        ids = seq.output_ids
        if seq.pending:  # drawn in the step in flight: its token is needed now
            if pending_tokens is None:
                pending_tokens = prev.read()["tokens"].tolist()
            ids = [*ids, pending_tokens[seq.last_row]]
        seq.grammar.accept(ids, len(ids), seq.request.id)
        if seq.grammar.fill(bitmask, i):
            filled.append(i)
    if device.type == "cuda":
        bitmask = bitmask.pin_memory().to(device, non_blocking=True)
    return GrammarMasks(bitmask, filled, time.perf_counter() - began)
