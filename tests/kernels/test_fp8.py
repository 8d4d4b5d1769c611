"""The fp8 (e4m3) KV cache twins: quantize / dequantize error, and attention on fp8 pages
against attention on full-precision pages, on random data with pages at random."""

from __future__ import annotations

import pytest
import torch

from slora_kernels import fp8, ref
from slora_kernels.meta import AttnMeta

# e4m3: 3 mantissa bits, so a normal value rounds to within 2^-4 of itself (half an ulp,
# relative); below 2^-6 (subnormals) the step is 2^-9, half of it 2^-10, absolute.
HALF_ULP_REL, HALF_ULP_SUB = 2.0**-4, 2.0**-10


def test_quantize_error_within_half_ulp_times_scale():
    torch.manual_seed(0)
    rows = torch.randn(64, 4 * 16) * torch.logspace(-3, 2, 64)[:, None]
    rows[3] = 0.0  # an all-zero token: scale 1, exact zeros
    q, s = fp8.quantize(rows, kv_heads=4)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 4)
    back = fp8.dequantize(q, s)
    scaled = (rows.view(64, 4, 16) / s[..., None]).abs()
    bound = torch.maximum(scaled * HALF_ULP_REL, torch.full_like(scaled, HALF_ULP_SUB))
    err = (back - rows).view(64, 4, 16).abs() / s[..., None]
    assert (err <= bound * (1 + 1e-6)).all(), float((err / bound).max())
    assert (back[3] == 0).all()
    # each head's largest element maps to 448 exactly: the whole e4m3 range is used
    assert torch.allclose(scaled.amax(-1)[s != 1], torch.tensor(448.0))


