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


def test_groups_hand_out_aligned_runs_and_return_when_wholly_freed():
    """fp8 KV pools allocate in aligned groups of 16: an adapter of 20 pages takes two groups
    (12 pages of slack counted as used), KV slots come as whole groups, and a group goes back
    to the free list when the last page handed out of it is freed, in whatever order."""
    pool = PagePool(70, page_size=8, num_layers=1)
    pool.use_fp8_kv(kv_heads=1, kv_dim=16)
    assert (pool.group, pool.num_free) == (16, 64)  # 70 pages: 4 whole groups
    adapter = pool.alloc(20, "adapter")
    assert adapter.tolist() == list(range(20)) and pool.num_used == 32
    kv = pool.kv_pages(pool.kv_slots(17))
    assert kv.shape == (32, 2) and (kv[:, 0] == kv[:, 1]).all()
    assert kv[0, 0] % 16 == 0 and (np.diff(kv[:, 0]) == 1).all()  # one aligned run
    assert pool.footprint(20) == 32 and pool.kv_slots(16) == 16 and pool.kv_slots(0) == 0
    with pytest.raises(PoolExhausted) as err:
        pool.alloc(1)
    assert (err.value.need, err.value.free) == (1, 0)
    pool.free(adapter[16:])  # the second group's 4 pages: it is free again
    assert pool.num_free == 16
    pool.free(adapter[:10])
    assert pool.num_free == 16  # 6 pages of the first group still out
    pool.free(adapter[10:16])
    assert pool.num_free == 32
    with pytest.raises(ValueError, match="double free"):
        pool.free(adapter[:1])
    pool.free(kv[:, 0])
    assert pool.num_free == 64 and pool.num_used == 0


def test_group_churn_keeps_invariants():
    rng = np.random.default_rng(1)
    pool = PagePool(160, page_size=8)
    pool.use_fp8_kv(kv_heads=1, kv_dim=16)
    held = []
    for _ in range(400):
        if held and rng.random() < 0.5:
            pool.free(held.pop(rng.integers(len(held))))
        else:
            n = int(rng.integers(1, 40))
            if pool.footprint(n) <= pool.num_free:
                held.append(pool.alloc(n))
        in_use = np.concatenate(held) if held else np.zeros(0, dtype=np.int32)
        groups = np.unique(in_use // 16)
        assert np.unique(in_use).size == in_use.size
        assert pool.num_used == groups.size * 16 == 160 - pool.num_free


def test_fp8_kv_widths_off_the_group_keep_v_per_token():
    """A kv_dim that is no multiple of 16 cannot hold V column-major in groups of 16: the pool
    stays page by page and the kernels get no group (v_group 0)."""
    pool = PagePool(40, page_size=16, num_layers=1)
    pool.use_fp8_kv(kv_heads=3, kv_dim=24)
    assert pool.group == 1 and pool.kv_args(0)["v_group"] == 0
    assert pool.kv_pages(3).tolist() == [[0, 0], [1, 1], [2, 2]]
    grouped = PagePool(40, page_size=16, num_layers=1)
    grouped.use_fp8_kv(kv_heads=2, kv_dim=32)
    assert grouped.group == 16 and grouped.kv_args(0)["v_group"] == 16
