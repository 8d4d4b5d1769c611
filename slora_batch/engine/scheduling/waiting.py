"""The waiting queue: a deque of sequences that also counts its rows per adapter, so that
admission can tell how many waiting rows the adapter cap lets join without a pass over the
queue (``joinable``; that pass cost ~0.2 ms a step at 1000 waiting rows).

Every change goes through the methods below, which keep ``by_adapter`` equal to a count of the
queue: adapter -> waiting rows of it, ``None`` for base-model rows (any falsy adapter).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Collection, Iterable
from itertools import repeat

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

    def joinable(self, want: int, pinned: Collection[str], cap: int) -> int:
        """How many waiting rows an adapter cap of ``cap`` lets join now, counted up to
        ``want``, with the adapters of ``pinned`` holding slots already: rows of the base model
        or of a pinned adapter, and the rows of as many other adapters as the cap has slots
        left, the first such adapters in queue order. Running example, cap 256 with 255
        pinned: of waiting rows [p, q, q, r] (p pinned), p and both q rows may join, r waits
        for a second slot: 3. Counted from ``by_adapter``; only the new adapters are looked for
        in the queue, and the walk stops once the cap's slots are named."""
        slots = cap - len(pinned)
        if slots >= want:  # a row brings at most one adapter
            return want
        by_adapter = self.by_adapter
        if len(pinned) < len(by_adapter):
            count = by_adapter.get(None, 0) + sum(map(by_adapter.get, pinned, repeat(0)))
        else:
            count = sum(n for a, n in by_adapter.items() if a is None or a in pinned)
        if count >= want or slots <= 0:
            return min(count, want)
        new: set[str] = set()
        for seq in self:
            adapter = seq.adapter
            if adapter and adapter not in pinned and adapter not in new:
                new.add(adapter)
                count += by_adapter[adapter]
                if len(new) == slots or count >= want:
                    break
        return min(count, want)