def pools(num_pages: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    kv_dim = kv_heads * head_dim
    full = torch.zeros(num_pages, kv_dim, dtype=dtype)
    packed = torch.zeros(num_pages, kv_dim, dtype=dtype)  # same page size: K and V in e4m3
    scales = torch.ones(num_pages, 2 * kv_heads)
    return full, packed, scales


def case(seq_lens, new, kv_heads=2, head_dim=16, dtype=torch.float32, seed=0):
    """Random K/V written through kv_write into a full-precision pool (a K page and a V page
    per token) and an fp8 pool (one page per token, named twice), pages at random."""
    torch.manual_seed(seed)
    total = sum(seq_lens)
    full, packed, scales = pools(2 * total + 3, kv_heads, head_dim, dtype)
    kv_dim = kv_heads * head_dim
    k = torch.randn(total, kv_dim, dtype=dtype) * 2
    v = torch.randn(total, kv_dim, dtype=dtype)
    pages = torch.randperm(2 * total + 3)[: 2 * total].view(total, 2).int()
    one = pages[:, :1].repeat(1, 2).contiguous()  # fp8: one page, K and V side by side
    ref.kv_write(full, k, v, pages)
    ref.kv_write(packed, k, v, one, scales=scales)
    width = max(seq_lens)
    tables = [torch.full((len(seq_lens), width, 2), -1, dtype=torch.int32) for _ in range(2)]
    lo = 0
    for b, n in enumerate(seq_lens):
        tables[0][b, :n] = pages[lo : lo + n]
        tables[1][b, :n] = one[lo : lo + n]
        lo += n
    b1 = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    metas = [AttnMeta(b1, lens, t, max(new)) for t in tables]
    return (full, packed, scales), metas, (k, v)


def test_kv_write_fp8_round_trip_and_sentinel():
    (full, packed, scales), metas, (k, v) = case([5, 9], [5, 9])
    table = metas[1].page_table
    rows = torch.cat([table[0, :5], table[1, :9]])
    k8, v8 = ref.gather_kv(packed, rows, k.shape[1], scales)
    assert torch.allclose(k8, k, rtol=HALF_ULP_REL, atol=scales.max().item() * HALF_ULP_SUB)
    assert torch.allclose(v8, v, rtol=HALF_ULP_REL, atol=scales.max().item() * HALF_ULP_SUB)
    before = packed.clone(), scales.clone()
    ref.kv_write(packed, k[:2], v[:2], torch.full((2, 2), -1, dtype=torch.int32), scales=scales)
    assert torch.equal(packed, before[0]) and torch.equal(scales, before[1])


# Attention over fp8 K/V: each K and V element is off by at most 2^-4 relative (about 2^-6 on
# average), which moves logits of spread ~2 (|k| ~ 2, scale 0.25) by a few hundredths and the
# outputs (convex mixes of V rows, |V| ~ 1) by 0.01-0.03 on average, 0.15 at worst here; a
# broken scale or a V read from the K half moves them by O(1).
FP8_ATOL = {torch.float32: 0.2, torch.bfloat16: 0.2}
FP8_MEAN = 0.03


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (6, 0.0), (0, 30.0)])
def test_attention_fp8_close_to_full_precision(dtype, window, softcap):
    seq_lens, new = [7, 30, 13], [7, 4, 13]
    (full, packed, scales), metas, _ = case(seq_lens, new, kv_heads=2, dtype=dtype, seed=1)
    q = torch.randn(sum(new), 4, 16, dtype=dtype)
    kw = dict(window=window, softcap=softcap)
    want = ref.attention(q, full, metas[0], 2, 0.25, **kw).float()
    got = ref.attention(q, packed, metas[1], 2, 0.25, scales=scales, **kw).float()
    err = (got - want).abs()
    assert err.max() < FP8_ATOL[dtype], float(err.max())
    assert err.mean() < FP8_MEAN, float(err.mean())
    # the same pages read as the model dtype (no scales) are garbage: fp8 really is in use
    garbage = ref.attention(q, packed, metas[1], 2, 0.25, **kw).float()
    assert not torch.allclose(garbage, want, atol=0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_decode_fp8_matches_prefill_twin(dtype):
    seq_lens = [3, 17, 40, 1]
    (full, packed, scales), metas, _ = case(seq_lens, [1] * 4, dtype=dtype, seed=2)
    q = torch.randn(4, 4, 16, dtype=dtype)
    want = ref.attention_decode(q, full, metas[0], 2, 0.25).float()
    got = ref.attention_decode(q, packed, metas[1], 2, 0.25, scales=scales)
    assert (got.float() - want).abs().max() < FP8_ATOL[dtype]
    prefill = ref.attention(q, packed, metas[1], 2, 0.25, scales=scales)
    assert torch.allclose(
        got.float(), prefill.float(), atol=1e-2 if dtype != torch.float32 else 1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_decode_fp8_ignores_nan_bytes_past_a_sequence(dtype):
    """Keys past a sequence's length read the padding page (page 0 after the clamp); in a
    unified pool it may hold an adapter's weights, whose bytes read as e4m3 include NaN (0x7f).
    They must not reach the output: the H200's first fp8 run found the twin giving NaN there."""
    seq_lens = [3, 17, 40, 1]
    (_, packed, scales), metas, _ = case(seq_lens, [1] * 4, dtype=dtype, seed=3)
    q = torch.randn(4, 4, 16, dtype=dtype)
    want = ref.attention_decode(q, packed, metas[1], 2, 0.25, scales=scales)
    table = metas[1].page_table
    used = set(table[table >= 0].tolist())
    free = next(p for p in range(packed.shape[0]) if p not in used)
    fp8.bytes_view(packed)[free] = torch.tensor(0x7F, dtype=torch.uint8).view(fp8.FP8)
    padded = table.clone()
    padded[padded < 0] = free  # padding names a page full of NaN bytes
    meta = AttnMeta(metas[1].b1_start, metas[1].b_seq_len, padded, metas[1].max_new)
    got = ref.attention_decode(q, packed, meta, 2, 0.25, scales=scales)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got, want)


@pytest.mark.parametrize("window", [0, 6])
def test_attention_fp8_with_own_rows_reads_them_as_the_pages_hold_them(window):
    """``own``: the step's own keys come from its K/V rows rounded through e4m3 as kv_write
    rounds them: the rows kv_write wrote give the paged result exactly; other rows differ."""
    seq_lens, new = [7, 30, 13], [7, 4, 5]
    (_, packed, scales), metas, (k, v) = case(seq_lens, new, kv_heads=2, seed=4)
    starts = [0, *torch.tensor(seq_lens).cumsum(0).tolist()]
    ends = zip(starts, seq_lens, new, strict=False)  # starts: one more
    rows = torch.cat([torch.arange(s + c - n, s + c) for s, c, n in ends])
    q = torch.randn(sum(new), 4, 16)
    args = (q, packed, metas[1], 2, 0.25, window)
    paged = ref.attention(*args, scales=scales)
    assert torch.equal(ref.attention(*args, scales=scales, own=(k[rows], v[rows])), paged)
    other = ref.attention(*args, scales=scales, own=(k[rows] + 1, v[rows] - 1))
    assert not torch.allclose(other, paged, atol=1e-3)  # the own rows were read


def test_grouped_v_layout_holds_the_same_values_and_zeros_after_the_last_token():
    """kv_write with v_group 16: a sequence's 20 tokens in a prefill chunk of 13 then 7 decode
    rows (groups on pages 32..47 and 80..95), beside another sequence's 3 tokens (pages 0..2): K, V and the
    scales read back as the per-token layout stores them; V column c of slot i sits at byte c *
    16 + i of the group's run; the slots after a group's last token hold zeros from the step
    that starts the group, and a later step writes them without zeroing anything it wrote."""
    torch.manual_seed(3)
    kv_heads, kv_dim, group = 2, 32, 16
    pool = torch.randn(128, kv_dim, dtype=torch.bfloat16)  # 64-byte pages: K and V of a token
    flat = pool.clone()
    scales, flat_scales = torch.rand(128, 2 * kv_heads), torch.rand(128, 2 * kv_heads)
    k, v = torch.randn(23, kv_dim), torch.randn(23, kv_dim)
    pages = torch.tensor(list(range(32, 48)) + list(range(80, 84)) + [0, 1, 2], dtype=torch.int32)
    steps = [list(range(13)) + [20, 21, 22], *[[t] for t in range(13, 20)]]  # prefill, decode
    for step in steps:
        out = pages[step][:, None].repeat(1, 2).contiguous()
        ref.kv_write(pool, k[step], v[step], out, scales, v_group=group)
        ref.kv_write(flat, k[step], v[step], out, flat_scales)
        if step[0] == 0:  # after the chunk: its group's slots 13.., the other's 3.. are zeros
            data = fp8.bytes_view(pool)
            assert not data[fp8.v_locations(torch.arange(45, 48), kv_dim, group)].float().any()
            assert not data[fp8.v_locations(torch.arange(3, 16), kv_dim, group)].float().any()
    pairs = pages[:, None].repeat(1, 2)
    want = ref.gather_kv(flat, pairs, kv_dim, flat_scales)
    got = ref.gather_kv(pool, pairs, kv_dim, scales, v_group=group)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    data, flat_data = fp8.bytes_view(pool), fp8.bytes_view(flat)
    run = data[32:48, kv_dim:].reshape(-1)  # the first group's V run
    assert torch.equal(
        run.view(torch.uint8)[17 * 16 + 3], flat_data[35, kv_dim + 17].view(torch.uint8)
    )
    # the second group: 4 written slots, the rest zeros (the chunk did not start it)
    assert not data[fp8.v_locations(torch.arange(84, 96), kv_dim, group)].float().any()
