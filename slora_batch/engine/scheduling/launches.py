"""What a launched step changes: ``Scheduler``'s launch half (a mixin over its state: ``rows``,
and its ``_after_computed``, ``_computed_tokens`` and ``_retire``).

Step N is on the device once launched: its K/V counts as computed (queued), and each row that
draws a token has one pending until read back. Rows of the row table are counted by array ops
over its columns; a row goes through Python only when something happens to it: its prompt
ends or is chunked (prompt blocks cached, followers released, a scored row retired), or its
pending token is its last (retired). Running example: a mixed step of decodes A, B (table rows
0, 1) and C's 16-token chunk that ends its prompt (row 2), drawn [A, B, C]: computed += [1, 1,
16], pending += 1 and last_row = [0, 1, 2] for all three; only C goes through
``_after_computed``; B retires if its pending token is its last.
"""

from __future__ import annotations

import numpy as np

from slora_batch.engine.requests.sequence import Sequence, Status
from slora_batch.engine.scheduling.admission import ScheduledStep


class Launches:
    def launched(self, step: ScheduledStep, drawn: list[Sequence], number: int) -> None:
        """Step ``number`` is on the device: its K/V counts as computed, and ``drawn`` (its rows
        that draw a token) each have one token pending. A row whose pending token is its last
        (``max_new_tokens``), or a scored sequence whose last chunk this is, leaves the running
        set now but keeps its pages until read back."""
        step.mark = self.rows.mark()  # before its rows retire (``postprocess``)
        if step.rows is not None:  # every running row, one token each, each drawing one
            self._launched_decode(step.seqs, number)
            return
        b_row = np.fromiter([s.row for s in step.seqs], np.int64, len(step.seqs))
        d_row = np.fromiter([s.row for s in drawn], np.int64, len(drawn))
        if (b_row < 0).any() or (d_row < 0).any():  # a row out of the table: one by one
            for seq, n in zip(step.seqs, step.num_new, strict=True):
                self._computed_tokens(seq, n, number)
            self._pend(drawn, number)
            return
        self._launched_mixed(step, drawn, number, b_row, d_row)

    def _launched_decode(self, seqs: list[Sequence], number: int) -> None:
        """``launched`` for a step of the row table's rows (``ScheduledStep.rows``): array ops
        over the table's columns; only a row whose prompt ends with this token goes through
        ``_computed`` (its last prompt block is cached, its followers released), and only the
        rows whose pending token is their last are retired, one by one."""
        table, n = self.rows, len(seqs)
        prefilling = np.flatnonzero(table.b_computed[:n] < table.b_prompt_len[:n])
        table.b_computed[:n] += 1
        table.b_pending[:n] += 1
        table.b_last_row[:n] = np.arange(n)
        table.b_last_step[:n] = number
        done = np.flatnonzero(table.b_outputs[:n] + table.b_pending[:n] >= table.b_max_new[:n])
        for i in prefilling.tolist():
            self._after_computed(seqs[i], number)
        for i in done.tolist():
            self._retire(seqs[i])

    def _launched_mixed(
        self,
        step: ScheduledStep,
        drawn: list[Sequence],
        number: int,
        b_row: np.ndarray,
        d_row: np.ndarray,
    ) -> None:
        """``launched`` for any other step whose rows are all in the table (``b_row``: the
        step's rows, ``d_row``: the drawn ones'): the counts by array ops, as in
        ``_launched_decode``; ``_after_computed`` only for the rows still in their prompt or
        bringing a chunk (a decoding row past its prompt has nothing left to cache, claim or
        release), in step order, then the drawn rows whose pending token is their last retire,
        in draw order (the order of the one-by-one path)."""
        table, seqs = self.rows, step.seqs
        b_new = np.asarray(step.num_new, dtype=np.int64)
        before = table.b_computed[b_row]
        table.b_computed[b_row] = before + b_new
        look = np.flatnonzero((before < table.b_prompt_len[b_row]) | (b_new > 1))
        table.b_pending[d_row] += 1
        table.b_last_row[d_row] = np.arange(d_row.size)
        table.b_last_step[d_row] = number
        done = table.b_outputs[d_row] + table.b_pending[d_row] >= table.b_max_new[d_row]
        for i in look.tolist():
            self._after_computed(seqs[i], number)
        for i in np.flatnonzero(done).tolist():
            if drawn[i].status is Status.RUNNING:
                self._retire(drawn[i])

    def _pend(self, drawn: list[Sequence], number: int) -> None:
        """Each row of ``drawn`` has one more token pending (row ``row`` of step ``number``'s
        draw); a row whose pending token is its last leaves the running set now."""
        for row, seq in enumerate(drawn):
            seq.pending += 1
            seq.last_row, seq.last_step = row, number
            if seq.num_drawn >= seq.max_new_tokens and seq.status is Status.RUNNING:
                self._retire(seq)
