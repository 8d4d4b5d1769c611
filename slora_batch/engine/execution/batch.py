"""Turns a scheduled step (host bookkeeping) into the flat arrays the model and kernels read.

This is the one place per-step tensors are built. Running example: sequence A decodes its 17th
token with adapter slot 2, sequence B prefills a 3-token chunk at positions 5..7 on the base model.
  input_ids   [a16, b5, b6, b7]      positions [16, 5, 6, 7]
  b1_start    [0, 1, 4]              b_seq_len [17, 8]
  b_slot      [2, -1, -1, -1]        token_order [0, 1, 2, 3], seg1_start [0, 1], seg_slot [2]
  logits_index [0, 3] if B's chunk ends its prompt, else [0]
"""

from __future__ import annotations

__all__ = [
    "HostStep",
    "LoraLayout",
    "lora_layout",
    "lora_meta",
    "lora_segments",
    "plan_step",
    "position_segments",
    "tiled_tokens",
    "upload",
    "vector_tokens",
]

from dataclasses import dataclass

import numpy as np
import torch

from slora_batch.engine.adapters.residency import AdapterResidency
from slora_batch.engine.device import to_device
from slora_batch.engine.execution.lora_layout import (  # re-exported: tests and the runner
    LoraLayout,
    lora_layout,
    lora_meta,
    lora_segments,
    position_segments,
    step_targets,
    step_vectors,
    tiled_tokens,
    vector_tokens,
)
from slora_batch.engine.models.step import StepInput
from slora_batch.engine.scheduling.scheduler import ScheduledStep
from slora_kernels.meta import AttnMeta, LoraMeta


