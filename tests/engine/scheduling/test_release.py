"""Releasing the rows a step finishes together (``Scheduler._release`` of many, one
``PagePool.free``) against releasing them one by one: the same free list, cached blocks'
references and idle order, and adapter pins after every step."""

from __future__ import annotations

import random

import pytest
import torch
from test_scheduler import SPEC, FakeStore

from slora_batch.engine.adapters.residency import AdapterResidency
from slora_batch.engine.config import EngineConfig
from slora_batch.engine.pool import PagePool
from slora_batch.engine.requests.request import Request
from slora_batch.engine.requests.sequence import Sequence
from slora_batch.engine.scheduling.scheduler import Scheduler

EOS = 9


def state(sched, pool, residency):
    """What a release changes. The pool's free list in order (which pages go out next) and the
    adapters' reference counts have no public reader: the test reads them where they live."""
    cache = sched.cache
    return (
        pool._stack[: pool.num_free].tolist(),
        sorted((key, b.refs) for key, b in cache.blocks.items()),
        list(cache.idle),
        cache.idle_pages,
        dict(sched.pinned),
        sorted((name, e.refcount) for name, e in residency._resident.items()),
    )


def run(seed: int, num_pages: int, together: bool, monkeypatch) -> list:
    """A stream with one step in flight, as the engine runs it: step N launches, then step
    N-1's tokens come back (EOS at random)."""
    pool = PagePool(num_pages, SPEC.page_size, num_layers=1)
    residency = AdapterResidency(
        pool, FakeStore({"x": 2, "y": 3}), max_slots=8, device=torch.device("cpu")
    )
    config = EngineConfig(device="cpu", prefix_caching=True, prefix_block_tokens=4)
    sched = Scheduler(config, pool, residency, eos_token_ids=[EOS])
    if not together:  # the reference: every release goes through ``_release``, one row at a time
        one_by_one = sched._release
        monkeypatch.setattr(sched, "_release", lambda seqs: [one_by_one([s]) for s in seqs])
    rng = random.Random(seed)
    for i in range(40):
        prompt = [1 + i % 3] * 8 + [rng.randrange(8) for _ in range(rng.randrange(1, 10))]
        sched.add(
            Sequence(
                request=Request(id=i),
                order=i,
                adapter=("x", "y", None)[i % 3],
                prompt_ids=prompt,
                max_new_tokens=rng.randrange(1, 12),
                temperature=0.0,
                top_k=0,
                top_p=1.0,
                key=0,
                stop=[],
                ignore_eos=False,
            )
        )
    trace, inflight, number = [], None, 0
    while sched.has_work() or inflight is not None:
        step = sched.schedule() if sched.has_work() else None
        if step is not None and step.seqs:
            number += 1
            drawn = [
                s
                for s, n in zip(step.seqs, step.num_new, strict=True)
                if s.draws and s.num_computed + n == s.num_tokens
            ]
            sched.launched(step, drawn, number)
            current = (number, drawn)
        else:
            current = None
        if inflight is not None:
            done, drawn = inflight
            tokens = [EOS if rng.random() < 0.2 else 5 for _ in drawn]
            sched.postprocess(done, drawn, tokens)
            trace.append(state(sched, pool, residency))
        inflight = current
    return trace


@pytest.mark.parametrize("seed, num_pages", [(0, 600), (1, 600), (2, 200), (3, 160)])
def test_release_together_frees_what_one_by_one_frees(seed, num_pages, monkeypatch):
    together = run(seed, num_pages, True, monkeypatch)
    assert together == run(seed, num_pages, False, monkeypatch)
    assert len(together) > 5
