"""Iteration-level scheduling: the one owner of a sequence's life, and what each step runs.

A sequence goes WAITING -> RUNNING -> (RETIRED) -> FINISHED -> RELEASED, or back from RUNNING to
WAITING when preempted. With overlapped steps a row's token is read back one step after its
launch, so two states keep pages that no longer run: RETIRED (its last token is drawn on the
device, not yet read back) and FINISHED while a step still in flight uses its pages (it was
already launched in step N+1 when step N's token finished it). Both keep their adapter pinned,
and the per-batch adapter cap counts every adapter pinned by this scheduler's sequences, not
only those of running rows: admission can then never take an adapter that has no slot.

A step, as the engine drives it; ``Scheduler``'s methods come in this order:

1. ``schedule``, the running rows first: decodes take one token each, unfinished prefills a
   chunk of the token budget, each getting pages for its new tokens. The common decode step
   takes its page pairs in one allocation (``_grow_decodes``); when the pool runs dry a row
   evicts idle adapters and cached blocks, then preempts the latest arrivals (``_grow``,
   ``_preempt``: they rejoin the queue's front and recompute later).
2. Then waiting rows join, once ``admit_batch`` of them can (free seats, and room under the
   adapter cap ``max_adapters_per_batch``, which with many adapters fills first:
   ``_admitting``). The next one is picked by adapter clustering: a preempted row first, then
   a row whose adapter is pinned, then resident, then in host memory (``_pick``). It is
   admitted while the token budget, the sequence cap, the adapter cap and the free pages
   (counting the pages of an adapter not yet resident: ``KVPages.admissible``) allow, and
   starts past its cached prefix; a row whose prompt continues with a block that a running row
   is computing waits for it to be cached (``_admit_waiting``).
3. ``launched``: the step is on the device. Its K/V counts as computed (queued), and each row
   that draws a token has one pending until read back. Rows of the row table are counted by
   array ops over its columns; a row goes through Python only when something happens to it:
   its prompt ends or is chunked (prompt blocks cached, followers released, a scored row
   retired), or its pending token is its last (retired). Running example: a mixed step of
   decodes A, B (table rows 0, 1) and C's 16-token chunk that ends its prompt (row 2), drawn
   [A, B, C]: computed += [1, 1, 16], pending += 1 and last_row = [0, 1, 2] for all three;
   only C goes through ``_after_computed``; B retires if its pending token is its last.
4. ``postprocess``, one step later: the step's tokens are read back into their rows
   (``read_back``); rows finish on EOS, a stop string, the end of their grammar or their
   length, and their pages and adapters go back (``_release``), or wait while the step now in
   flight still uses them (``held``).

Pages themselves, cached prefix blocks included, are ``kv_pages.KVPages``'s; the running rows'
per-step fields live in ``rows.RowTable``; the waiting queue counts its rows per adapter
(``waiting.WaitingQueue``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from slora_batch.engine.adapters.residency import AdapterResidency
from slora_batch.engine.config import EngineConfig
from slora_batch.engine.pool import PagePool
from slora_batch.engine.requests.sequence import Sequence, Status
from slora_batch.engine.scheduling.kv_pages import PAGES_PER_TOKEN, KVPages
from slora_batch.engine.scheduling.prefix_cache import Block, PrefixCache
from slora_batch.engine.scheduling.read_back import read_back
from slora_batch.engine.scheduling.rows import RowTable
from slora_batch.engine.scheduling.waiting import WaitingQueue

log = logging.getLogger(__name__)

__all__ = ["PAGES_PER_TOKEN", "ScheduledStep", "Scheduler"]

MAX_DEFERRED = 64  # waiting rows set aside in one step for a prefix being computed


@dataclass
class ScheduledStep:
    """One step's rows and the tokens each computes: what ``Scheduler.schedule`` returns."""

    seqs: list[Sequence]
    num_new: list[int]  # tokens computed for each sequence this step
    # Set when the step is every row of the scheduler's row table, in its order, one token
    # each, each drawing one: the step is then built from the table's arrays.
    rows: RowTable | None = None
    mark: int | None = None  # the row table's ``mark()`` at launch (``Scheduler.postprocess``)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
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
        self.pages = KVPages(pool, residency, self.cache, long_prompts)  # whether pages are there
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

    # -- 1. the running rows: decodes and prefill chunks -------------------------------------------

    def schedule(self) -> ScheduledStep:
        """The next step: the running rows in arrival order, each taking what it brings (one
        token, or a prefill chunk) while the token budget lasts, then the waiting rows that
        may join (``_admitting``, ``_admit_waiting``)."""
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

    def _grow(self, seq: Sequence, n: int) -> bool:
        """Pages for n more tokens of a running sequence, preempting later arrivals if needed."""
        need = self.pages.kv_need(seq, n)
        while not self.pages.room(need):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.pages.take(seq, n)
        return True

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

    # -- 2. waiting rows join ----------------------------------------------------------------------

    def _admitting(self) -> bool:
        """Whether waiting requests may join this step. A running batch takes newcomers only once
        ``admit_seats`` of them can join (or all waiting ones): ``admit_seats`` seats free, and
        the adapter cap letting that many in (``WaitingQueue.joinable``). One prefill step for
        many new requests instead of one mixed, graph-less step per finished request: with many
        adapters the cap fills before the seats do (1000 adapters, fp8 KV: 591 seats, ~300 rows
        on 256 adapters), and free seats alone admitted the row or two of each freed adapter in
        a mixed step of its own, one step in two."""
        if not self.running or not self.waiting:
            return True
        want = min(self.config.admit_seats, len(self.waiting))
        free = self.config.seats_bound - len(self.running)
        if free < want:
            return False
        return self.waiting.joinable(want, self.pinned, self.config.max_adapters_per_batch) >= want

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

    def _admit(self, seq: Sequence, n: int, hit: list[Block] = ()) -> bool:
        """``seq`` starts running with ``n`` tokens past its cached blocks ``hit``, if the pages
        for them (and its adapter's, when not resident) are there: it takes the blocks, its
        adapter's slot and its pages, and a row of the table. False: it stays waiting."""
        adapter = seq.adapter
        if not self.pages.admissible(seq, n, hit, pinned=adapter in self.pinned):
            return False
        self.waiting.remove(seq)
        self.pages.attach(seq, hit)
        if adapter:
            seq.slot = self.residency.acquire(adapter)
            self.pinned[adapter] += 1
        need = self.pages.kv_need(seq, n)
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

    # -- 3. the step is launched -------------------------------------------------------------------

    def launched(self, step: ScheduledStep, drawn: list[Sequence], number: int) -> None:
        """Step ``number`` is on the device: its K/V counts as computed, and ``drawn`` (its rows
        that draw a token) each have one token pending. A row whose pending token is its last
        (``max_new_tokens``), or a scored sequence whose last chunk this is, leaves the running
        set now but keeps its pages until read back."""
        step.mark = self.rows.mark()  # before its rows retire (``postprocess``)
        if step.rows is not None:  # every running row, one token each, each drawing one
            self._launched_decode(step.seqs, number)
            return
        b_row = np.fromiter([s.row for s in step.seqs], np.int64, len(step.seqs))
        d_row = np.fromiter([s.row for s in drawn], np.int64, len(drawn))
        if (b_row < 0).any() or (d_row < 0).any():  # a row out of the table: one by one
            for seq, n in zip(step.seqs, step.num_new, strict=True):
                self._computed_tokens(seq, n, number)
            self._pend(drawn, number)
            return
        self._launched_mixed(step, drawn, number, b_row, d_row)

    def _launched_decode(self, seqs: list[Sequence], number: int) -> None:
        """``launched`` for a step of the row table's rows (``ScheduledStep.rows``): array ops
        over the table's columns; only a row whose prompt ends with this token goes through
        ``_computed`` (its last prompt block is cached, its followers released), and only the
        rows whose pending token is their last are retired, one by one."""
        table, n = self.rows, len(seqs)
        prefilling = np.flatnonzero(table.b_computed[:n] < table.b_prompt_len[:n])
        table.b_computed[:n] += 1
        table.b_pending[:n] += 1
        table.b_last_row[:n] = np.arange(n)
        table.b_last_step[:n] = number
        done = np.flatnonzero(table.b_outputs[:n] + table.b_pending[:n] >= table.b_max_new[:n])
        for i in prefilling.tolist():
            self._after_computed(seqs[i], number)
        for i in done.tolist():
            self._retire(seqs[i])

    def _launched_mixed(
        self,
        step: ScheduledStep,
        drawn: list[Sequence],
        number: int,
        b_row: np.ndarray,
        d_row: np.ndarray,
    ) -> None:
        """``launched`` for any other step whose rows are all in the table (``b_row``: the
        step's rows, ``d_row``: the drawn ones'): the counts by array ops, as in
        ``_launched_decode``; ``_after_computed`` only for the rows still in their prompt or
        bringing a chunk (a decoding row past its prompt has nothing left to cache, claim or
        release), in step order, then the drawn rows whose pending token is their last retire,
        in draw order (the order of the one-by-one path)."""
        table, seqs = self.rows, step.seqs
        b_new = np.asarray(step.num_new, dtype=np.int64)
        before = table.b_computed[b_row]
        table.b_computed[b_row] = before + b_new
        look = np.flatnonzero((before < table.b_prompt_len[b_row]) | (b_new > 1))
        table.b_pending[d_row] += 1
        table.b_last_row[d_row] = np.arange(d_row.size)
        table.b_last_step[d_row] = number
        done = table.b_outputs[d_row] + table.b_pending[d_row] >= table.b_max_new[d_row]
        for i in look.tolist():
            self._after_computed(seqs[i], number)
        for i in np.flatnonzero(done).tolist():
            if drawn[i].status is Status.RUNNING:
                self._retire(drawn[i])

    def _pend(self, drawn: list[Sequence], number: int) -> None:
        """Each row of ``drawn`` has one more token pending (row ``row`` of step ``number``'s
        draw); a row whose pending token is its last leaves the running set now."""
        for row, seq in enumerate(drawn):
            seq.pending += 1
            seq.last_row, seq.last_step = row, number
            if seq.num_drawn >= seq.max_new_tokens and seq.status is Status.RUNNING:
                self._retire(seq)

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

    # -- 4. its tokens are read back ---------------------------------------------------------------

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

    # -- leaving: pages and adapters go back -------------------------------------------------------

    def finish(self, seq: Sequence) -> None:
        """A sequence is done and no step in flight uses it: pages and adapter go back."""
        self._leave(seq)
        seq.status = Status.FINISHED
        self._release([seq])

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
