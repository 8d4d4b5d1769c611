"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Every step: running sequences first (decodes take one token, unfinished prefills a chunk), each
getting pages for its new tokens -- evicting idle adapters, then preempting the latest arrivals
(recompute later) when the pool runs dry. Then, once enough seats are free (``admit_batch``),
waiting sequences join while the token budget, the sequence cap, the adapter cap and the free
pages (counting the pages of an adapter not yet resident) allow, preferring adapters already
running, then adapters already resident.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from slora_batch.config import EngineConfig
from slora_batch.pool import PagePool
from slora_batch.residency import AdapterResidency
from slora_batch.sequence import Sequence

log = logging.getLogger(__name__)

PAGES_PER_TOKEN = 2  # one K page and one V page


@dataclass
class ScheduledStep:
    seqs: list[Sequence]
    num_new: list[int]  # tokens computed for each sequence this step

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, pool: PagePool, residency: AdapterResidency) -> None:
        self.config = config
        self.pool = pool
        self.residency = residency
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.steps = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pages_for(self, seq: Sequence) -> int:
        """Pages a sequence needs to run at all: its whole context plus its adapter."""
        total = PAGES_PER_TOKEN * (len(seq.prompt_ids) + seq.max_new_tokens)
        if seq.adapter and self.unified:
            total += self.residency.store.pages(seq.adapter)
        return total

    def schedule(self) -> ScheduledStep:
        self.steps += 1
        step = ScheduledStep([], [])
        budget = self.config.max_num_batched_tokens
        i = self._grow_decodes(step, budget)
        budget -= i
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.remaining, budget)
            if not self._grow(seq, n):
                break  # seq itself was preempted: it was the latest arrival
            step.seqs.append(seq)
            step.num_new.append(n)
            budget -= n
            i += 1
        if not self._admitting():
            return step
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self._pick()
            if seq is None:
                break
            n = min(seq.remaining, budget)
            if not self._admit(seq, n):
                break
            step.seqs.append(seq)
            step.num_new.append(n)
            budget -= n
        return step

    def _admitting(self) -> bool:
        """Whether waiting requests may join this step. A running batch takes newcomers only once
        ``admit_seats`` seats are free (or all waiting ones fit): one prefill step for many new
        requests instead of one mixed, graph-less step per finished request."""
        if not self.running or not self.waiting:
            return True
        free = self.config.max_num_seqs - len(self.running)
        return free >= min(self.config.admit_seats, len(self.waiting))

    def finish(self, seq: Sequence) -> None:
        """A sequence is done: its pages go back and its adapter is unpinned."""
        self.retire(seq)
        self.release(seq)

    def retire(self, seq: Sequence) -> None:
        """A sequence leaves the running set (or the queue, if preempted) but keeps its pages
        and adapter until ``release``: a step still on the device may be using them."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _grow(self, seq: Sequence, n: int) -> bool:
        """Pages for n more tokens of a running sequence, preempting later arrivals if needed."""
        need = PAGES_PER_TOKEN * n
        while not self._kv_room(need):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self._take_pages(seq, n)
        return True

    def _admit(self, seq: Sequence, n: int) -> bool:
        need = PAGES_PER_TOKEN * n
        adapter = seq.adapter
        cost = self.residency.cost(adapter)
        evictable = self.residency.evictable_pages()
        if adapter and self.residency.is_resident(adapter) and self._idle(adapter):
            evictable -= self.residency.store.pages(adapter)  # it is about to be pinned
        if self.unified:
            fits = need + cost <= self.pool.num_free + evictable
        else:
            fits = need <= self.pool.num_free and cost <= self.residency.pool.num_free + evictable
        if not fits:
            return False
        self.waiting.remove(seq)
        if adapter:
            seq.slot = self.residency.acquire(adapter)
        if not self._kv_room(need):
            raise AssertionError(
                f"admission counted {need} KV pages, {self.pool.num_free} free "
                f"after loading {adapter!r}"
            )
        self._take_pages(seq, n)
        self.running.append(seq)
        return True

    @property
    def unified(self) -> bool:
        """KV and adapters share the pool (False only in the no-unified ablation)."""
        return self.residency.pool is self.pool

    def _kv_room(self, need: int) -> bool:
        """Whether ``need`` KV pages are free, evicting idle adapters first when they share the pool."""
        if self.unified:
            return self.residency.make_room(need)
        return self.pool.num_free >= need

    def _idle(self, adapter: str) -> bool:
        return all(s.adapter != adapter for s in self.running)

    def _pick(self) -> Sequence | None:
        """The next waiting sequence: preempted ones first, then clustering by adapter."""
        if not self.waiting:
            return None
        head = self.waiting[0]
        if head.preemptions:  # a token still on the device: recompute once it is read back
            return head if not head.pending and self._adapter_allowed(head.adapter) else None
        running_adapters = {s.adapter for s in self.running if s.adapter}
        full = len(running_adapters) >= self.config.max_adapters_per_batch
        resident = None
        for seq in self.waiting:
            if not seq.adapter or seq.adapter in running_adapters:
                return seq
            if resident is None and not full and self.residency.is_resident(seq.adapter):
                resident = seq
        if resident is not None or full:
            return resident
        return head

    def _adapter_allowed(self, adapter: str | None) -> bool:
        running_adapters = {s.adapter for s in self.running if s.adapter}
        return (
            not adapter
            or adapter in running_adapters
            or len(running_adapters) < self.config.max_adapters_per_batch
        )

    def _grow_decodes(self, step: ScheduledStep, budget: int) -> int:
        """The common decode step in one allocation: the leading running sequences that bring one
        token each get their page pairs from one ``alloc``, when the pool has room for all of
        them. The same steps, page counts and evictions as growing them one by one (which
        ``schedule`` falls back to when room runs out, to preempt); only which free pages go to
        whom may differ after an eviction. Returns how many it scheduled."""
        count = 0
        limit = min(len(self.running), budget)
        while count < limit and self.running[count].remaining == 1:
            count += 1
        if count == 0:
            return 0
        seqs = self.running[:count]
        short = [s for s in seqs if s.num_computed + 1 > s.num_paged]
        if not self._kv_room(PAGES_PER_TOKEN * len(short)):
            return 0
        if short:
            pages = self.pool.alloc(PAGES_PER_TOKEN * len(short)).reshape(-1, PAGES_PER_TOKEN)
            for seq, pair in zip(short, pages, strict=True):
                seq.add_page(pair)
        step.seqs.extend(seqs)
        step.num_new.extend([1] * count)
        return count

    def _take_pages(self, seq: Sequence, n: int) -> None:
        start = seq.num_computed
        have = seq.pages.shape[0]
        if start + n > have:
            new = self.pool.alloc(PAGES_PER_TOKEN * (start + n - have)).reshape(-1, PAGES_PER_TOKEN)
            seq.add_pages(new)

    def _preempt(self, seq: Sequence) -> None:
        """Drop a running sequence's KV; it rejoins the queue's front and recomputes later."""
        self.running.remove(seq)
        self.release(seq)
        seq.num_computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
        log.debug(
            "preempted row %r after %d tokens (%d free pages)",
            seq.request.id,
            len(seq.output_ids),
            self.pool.num_free,
        )

    def release(self, seq: Sequence) -> None:
        """A sequence's pages go back to the pool and its adapter is unpinned."""
        self.pool.free(seq.drop_pages())
        if seq.adapter and seq.slot >= 0:
            self.residency.release(seq.adapter)
        seq.slot = -1
