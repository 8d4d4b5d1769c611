"""A request's life inside the engine: its tokens, its pages, how far its KV has been computed."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import numpy as np

from slora_batch.engine.requests.grammar import GrammarState
from slora_batch.engine.requests.request import Request
from slora_batch.engine.requests.scoring import ChoiceGroup, ScoreBuffer
from slora_batch.engine.requests.tokens import Detokenizer


class Seats(Protocol):
    """What a sequence reads of the table it runs in (``scheduling.rows.RowTable``; named here
    by its shape, so that requests import nothing of scheduling): per row, its pages, its read
    back tokens and the per-step columns its properties of the same names read."""

    b_paged: np.ndarray  # [rows] tokens with pages
    b_outputs: np.ndarray  # [rows] tokens read back
    out: np.ndarray  # [rows, width] the tokens read back
    b_computed: np.ndarray
    b_pending: np.ndarray
    b_last_row: np.ndarray
    b_last_step: np.ndarray

    def row_pages(self, row: int) -> np.ndarray: ...

    def add_pages(self, row: int, new: np.ndarray) -> None: ...

    def outputs(self, row: int) -> list[int]: ...

    def set_outputs(self, row: int, ids: list[int]) -> None: ...


def _seated(column: str, own: str, doc: str) -> property:
    """A per-step field: the sequence's row of the table's ``column`` while it runs (seated),
    its own attribute ``own`` otherwise."""

    def get(seq: Sequence) -> int:
        table = seq.table
        return getattr(seq, own) if table is None else int(getattr(table, column)[seq.row])

    def put(seq: Sequence, value: int) -> None:
        table = seq.table
        if table is None:
            setattr(seq, own, value)
        else:
            getattr(table, column)[seq.row] = value

    return property(get, put, doc=doc)


class Status(Enum):
    """Where a sequence is in its life; ``Scheduler`` moves it (see its module docstring)."""

    WAITING = "waiting"  # queued: new, or preempted (KV dropped, recomputed on admission)
    RUNNING = "running"  # scheduled every step until its last token is drawn
    RETIRED = "retired"  # last token drawn on the device, not read back: pages held
    FINISHED = "finished"  # read back and done; pages held while a step in flight uses them
    RELEASED = "released"  # pages and adapter returned


@dataclass(eq=False)
class Sequence:
    """One admitted row; a sequence is equal only to itself (the scheduler's ``list.remove``
    and ``in`` then compare identities, in C, not every field of every row they pass).

    ``tokens`` = prompt ids + generated ids. ``num_computed`` tokens have their K/V in the pool at
    ``pages[:num_computed]`` (one (K page, V page) pair per token). After a preemption the pages
    are gone and ``num_computed`` is 0: the next prefill recomputes prompt and outputs alike.
    """

    request: Request
    order: int  # arrival number: preemption takes the latest arrivals first
    adapter: str | None
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    key: int  # sampling.noise_key(seed, id): the row's sampling noise
    stop: list[str]
    ignore_eos: bool
    # The per-step state below (``_output_ids``, ``_num_computed``, ``_pending``, ``_last_row``,
    # ``_last_step``) is the sequence's own while it is not running; while seated, its row of
    # ``table`` holds it (a decode step updates every row by array ops) and the properties of the
    # same names without "_" read and write that row.
    _output_ids: list[int] = field(default_factory=list)
    _num_computed: int = 0
    # Pages while not running (a running sequence's are in its row of ``table``): tokens with
    # pages, and the buffer holding them, grown by doubling so appends stay O(1).
    page_buf: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int32))
    buf_paged: int = 0
    table: Seats | None = None  # while running: the scheduler's row table, and its row
    row: int = -1
    slot: int = -1  # adapter slot while running, -1 for the base model
    status: Status = Status.WAITING
    finish_reason: str | None = None
    preemptions: int = 0
    detok: Detokenizer | None = None  # fed token by token only when ``stop`` is non-empty
    # Overlapped steps: tokens drawn on the device and not read back yet (counted in
    # num_tokens), the row of the latest one among its step's drawn rows, and that step's number.
    _pending: int = 0
    _last_row: int = -1
    _last_step: int = -1
    # A scored sequence (prefill only, nothing drawn): its continuation tokens' scores, and for
    # a row with choices the group it belongs to and its index there.
    scores: ScoreBuffer | None = None
    group: ChoiceGroup | None = None
    choice: int = 0
    context_tokens: int = 0
    # A generated row's logprobs: how many alternatives, and per drawn token (token id, its
    # log-probability, top ids, their log-probabilities), appended as tokens are read back.
    logprobs: int | None = None
    logprob_entries: list = field(default_factory=list)
    # Prefix caching: the cached blocks this sequence references, its prefix in order (their
    # pages are the first of ``pages``), and whether it stopped adding its own (another
    # sequence cached one of them first).
    blocks: list = field(default_factory=list)
    cache_done: bool = False
    computing: int | None = None  # the key of the first block it computes (Scheduler.computing)
    # n samples of a row: which this is. The first sample (or choice) of a row holds the others,
    # queued once it has computed the shared context_tokens (the prompt, or a scored row's
    # context), so that they find its blocks in the prefix cache.
    sample_index: int = 0
    followers: list = field(default_factory=list)
    # Structured output: this sample's matcher (None: unconstrained). The row ends with "stop"
    # once its grammar has ended.
    grammar: GrammarState | None = None

    @property
    def draws(self) -> bool:
        """Whether the sequence draws tokens (False for a scored one)."""
        return self.scores is None

    @property
    def pages(self) -> np.ndarray:
        """[num_paged, 2] (K page, V page) per token, a view (of the table's row while seated)."""
        if self.table is not None:
            return self.table.row_pages(self.row)
        return self.page_buf[: self.buf_paged]

    @property
    def num_paged(self) -> int:
        """Tokens with pages."""
        if self.table is not None:
            return int(self.table.b_paged[self.row])
        return self.buf_paged

    def add_pages(self, new: np.ndarray) -> None:
        if self.table is not None:
            self.table.add_pages(self.row, new)
            return
        end = self.buf_paged + new.shape[0]
        if end > self.page_buf.shape[0]:
            grown = np.zeros((max(end, 2 * self.page_buf.shape[0], 16), 2), dtype=np.int32)
            grown[: self.buf_paged] = self.pages
            self.page_buf = grown
        self.page_buf[self.buf_paged : end] = new
        self.buf_paged = end

    def drop_pages(self) -> np.ndarray:
        """Forgets every page and returns them, [n, 2] (K page, V page) per token (a sequence
        that no longer runs: ``RowTable.leave`` handed them back)."""
        assert self.table is None, "a running sequence's pages are its row's"
        pages = self.pages.copy()
        self.buf_paged = 0
        return pages

    def seat(self, table: Seats, row: int) -> None:
        """Starts running in ``row`` of ``table``, which took its pages and per-step state."""
        self.table, self.row = table, row
        self.page_buf, self.buf_paged = self.page_buf[:0], 0

    def unseat(self, pages: np.ndarray, state: tuple[list[int], int, int, int, int]) -> None:
        """Stops running; ``pages`` [n, 2] and ``state`` (output ids, computed, pending, last
        row, last step) are its own again."""
        self.table, self.row = None, -1
        self.page_buf, self.buf_paged = pages, pages.shape[0]
        (self._output_ids, self._num_computed, self._pending, self._last_row, self._last_step) = (
            state
        )

    @property
    def output_ids(self) -> list[int]:
        """The tokens read back (while seated a new list: appending to it changes nothing)."""
        if self.table is not None:
            return self.table.outputs(self.row)
        return self._output_ids

    @output_ids.setter
    def output_ids(self, ids: list[int]) -> None:
        if self.table is not None:
            self.table.set_outputs(self.row, ids)
        else:
            self._output_ids = ids

    @property
    def num_outputs(self) -> int:
        """Tokens read back."""
        if self.table is not None:
            return int(self.table.b_outputs[self.row])
        return len(self._output_ids)

    num_computed = _seated("b_computed", "_num_computed", "Tokens whose K/V is computed (queued).")
    pending = _seated("b_pending", "_pending", "Tokens drawn on the device, not read back yet.")
    last_row = _seated("b_last_row", "_last_row", "The latest draw's row among its step's.")
    last_step = _seated("b_last_step", "_last_step", "The step of the latest draw.")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + self.num_outputs + self.pending

    @property
    def num_drawn(self) -> int:
        """Tokens drawn so far, read back or not: the index of the next one."""
        return self.num_outputs + self.pending

    @property
    def remaining(self) -> int:
        """Tokens whose K/V must still be computed before the next token can be drawn."""
        return self.num_tokens - self.num_computed

    def token(self, position: int) -> int:
        n = len(self.prompt_ids)
        if position < n:
            return self.prompt_ids[position]
        if self.table is not None:
            return int(self.table.out[self.row, position - n])
        return self._output_ids[position - n]
