"""Prefix caching against transformers + PEFT: rows of one adapter share their prompt's cached
blocks, rows of other adapters (or of the base model) never do; the tokens stay PEFT's with the
cache on and off, after evictions and preemptions; idle blocks and idle adapters leave the pool
least recently used first."""

from __future__ import annotations

import random

import numpy as np
import pytest
from factory import make_adapters, make_model, reference

from slora_batch import Engine, EngineConfig, Request
from slora_batch.engine.pool import PagePool
from slora_batch.engine.scheduling.prefix_cache import PrefixCache

VOCAB = 300
KNOBS = dict(device="cpu", dtype="float32", cpu_threads=1, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    model_dir = make_model(root, "gqa")
    return model_dir, make_adapters(model_dir, root / "adapters")


def shared_prefix_rows(adapters: list[str], seed: int) -> list[dict]:
    """Per adapter (and the base model) one 40-token prefix, then rows of that prefix and a
    short suffix of their own; every prefix also appears once under another adapter."""
    rng = random.Random(seed)
    rows = []
    for a, adapter in enumerate([None, *adapters[:3]]):
        prefix = [rng.randrange(3, VOCAB) for _ in range(40)]
        for j in range(4):
            suffix = [rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 5, 12]))]
            rows.append(
                dict(
                    id=f"{a}-{j}",
                    adapter=adapter,
                    prompt_token_ids=prefix + suffix,
                    max_new_tokens=rng.choice([2, 6, 10]),
                )
            )
        other = adapters[(a + 3) % len(adapters)]  # the same prompt on another adapter
        rows.append(
            dict(id=f"{a}-x", adapter=other, prompt_token_ids=prefix + [7], max_new_tokens=4)
        )
    return rows


def generate(model_dir, adapters, rows, **knobs):
    engine = Engine(model_dir, adapters=adapters, config=EngineConfig(**{**KNOBS, **knobs}))
    results = {r.id: r for r in engine.generate(Request(**row) for row in rows)}
    assert not [r.error for r in results.values() if r.error]
    return {i: r.token_ids for i, r in results.items()}, engine


def test_shared_prefixes_hit_the_cache_and_keep_peft_tokens(tiny):
    model_dir, adapters = tiny
    rows = shared_prefix_rows(list(adapters), seed=2)
    expected = reference(model_dir, adapters, rows)
    on, engine = generate(model_dir, adapters, rows, num_pages=6000, max_num_seqs=2)
    off, _ = generate(model_dir, adapters, rows, num_pages=6000, prefix_caching=False)
    assert on == expected and off == expected
    # 4 groups of 4 rows share 2 full blocks (32 of 40 prefix tokens): the first row of each
    # group computes them, at most the 3 others hit; the rows on another adapter never do.
    hits = engine.counters.prefix_hit_tokens
    assert 0 < hits <= 4 * 3 * 32 and hits % 16 == 0
    assert engine.counters.cached_blocks > 0


def test_identical_prompts_on_two_adapters_share_nothing(tiny):
    model_dir, adapters = tiny
    names = list(adapters)
    prompt = list(range(10, 50))
    rows = [
        dict(id=i, adapter=adapter, prompt_token_ids=prompt, max_new_tokens=3)
        for i, adapter in enumerate([names[0], names[1], None])
    ]
    expected = reference(model_dir, adapters, rows)
    tokens, engine = generate(model_dir, adapters, rows, num_pages=4000, max_num_seqs=1)
    assert tokens == expected
    assert engine.counters.prefix_hit_tokens == 0
    again, engine = generate(
        model_dir, adapters, rows + [dict(rows[0], id=9)], num_pages=4000, max_num_seqs=1
    )
    assert again[9] == expected[0]
    assert engine.counters.prefix_hit_tokens == 32  # the same adapter: its 2 full blocks


def test_evictions_and_preemptions_keep_the_tokens(tiny):
    """A pool of 1400 pages holds the rank-64 adapter and a few rows: idle cached blocks and
    idle adapters are evicted for room, and the tokens stay PEFT's."""
    model_dir, adapters = tiny
    rows = shared_prefix_rows(list(adapters), seed=4)
    expected = reference(model_dir, adapters, rows)
    tokens, engine = generate(
        model_dir,
        adapters,
        rows,
        num_pages=1400,
        max_num_batched_tokens=48,
        max_adapters_per_batch=3,
    )
    assert tokens == expected
    counters = engine.counters
    assert counters.prefix_hit_tokens > 0
    assert counters.block_evictions > 0
    assert counters.adapter_evictions > 0


def test_idle_blocks_leave_leaves_first_least_recently_used_first():
    pool = PagePool(64, 4)
    cache = PrefixCache(pool, block_tokens=2)
    pages = pool.alloc(12).reshape(-1, 2)
    a = cache.insert(None, "x", [1, 2], pages[0:2])
    b = cache.insert(a, "x", [3, 4], pages[2:4])
    c = cache.insert(None, None, [1, 2], pages[4:6])  # the base model's: another key
    assert c is not None and cache.insert(None, "x", [1, 2], pages[4:6]) is None
    assert [blk.tokens for blk in cache.match("x", [1, 2, 3, 4, 5])] == [(1, 2), (3, 4)]
    assert [blk.tokens for blk in cache.match("y", [1, 2, 3, 4, 5])] == []
    assert len(cache.match("x", [1, 2, 3, 4])) == 1  # the last token is always computed
    cache.clock = 1
    cache.release([c])
    cache.clock = 2
    cache.release([a, b])
    assert cache.oldest_idle() is c
    cache.evict(c)
    assert cache.oldest_idle() is b  # a is older but b extends it
    free = pool.num_free
    cache.evict(b)
    cache.evict(a)
    assert pool.num_free == free + 8 and not cache.blocks
    np.testing.assert_array_equal(np.sort(pool.alloc(pool.num_free))[:4], np.arange(4))


def test_rows_waiting_for_a_prefix_being_computed_find_it_cached(tiny):
    """Rows that arrive together with one prefix: the first computes its blocks, the others
    wait a step and start past them (without waiting, all would compute it in one step)."""
    model_dir, adapters = tiny
    names = list(adapters)
    prefix = [(7 * j) % 290 + 3 for j in range(50)]  # 3 full blocks before the suffix
    rows = [
        dict(
            id=i, adapter=names[i % 2], prompt_token_ids=prefix + [10 + i, 20 + i], max_new_tokens=3
        )
        for i in range(8)
    ]
    expected = reference(model_dir, adapters, rows)
    tokens, engine = generate(
        model_dir, adapters, rows, num_pages=4000, max_num_batched_tokens=2048
    )
    assert tokens == expected
    # per adapter 4 rows: the first computes 3 blocks, the 3 others find them
    assert engine.counters.prefix_hit_tokens == 2 * 3 * 48
