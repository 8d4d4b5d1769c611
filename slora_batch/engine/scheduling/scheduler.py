"""Iteration-level scheduling, and the one owner of a sequence's life.

A sequence goes WAITING -> RUNNING -> (RETIRED) -> FINISHED -> RELEASED, or back from RUNNING to
WAITING when preempted. With overlapped steps a row's token is read back one step after its
launch, so two states keep pages that no longer run: RETIRED (its last token is drawn on the
device, not yet read back) and FINISHED while a step still in flight uses its pages (it was
already launched in step N+1 when step N's token finished it). Both keep their adapter pinned,
and the per-batch adapter cap counts every adapter pinned by this scheduler's sequences, not
only those of running rows: admission can then never take an adapter that has no slot.

Every step: running sequences first (decodes take one token, unfinished prefills a chunk), each
getting pages for its new tokens -- evicting idle adapters, then preempting the latest arrivals
(recompute later) when the pool runs dry. Then, once ``admit_batch`` newcomers can join (free
seats and room under the adapter cap), waiting sequences join while the token budget, the
sequence cap, the adapter cap and the free pages (counting the pages of an adapter not yet
resident) allow, preferring adapters already running, then adapters already resident
(``admission.Admission``, this class's other half).
Pages themselves, cached prefix blocks included, are ``kv_pages.KVPages``'s.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence as Seq

import numpy as np

from slora_batch.engine.adapters.residency import AdapterResidency
from slora_batch.engine.config import EngineConfig
from slora_batch.engine.pool import PagePool
from slora_batch.engine.requests.sequence import Sequence, Status
from slora_batch.engine.scheduling.admission import Admission, ScheduledStep
from slora_batch.engine.scheduling.kv_pages import PAGES_PER_TOKEN, KVPages
from slora_batch.engine.scheduling.launches import Launches
from slora_batch.engine.scheduling.prefix_cache import PrefixCache
from slora_batch.engine.scheduling.read_back import read_back
from slora_batch.engine.scheduling.rows import RowTable
from slora_batch.engine.scheduling.waiting import WaitingQueue

log = logging.getLogger(__name__)

__all__ = ["PAGES_PER_TOKEN", "ScheduledStep", "Scheduler"]


class Scheduler(Admission, Launches):
    def __init__(
        self,
        config: EngineConfig,
        pool: PagePool,
        residency: AdapterResidency,
        eos_token_ids: Seq[int] = (),
        long_prompts: int | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.residency = residency
        self.eos_token_ids = frozenset(eos_token_ids)
        self.b_eos = np.array(sorted(self.eos_token_ids), dtype=np.int64)
        self.waiting = WaitingQueue()  # counts its rows per adapter (admission)
        self.running: list[Sequence] = []
        self.rows = RowTable()  # the running sequences' pages and fixed fields, one row each
        self.retired: list[Sequence] = []  # last token drawn, not read back: pages held
        self.held: list[Sequence] = []  # finished, pages used by a step in flight
        self.pinned: Counter[str] = Counter()  # adapter -> sequences holding its slot
        self.preemptions = 0
        self.steps = 0
        self.cache = None
        if config.prefix_caching:
            self.cache = PrefixCache(pool, config.prefix_block_tokens)
        self.pages = KVPages(
            pool, residency, self.cache, long_prompts
        )  # whether the pages are there
        # The first uncached block of each running prompt -> the sequence computing it: a row
        # that would compute the same block waits until it is cached (``_admit_waiting``).
        self.computing: dict[int, Sequence] = {}

    def never_fits(self, seq: Sequence) -> str | None:
        """Why a sequence could never run, even alone (None: it can)."""
        return self.pages.never_fits(seq)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def unanswered(self) -> int:
        """Sequences whose result is not read back yet: waiting, running, and retired (their last
        token drawn on the device). The engine pulls rows only while these are under lookahead."""
        return len(self.waiting) + len(self.running) + len(self.retired)

    def holds_pages(self) -> bool:
        """Whether any sequence still holds pages or an adapter (work, or rows in flight)."""
        return bool(self.running or self.retired or self.held or self.pinned)

    # -- after a step: launch, read back ------------------------------------------------------

    def _computed_tokens(self, seq: Sequence, n: int, number: int) -> None:
        """``n`` more tokens of ``seq``'s K/V are computed (queued) by step ``number``."""
        seq.num_computed += n
        self._after_computed(seq, number)

    def _after_computed(self, seq: Sequence, number: int) -> None:
        """``seq``'s K/V computed (queued) count grew: cache its prompt blocks that are now
        whole, end its claim on the block it was computing for others, let its followers start
        past its context, and retire it if it is scored and this was its last chunk."""
        if self.cache is not None and not seq.cache_done and self._uncached_prompt_block(seq):
            self.pages.cache_computed(seq)
        computed = seq.num_computed
        if seq.computing is not None and computed >= len(seq.prompt_ids):
            self._computed(seq)
        if seq.followers and computed >= seq.context_tokens:
            self._release_followers(seq)
        if not seq.draws and computed == seq.num_tokens:  # scored: all computed
            seq.last_step = number
            self._retire(seq)

    def _uncached_prompt_block(self, seq: Sequence) -> bool:
        """Whether a whole block of ``seq``'s prompt is not in the cache yet (a decoding row's
        prompt is cached whole, so this is false for it)."""
        return len(seq.blocks) < len(seq.prompt_ids) // self.config.prefix_block_tokens

    def _release_followers(self, seq: Sequence) -> None:
        """The row's other samples or choices wait at the front of the queue, in their order:
        ``seq``'s context is computed, so they start past its cached blocks."""
        for follower in reversed(seq.followers):
            follower.status = Status.WAITING
            self.waiting.appendleft(follower)
        seq.followers = []

    def _retire(self, seq: Sequence) -> None:
        """Out of the running set, pages kept until its last step is read back."""
        self._stop_running(seq)
        seq.status = Status.RETIRED
        self.retired.append(seq)

    def postprocess(
        self,
        number: int,
        drawn: list[Sequence],
        tokens: list[int],
        step: ScheduledStep | None = None,
    ) -> list[Sequence]:
        """Step ``number``'s tokens are read back: append them, finish rows on EOS, a stop
        string, the end of their grammar or their length, and release what no step in flight
        uses. Returns the rows finished by this step: scored sequences whose last chunk it ran,
        then the drawn rows in ``drawn`` order. ``step``: the step launched (its ``mark``)."""
        # Released together at the end (one ``PagePool.free``), in the order they come: held
        # for a step up to this one (no step in flight uses them now), scored, then drawn.
        release = [seq for seq in self.held if seq.last_step <= number]
        self.held = [seq for seq in self.held if seq.last_step > number]
        finished = [s for s in self.retired if not s.draws and s.last_step <= number]
        for seq in finished:
            seq.finish_reason = "score"  # its scores are read back with its last step
            self._leave(seq)
            seq.status = Status.FINISHED
            release.append(seq)
        mark = step.mark if step is not None and step.rows is not None else None
        watched = read_back(self.rows, drawn, tokens, self.b_eos, self.eos_token_ids, mark)
        if step is not None and step.mark is not None:  # read back in order: none before it
            self.rows.trim(step.mark)
        for seq, token in watched:
            stopped = seq.detok is not None and seq.detok.add([token])  # only rows with stops
            if seq.grammar is not None:  # a token taken already (masks.py) is not taken again
                ids = seq.output_ids
                stopped = seq.grammar.accept(ids, len(ids), seq.request.id) or stopped
            if stopped or (token in self.eos_token_ids and not seq.ignore_eos):
                seq.finish_reason = "stop"
            elif seq.num_outputs >= seq.max_new_tokens:
                seq.finish_reason = "length"
            else:
                continue
            self._leave(seq)
            seq.status = Status.FINISHED
            if seq.last_step > number:  # also launched in the step now in flight
                self.held.append(seq)
            else:
                release.append(seq)
            finished.append(seq)
        self._release(release)
        return finished

    def abort(self) -> list[Sequence]:
        """Drop every sequence (the caller stopped pulling results, and no step is in flight):
        pages and adapters go back. Returns the dropped sequences that had not finished."""
        dropped = [*self.running, *self.retired, *self.waiting]
        self.rows.clear()
        for seq in [*dropped, *self.held]:
            seq.pending = 0
        self._release([*dropped, *self.held])
        self.running, self.retired, self.held = [], [], []
        self.waiting.clear()
        if self.cache is not None:  # an abandoned stream leaves the pool as it found it
            self.cache.clear()
        return dropped

    def schedule(self) -> ScheduledStep:
        self.steps += 1
        self.residency.clock = self.steps
        if self.cache is not None:
            self.cache.clock = self.steps
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
        if self._admitting():
            self._admit_waiting(step, budget)
            if len(step.seqs) > i:  # newcomers: the step is no longer the table's rows alone
                step.rows = None
        return step

    def finish(self, seq: Sequence) -> None:
        """A sequence is done and no step in flight uses it: pages and adapter go back."""
        self._leave(seq)
        seq.status = Status.FINISHED
        self._release([seq])

    def _leave(self, seq: Sequence) -> None:
        """Takes a sequence out of whichever list holds it (running, retired, or the queue when
        a token read back after its preemption finishes it)."""
        if seq.status is Status.RUNNING:
            self._stop_running(seq)
        elif seq.status is Status.RETIRED:
            self.retired.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)

    def _stop_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.rows.leave(seq)

    def _computed(self, seq: Sequence) -> None:
        """A sequence no longer computes its first uncached block (done, preempted, released)."""
        if self.computing.get(seq.computing) is seq:
            del self.computing[seq.computing]
        seq.computing = None

    def _grow(self, seq: Sequence, n: int) -> bool:
        """Pages for n more tokens of a running sequence, preempting later arrivals if needed."""
        need = self.pool.kv_pages_per_token * n
        while not self.pages.room(need):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.pages.take(seq, n)
        return True

    def _grow_decodes(self, step: ScheduledStep, budget: int) -> int:
        """The common decode step in one allocation: the leading running sequences that bring one
        token each get their page pairs from one ``alloc``, when the pool has room for all of
        them. The same steps, page counts and evictions as growing them one by one (which
        ``schedule`` falls back to when room runs out, to preempt); only which free pages go to
        whom may differ. When that is every running row and each draws a token, the step lists
        them in the row table's order and carries the table (``ScheduledStep.rows``). Returns how
        many it scheduled."""
        running, table = self.running, self.rows
        limit = min(len(running), budget)
        # the first row that brings more than one token; the table's columns tell at once when
        # none does (every running row is seated)
        n = len(table)
        b_remaining = (
            table.b_prompt_len[:n]
            + table.b_outputs[:n]
            + table.b_pending[:n]
            - table.b_computed[:n]
        )
        count = limit
        if (b_remaining != 1).any():
            count = next((i for i, s in enumerate(running[:limit]) if s.remaining != 1), limit)
        if count == 0:
            return 0
        whole = count == len(running) and not self.rows.scored
        seqs = list(self.rows.seqs) if whole else running[:count]
        if not self.pages.take_one_each(seqs, self.rows, whole):
            return 0
        step.seqs.extend(seqs)
        step.num_new.extend([1] * count)
        if whole:
            step.rows = self.rows
        return count

    def _preempt(self, seq: Sequence) -> None:
        """Drop a running sequence's KV; it rejoins the queue's front and recomputes later."""
        self._stop_running(seq)
        self._release([seq])
        seq.num_computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        log.debug(
            "preempted row %r after %d tokens (%d free pages)",
            seq.request.id,
            len(seq.output_ids),
            self.pool.num_free,
        )

    def _release(self, seqs: list[Sequence]) -> None:
        """The sequences' pages go back to the pool (those of cached blocks stay, one reference
        fewer) and their adapters are unpinned (idempotent: a preempted row holds neither)."""
        self.pages.free(seqs)
        for seq in seqs:
            if seq.computing is not None:
                self._computed(seq)
            if seq.adapter and seq.slot >= 0:
                self.residency.release(seq.adapter)
                self.pinned[seq.adapter] -= 1
                if not self.pinned[seq.adapter]:
                    del self.pinned[seq.adapter]
            seq.slot = -1
            if seq.status is Status.FINISHED:
                seq.status = Status.RELEASED
