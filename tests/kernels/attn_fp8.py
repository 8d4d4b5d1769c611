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
    v_group: int = 0,
    **kw,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttnMeta]:
    """(q, pool, scales, meta): ``attn_case``'s sequences with each token's K and V quantized
    by the twin's kv_write into one page (K's random page of attn_case, named twice in the page
    table). The rest of every page and the scales of unwritten pages hold noise, so a kernel
    reading past a token's 2 * kv_dim bytes, or another page's scale, fails. v_group G > 0: the
    grouped V layout (``grouped_pages``), the same K and V values."""
    q, full, meta = attn_case(
        seqs=seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        seed=seed,
        **kw,
    )
    kv_dim = num_kv_heads * head_dim
    table = meta.page_table
    pages = table[table[..., 0] >= 0]  # [tokens, 2]: (K page, V page) of attn_case
    k = full[pages[:, 0].long(), :kv_dim] * K_GAIN
    v = full[pages[:, 1].long(), :kv_dim] * V_GAIN
    num_pages = full.shape[0]
    if v_group:
        table, num_pages = grouped_pages(
            meta.b_seq_len.tolist(), table.shape[1], num_pages, v_group, seed
        )
        table = table.to(meta.page_table.device)
        pages = table[table[..., 0] >= 0]
    gen = torch.Generator(device).manual_seed(seed + 100)
    pool = torch.randn(num_pages, full.shape[1], generator=gen, device=device).to(dtype)
    scales = torch.rand(num_pages, 2 * num_kv_heads, generator=gen, device=device) * 5
    one = pages[:, :1].repeat(1, 2).contiguous()  # K and V side by side in the K page
    ref.kv_write(pool, k, v, one, scales=scales, v_group=v_group)
    packed = torch.where(table >= 0, table[..., :1].expand_as(table), table).contiguous()
    meta = AttnMeta(meta.b1_start, meta.b_seq_len, packed, meta.max_new)
    return q, pool, scales, meta


def grouped_pages(
    lengths: list[int], max_ctx: int, num_pages: int, group: int, seed: int
) -> tuple[torch.Tensor, int]:
    """(page table [B, max_ctx, 2], pool pages): each sequence's positions in groups of
    ``group`` on whole aligned groups of pages placed at random (position p on page g * group +
    p % group of its (p // group)-th group g), at least ``num_pages`` pages in all. Group 0 is
    left free: page 0 is where the kernels' masked page-table loads fall back to, which
    ``poisoned`` fills with NaN."""
    counts = [-(-n // group) for n in lengths]
    num_groups = max(-(-num_pages // group), sum(counts) + 2)
    order = torch.randperm(num_groups - 1, generator=torch.Generator().manual_seed(seed)) + 1
    table = torch.full((len(lengths), max_ctx, 2), -1, dtype=torch.int32)
    cursor = 0
    for b, (n, c) in enumerate(zip(lengths, counts, strict=True)):
        groups = order[cursor : cursor + c].repeat_interleave(group)[:n]
        table[b, :n] = (groups * group + torch.arange(n) % group).int()[:, None]
        cursor += c
    return table, num_groups * group


def check_fp8(
    mine, q, pool, scales, meta, kv_heads, scale, window, softcap, dtype, fn, v_group=0
) -> None:
    """``mine`` against the twin ``fn`` on the fp8 pages, at the dtype's usual tolerance; the
    twin reading the pages without scales differs from it, so the scales must be honoured, and
    with v_group the twin reading V from per-token pages differs too (the layout matters)."""
    args = (q, pool, meta, kv_heads, scale, window, softcap)
    expected = fn(*args, scales=scales, v_group=v_group)
    assert_close(mine, expected, dtype)
    ones = torch.ones_like(scales)
    assert not torch.allclose(fn(*args, scales=ones, v_group=v_group), expected, atol=0.1)
    if v_group:
        assert not torch.allclose(fn(*args, scales=scales).float(), expected.float(), atol=0.1)


def poisoned(
    pool: torch.Tensor, scales: torch.Tensor, meta: AttnMeta, kv_dim: int, v_group: int = 0
) -> tuple[torch.Tensor, torch.Tensor, AttnMeta]:
    """Issue 28's question on the kernels: copies of ``fp8_attn_case``'s pages and scales with
    e4m3 NaN (bytes 0xff, NaN scales) in everything no sequence wrote (the pages no table names,
    every page's bytes past its token's K and V, their scale rows), and a page table that names
    such a page past each sequence's end, as a CUDA graph's static table holds stale pages
    there. A kernel reading any of it returns NaN, or a result that differs. Page 0, where the
    kernels' masked page-table loads fall back to (other=0), must be one of them. v_group G >
    0 (the grouped V layout): the V bytes of every page of a sequence's groups are its own,
    those past its end zeros by contract; the K bytes and scales of pages past its end are
    poisoned."""
    table = meta.page_table
    owned = torch.zeros(pool.shape[0], dtype=torch.bool, device=pool.device)
    owned[table[table >= 0].long()] = True
    assert not owned[0], "a case whose sequences leave page 0 unwritten (pick another seed)"
    in_group = owned.clone()  # pages whose V bytes a sequence's group holds
    if v_group:
        in_group = owned.view(-1, v_group).any(1).repeat_interleave(v_group)
    pool, scales = pool.clone(), scales.clone()
    data = fp8.bytes_view(pool).view(torch.uint8)
    data[~owned, :kv_dim] = 0xFF
    data[~in_group, kv_dim:] = 0xFF
    data[:, 2 * kv_dim :] = 0xFF
    scales[~owned] = float("nan")
    stale = torch.where(table >= 0, table, int(torch.nonzero(~in_group)[0])).contiguous()
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
