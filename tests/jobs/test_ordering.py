"""Window sort: every item exactly once, sorted within windows; fan-out."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from slora_batch.engine.requests.request import Request, Result
from slora_batch.jobs.ordering import adapter_group, fan_out, sort_key, sorted_windows


def make_requests(count: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    adapters = [None, "", "a", "b", "c"]
    return [
        Request(id=i, adapter=rng.choice(adapters), prompt="x" * rng.randint(1, 50))
        for i in range(count)
    ]


@pytest.mark.parametrize(("count", "window"), [(0, 4), (1, 4), (100, 7), (100, 100), (100, 1000)])
def test_every_item_once_and_sorted_within_windows(count, window):
    items = make_requests(count)
    pulled = 0

    def source():
        nonlocal pulled
        for item in items:
            pulled += 1
            yield item

    out = []
    for item in sorted_windows(source(), window=window):
        out.append(item)
        assert pulled - len(out) < window  # never more than one window held
    assert Counter(r.id for r in out) == Counter(r.id for r in items)
    for index, start in enumerate(range(0, count, window)):
        chunk = out[start : start + window]
        assert [r.id for r in chunk] != [] or count == 0
        assert {r.id for r in chunk} == {r.id for r in items[start : start + window]}
        # within an adapter's run by prompt; runs by adapter, every second window reversed
        groups = [adapter_group(r) for r in chunk]
        order = sorted(set(groups), key=lambda g: (g[0], g[1] is not None, g[1] or ""))
        if index % 2:
            order = order[:1] + order[1:][::-1] if order[0] == (0, None) else order[::-1]
        assert sorted(chunk, key=lambda r: (order.index(adapter_group(r)), sort_key(r))) == chunk


def test_sort_key_order():
    error = Result(id=9, adapter="b", text="", finish_reason="error", error="bad")
    items = [
        Request(id=1, adapter="b", prompt="xx"),
        error,
        Request(id=2, adapter=None, prompt="xyz"),
        Request(id=3, adapter="a", prompt="x"),
        Request(id=4, adapter="", messages=[{"role": "user", "content": "hi"}]),
        Request(id=5, adapter="a", prompt_token_ids=[1, 2, 3, 4]),
    ]
    assert [i.id for i in sorted_windows(items, window=10)] == [9, 4, 2, 3, 5, 1]


def test_rows_sharing_a_prefix_become_neighbours():
    system = "You are a careful translator. Translate to French: "
    items = [
        Request(id=1, adapter="a", prompt=system + "cat"),
        Request(id=2, adapter="a", prompt="Write a poem"),
        Request(id=3, adapter="a", prompt=system + "dog"),
        Request(id=4, adapter="a", prompt_token_ids=[5, 6, 9]),
        Request(id=5, adapter="a", prompt_token_ids=[5, 6, 7, 8]),
        Request(id=6, adapter="a", prompt="Write a song"),
    ]
    assert [i.id for i in sorted_windows(items, window=10)] == [2, 6, 1, 3, 5, 4]


def test_windows_alternate_adapter_order():
    """With one order in every window, adapter access is cyclic and an LRU smaller than a
    window's adapters never hits; alternate windows end and start with the same adapters."""
    adapters = ["a", "b", "c", "d"]
    items = [Request(id=i, adapter=adapters[(i * 7) % 4], prompt="x") for i in range(16)]
    items.insert(5, Result(id=99, adapter="c", text="", finish_reason="error", error="bad"))
    out = list(sorted_windows(items, window=8))
    runs = [
        a for a, _ in itertools.groupby(o.adapter if isinstance(o, Request) else "!" for o in out)
    ]
    assert runs == ["!", "a", "b", "c", "d", "c", "b", "a", "b"]  # windows 1, 2 share the d run


def test_sort_is_stable_for_equal_keys():
    items = [Request(id=i, adapter="a", prompt="same") for i in range(20)]
    assert [r.id for r in sorted_windows(items, window=8)] == list(range(20))


def test_bad_window():
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        list(sorted_windows([], window=0))


def test_fan_out_requests_and_errors():
    error = Result(id=2, adapter="x", text="", finish_reason="error", error="bad row")
    items = [Request(id=1, adapter="x", prompt="hi", max_new_tokens=3), error]
    out = list(fan_out(items, [None, "a"]))
    assert [(o.id, o.adapter) for o in out] == [(1, None), (1, "a"), (2, None), (2, "a")]
    assert all(o.max_new_tokens == 3 for o in out[:2])
    assert all(isinstance(o, Result) and o.error == "bad row" for o in out[2:])
    assert items[0].adapter == "x"  # inputs untouched
    with pytest.raises(ValueError, match="at least one adapter"):
        list(fan_out(items, []))


@pytest.mark.parametrize("seed", range(4))
def test_eval_jobs_fan_out_adapter_by_adapter(tmp_path, seed):
    """An eval job's items (``resume.adapter_major``): each (row, adapter) not done exactly
    once, as the windowed fan-out yields them, but adapter by adapter in ``sort_key``'s order
    (base first), each adapter's rows sorted by prompt: every adapter's rows run together."""
    import json
    from types import SimpleNamespace

    from slora_batch.jobs.config import JobConfig
    from slora_batch.jobs.eval_keys import EvalConfig
    from slora_batch.jobs.resume import pending_items
    from slora_batch.jobs.rows import row_key
    from slora_batch.jobs.samples import DoneSamples
    from slora_batch.jobs.scan import InputScan

    rng = random.Random(seed)
    rows = [{"id": f"r{i}", "prompt_token_ids": [rng.randint(1, 9) for _ in range(rng.randint(1, 4))],
             "continuation_token_ids": [rng.randint(1, 9)]} for i in range(rng.randint(1, 30))]  # fmt: skip
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sweep = rng.sample([None, "b", "a", "c", "z1"], rng.randint(1, 5))
    adapters = {a: str(tmp_path / a) for a in sweep if a}
    done = DoneSamples()
    for row in rows:
        for adapter in sweep:
            if rng.random() < 0.3:
                done.add(row_key(row["id"], adapter), 0, rng.random() < 0.2)

    def items(eval_job: bool) -> list:
        job = JobConfig(name="t", model="m", adapters=adapters or None, input=str(tmp_path),
                        output=str(tmp_path / "out"), fanout=list(sweep),
                        eval=EvalConfig(tasks=["t"]) if eval_job else None)  # fmt: skip
        plan = SimpleNamespace(job=job, sweep=list(sweep), files=[tmp_path / "in.jsonl"],
                               input_fs=None, openai=None)  # fmt: skip
        return [item for item, _ in pending_items(plan, InputScan(), done)]

    ours, theirs = items(True), items(False)
    pairs = [(r.id, r.adapter) for r in ours]
    assert Counter(pairs) == Counter((r.id, r.adapter) for r in theirs)
    assert len(set(pairs)) == len(pairs)
    assert not any(done.bits.get(row_key(i, a)) for i, a in pairs)
    assert [sort_key(r) for r in ours] == sorted(sort_key(r) for r in ours)
    assert all(r.continuation_token_ids for r in ours)
