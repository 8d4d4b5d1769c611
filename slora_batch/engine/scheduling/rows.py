"""The running rows' table: one dense row per running sequence, holding what a decode step reads
in preallocated arrays, so that the step is built by array slices instead of a Python pass over
every row (per-step host work grew with the rows and left the GPU waiting).

A sequence takes the next row when it starts running and gives it up when it stops (retired,
finished, preempted); the table's last row then moves into the hole, so rows stay dense in
``[0, n)`` and a row keeps its place from step to step while nothing around it leaves. Running
example: rows [A, B, C, D]; B finishes -> [A, D, C]; E joins -> [A, D, C, E]. A decode step of
every running row is then the table's first n rows in this order (``Scheduler`` emits it so),
its page table ``pages[:n, :width]`` with no copy, and a row that kept its place from one step
to the next differs only by the page pair of its new token (``ModelRunner._fill`` writes just
that into a CUDA graph's table).

While a sequence is seated its pages live here (``Sequence.pages`` reads them); a new page
pair is written into its row when allocated. Leaving, it takes them back into its own buffer.
Entries past a row's pages are -1. So does its per-step state (tokens computed, pending, read
back, the row and step of its latest draw): a decode step's ``launched`` and ``postprocess``
update every row with a few array ops, and ``Sequence``'s properties read the row while seated.
Running example: row 2 at 40 computed, 1 pending, 5 read back; its step launches -> 41
computed, 2 pending; the earlier token 17 comes back -> ``out[2, 5] = 17``, 6 read back, 1
pending.
"""

from __future__ import annotations

import itertools

import numpy as np

from slora_batch.engine.requests.sequence import Sequence

MIN_ROWS, MIN_WIDTH = 16, 64  # first sizes; both double when a row or a page pair overflows
MIN_OUTPUTS = 64  # first width of the read-back tokens; doubles when a row's outputs overflow


