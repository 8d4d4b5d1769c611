"""How waiting sequences join a step: ``Scheduler``'s admission half (a mixin over its state:
``waiting``, ``running``, ``pinned``, ``pages``, ``computing``, ``residency``, ``config``).

A running batch takes newcomers once ``admit_batch`` of them can join: seats free, and room under
the adapter cap (``max_adapters_per_batch``), which with many adapters fills first. The next
waiting row is picked by adapter clustering (a preempted row first; then a row whose adapter is
pinned, then resident, then in host memory), admitted while the token budget, the sequence cap,
the adapter cap and the pages allow (``KVPages.admissible``), and starts past its cached prefix.
A row whose prompt continues with a block that a running row is computing waits for it to be
cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat

from slora_batch.engine.requests.sequence import Sequence, Status
from slora_batch.engine.scheduling.prefix_cache import Block
from slora_batch.engine.scheduling.rows import RowTable


@dataclass
class ScheduledStep:
    """One step's rows and the tokens each computes (``scheduler`` re-exports it)."""

    seqs: list[Sequence]
    num_new: list[int]  # tokens computed for each sequence this step
    # Set when the step is every row of the scheduler's row table, in its order, one token
    # each, each drawing one: the step is then built from the table's arrays.
    rows: RowTable | None = None
    mark: int | None = None  # the row table's ``mark()`` at launch (``Scheduler.postprocess``)

    def __bool__(self) -> bool:
        return bool(self.seqs)


MAX_DEFERRED = 64  # waiting rows set aside in one step for a prefix being computed


class Admission:
    def _admit_waiting(self, step: ScheduledStep, budget: int) -> None:
        """Waiting sequences join the step while they fit. One whose prompt continues past its
        cached prefix with a block that a running sequence is computing waits for it to be
        cached (the next steps), rather than compute it again: rows sharing a system prompt
        then compute it once."""
        deferred: list[Sequence] = []
        while budget > 0 and len(self.running) < self.config.seats_bound:
            seq = self._pick()
            if seq is None:
                break
            hit = self.pages.prefix(seq)
            key = self.pages.first_miss(seq, hit)
            # ``computing`` maps a prefix block's chain key to the row computing it. Another row
            # computes this row's first missing block now: defer this row until the block is
            # cached, then share it (no entry, or this row itself: go on and compute it).
            if key is not None and self.computing.get(key, seq) is not seq:
                self.waiting.remove(seq)
                deferred.append(seq)
                if len(deferred) == MAX_DEFERRED:
                    break
                continue
            n = min(seq.remaining - len(hit) * self.config.prefix_block_tokens, budget)
            if not self._admit(seq, n, hit):
                break
            if key is not None:
                self.computing[key] = seq
                seq.computing = key
            step.seqs.append(seq)
            step.num_new.append(n)
            budget -= n
        self.waiting.extendleft(reversed(deferred))

    def _admitting(self) -> bool:
        """Whether waiting requests may join this step. A running batch takes newcomers only once
        ``admit_seats`` of them can join (or all waiting ones): ``admit_seats`` seats free, and
        the adapter cap letting that many in (``_joinable``). One prefill step for many new
        requests instead of one mixed, graph-less step per finished request: with many adapters
        the cap fills before the seats do (1000 adapters, fp8 KV: 591 seats, ~300 rows on 256
        adapters), and free seats alone admitted the row or two of each freed adapter in a
        mixed step of its own, one step in two."""
        if not self.running or not self.waiting:
            return True
        want = min(self.config.admit_seats, len(self.waiting))
        free = self.config.seats_bound - len(self.running)
        return free >= want and self._joinable(want) >= want

    def _joinable(self, want: int) -> int:
        """How many waiting rows the adapter cap lets join now, counted up to ``want``: rows of
        the base model or of a pinned adapter, and the rows of as many other adapters as the cap
        has slots left, the first such adapters in queue order. Running example, cap 256 with
        255 pinned: of waiting rows [p, q, q, r] (p pinned), p and both q rows may join, r waits
        for a second slot: 3. Counted from the queue's rows per adapter
        (``WaitingQueue.by_adapter``); only the new adapters are looked for in the queue, and
        the walk stops once the cap's slots are named."""
        slots = self.config.max_adapters_per_batch - len(self.pinned)
        if slots >= want:  # a row brings at most one adapter
            return want
        by_adapter = self.waiting.by_adapter
        pinned = self.pinned
        if len(pinned) < len(by_adapter):
            count = by_adapter.get(None, 0) + sum(map(by_adapter.get, pinned, repeat(0)))
        else:
            count = sum(n for a, n in by_adapter.items() if a is None or a in pinned)
        if count >= want or slots <= 0:
            return min(count, want)
        new: set[str] = set()
        for seq in self.waiting:
            adapter = seq.adapter
            if adapter and adapter not in pinned and adapter not in new:
                new.add(adapter)
                count += by_adapter[adapter]
                if len(new) == slots or count >= want:
                    break
        return min(count, want)

    def _admit(self, seq: Sequence, n: int, hit: list[Block] = ()) -> bool:
        adapter = seq.adapter
        if not self.pages.admissible(seq, n, hit, pinned=adapter in self.pinned):
            return False
        self.waiting.remove(seq)
        self.pages.attach(seq, hit)
        if adapter:
            seq.slot = self.residency.acquire(adapter)
            self.pinned[adapter] += 1
        need = self.pool.kv_pages_per_token * n
        if not self.pages.room(need):
            raise AssertionError(
                f"admission counted {need} KV pages, {self.pool.num_free} free "
                f"after loading {adapter!r}"
            )
        self.pages.take(seq, n)
        seq.status = Status.RUNNING
        self.running.append(seq)
        self.rows.join(seq)
        return True

    def _pick(self) -> Sequence | None:
        """The next waiting sequence: preempted ones first, then clustering by adapter: a row
        whose adapter is pinned already, else one whose adapter is resident, else the first
        whose adapter is in host memory. While rows run, a row whose adapter the loader thread
        is still reading waits (the batch decodes meanwhile) rather than stall the step."""
        if not self.waiting:
            return None
        head = self.waiting[0]
        if head.preemptions:  # a token still on the device: recompute once it is read back
            return head if not head.pending and self._adapter_allowed(head.adapter) else None
        full = len(self.pinned) >= self.config.max_adapters_per_batch
        store = self.residency.store
        resident = ready = None
        for seq in self.waiting:
            if not seq.adapter or seq.adapter in self.pinned:
                return seq
            if full or resident is not None:
                continue
            if self.residency.is_resident(seq.adapter):
                resident = seq
            elif ready is None and store.ready(seq.adapter):
                ready = seq
        if full:
            return None
        if resident is not None or ready is not None:
            return resident or ready
        return None if self.running else head

    def _adapter_allowed(self, adapter: str | None) -> bool:
        """Adapters pinned by any of this scheduler's sequences count against the cap: running
        rows, and retired or held ones whose slot a step in flight still reads."""
        return (
            not adapter
            or adapter in self.pinned
            or len(self.pinned) < self.config.max_adapters_per_batch
        )