@dataclass
class HostStep:
    """The step on the host, as numpy arrays (see the module docstring for an example)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    out_pages: np.ndarray  # [T, 2] int32
    b1_start: np.ndarray  # [B+1] int32
    b_seq_len: np.ndarray  # [B] int32
    page_table: np.ndarray  # [B, max_ctx, 2] int32, -1 past the end
    b_slot: np.ndarray  # [T] int64, -1 for base-model tokens
    logits_index: np.ndarray  # [S] int64
    logit_rows: list[int]  # per sequence: its row in the logits, -1 when no token is drawn
    max_new: int
    # Mixed steps: how many leading sequences bring one token. Their attention runs on the
    # decode kernel and the rest on the prefill kernel (0: all on the prefill kernel).
    decode_rows: int = 0
    # Overlapped steps: per token, the row of the previous step's drawn tokens (still on the
    # device) that is its input id, -1 where input_ids holds it; None when no token needs one.
    prev_rows: np.ndarray | None = None
    # Scored sequences: the tokens whose next-token log-probability is read (after the drawn
    # rows in logits_index), the token each must predict, and where the value goes: the
    # sequence's index in the step and the continuation token's index. None: no scored token.
    score_index: np.ndarray | None = None  # [E] int64
    score_targets: np.ndarray | None = None  # [E] int64
    score_owner: np.ndarray | None = None  # [E] int64
    score_pos: np.ndarray | None = None  # [E] int64
    # Per sequence, a key that stays the same while its pages only grow: (arrival, preemptions).
    # Tensor parallelism sends the other ranks only the page-table entries a key adds.
    seq_keys: list[tuple[int, int]] | None = None
    # Per sequence, a number unique to its run in the row table (``RowTable``), whose pages only
    # grow while it lasts: a CUDA graph's page table then takes only the entries a row added
    # since the last step that had it at that row (``ModelRunner._fill``). None: unknown.
    b_tenure: np.ndarray | None = None  # [B] int64
    # Per sequence, its prompt's length (longrope models read it per token; ``upload``).
    prompt_lens: np.ndarray | None = None  # [B] int64

    @property
    def decode_only(self) -> bool:
        return self.max_new == 1


def plan_step(step: ScheduledStep) -> HostStep:
    if step.rows is not None:
        return _plan_rows(step)
    if max(step.num_new) == 1 and all(seq.draws for seq in step.seqs):
        return _plan_decode(step)
    return _plan_mixed(step)


def _plan_mixed(step: ScheduledStep) -> HostStep:
    """``plan_step`` of any step: prefill chunks, decodes, scored sequences, in any mix."""
    # per sequence only Python scalars and list slices: its tokens' positions and adapter slots
    # are spread over its tokens by array ops after the loop (an arange and a full a sequence
    # cost more than the sequence's own work)
    ids, slots, out_pages, prev = [], [], [], []
    b1_start, seq_lens, logit_rows, logits_index = [0], [], [], []
    scored: list[tuple[int, int, int, int]] = []  # (token index, target, owner, position)
    for b, (seq, n) in enumerate(zip(step.seqs, step.num_new, strict=True)):
        start = seq.num_computed
        if not seq.draws:
            _add_scored(scored, seq, b, b1_start[-1], n)
        slots.append(seq.slot)
        if seq.pending:  # its one new token is the previous step's draw, still on the device
            assert n == 1 and seq.pending == 1, (n, seq.pending)
            ids.append(0)
            prev.append(seq.last_row)
        else:
            if n == 1:
                ids.append(seq.token(start))
            else:
                _add_chunk_ids(ids, seq, start, n)
            prev.extend([-1] * n)
        out_pages.append(seq.pages[start : start + n])
        b1_start.append(b1_start[-1] + n)
        seq_lens.append(start + n)
        if start + n == seq.num_tokens and seq.draws:  # the chunk ends it: a token is drawn
            logit_rows.append(len(logits_index))
            logits_index.append(b1_start[-1] - 1)
        else:
            logit_rows.append(-1)
    score = np.asarray(scored, dtype=np.int64).reshape(-1, 4).T if scored else None
    starts = np.asarray(b1_start, dtype=np.int64)
    counts = np.diff(starts)  # token i of the step, of sequence b, sits at position
    computed = np.asarray(seq_lens, dtype=np.int64) - counts  # computed[b] + i - starts[b]
    positions = np.arange(starts[-1], dtype=np.int64) + np.repeat(computed - starts[:-1], counts)
    if score is not None:
        logits_index.extend(score[0].tolist())
    return HostStep(
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=positions,
        out_pages=np.concatenate(out_pages).astype(np.int32),
        b1_start=np.asarray(b1_start, dtype=np.int32),
        b_seq_len=np.asarray(seq_lens, dtype=np.int32),
        page_table=_page_table(step.seqs, seq_lens),
        b_slot=np.repeat(np.asarray(slots, dtype=np.int64), counts),
        logits_index=np.asarray(logits_index, dtype=np.int64),
        logit_rows=logit_rows,
        max_new=max(step.num_new),
        decode_rows=_leading_ones(step.num_new),
        prev_rows=_prev_rows(np.asarray(prev, dtype=np.int64)),
        seq_keys=[(seq.order, seq.preemptions) for seq in step.seqs],
        prompt_lens=np.fromiter((len(s.prompt_ids) for s in step.seqs), np.int64, len(step.seqs)),
        **(
            dict(
                score_index=score[0],
                score_targets=score[1],
                score_owner=score[2],
                score_pos=score[3],
            )
            if score is not None
            else {}
        ),
    )


def _add_scored(scored: list[tuple[int, int, int, int]], seq, b: int, row: int, n: int) -> None:
    """Appends to ``scored`` the positions of scored sequence ``b`` (its chunk of ``n`` tokens
    from step token ``row`` on) that predict a continuation token, position p predicting token
    p + 1: (its step token, the target, b, the continuation token's index)."""
    start = seq.num_computed
    first, lo, hi = seq.scores.start, max(start, seq.scores.start - 1), start + n
    targets = seq.scores.targets(seq.prompt_ids, lo, hi)  # the last one is not fed
    row -= start
    for p, target in zip(range(lo, hi), targets, strict=True):
        scored.append((row + p, target, b, p + 1 - first))


def _add_chunk_ids(ids: list[int], seq, start: int, n: int) -> None:
    """Appends to ``ids`` the ``n`` tokens of a chunk from position ``start``: the prompt's, then
    a recomputed (preempted) row's outputs."""
    prompt = seq.prompt_ids
    ids.extend(prompt[start : start + n])
    if start + n > len(prompt):
        ids.extend(seq.output_ids[max(start - len(prompt), 0) : start + n - len(prompt)])


def _page_table(seqs, seq_lens: list[int]) -> np.ndarray:
    """[B, width, 2] int32: each sequence's pages up to its length, -1 past it."""
    # An even width keeps every row of the table 16-byte aligned, so the prefill half of a
    # split step can be a view at any row (Triton builds a kernel per pointer alignment).
    width = max(seq_lens) + max(seq_lens) % 2
    table = np.full((len(seqs), width, 2), -1, dtype=np.int32)
    for b, seq in enumerate(seqs):
        table[b, : seq_lens[b]] = seq.pages[: seq_lens[b]]
    return table


def _prev_rows(rows: np.ndarray) -> np.ndarray | None:
    return rows if (rows >= 0).any() else None


def _leading_ones(num_new: list[int]) -> int:
    count = 0
    while count < len(num_new) and num_new[count] == 1:
        count += 1
    return count


def _plan_decode(step: ScheduledStep) -> HostStep:
    """``plan_step`` when every sequence brings one token: one pass over the sequences into
    Python lists (a numpy scalar per row costs more than the row's work), then array ops."""
    seqs = step.seqs
    batch = len(seqs)
    lens, ends, prev, ids, slots, keys = [], [], [], [], [], []
    for s in seqs:
        position = s.num_computed
        lens.append(position + 1)
        # A one-token chunk draws a token unless it is a prefill cut short by the token budget.
        ends.append(position + 1 == s.num_tokens)
        # A sequence with a pending token brings that token, still on the device (overlapped
        # steps).
        if s.pending:
            prev.append(s.last_row)
            ids.append(0)
        else:
            prev.append(-1)
            ids.append(s.token(position))
        slots.append(s.slot)
        keys.append((s.order, s.preemptions))
    seq_lens = np.array(lens, dtype=np.int64)
    positions = seq_lens - 1
    drawn = np.flatnonzero(ends).astype(np.int64)
    rows = np.full(batch, -1, dtype=np.int64)
    rows[drawn] = np.arange(drawn.size)
    table = np.full((batch, max(lens), 2), -1, dtype=np.int32)
    for row, seq, n in zip(table, seqs, lens, strict=True):
        row[:n] = seq.pages[:n]
    return HostStep(
        input_ids=np.array(ids, dtype=np.int64),
        positions=positions,
        out_pages=table[np.arange(batch), positions],
        b1_start=np.arange(batch + 1, dtype=np.int32),
        b_seq_len=seq_lens.astype(np.int32),
        page_table=table,
        b_slot=np.array(slots, dtype=np.int64),
        logits_index=drawn,
        logit_rows=rows.tolist(),
        max_new=1,
        prev_rows=_prev_rows(np.array(prev, dtype=np.int64)),
        seq_keys=keys,
    )


def _plan_rows(step: ScheduledStep) -> HostStep:
    """``plan_step`` of a step that is the row table's first B rows, one token each, each
    drawing one (``ScheduledStep.rows``): the page table is a view of the table's, the slots
    and keys, positions and pending draws its columns; only a row whose token was read back
    reads it from its sequence.

    Running example: rows [A, B], A at position 16 with its token pending (row 3 of the last
    step's draws), B at position 7 not pending (its last token 42 read back):
    positions [16, 7], prev_rows [3, -1], input_ids [0, 42], page_table = pages[:2, :17]."""
    seqs, table = step.seqs, step.rows
    batch = len(seqs)
    positions = table.b_computed[:batch].copy()
    pending = table.b_pending[:batch] > 0
    prev = np.where(pending, table.b_last_row[:batch], -1)
    ids = np.zeros(batch, dtype=np.int64)
    for b in np.flatnonzero(~pending).tolist():  # its token read back: known on the host
        ids[b] = seqs[b].token(int(positions[b]))
    seq_lens = positions + 1
    table_view = table.pages[:batch, : int(seq_lens.max())]
    rows = np.arange(batch, dtype=np.int64)
    return HostStep(
        input_ids=ids,
        positions=positions,
        out_pages=table_view[rows, positions],
        b1_start=np.arange(batch + 1, dtype=np.int32),
        b_seq_len=seq_lens.astype(np.int32),
        page_table=table_view,
        b_slot=table.b_slot[:batch].copy(),
        logits_index=rows,
        logit_rows=list(range(batch)),
        max_new=1,
        prev_rows=_prev_rows(prev),
        seq_keys=table.keys[:batch],
        b_tenure=table.b_tenure[:batch].copy(),
    )


def upload(
    host: HostStep,
    residency: AdapterResidency,
    device: torch.device,
    prompt_lens: bool = False,
) -> StepInput:
    """Device tensors of an eager step; LoRA metadata only when a token uses an adapter; each
    token's prompt length when ``prompt_lens`` (the model's ``needs_prompt_lens``)."""

    def dev(array: np.ndarray, dtype=torch.int64) -> torch.Tensor:
        return to_device(array, device, dtype)

    lora = None
    if (host.b_slot >= 0).any():
        layout = lora_layout(host.b_slot, LoraMeta.vector_max)
        seg_slot = layout.seg_slot
        lora = lora_meta(
            dev(host.b_slot, torch.int32),
            dev(layout.order, torch.int32),
            dev(layout.seg1_start, torch.int32),
            dev(seg_slot, torch.int32),
            residency,
            int(residency.slot_rank[seg_slot].max()),
            *step_targets(residency, seg_slot),
            step_vectors(residency, seg_slot),
        )
        layout.hint(lora, lambda array: dev(array, torch.int32))
    attn = AttnMeta(
        b1_start=dev(host.b1_start, torch.int32),
        b_seq_len=dev(host.b_seq_len, torch.int32),
        # contiguous for the kernels (a decode step's table is a view of the row table's)
        page_table=dev(np.ascontiguousarray(host.page_table), torch.int32),
        max_new=host.max_new,
    )
    split = None
    d = host.decode_rows
    if not host.decode_only and 0 < d < len(host.b_seq_len):  # leading decodes, then prefills
        split = (
            d,
            AttnMeta(attn.b1_start[: d + 1], attn.b_seq_len[:d], attn.page_table[:d], 1),
            AttnMeta(  # b_seq_len's own copy: a view at row d is 16-byte aligned only when
                # d % 4 == 0, and Triton builds a kernel per pointer alignment
                dev(host.b1_start[d:] - d, torch.int32),
                dev(host.b_seq_len[d:], torch.int32),
                attn.page_table[d:],  # aligned at any row (plan_step's even width)
                host.max_new,
            ),
        )
    return StepInput(
        input_ids=dev(host.input_ids),
        positions=dev(host.positions),
        out_pages=dev(host.out_pages, torch.int32),
        attn=attn,
        lora=lora,
        logits_index=dev(host.logits_index),
        decode_only=host.decode_only,
        attn_split=split,
        prompt_lens=dev(np.repeat(host.prompt_lens, np.diff(host.b1_start)))
        if prompt_lens and host.prompt_lens is not None
        else None,
    )