class RowTable:
    def __init__(self) -> None:
        self.seqs: list[Sequence] = []  # row -> its sequence
        # Per incarnation of a row (a preempted sequence comes back as a new one): the key of
        # ``HostStep.seq_keys`` for tensor parallelism, and a number unique in this table's life
        # whose pages only grow while it lasts (``HostStep.b_tenure``).
        self.keys: list[tuple[int, int]] = []
        self._tenures = itertools.count()
        # (row, last row) of every leave, in order, from event number ``moves_base`` on: where
        # the rows of a step launched at ``mark()`` are now (``rows_since``)
        self.moves: list[tuple[int, int]] = []
        self.moves_base = 0
        self.scored = 0  # seated sequences that draw nothing (scored): no step is all draws
        self.logprobs = 0  # seated sequences that read logprobs back (``step_outputs``)
        self.pages = np.full((MIN_ROWS, MIN_WIDTH, 2), -1, dtype=np.int32)  # [rows, width, 2]
        self.b_paged = np.zeros(MIN_ROWS, dtype=np.int64)  # tokens with pages
        self.b_tenure = np.full(MIN_ROWS, -1, dtype=np.int64)
        self.b_slot = np.full(MIN_ROWS, -1, dtype=np.int64)  # adapter slot, -1: base model
        # sampling parameters (``SamplingBatch``): fixed while a row is seated
        self.b_temperature = np.zeros(MIN_ROWS, dtype=np.float32)
        self.b_top_k = np.zeros(MIN_ROWS, dtype=np.int64)
        self.b_top_p = np.ones(MIN_ROWS, dtype=np.float32)
        self.b_noise = np.zeros(MIN_ROWS, dtype=np.int64)
        self.b_max_new = np.zeros(MIN_ROWS, dtype=np.int64)  # max_new_tokens
        self.b_prompt_len = np.zeros(MIN_ROWS, dtype=np.int64)
        # rows ``postprocess`` looks at on every token: a stop string or a grammar to feed
        self.b_watched = np.zeros(MIN_ROWS, dtype=np.bool_)
        # per-step state (``Sequence``'s properties of these names read them while seated)
        self.b_computed = np.zeros(MIN_ROWS, dtype=np.int64)  # num_computed
        self.b_pending = np.zeros(MIN_ROWS, dtype=np.int64)
        self.b_last_row = np.full(MIN_ROWS, -1, dtype=np.int64)
        self.b_last_step = np.full(MIN_ROWS, -1, dtype=np.int64)
        self.b_outputs = np.zeros(MIN_ROWS, dtype=np.int64)  # tokens read back
        self.out = np.zeros((MIN_ROWS, MIN_OUTPUTS), dtype=np.int64)  # [rows, width] their ids

    def __len__(self) -> int:
        return len(self.seqs)

    def _columns(self) -> tuple[str, ...]:
        return (
            "b_paged",
            "b_tenure",
            "b_slot",
            "b_temperature",
            "b_top_k",
            "b_top_p",
            "b_noise",
            "b_max_new",
            "b_prompt_len",
            "b_watched",
            "b_computed",
            "b_pending",
            "b_last_row",
            "b_last_step",
            "b_outputs",
        )

    def join(self, seq: Sequence) -> None:
        """``seq`` starts running: the next row, with its pages (a cached prefix, its first
        chunk's) and its fixed fields."""
        row = len(self.seqs)
        if row == self.pages.shape[0]:
            self._grow_rows()
        pages = seq.pages
        self._fit(pages.shape[0])
        self.pages[row, : pages.shape[0]] = pages
        self.b_paged[row] = pages.shape[0]
        self.b_tenure[row] = next(self._tenures)
        self.b_slot[row] = seq.slot
        self.b_temperature[row] = seq.temperature
        self.b_top_k[row] = seq.top_k
        self.b_top_p[row] = seq.top_p
        self.b_noise[row] = seq.key
        self.b_max_new[row] = seq.max_new_tokens
        self.b_prompt_len[row] = len(seq.prompt_ids)
        self.b_watched[row] = seq.detok is not None or seq.grammar is not None
        self.b_computed[row] = seq.num_computed
        self.b_pending[row] = seq.pending
        self.b_last_row[row] = seq.last_row
        self.b_last_step[row] = seq.last_step
        self.b_outputs[row] = 0
        self.set_outputs(row, seq.output_ids)
        self.seqs.append(seq)
        self.keys.append((seq.order, seq.preemptions))
        self.scored += not seq.draws
        self.logprobs += seq.logprobs is not None
        seq.seat(self, row)

    def leave(self, seq: Sequence) -> None:
        """``seq`` stops running: its pages go back into its own buffer, the last row moves
        into its place."""
        row, last = seq.row, len(self.seqs) - 1
        self.scored -= not seq.draws
        self.logprobs -= seq.logprobs is not None
        paged = int(self.b_paged[row])
        state = (
            self.outputs(row),
            int(self.b_computed[row]),
            int(self.b_pending[row]),
            int(self.b_last_row[row]),
            int(self.b_last_step[row]),
        )
        seq.unseat(self.pages[row, :paged].copy(), state)
        self.pages[row, :paged] = -1
        if row != last:
            moved = int(self.b_paged[last])
            self.pages[row, :moved] = self.pages[last, :moved]
            self.pages[last, :moved] = -1
            self.out[row, : self.b_outputs[last]] = self.out[last, : self.b_outputs[last]]
            for name in self._columns():
                column = getattr(self, name)
                column[row] = column[last]
            mover = self.seqs[last]
            self.seqs[row], self.keys[row] = mover, self.keys[last]
            mover.row = row
        self.seqs.pop()
        self.keys.pop()
        self.b_tenure[last] = -1
        self.moves.append((row, last))

    def mark(self) -> int:
        """The number of leaves so far: ``rows_since`` reads where rows went after this point."""
        return self.moves_base + len(self.moves)

    def rows_since(self, mark: int, count: int) -> np.ndarray:
        """[count] where the sequences that held rows 0..count-1 at ``mark`` are now, -1 for
        one that left since (it may hold a row again: its own ``row`` says). By the leaves
        since then, without reading the sequences. Running example: rows [A, B, C, D] at the
        mark; B leaves (D moves to row 1), then D leaves (C moves to row 1), E joins at row 2
        -> [0, -1, 1, -1]."""
        b_row = np.arange(count, dtype=np.int64)
        held: dict[int, int] = {}  # row -> index of the sequence in it now (-1: none of those)
        for row, last in self.moves[mark - self.moves_base :]:
            i = held.get(row, row if row < count else -1)
            if i >= 0:
                b_row[i] = -1
            if last != row:
                j = held[row] = held.get(last, last if last < count else -1)
                if j >= 0:
                    b_row[j] = row
            held[last] = -1  # a row that joins later holds none of them
        return b_row

    def trim(self, mark: int) -> None:
        """No step launched before ``mark`` is read back any more: its leaves are forgotten."""
        drop = mark - self.moves_base
        if drop > 0:
            del self.moves[:drop]
            self.moves_base = mark

    def clear(self) -> None:
        """Every sequence leaves (the scheduler dropped them all)."""
        for seq in reversed(self.seqs):
            self.leave(seq)

    def outputs(self, row: int) -> list[int]:
        """The row's tokens read back, a new list."""
        return self.out[row, : self.b_outputs[row]].tolist()

    def set_outputs(self, row: int, ids: list[int]) -> None:
        self._fit_outputs(len(ids))
        self.out[row, : len(ids)] = ids
        self.b_outputs[row] = len(ids)

    def add_outputs(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """One token read back for each of ``rows`` (distinct), [k] and [k]."""
        ends = self.b_outputs[rows]
        if rows.size:
            self._fit_outputs(int(ends.max()) + 1)
        self.out[rows, ends] = tokens
        self.b_outputs[rows] = ends + 1

    def _fit_outputs(self, width: int) -> None:
        have = self.out.shape[1]
        if width > have:
            wider = np.zeros((self.out.shape[0], max(width, 2 * have)), dtype=np.int64)
            wider[:, :have] = self.out
            self.out = wider

    def row_pages(self, row: int) -> np.ndarray:
        """[paged, 2] the row's (K page, V page) per token, a view."""
        return self.pages[row, : self.b_paged[row]]

    def add_pages(self, row: int, new: np.ndarray) -> None:
        """A seated sequence's next pages, [k, 2]."""
        start = int(self.b_paged[row])
        end = start + new.shape[0]
        self._fit(end)
        self.pages[row, start:end] = new
        self.b_paged[row] = end

    def add_each(self, rows: np.ndarray, pairs: np.ndarray) -> None:
        """The same number m of token slots' page pairs for each of ``rows`` (distinct): [k]
        and [k, m, 2]."""
        ends = self.b_paged[rows]
        m = pairs.shape[1]
        self._fit(int(ends.max()) + m)
        self.pages[rows[:, None], ends[:, None] + np.arange(m)] = pairs
        self.b_paged[rows] = ends + m

    def _fit(self, width: int) -> None:
        have = self.pages.shape[1]
        if width <= have:
            return
        wider = np.full((self.pages.shape[0], max(width, 2 * have), 2), -1, dtype=np.int32)
        wider[:, :have] = self.pages
        self.pages = wider

    def _grow_rows(self) -> None:
        rows = 2 * self.pages.shape[0]
        pages = np.full((rows, *self.pages.shape[1:]), -1, dtype=np.int32)
        pages[: self.pages.shape[0]] = self.pages
        self.pages = pages
        out = np.zeros((rows, self.out.shape[1]), dtype=np.int64)
        out[: self.out.shape[0]] = self.out
        self.out = out
        for name in self._columns():
            column = getattr(self, name)
            grown = np.zeros(rows, dtype=column.dtype)
            grown[: column.size] = column
            setattr(self, name, grown)
