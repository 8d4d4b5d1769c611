"""The waiting queue: a deque of sequences that also counts its rows per adapter, so that
admission can tell how many waiting rows the adapter cap lets join without a pass over the
queue (``Admission._joinable``; issue 37: that pass cost ~0.2 ms a step at 1000 waiting rows).

Every change goes through the methods below, which keep ``by_adapter`` equal to a count of the
queue: adapter -> waiting rows of it, ``None`` for base-model rows (any falsy adapter).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from slora_batch.engine.requests.sequence import Sequence


class WaitingQueue(deque):
    def __init__(self) -> None:
        super().__init__()
        self.by_adapter: Counter[str | None] = Counter()

    def _count(self, seq: Sequence, delta: int) -> None:
        key = seq.adapter or None
        self.by_adapter[key] += delta
        if not self.by_adapter[key]:
            del self.by_adapter[key]

    def append(self, seq: Sequence) -> None:
        super().append(seq)
        self._count(seq, 1)

    def appendleft(self, seq: Sequence) -> None:
        super().appendleft(seq)
        self._count(seq, 1)

    def extendleft(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        super().remove(seq)
        self._count(seq, -1)

    def clear(self) -> None:
        super().clear()
        self.by_adapter.clear()
