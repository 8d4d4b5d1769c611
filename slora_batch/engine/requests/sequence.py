"""A request's life inside the engine: its tokens, its pages, how far its KV has been computed."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from slora_batch.engine.requests.grammar import GrammarState
from slora_batch.engine.requests.request import Request
from slora_batch.engine.requests.scoring import ChoiceGroup, ScoreBuffer
from slora_batch.engine.requests.tokens import Detokenizer


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
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    page_buf: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int32))
    num_paged: int = 0  # tokens with pages; page_buf grows by doubling so appends stay O(1)
    slot: int = -1  # adapter slot while running, -1 for the base model
    status: Status = Status.WAITING
    finish_reason: str | None = None
    preemptions: int = 0
    detok: Detokenizer | None = None  # fed token by token only when ``stop`` is non-empty
    # Overlapped steps: tokens drawn on the device and not read back yet (counted in
    # num_tokens), the row of the latest one among its step's drawn rows, and that step's number.
    pending: int = 0
    last_row: int = -1
    last_step: int = -1
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
        """[num_paged, 2] (K page, V page) per token, a view of the buffer."""
        return self.page_buf[: self.num_paged]

    def add_pages(self, new: np.ndarray) -> None:
        end = self.num_paged + new.shape[0]
        if end > self.page_buf.shape[0]:
            grown = np.zeros((max(end, 2 * self.page_buf.shape[0], 16), 2), dtype=np.int32)
            grown[: self.num_paged] = self.pages
            self.page_buf = grown
        self.page_buf[self.num_paged : end] = new
        self.num_paged = end

    def add_page(self, pair: np.ndarray) -> None:
        """One token's (K page, V page): ``add_pages`` for the decode path."""
        if self.num_paged == self.page_buf.shape[0]:
            self.add_pages(pair[None])
            return
        self.page_buf[self.num_paged] = pair
        self.num_paged += 1

    def drop_pages(self) -> np.ndarray:
        """Forgets every page and returns them, [n, 2] (K page, V page) per token."""
        pages = self.pages.copy()
        self.num_paged = 0
        return pages

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.pending

    @property
    def num_drawn(self) -> int:
        """Tokens drawn so far, read back or not: the index of the next one."""
        return len(self.output_ids) + self.pending

    @property
    def remaining(self) -> int:
        """Tokens whose K/V must still be computed before the next token can be drawn."""
        return self.num_tokens - self.num_computed

    def token(self, position: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]
