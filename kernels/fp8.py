"""FP8 (e4m3) KV cache: the page layout and the torch quantize / dequantize the twins use.

With ``kv_cache_dtype: fp8`` a pool page (``page_size`` elements of the model dtype, at least
2 * kv_dim bytes) holds one token's K in its first kv_dim bytes and its V in the next kv_dim
bytes, both e4m3; a token takes one page instead of a K page and a V page, and its page-table
row names that page twice (K page, V page). Scales are per token and KV head, amax / 448, fp32,
in a side table beside the pool: ``scales[page, h]`` for K head h, ``scales[page, kv_heads + h]``
for V head h. Running example: kv_heads 2, head_dim 4 (kv_dim 8), bf16 page of 8 elements = 16
bytes; token at page 5: K bytes 0..7 of page 5 (head 1 at bytes 4..7, scale scales[5, 1]), V
bytes 8..15 (head 1 at 12..15, scale scales[5, 3]).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value


def bytes_view(pool_layer: torch.Tensor) -> torch.Tensor:
    """The pool layer as e4m3 bytes: [P, page_size] -> [P, page_size * element bytes]."""
    return pool_layer.view(FP8)


def quantize(rows: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and head e4m3 quantization.

    Semantics: s[t, h] = amax(|rows[t, h-th head]|) / 448 (1 for an all-zero head);
      q[t, h * d + i] = e4m3(rows[t, h * d + i] / s[t, h]) (round to nearest even).
    Shape: rows [T, kv_dim] -> q [T, kv_dim] float8_e4m3fn, s [T, kv_heads] fp32.
    """
    heads = rows.float().view(rows.shape[0], kv_heads, rows.shape[1] // kv_heads)  # [T, kvh, d]
    s = heads.abs().amax(-1) / FP8_MAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (heads / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows.shape), s


def dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``quantize``'s inverse: q [..., kv_dim] e4m3, s [..., kv_heads] -> [..., kv_dim] fp32."""
    heads = q.float().unflatten(-1, (s.shape[-1], q.shape[-1] // s.shape[-1]))  # [..., kvh, d]
    return (heads * s[..., None]).flatten(-2)


def kv_write(
    pool_layer: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_pages: torch.Tensor,
    scales: torch.Tensor,
    v_group: int = 0,
) -> None:
    """``slora_kernels.ref.kv_write`` on fp8 pages: K quantized into bytes 0 .. kv_dim of page
    out_pages[t, 0], V into bytes kv_dim .. 2 * kv_dim of page out_pages[t, 1] (v_group G > 0:
    V's bytes where the grouped layout below puts them, and the rest of a group the step
    starts zeroed after its last token, ``_zero_after``), their scales into scales[page,
    :kv_heads] and scales[page, kv_heads:] (page -1: nothing written).
    Shape: scales [P, 2 * kv_heads] fp32."""
    kv_heads, kv_dim = scales.shape[1] // 2, k.shape[1]
    data = bytes_view(pool_layer)
    assert data.shape[1] >= 2 * kv_dim, f"a page of {data.shape[1]} B cannot hold {kv_dim} x 2"
    pages = out_pages.long()
    for which, rows in enumerate((k, v)):
        keep = pages[:, which] >= 0
        q, s = quantize(rows[keep], kv_heads)
        if which == 1 and v_group:
            data[v_locations(pages[keep, 1], kv_dim, v_group)] = q
        else:
            data[pages[keep, which], which * kv_dim : (which + 1) * kv_dim] = q
        scales[pages[keep, which], which * kv_heads : (which + 1) * kv_heads] = s
    if v_group:
        _zero_after(data, pages[:, 1], kv_dim, v_group)


def gather(
    pool_layer: torch.Tensor,
    scales: torch.Tensor,
    pages: torch.Tensor,
    kv_dim: int,
    v_group: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized K and V (fp32) at pages [..., 2] (K page, V page) -> k, v [..., kv_dim];
    v_group G > 0: V in the grouped layout."""
    kv_heads = scales.shape[1] // 2
    data = bytes_view(pool_layer)
    pages = pages.long()
    k = dequantize(data[pages[..., 0], :kv_dim], scales[pages[..., 0], :kv_heads])
    if v_group:
        v_bytes = data[v_locations(pages[..., 1], kv_dim, v_group)]
    else:
        v_bytes = data[pages[..., 1], kv_dim : 2 * kv_dim]
    return k, dequantize(v_bytes, scales[pages[..., 1], kv_heads:])


# The grouped V layout (``v_group`` G, ``KV_GROUP`` in the engine). A sequence's tokens sit
# in groups of G consecutive positions, each group on G consecutive pages g0 .. g0 + G - 1 (g0
# a multiple of G), the token at position p on page g0 + p % G: a page's slot in its group is
# page % G. K stays in bytes 0 .. kv_dim of the token's own page, the scales in its row of the
# table; the group's V bytes (kv_dim .. 2 * kv_dim of its G pages, seen as one run of G *
# kv_dim bytes) hold V transposed: column c of the token in slot i at c * G + i, so the G keys
# of a column are G adjacent bytes, the layout the p . V dot reads as its K-major operand.
# Running example, G 16, kv_dim 256: column 17 of the token in slot 3 is at 17 * 16 + 3 = 275,
# byte kv_dim + 275 % 256 = 275 of page g0 + 275 // 256 = g0 + 1. The decode kernel reads a
# group's V whole, so the slots past a sequence's last token hold zeros (``_zero_after``).
KV_GROUP = 16


def v_locations(pages: torch.Tensor, kv_dim: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, byte) of each V column of the tokens at ``pages`` [...] in the grouped layout,
    [..., kv_dim] each: an index of the pool's bytes."""
    pages = pages.long()
    slot = pages % group
    run = torch.arange(kv_dim, device=pages.device) * group + slot[..., None]
    return (pages - slot)[..., None] + run // kv_dim, kv_dim + run % kv_dim


def _zero_after(data: torch.Tensor, v_pages: torch.Tensor, kv_dim: int, group: int) -> None:
    """Zeros the V of the slots after a step's last token in a group the step starts: token t
    (V page p, slot i = p % G) whose next token is not at p + 1 and whose group's slot 0 the
    step wrote too (token t - i at p - i) zeroes slots i + 1 .. G - 1. Each group thus holds
    zeros past its sequence's end from the step it is first written in, and nothing the step
    writes is zeroed (the tokens after t in the group, if any, come in later steps)."""
    pages = v_pages.long()
    slot = pages % group
    after = torch.cat([pages[1:], pages.new_full((1,), -1)])
    back = torch.arange(pages.shape[0], device=pages.device) - slot
    starts = (back >= 0) & (pages[back.clamp(min=0)] == pages - slot)
    chosen = (pages >= 0) & (after != pages + 1) & starts & (slot < group - 1)
    first, slot = (pages - slot)[chosen], slot[chosen]
    lanes = torch.arange(group, device=pages.device)
    rest = (first[:, None] + lanes)[lanes[None, :] > slot[:, None]]  # the slots after each
    data[v_locations(rest, kv_dim, group)] = 0


def to_grouped(
    pool_layer: torch.Tensor,
    scales: torch.Tensor,
    page_table: torch.Tensor,
    b_seq_len: torch.Tensor,
    kv_dim: int,
    group: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8 pages (the table naming a token's page twice) rewritten in the grouped V layout
    above: (pool, scales, page table) with every sequence's groups on fresh pages in order, the
    V bytes of slots past a sequence's end zero. Shapes as the inputs'."""
    assert kv_dim % group == 0, (kv_dim, group)
    data = bytes_view(pool_layer).view(torch.uint8)
    lengths = b_seq_len.long().cpu()
    firsts = torch.cumsum(-(-lengths // group) * group, 0)  # each sequence's run ends here
    pages_new = int(firsts[-1]) if len(firsts) else 0
    out = torch.zeros(pages_new, data.shape[1], dtype=torch.uint8, device=data.device)
    out_scales = torch.ones(pages_new, scales.shape[1], dtype=scales.dtype, device=scales.device)
    table = torch.full_like(page_table, -1)
    positions = torch.arange(page_table.shape[1])
    live = (positions[None, :] < lengths[:, None]).to(page_table.device)
    new = (firsts - firsts.diff(prepend=firsts.new_zeros(1)))[:, None] + positions
    new = new.to(data.device)[live]
    old = page_table[..., 0][live].long()
    table[live] = new[:, None].to(table.dtype)
    out[new, :kv_dim] = data[old, :kv_dim]
    out_scales[new] = scales[old]
    out[v_locations(new, kv_dim, group)] = data[old, kv_dim : 2 * kv_dim]  # kv_write's layout
    pool = out.view(pool_layer.dtype).view(pages_new, pool_layer.shape[1])
    return pool, out_scales, table
