"""FP8 (e4m3) LoRA rows: the page layout of adapters stored with ``adapter_dtype: fp8``, the
row quantization, and the gather the twins use (``LoraMeta.fp8_rows``).

A factor's rows (A: rank rows of d_in; B^T: rank rows of d_out) are e4m3 with one fp32 scale per
row, amax / 448 (1 for a row of zeros). A pool page of page_size model-dtype elements holds
k = element bytes (2 for bf16 and fp16, 4 for fp32) sub-pages of page_size e4m3 values; a row
of width w takes per_row = ceil(w / page_size) sub-pages, exactly as a model-dtype row takes
pages, and the factor's rank * per_row sub-pages fill its pages k at a time: sub-page n of the
factor is sub-page n % k (bytes (n % k) * page_size on) of page slot_pages[start + n // k],
start being the factor's offset (``LoraMeta.slot_offsets``). A factor thus takes
ceil(rank * per_row / k) pages, 1 / k of the model dtype's, and a block of a row (dividing
page_size) lies in one sub-page. With k = 1 this is the model-dtype layout.

The factor's scales lie in the pages just before its first row page, spp = k * page_size / 4
fp32 scales a page, walking backwards: row j's scale is fp32 element j % spp of page
slot_pages[start - 1 - j // spp], so a kernel finds a row's scale from the offset alone,
whatever the factor's rank.

Running example: bf16 pages of 32 elements (k = 2, 64 bytes, spp 16), A of rank 20 on d_in 96:
per_row 3 sub-pages, 60 sub-pages in 30 pages after 2 scale pages. Row 5's elements 32 .. 63
are sub-page 16: bytes 0 .. 31 of page slot_pages[start + 8]; its scale is element 5 of page
slot_pages[start - 1], row 17's element 1 of slot_pages[start - 2].

What else an adapter has stays in the model dtype: lora_B's bias and DoRA's rows (vector rows),
expert targets, and LoRA on embed_tokens and lm_head.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value


def sub_pages(dtype: torch.dtype) -> int:
    """Sub-pages of e4m3 rows a pool page of ``dtype`` holds: its element bytes."""
    return torch.finfo(dtype).bits // 8


def scale_pages(rank: int, page_size: int, k: int) -> int:
    """Pages of a factor's ``rank`` fp32 scales, pages of ``k`` sub-pages."""
    return -(-rank // (k * page_size // 4))


def factor_pages(rank: int, width: int, page_size: int, k: int) -> int:
    """Pages of one fp8 factor: its scales, then ``rank`` rows of ``width`` e4m3 values, each
    in ceil(width / page_size) sub-pages, ``k`` sub-pages a page."""
    row_pages = -(-rank * -(-width // page_size) // k)
    return scale_pages(rank, page_size, k) + row_pages


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row e4m3 quantization.

    Semantics: s[..., j] = amax(|rows[..., j, :]|) / 448 (1 for a row of zeros);
      q[..., j, k] = e4m3(rows[..., j, k] / s[..., j]) (round to nearest even).
    Shape: rows [..., r, w] -> q [..., r, w] float8_e4m3fn, s [..., r] fp32.
    """
    rows = rows.float()
    s = rows.abs().amax(-1) / FP8_MAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (rows / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, s


def dequantize_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``quantize_rows``' inverse in fp32: q [..., r, w] e4m3, s [..., r] -> [..., r, w]."""
    return q.float() * s[..., None]


def round_trip(rows: torch.Tensor) -> torch.Tensor:
    """The fp32 values that fp8 storage gives ``rows`` [..., r, w]: what the kernels compute with."""
    return dequantize_rows(*quantize_rows(rows))


def write_factor(pages: torch.Tensor, scale_count: int, layers, rank: int, width: int) -> None:
    """Writes a factor into its pages of an adapter's buffer, layer by layer.

    ``pages`` [L, scale_count + row pages, page_size] (model dtype, a contiguous slice of the
    buffer; ``factor_pages``) gets the scales in its first ``scale_count`` pages, backwards
    (module doc), then the e4m3 rows, each padded with zeros to whole sub-pages. ``layers``:
    each layer's rows [r_l, width] (r_l <= rank), a stacked [L, r, width] tensor or a list;
    rows past r_l are zeros.
    """
    num_layers, _, page_size = pages.shape
    scales = pages.view(torch.float32)  # [L, n, k * page_size / 4]
    data = pages[:, scale_count:].view(FP8).view(num_layers, -1, page_size)  # sub-pages
    data.view(torch.uint8).zero_()
    per_row = -(-width // page_size)
    rows = data[:, : rank * per_row].view(num_layers, rank, per_row * page_size)[:, :, :width]
    spp = scales.shape[2]
    by_page = torch.zeros(num_layers, scale_count * spp)
    for layer, tensor in enumerate(layers):
        q, s = quantize_rows(tensor)
        rows[layer, : q.shape[0]] = q
        by_page[layer, : s.shape[0]] = s
    # scale page i (from the first row page back) holds rows i * spp .. (i + 1) * spp - 1
    scales[:, :scale_count] = by_page.view(num_layers, scale_count, spp).flip(1)


def gather_rows(
    pool_layer: torch.Tensor, slot_pages: torch.Tensor, start: int, rank: int, width: int
) -> torch.Tensor:
    """The first ``rank`` rows of an fp8 factor whose rows begin at slot_pages[start],
    dequantized: [rank, width] fp32. ``slot_pages``: one slot's row of ``LoraMeta.slot_pages``."""
    num_pages, page_size = pool_layer.shape
    k = pool_layer.element_size()
    sub = pool_layer.view(FP8).view(num_pages * k, page_size)
    per_row = -(-width // page_size)
    n = torch.arange(rank * per_row, device=slot_pages.device)
    ids = slot_pages[start + n // k].long() * k + n % k
    q = sub[ids].reshape(rank, per_row * page_size)[:, :width]
    spp = k * page_size // 4
    j = torch.arange(rank, device=slot_pages.device)
    s = pool_layer.view(torch.float32)[slot_pages[start - 1 - j // spp].long(), j % spp]
    return dequantize_rows(q, s)
