"""A sequence's whole life in the engine: adapter slots under overlapped steps, abandoning
``generate``, and the pages and adapters every path gives back."""

from __future__ import annotations

import random

import pytest
from factory import gqa_with_adapters

from slora_batch import Engine, EngineConfig, Request

VOCAB = 300


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return gqa_with_adapters(tmp_path_factory.mktemp("lifecycle"), 6)


def rows(n: int, adapters: list[str], seed: int = 0) -> list[Request]:
    """Rows whose lengths differ, so that rows finish in every step and adapters change often."""
    rng = random.Random(seed)
    return [
        Request(
            id=i,
            adapter=adapters[rng.randrange(len(adapters))],
            prompt_token_ids=[rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 3, 6]))],
            max_new_tokens=rng.choice([1, 2, 3, 5]),
            ignore_eos=True,
        )
        for i in range(n)
    ]


def assert_idle(engine: Engine) -> None:
    """No row holds a page or pins an adapter: only idle resident adapters use pages."""
    sched, residency = engine.scheduler, engine.residency
    assert not sched.holds_pages() and not sched.waiting
    assert all(entry.refcount == 0 for entry in residency._resident.values())
    adapter_pages = sum(entry.pages.size for entry in residency._resident.values())
    assert engine.pool.num_used == adapter_pages


def test_adapter_cap_counts_rows_that_hold_slots_under_overlap(tiny):
    """Defect 5 (c06029c): with as many slots as the per-batch cap, rows retired at launch and
    rows held one more step keep their adapters pinned; counting only running rows, admission
    took a row whose adapter had no slot and the scheduler raised PoolExhausted."""
    model_dir, adapters = tiny
    config = EngineConfig(
        device="cpu", num_pages=4000, max_resident_adapters=2, max_adapters_per_batch=2,
        max_num_seqs=8, admit_batch=1, overlap=True,
    )  # fmt: skip
    engine = Engine(model_dir, adapters=adapters, config=config)
    requests = rows(60, sorted(adapters))
    results = {r.id: r for r in engine.generate(requests)}
    assert sorted(results) == list(range(60))
    assert all(r.finish_reason == "length" for r in results.values())
    assert all(r.completion_tokens == q.max_new_tokens for r, q in zip(
        (results[i] for i in range(60)), requests, strict=True))  # fmt: skip
    assert_idle(engine)


@pytest.mark.parametrize("how", ["break", "raise", "source raises", "close", "new generate"])
def test_abandoned_generate_releases_everything(tiny, how):
    """Defect 8 (c06029c): leaving ``generate`` early left rows, pages and pending tokens
    behind and the next ``generate`` failed. Now every way out gives everything back, and the
    next run's tokens equal a fresh engine's."""
    model_dir, adapters = tiny
    config = EngineConfig(device="cpu", num_pages=4000, max_num_seqs=6, admit_batch=1)
    engine = Engine(model_dir, adapters=adapters, config=config)
    requests = rows(30, sorted(adapters), seed=1)

    def source():
        yield from requests[:20]
        raise KeyError("the input failed")

    if how in ("raise", "source raises"):
        with pytest.raises(KeyError):
            for i, _ in enumerate(
                engine.generate(source() if how == "source raises" else requests)
            ):
                if i == 2:
                    raise KeyError("the consumer failed")
    else:
        iterator = engine.generate(requests)
        got = [next(iterator) for _ in range(3)]
        assert len(got) == 3 and engine.scheduler.holds_pages()
        if how == "break":
            del iterator  # what a for loop's break leaves behind
        elif how == "close":
            iterator.close()
        else:
            engine.generate([])  # starting again closes the abandoned iterator
    assert_idle(engine)
    again = {r.id: r.token_ids for r in engine.generate(requests)}
    fresh = Engine(model_dir, adapters=adapters, config=config)
    assert again == {r.id: r.token_ids for r in fresh.generate(requests)}
    assert_idle(engine)


def test_a_stop_string_finishes_the_row_at_the_step_that_completes_it(sample_model_dir):
    """Through the scheduler's read-back: a row whose output holds a stop string ends there,
    with ``stop`` and the text cut before it; the same row without stops runs to its length."""
    config = EngineConfig(device="cpu", num_pages=4000)
    engine = Engine(sample_model_dir, config=config)
    question = [{"role": "user", "content": "Name three colours, one per line."}]
    (free,) = engine.generate(
        [Request(id=0, messages=question, max_new_tokens=24, ignore_eos=True)]
    )
    assert free.finish_reason == "length" and len(free.text) > 12
    stop = free.text[6:9]
    cut = free.text.index(stop)
    (stopped,) = engine.generate(
        [Request(id=0, messages=question, max_new_tokens=24, ignore_eos=True, stop=[stop])]
    )
    assert stopped.finish_reason == "stop" and stopped.text == free.text[:cut]
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(free.token_ids)
    assert_idle(engine)


def test_an_engine_whose_step_raised_refuses_further_use(tiny):
    """A step that raised leaves no silently inconsistent engine: the next generate() says
    why it cannot run; a source that raises (the caller's error) leaves the engine usable."""
    model_dir, adapters = tiny
    config = EngineConfig(device="cpu", dtype="float32", num_pages=4000, cpu_threads=1)
    engine = Engine(model_dir, adapters=adapters, config=config)

    def bad_source():
        yield from rows(2, list(adapters))
        raise KeyError("unreadable row")

    with pytest.raises(KeyError, match="unreadable row"):
        list(engine.generate(bad_source()))
    assert len(list(engine.generate(rows(3, list(adapters))))) == 3  # still usable
    forward, calls = engine.runner.forward, []

    def broken(*args, **kwargs):  # the second step of the stream raises
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("device lost")
        return forward(*args, **kwargs)

    engine.runner.forward = broken
    with pytest.raises(ValueError, match="device lost"):
        list(engine.generate(rows(8, list(adapters))))
    step = f"its step {engine._steps} raised ValueError: device lost"
    with pytest.raises(RuntimeError, match=f"cannot be used again: {step}"):
        engine.generate(rows(3, list(adapters)))


def test_turn_phases_count_decode_turns_and_none_of_the_callers_time(tiny, monkeypatch):
    """The engine's host seconds per loop turn and phase (``counters.TURN_PHASES``, the bench's
    "host ms per decode turn"): every decode step's turn counted once, each phase marked, and
    the caller's time between results in no phase. The counters read a fake clock that moves
    1 ms a read, and 1000 s while the caller holds a result."""
    from types import SimpleNamespace

    from slora_batch.engine import counters as counters_module
    from slora_batch.engine.counters import TURN_PHASES

    clock = [0.0]

    def perf_counter() -> float:
        clock[0] += 1e-3
        return clock[0]

    monkeypatch.setattr(counters_module, "time", SimpleNamespace(perf_counter=perf_counter))
    model_dir, adapters = tiny
    config = EngineConfig(device="cpu", num_pages=4000, max_num_seqs=8, overlap=True)
    engine = Engine(model_dir, adapters=adapters, config=config)
    engine.counters.skip()
    requests = rows(40, sorted(adapters), seed=3)
    for _ in engine.generate(requests):
        clock[0] += 1000.0
    counters = engine.counters
    assert counters.decode_turns == counters.decode_steps > 0
    for phase in TURN_PHASES:
        seconds = getattr(counters, f"turn_{phase}_s")
        assert counters.decode_turns * 0.9e-3 <= seconds < 1000.0, (phase, seconds)
