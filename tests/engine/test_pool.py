"""The unified page pool: one free list, exhaustion with numbers, no double free."""

import numpy as np
import pytest
import torch

from slora_batch.engine.pool import PagePool, PoolExhausted


def test_alloc_free_roundtrip():
    pool = PagePool(10, page_size=4, num_layers=2)
    assert pool.data.shape == (2, 10, 4)
    a = pool.alloc(3)
    b = pool.alloc(5)
    assert a.tolist() == [0, 1, 2] and b.tolist() == [3, 4, 5, 6, 7]
    assert (pool.num_free, pool.num_used, pool.peak_used) == (2, 8, 8)
    pool.free(a)
    assert pool.free_pages().tolist() == [0, 1, 2, 8, 9]
    c = pool.alloc(4)
    assert sorted(c.tolist()) == [0, 1, 2, 8]
    assert pool.peak_used == 9
    pool.free(np.concatenate([b, c]))
    assert pool.num_free == 10


def test_exhaustion_carries_numbers_and_takes_nothing():
    pool = PagePool(8, page_size=2)
    pool.alloc(6)
    with pytest.raises(PoolExhausted) as err:
        pool.alloc(3, "row 7")
    assert (err.value.need, err.value.free, err.value.total) == (3, 2, 8)
    assert "need 3 pages, 2 free of 8" in str(err.value) and "row 7" in str(err.value)
    assert pool.num_free == 2


def test_double_free_raises():
    pool = PagePool(4, page_size=2)
    pages = pool.alloc(2)
    pool.free(pages)
    with pytest.raises(ValueError, match="double free"):
        pool.free(pages)
    with pytest.raises(ValueError):
        pool.free(np.array([3, 3]))


def test_random_churn_keeps_invariants():
    rng = np.random.default_rng(0)
    pool = PagePool(64, page_size=1)
    held = []
    for _ in range(500):
        if held and rng.random() < 0.5:
            pool.free(held.pop(rng.integers(len(held))))
        else:
            n = int(rng.integers(1, 8))
            if n <= pool.num_free:
                held.append(pool.alloc(n))
        in_use = np.concatenate(held) if held else np.zeros(0, dtype=np.int32)
        assert np.unique(in_use).size == in_use.size == pool.num_used


def test_layer_view_shares_storage():
    pool = PagePool(3, page_size=2, num_layers=2, dtype=torch.float16)
    pool.layer(1)[2] = 5
    assert pool.data[1, 2].tolist() == [5, 5] and pool.data.dtype == torch.float16
