"""The waiting queue's per-adapter counts stay equal to a count of the queue through every
change, and ``joinable`` read from them (how many rows the adapter cap lets join) equals a walk
over the queue."""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

from slora_batch.engine.scheduling.waiting import WaitingQueue


def walk_joinable(waiting, pinned, cap: int, want: int) -> int:
    """``joinable`` as a walk over the whole queue (its definition)."""
    slots = cap - len(pinned)
    if slots >= want:
        return want
    count, new = 0, set()
    for seq in waiting:
        adapter = seq.adapter
        if adapter and adapter not in pinned and adapter not in new:
            if len(new) == slots:
                continue
            new.add(adapter)
        count += 1
        if count == want:
            break
    return count


def test_counts_and_joinable_follow_the_queue():
    rng = random.Random(0)
    adapters = [None, "", *(f"a{i}" for i in range(12))]
    queue, cap = WaitingQueue(), 6
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 or not queue:
            seq = SimpleNamespace(adapter=rng.choice(adapters))
            (queue.append if rng.random() < 0.7 else queue.appendleft)(seq)
        elif op < 0.6:
            queue.remove(rng.choice(list(queue)))
        elif op < 0.65:
            taken = [s for s in list(queue)[:4]]
            for seq in taken:
                queue.remove(seq)
            queue.extendleft(reversed(taken))
        elif op < 0.67:
            queue.clear()
        assert queue.by_adapter == Counter(s.adapter or None for s in queue)
        pinned = Counter({a: 1 for a in rng.sample(adapters[2:], rng.randrange(0, cap + 1))})
        for want in (1, 2, 3, 5, 8, 20):
            assert queue.joinable(want, pinned, cap) == walk_joinable(queue, pinned, cap, want)
