"""Scheduler and adapter residency on a fake adapter store: no model, no weights on disk."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from factory import tiny_spec

from slora_batch.engine.adapters.residency import AdapterResidency
from slora_batch.engine.adapters.store import AdapterInfo, AdapterWeights, to_pages
from slora_batch.engine.config import EngineConfig
from slora_batch.engine.models.spec import ModelSpec
from slora_batch.engine.pool import PagePool, PoolExhausted
from slora_batch.engine.requests.request import Request
from slora_batch.engine.requests.sequence import Sequence
from slora_batch.engine.scheduling.scheduler import Scheduler

SPEC = tiny_spec(
    path="fake",
    vocab_size=10,
    hidden_size=8,
    intermediate_size=8,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    eos_token_ids=(),
    bos_token_id=None,
)
# page_size = kv_dim = 4; a q-only adapter of rank r takes r * (8/4 + 8/4) = 4r pages.


@dataclass
class FakeStore:
    ranks: dict[str, int]
    spec: ModelSpec = SPEC
    fp8: bool = False  # adapter rows in the model dtype (``AdapterStore.fp8``)

    @property
    def names(self):
        return sorted(self.ranks)

    def __contains__(self, name):
        return name in self.ranks

    def info(self, name):
        return AdapterInfo(name, None, self.ranks[name], 1.0, False, ("q",))

    def pages(self, name):
        return SPEC.adapter_pages(self.ranks[name], ("q",))

    def ready(self, name):
        return True

    def paged(self, name):
        r = self.ranks[name]
        weights = AdapterWeights(
            a={"q": torch.full((1, r, 8), float(r))}, b_t={"q": torch.ones(1, r, 8)}
        )
        return to_pages(self.info(name), weights, SPEC.page_size, torch.float32)


def make(num_pages, ranks=None, **knobs):
    pool = PagePool(num_pages, SPEC.page_size, num_layers=1)
    residency = AdapterResidency(
        pool, FakeStore(ranks or {}), max_slots=knobs.pop("slots", 8), device=torch.device("cpu")
    )
    return Scheduler(EngineConfig(device="cpu", **knobs), pool, residency), pool, residency


_order = iter(range(10**6))


def seq(prompt_len, adapter=None, max_new=4):
    return Sequence(
        request=Request(id=next(_order)),
        order=0,
        adapter=adapter,
        prompt_ids=[1] * prompt_len,
        max_new_tokens=max_new,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        key=0,
        stop=[],
        ignore_eos=False,
    )


def tokens_of(step):
    """Each row of a step -> its new tokens. A decode step lists its rows in the row table's
    order (``RowTable``), which a finished row reshuffles; what runs is what tests compare."""
    return dict(zip(step.seqs, step.num_new, strict=True))


def advance(sched):
    """Pretend the model ran the step: K/V computed, a token drawn where a chunk ends a row."""
    step = sched.schedule()
    for s, n in zip(step.seqs, step.num_new, strict=True):
        s.num_computed += n
        if s.num_computed == s.num_tokens:
            s.output_ids = [*s.output_ids, 7]  # seated: the row holds its outputs
            if len(s.output_ids) >= s.max_new_tokens:
                sched.finish(s)
    return step


def test_chunked_prefill_under_token_budget_mixed_with_decode():
    sched, pool, _ = make(1000, max_num_batched_tokens=32)
    a, b = seq(10, max_new=5), seq(70)
    sched.add(a)
    sched.add(b)
    assert advance(sched).num_new == [10, 22]
    assert advance(sched).num_new == [1, 31]  # a decodes while b's prefill goes on
    assert advance(sched).num_new == [1, 17]
    assert b.num_computed == 70 and len(b.output_ids) == 1
    assert pool.num_used == 2 * (a.num_computed + b.num_computed)


def test_admission_counts_adapter_pages():
    sched, pool, residency = make(90, {"x": 10, "y": 10})  # 40 adapter pages each
    first, second = seq(10, "x", max_new=2), seq(10, "y", max_new=2)
    sched.add(first)
    sched.add(second)
    step = advance(sched)
    assert step.seqs == [first]  # 20 KV + 40 adapter pages; y would need 60 of the 30 left
    assert pool.num_used == 60 and residency.is_resident("x") and not residency.is_resident("y")
    advance(sched)  # first finishes, x goes idle but stays resident
    assert residency.is_resident("x") and pool.num_used == 40
    step = advance(sched)
    assert step.seqs == [second]  # x was evicted to make room
    assert (residency.loads, residency.evictions) == (2, 1)


def test_preemption_takes_latest_arrival_and_recomputes():
    sched, pool, _ = make(24)
    older, newer = seq(5, max_new=6), seq(5, max_new=6)
    sched.add(older)
    sched.add(newer)
    advance(sched)  # 20 pages used
    advance(sched)  # 24 used
    step = advance(sched)  # both need 2 more pages: newer is preempted
    assert step.seqs == [older] and sched.preemptions == 1
    assert newer in sched.waiting and newer.num_computed == 0 and len(newer.output_ids) == 2
    while sched.has_work():
        advance(sched)
    assert len(older.output_ids) == len(newer.output_ids) == 6
    assert pool.num_used == 0


def test_clustering_caps_distinct_adapters_and_prefers_resident():
    sched, _, residency = make(1000, {"x": 1, "y": 1, "z": 1}, max_adapters_per_batch=1)
    rows = [seq(3, "x", 50), seq(3, "y", 50), seq(3, "x", 50), seq(3, None, 50)]
    for r in rows:
        sched.add(r)
    step = advance(sched)
    assert sorted(map(str, (s.adapter for s in step.seqs))) == ["None", "x", "x"]
    assert not residency.is_resident("y")


def test_prefers_resident_adapter_over_arrival_order():
    sched, _, residency = make(1000, {"x": 1, "y": 1})
    warm = seq(2, "y", max_new=1)
    sched.add(warm)
    advance(sched)  # y resident, idle
    sched.add(seq(2, "x"))
    sched.add(seq(2, "y"))
    sched.config.max_num_seqs = 1
    assert [s.adapter for s in advance(sched).seqs] == ["y"]
    assert residency.is_resident("y") and not residency.is_resident("x")


def test_residency_writes_rows_into_pages_and_evicts_lru():
    sched, pool, residency = make(40, {"a": 2, "b": 3, "c": 2})  # 8, 12, 8 pages
    for name in ("a", "b", "c"):
        residency.acquire(name)
        residency.release(name)
    slot = residency.slot("b")
    pages = residency.slot_pages[slot, :12]
    start = residency.slot_offsets[slot, 0, 0]
    assert start == 0 and residency.slot_offsets[slot, 1, 0] == -1  # only q is targeted
    # A rows of b are rows of 8 = 2 pages each, all filled with 3.0
    assert torch.all(pool.data[0, torch.from_numpy(pages[:6]).long()] == 3.0)
    residency.acquire("a")  # a becomes most recently used
    assert residency.make_room(pool.num_free + 20)  # evicts b (12) then c (8); a is pinned
    assert (
        residency.is_resident("a")
        and not residency.is_resident("b")
        and not residency.is_resident("c")
    )
    assert residency.evictions == 2
    pool.alloc(pool.num_free)  # KV takes every free page; a is pinned, nothing is idle
    with pytest.raises(PoolExhausted, match="need 12 pages, 0 free of 40"):
        residency.acquire("b")


def test_newcomers_wait_for_admit_batch_seats():
    """A full running batch takes newcomers only once admit_batch seats are free: the steps in
    between are pure decode steps (CUDA-graph replays on the GPU)."""
    sched, _, _ = make(10_000, max_num_seqs=4, admit_batch=2)
    rows = [seq(3, max_new=n) for n in (2, 3, 9, 9)] + [seq(3, max_new=5) for _ in range(3)]
    for row in rows:
        sched.add(row)
    assert advance(sched).seqs == rows[:4]  # an empty batch admits at once
    advance(sched)  # rows[0] finishes: one seat free, two wanted
    step = advance(sched)
    assert tokens_of(step) == dict.fromkeys(rows[1:4], 1)  # decode only
    assert rows[1] not in sched.running  # rows[1] done
    step = advance(sched)
    assert tokens_of(step) == dict(zip(rows[2:6], [1, 1, 3, 3], strict=True))  # two join together
    while len(sched.running) > 2:
        advance(sched)
    step = advance(sched)
    assert rows[6] in step.seqs  # the last waiting one joins alone: every waiting one fits


def test_newcomers_wait_for_admit_batch_rows_the_adapter_cap_lets_in():
    """With the adapter cap full and seats to spare (many adapters, max_num_seqs large), free
    seats alone would admit each freed adapter's row in a mixed step of its own; newcomers wait
    until admit_batch of them can join, then join in one step."""
    ranks = {name: 1 for name in "abcd"}
    sched, _, _ = make(10_000, ranks, max_num_seqs=8, admit_batch=2, max_adapters_per_batch=2)
    base = seq(3, max_new=30)  # the base model: keeps the batch running, needs no adapter slot
    a, b = seq(3, "a", max_new=2), seq(3, "b", max_new=4)
    c, d = seq(3, "c", max_new=5), seq(3, "d", max_new=5)
    for row in (base, a, b, c, d):
        sched.add(row)
    joined = []  # per step, the rows starting their prefill
    while c.num_computed == 0 or d.num_computed == 0:
        fresh = [s for s in sched.waiting if s.num_computed == 0]
        step = advance(sched)
        joined.append([s for s in step.seqs if s in fresh])
    assert joined[0] == [base, a, b]  # an empty batch admits at once; the cap stops c and d
    assert joined[1:] == [[]] * (len(joined) - 2) + [[c, d]]  # a's slot alone did not let c in


def test_rows_of_running_adapters_join_under_a_full_adapter_cap():
    sched, _, _ = make(10_000, {"x": 1}, max_num_seqs=4, admit_batch=2, max_adapters_per_batch=1)
    rows = [seq(3, "x", max_new=n) for n in (2, 3, 9, 9)] + [seq(3, "x", 5) for _ in range(2)]
    for row in rows:
        sched.add(row)
    assert advance(sched).seqs == rows[:4]
    advance(sched)  # rows[0] finishes: one seat free, two wanted
    advance(sched)  # rows[1] finishes
    step = advance(sched)
    assert tokens_of(step) == dict(
        zip(rows[2:6], [1, 1, 3, 3], strict=True)
    )  # x is pinned: no new slot


def test_admit_batch_default_and_range():
    assert EngineConfig(max_num_seqs=256).admit_seats == 16
    assert EngineConfig(max_num_seqs=8).admit_seats == 1
    assert EngineConfig(max_num_seqs=8, admit_batch=3).admit_seats == 3
    with pytest.raises(ValueError, match="admit_batch"):
        EngineConfig(max_num_seqs=8, admit_batch=9)


@pytest.mark.parametrize("num_pages", [400, 90, 70])
def test_decode_fast_path_matches_growing_one_by_one(num_pages, monkeypatch):
    """The one-allocation decode path schedules the same steps, with as many pages per sequence,
    the same evictions and the same preemptions, as growing each sequence alone: with room to
    spare (400 pages), with preemptions and an idle adapter evicted (90), with preemptions
    (70)."""

    def run(fast: bool):
        sched, pool, residency = make(num_pages, {"x": 2, "y": 3}, admit_batch=2)
        if not fast:  # the reference: no public switch turns the one-allocation path off
            monkeypatch.setattr(sched, "_grow_decodes", lambda step, budget: 0)
        seqs = [seq(3 + i % 4, ("x", "y", None)[i % 3], max_new=3 + i % 5) for i in range(9)]
        for s in seqs:
            sched.add(s)
        trace = []
        while sched.has_work():
            step = advance(sched)
            rows = sorted((seqs.index(s), n) for s, n in tokens_of(step).items())
            trace.append((rows, [s.num_paged for s in seqs], pool.num_free))
        return trace, sched.preemptions, residency.evictions

    fast, slow = run(True), run(False)
    assert fast == slow
    if num_pages == 70:
        assert fast[1] > 0  # the fallback (preemption) was exercised
    if num_pages == 90:
        assert fast[1] > 0 and fast[2] > 0


def test_sequences_are_equal_only_to_themselves():
    """Two rows with the same fields are two rows: the scheduler's list removals take the one
    named, and comparing never walks a row's fields (it compares identities)."""
    sched, _, _ = make(1000)
    a = seq(3, max_new=2)
    b = replace(a)
    assert a != b and len({a, b}) == 2
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(b)
    assert sched.running == [a] and sched.running[0] is a
