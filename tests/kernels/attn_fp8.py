"""FP8 KV pages for the attention kernel tests (interpreter and GPU): a case builder and the
check against the torch twins, shared by tests/kernels/test_kernels_interpret.py and
tests/kernels/test_attention_fp8_gpu.py."""

from __future__ import annotations

import torch
from test_kernels_interpret import assert_close, attn_case

from slora_kernels import fp8, ref
from slora_kernels.meta import AttnMeta

# K twice and V half the size of attn_case's randn rows: their per token and head scales
# differ by about 4x, so a kernel that reads V's scale for K (or K's bytes for V) fails.
K_GAIN, V_GAIN = 2.0, 0.5


def fp8_attn_case(
    *,
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int,
    **kw,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttnMeta]:
    """(q, pool, scales, meta): ``attn_case``'s sequences with each token's K and V quantized
    by the twin's kv_write into one page (K's random page of attn_case, named twice in the page
    table). The rest of every page and the scales of unwritten pages hold noise, so a kernel
    reading past a token's 2 * kv_dim bytes, or another page's scale, fails."""
    q, full, meta = attn_case(seqs=seqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, dtype=dtype, device=device, seed=seed,
                              **kw)  # fmt: skip
    kv_dim = num_kv_heads * head_dim
    gen = torch.Generator(device).manual_seed(seed + 100)
    pool = torch.randn(full.shape, generator=gen, device=device).to(dtype)
    scales = torch.rand(full.shape[0], 2 * num_kv_heads, generator=gen, device=device) * 5
    table = meta.page_table
    pages = table[table[..., 0] >= 0]  # [tokens, 2]: (K page, V page) of attn_case
    k = full[pages[:, 0].long(), :kv_dim] * K_GAIN
    v = full[pages[:, 1].long(), :kv_dim] * V_GAIN
    one = pages[:, :1].repeat(1, 2).contiguous()  # K and V side by side in the K page
    ref.kv_write(pool, k, v, one, scales=scales)
    packed = torch.where(table >= 0, table[..., :1].expand_as(table), table).contiguous()
    meta = AttnMeta(meta.b1_start, meta.b_seq_len, packed, meta.max_new)
    return q, pool, scales, meta


def check_fp8(mine, q, pool, scales, meta, kv_heads, scale, window, softcap, dtype, fn) -> None:
    """``mine`` against the twin ``fn`` on the fp8 pages, at the dtype's usual tolerance; the
    twin reading the pages without scales differs from it, so the scales must be honoured."""
    expected = fn(q, pool, meta, kv_heads, scale, window, softcap, scales=scales)
    assert_close(mine, expected, dtype)
    ones = torch.ones_like(scales)
    assert not torch.allclose(fn(q, pool, meta, kv_heads, scale, window, softcap, scales=ones),
                              expected, atol=0.1)  # fmt: skip


def poisoned(
    pool: torch.Tensor, scales: torch.Tensor, meta: AttnMeta, kv_dim: int
) -> tuple[torch.Tensor, torch.Tensor, AttnMeta]:
    """Issue 28's question on the kernels: copies of ``fp8_attn_case``'s pages and scales with
    e4m3 NaN (bytes 0xff, NaN scales) in everything no sequence wrote (the pages no table names,
    every page's bytes past its token's K and V, their scale rows), and a page table that names
    such a page past each sequence's end, as a CUDA graph's static table holds stale pages
    there. A kernel reading any of it returns NaN, or a result that differs. Page 0, where the
    kernels' masked page-table loads fall back to (other=0), must be one of them."""
    table = meta.page_table
    owned = torch.zeros(pool.shape[0], dtype=torch.bool)
    owned[table[table >= 0].long()] = True
    assert not owned[0], "a case whose sequences leave page 0 unwritten (pick another seed)"
    pool, scales = pool.clone(), scales.clone()
    data = fp8.bytes_view(pool).view(torch.uint8)
    data[~owned] = 0xFF
    data[:, 2 * kv_dim :] = 0xFF
    scales[~owned] = float("nan")
    stale = torch.where(table >= 0, table, int(torch.nonzero(~owned)[0])).contiguous()
    return pool, scales, AttnMeta(meta.b1_start, meta.b_seq_len, stale, meta.max_new)


def own_rows(meta: AttnMeta, kv_dim: int, dtype: torch.dtype, seed: int, pool=None):
    """(k, v) [T, kv_dim]: the step's own tokens' K and V for ``attention(..., own=)``, v with
    rows strided as the model's (a slice of its qkv rows). With ``pool`` (model-dtype pages):
    the values the pages hold at the step's positions; else random values no page holds."""
    news = (meta.b1_start[1:] - meta.b1_start[:-1]).tolist()
    rows = []
    for b, (n, ctx) in enumerate(zip(news, meta.b_seq_len.tolist(), strict=True)):
        pages = meta.page_table[b, ctx - n : ctx].long()
        if pool is None:
            gen = torch.Generator().manual_seed(seed + b)
            rows.append(torch.randn(n, 2 * kv_dim, generator=gen).to(dtype))
        else:
            rows.append(torch.cat([pool[pages[:, 0], :kv_dim], pool[pages[:, 1], :kv_dim]], 1))
    qkv = torch.cat([r.to(meta.b1_start.device) for r in rows]).to(dtype)
    wide = qkv.new_zeros(qkv.shape[0], 3 * kv_dim)  # [q | k | v] rows
    wide[:, kv_dim:] = qkv
    return wide[:, kv_dim : 2 * kv_dim].contiguous(), wide[:, 2 * kv_dim :]
