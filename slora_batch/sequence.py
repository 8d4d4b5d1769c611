"""A request's life inside the engine: its tokens, its pages, how far its KV has been computed."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slora_batch.request import Request
from slora_batch.tokens import Detokenizer


@dataclass
class Sequence:
    """One admitted row.

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
    key: int  # sampling.row_key(seed, id)
    stop: list[str]
    ignore_eos: bool
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    pages: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int32))
    slot: int = -1  # adapter slot while running, -1 for the base model
    text: str = ""
    finish_reason: str | None = None
    preemptions: int = 0
    detok: Detokenizer | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens whose K/V must still be computed before the next token can be drawn."""
        return self.num_tokens - self.num_computed

    def token(self, position: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]
