"""FP8 adapter rows (``slora_kernels.lora_fp8``): the row quantization, the page layout, and the
torch twins' LoRA on e4m3 rows (``LoraMeta.fp8_rows``) against the same math on the
dequantized rows, in fp32. The case builder is shared with the Triton tests
(test_fp8_adapters_interpret.py, test_fp8_adapters_gpu.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from slora_kernels import lora_fp8, ref
from slora_kernels.meta import LoraMeta

DIMS = {"q": (64, 64), "k": (64, 32), "down": (96, 64)}  # rows of 1 to 3 pages of 32 bytes


@dataclass
class Fp8Case:
    """A pool of fp8 adapters, the step's metadata, and each slot's rows before quantization:
    rows[slot][target index] = (A [rank, d_in], B^T [rank, d_out]) fp32."""

    pool: torch.Tensor
    meta: LoraMeta
    rows: list[dict[int, tuple[torch.Tensor, torch.Tensor]]]
    dims: dict[str, tuple[int, int]]


def row_magnitudes(rank: int, gen: torch.Generator) -> torch.Tensor:
    """A factor's rows scaled by 10^u, u in [-2, 1): the per row scales matter."""
    return 10.0 ** (torch.rand(rank, 1, generator=gen) * 3 - 2)


def slot_block(rows, ranks, dims, page, dtype, gen, bias: bool):
    """One adapter's pages [n, page] (model dtype) as ``store.to_pages`` lays them out with fp8
    rows: per target its A scales and rows, its B^T scales and rows, then (``bias``) one bias
    row of d_out in the model dtype. Returns (pages, offsets {t: (A, B^T)}, vectors {t: start})."""
    k = lora_fp8.sub_pages(dtype)
    blocks, offsets, vectors, used = [], {}, {}, 0
    for t, (a, b_t) in rows.items():
        starts = []
        for factor in (a, b_t):
            rank, width = factor.shape
            count = lora_fp8.scale_pages(rank, page, k)
            block = torch.zeros(1, lora_fp8.factor_pages(rank, width, page, k), page, dtype=dtype)
            lora_fp8.write_factor(block, count, [factor], rank, width)
            blocks.append(block[0])
            starts.append(used + count)
            used += block.shape[1]
        offsets[t] = tuple(starts)
        if bias:
            d_out = b_t.shape[1]
            row = torch.zeros(-(-d_out // page) * page)
            row[:d_out] = torch.randn(d_out, generator=gen)
            blocks.append(row.view(-1, page).to(dtype))
            vectors[t] = used
            used += blocks[-1].shape[0]
    return torch.cat(blocks), offsets, vectors


def fp8_case(
    *,
    ranks: list[int],
    num_tokens: int,
    dtype: torch.dtype,
    seed: int,
    page: int = 32,
    dims: dict[str, tuple[int, int]] = DIMS,
    base_share: float = 0.2,
    bias_slots: tuple[int, ...] = (),
    device: str | torch.device = "cpu",
) -> Fp8Case:
    """One fp8 adapter per rank (plus an empty slot), adapters after the first lacking random
    targets, their pages at random places in a pool whose other pages hold noise (as e4m3
    bytes, NaN among them: a kernel reading a page it should not fails), ``bias_slots`` with
    a lora_B bias row per target (model dtype). Every adapter has a token."""
    gen = torch.Generator().manual_seed(seed)
    targets = list(dims)
    slots = len(ranks) + 1
    all_rows, blocks, offsets, vectors = [], [], [], []
    for slot, rank in enumerate(ranks):
        keep = (torch.rand(len(targets), generator=gen) < 0.7).tolist()
        keep[0] = True
        rows = {}
        for t, (d_in, d_out) in enumerate(dims.values()):
            if keep[t] or slot == 0:
                a = torch.randn(rank, d_in, generator=gen) * d_in**-0.5
                b_t = torch.randn(rank, d_out, generator=gen) * rank**-0.5
                rows[t] = (a * row_magnitudes(rank, gen), b_t * row_magnitudes(rank, gen))
        block, where, vector = slot_block(rows, ranks, dims, page, dtype, gen, slot in bias_slots)
        all_rows.append(rows)
        blocks.append(block)
        offsets.append(where)
        vectors.append(vector)
    sizes = [b.shape[0] for b in blocks]
    num_pages = sum(sizes) + 13
    pool = torch.randn(num_pages, page, generator=gen).to(dtype)
    perm = torch.randperm(num_pages, generator=gen)
    slot_pages = torch.full((slots, max(sizes)), -1, dtype=torch.int32)
    slot_offsets = torch.full((slots, len(targets), 2), -1, dtype=torch.int32)
    slot_vectors = torch.full((slots, len(targets), 2), -1, dtype=torch.int32)
    cursor = 0
    for slot, block in enumerate(blocks):
        pages = perm[cursor : cursor + block.shape[0]]
        cursor += block.shape[0]
        pool[pages] = block
        slot_pages[slot, : pages.numel()] = pages.int()
        for t, where in offsets[slot].items():
            slot_offsets[slot, t] = torch.tensor(where)
        for t, start in vectors[slot].items():
            slot_vectors[slot, t, 0] = start
    b_slot = torch.randint(0, len(ranks), (num_tokens,), generator=gen)
    b_slot[torch.rand(num_tokens, generator=gen) < base_share] = -1
    b_slot[: len(ranks)] = torch.arange(len(ranks))
    meta = LoraMeta(
        b_slot=b_slot.int(),
        token_order=torch.zeros(0, dtype=torch.int32),
        seg1_start=torch.zeros(1, dtype=torch.int32),
        seg_slot=torch.zeros(0, dtype=torch.int32),
        slot_rank=torch.tensor(ranks + [0], dtype=torch.int32),
        slot_scale=torch.rand(slots, generator=gen) * 2 + 0.5,
        slot_pages=slot_pages,
        slot_offsets=slot_offsets,
        max_rank=max(ranks),
        slot_vectors=slot_vectors,
        has_vectors=bool(bias_slots),
        fp8_rows=True,
    )
    segment(meta)
    meta = to_device(meta, device)
    return Fp8Case(pool.to(device), meta, all_rows, dims)


def segment(meta: LoraMeta) -> None:
    """The step's segments over ``meta.b_slot``: sorted by slot, base tokens last."""
    b_slot = meta.b_slot.long()
    key = torch.where(b_slot < 0, torch.iinfo(torch.int64).max, b_slot)
    order = torch.sort(key, stable=True).indices
    used = b_slot[order][b_slot[order] >= 0]
    seg_slot, counts = torch.unique_consecutive(used, return_counts=True)
    meta.token_order = order.int()
    meta.seg1_start = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).int()
    meta.seg_slot = seg_slot.int()


def to_device(meta: LoraMeta, device) -> LoraMeta:
    for name, value in vars(meta).items():
        if isinstance(value, torch.Tensor):
            setattr(meta, name, value.to(device))
    return meta


# ----------------------------------------------------------------------------- quantization


def test_quantize_rows_bounds_each_rows_error_by_its_own_scale():
    """e4m3 keeps 3 mantissa bits: each element within 2^-4 of itself (relative) or, near zero,
    within the row's smallest step (2^-9 of the scale); the row's amax maps to 448 exactly."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 40, generator=gen) * row_magnitudes(6, gen)
    rows[2] = 0.0
    q, s = lora_fp8.quantize_rows(rows)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (6,)
    assert s[2] == 1.0 and (q[2].float() == 0).all()
    back = lora_fp8.dequantize_rows(q, s)
    error = (back - rows).abs()
    assert (error <= rows.abs() * 2**-4 + s[:, None] * 2**-9).all()
    assert torch.equal(q.float().abs().amax(-1)[[0, 1, 3, 4, 5]], torch.full((5,), 448.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("rank", "width"), [(1, 8), (20, 96), (64, 200)])
def test_write_factor_and_gather_rows_round_trip(dtype, rank, width):
    """A factor written into pages reads back as its fp8 round trip, wherever its pages are:
    rank rows of ceil(width / page_size) sub-pages, k = element bytes a page, after
    ceil(rank / (k * page_size / 4)) scale pages."""
    gen = torch.Generator().manual_seed(rank)
    page = 32
    k = lora_fp8.sub_pages(dtype)
    layers = [torch.randn(rank, width, generator=gen), torch.randn(rank // 2, width, generator=gen)]
    count = lora_fp8.scale_pages(rank, page, k)
    n = lora_fp8.factor_pages(rank, width, page, k)
    assert count == -(-rank // (k * page // 4))
    assert n == count + -(-rank * -(-width // page) // k)
    block = torch.full((2, n, page), float("nan"), dtype=dtype)  # every page written
    lora_fp8.write_factor(block, count, layers, rank, width)
    pool = torch.randn(2, n + 5, page).to(dtype)
    pages = torch.randperm(n + 5, generator=gen)[:n]
    pool[:, pages] = block
    for layer, rows in enumerate(layers):
        got = lora_fp8.gather_rows(pool[layer], pages.int(), count, rank, width)
        expected = torch.zeros(rank, width)
        expected[: rows.shape[0]] = lora_fp8.round_trip(rows)
        assert torch.equal(got, expected)


# ------------------------------------------------------------------- the twins on fp8 rows


def expected_lora(case: Fp8Case, x: torch.Tensor, v: torch.Tensor, out: torch.Tensor, t: int):
    """shrink and expand of target t by hand on the round-tripped rows (fp32)."""
    meta = case.meta
    shrunk, added = torch.zeros_like(v), out.float().clone()
    for token, slot in enumerate(meta.b_slot.tolist()):
        if slot < 0 or t not in case.rows[slot]:
            continue
        a, b_t = (lora_fp8.round_trip(f) for f in case.rows[slot][t])
        shrunk[token, : a.shape[0]] = x[token].float() @ a.T
        delta = v[token, : b_t.shape[0]] @ b_t
        bias_at = int(meta.slot_vectors[slot, t, 0])
        if bias_at >= 0:
            d_out = b_t.shape[1]
            page = meta.slot_pages[slot, bias_at : bias_at + -(-d_out // case.pool.shape[1])]
            delta = delta + case.pool[page.long()].reshape(-1)[:d_out].float()
        added[token] += delta * float(meta.slot_scale[slot])
    return shrunk, added


def test_twins_on_fp8_rows_compute_lora_on_the_dequantized_rows():
    """``ref.lora_shrink`` and ``ref.lora_expand`` with ``fp8_rows`` equal x (s q_A)^T and
    v (s q_B^T) with a bias row in the model dtype, at ranks 1 to 64, rows of 1 to 3 pages."""
    case = fp8_case(ranks=[1, 3, 8, 16, 64], num_tokens=12, dtype=torch.float32, seed=3,
                    page=16, bias_slots=(1,))  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    rank = case.meta.max_rank
    for t, (d_in, d_out) in enumerate(case.dims.values()):
        x = torch.randn(12, d_in, generator=gen)
        v = torch.randn(12, rank, generator=gen)
        out = torch.randn(12, d_out, generator=gen)
        shrunk, added = expected_lora(case, x, v, out, t)
        mine = torch.zeros(12, rank)
        ref.lora_shrink(x, case.pool, case.meta, t, mine)
        torch.testing.assert_close(mine, shrunk, rtol=1e-5, atol=1e-6)
        ref.lora_expand(v, case.pool, case.meta, t, out)
        torch.testing.assert_close(out, added, rtol=1e-5, atol=1e-5)
