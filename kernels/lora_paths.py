"""What the LoRA shrink and expand share: where an adapter's rows lie in pool pages
(``_factor``), the two paths a step's segments take and the tokens each path runs
(``position_segments``, ``_tiled_span``, ``_vector_pick`` on the host, ``_vector_token`` on the
device), and the launchers' argument checks.

Adapter rows are gathered straight from pool pages, a different rank per adapter, no padding to
the largest rank (S-LoRA's MBGMM/MBGMV, tiled as SGLang's chunked SGMV).

Page layout (``slora_kernels.ref.gather_lora_rows``): row j of slot s's factor lies in the pages
slot_pages[s, start + j * per_row + c], c = 0 .. per_row - 1, with start = slot_offsets[s, target,
which] and per_row = ceil(width / page_size); element k of the row is at offset k % page_size of
page c = k // page_size. Running example: page_size 4096, gate (d_in 4096, d_out 11008): an A row
is 1 page, a B^T row 3 pages (the third holds 2816 elements, then zeros). Blocks along a row
(BLOCK_K, BLOCK_N) divide page_size, so a block of a row lies in one page: one page index per row.

Two kernel families (paths), split by segment length (``LoraMeta.vector_max``, 8 tokens by
default):

Tiled (MBGMM), for segments longer than vector_max: the step's tokens, in ``token_order``
(sorted by slot, base tokens last), are cut into blocks of BLOCK_T. A program takes one block,
finds its first segment in ``pos_seg`` and walks the segments it overlaps, one ``tl.dot`` per
segment on the rows of that segment (the others masked, so never loaded). Example, BLOCK_T 16,
segments of 20 (slot 3), 1 (slot 7) and 1 (slot 0) tokens: block 0 = 16 tokens of slot 3, block 1
= 4 tokens of slot 3, then slot 7, then slot 0. A popular adapter's rows are read once per 16-32 of
its tokens; a decode token alone on its adapter costs its own rows. Blocks past the adapter tokens
return at once. The grid depends on T, max_rank and the widths only, never on the segment count,
so a captured decode step (segments padded with empty slot -1 ones) replays for any mix. Eager
steps put their long segments first and pass ``LoraMeta.tiled_tokens``: the grid then covers only
those tokens, and no block walks the short segments the vector kernels own (in a step of 16
prompt chunks and 248 decode rows on their own adapters, about 15 of them between two chunks).

Vector (MBGMV), for segments of at most vector_max tokens: one program per token (and target,
and split of d_in, or block of output columns), reading its own adapter's rows, stepping through
its own rank. A step of 256 tokens on 200 adapters needs no segment walk; in CUDA-graph decode
steps (vector_max = VECTOR_ALL) program t takes the t-th token in slot order (``token_order``)
and reads its slot from b_slot, so the tokens of one adapter run in adjacent programs and its
rows come from memory once. Eager steps
that list their vector tokens (``LoraMeta.vector_tokens``: a step's 248 decode rows next to its
prefill chunks) run one program per listed token.

A group of up to three targets sharing one input (q, k, v; gate, up) is one launch of each
kernel.

FP8 rows (``LoraMeta.fp8_rows``, ``slora_kernels.lora_fp8``): the launchers hand the kernels the
pool as e4m3 bytes (``row_source``), SUB sub-pages of page_size bytes a page; the
page arithmetic above holds per sub-page (``_row_page``). The kernels upcast the rows (exact)
and fold each row's scale (``_row_scales``) into the shrink's sums (x . (s_r q_r) = s_r (x .
q_r)) and into the expand's rank vector (sum_r v_r s_r q_r).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slora_kernels.lora_blocks import BLOCKS
from slora_kernels.meta import VECTOR_ALL, LoraMeta


@triton.jit
def _factor(
    slot,
    rank_ptr,
    rank_slot_stride,
    rank_target_stride,
    pages_ptr,
    pages_stride,
    offsets_ptr,
    target,
    which,
    rank_cap,
    NUM_TARGETS: tl.constexpr,
):
    """(start in slot_pages, -1 without the target or for slot -1; the module's rank, 0 where
    the adapter leaves it out; pointer to slot_pages[slot, start]). The rank table is
    ``module_tables``'; slot -1 (a padding segment) reads slot 0's rows, never before a table."""
    safe = tl.maximum(slot, 0)
    start = tl.load(offsets_ptr + (safe * NUM_TARGETS + target) * 2 + which)
    start = tl.where(slot >= 0, start, -1)
    rank = tl.load(rank_ptr + safe * rank_slot_stride + target * rank_target_stride)
    rank = tl.minimum(rank, rank_cap)
    return start, rank, pages_ptr + safe.to(tl.int64) * pages_stride + start


@triton.jit
def _row_page(slot_pages, sub, live, PAGE: tl.constexpr, SUB: tl.constexpr):
    """Where sub-page ``sub`` of a factor whose rows begin at ``slot_pages`` starts in the pool
    (elements of the kernels' pool pointer, int64): in the model dtype (SUB 1) page
    slot_pages[sub]; with fp8 rows (SUB sub-pages a page, ``slora_kernels.lora_fp8``) sub-page
    sub % SUB of page slot_pages[sub // SUB] (with SUB 1 the division and remainder fold away)."""
    page = tl.load(slot_pages + sub // SUB, mask=live, other=0).to(tl.int64)
    return page * (PAGE * SUB) + (sub % SUB) * PAGE


@triton.jit
def _row_scales(row_scale_ptr, slot_pages, rows, row_live, PAGE: tl.constexpr, SUB: tl.constexpr):
    """The fp32 scales of an fp8 factor's ``rows`` (``slora_kernels.lora_fp8``: row j's at
    element j % spp of page slot_pages[-1 - j // spp], spp = PAGE * SUB // 4 scales a page);
    ``row_scale_ptr``: the pool as fp32. 0 for the rows not live."""
    spp = PAGE * SUB // 4
    page = tl.load(slot_pages - 1 - rows // spp, mask=row_live, other=0).to(tl.int64)
    return tl.load(row_scale_ptr + page * spp + rows % spp, mask=row_live, other=0.0)


@triton.jit
def _segment_chunk(seg1_start_ptr, seg, b0, BLOCK_T: tl.constexpr, ALIGNED: tl.constexpr):
    """(lo, hi) of segment ``seg``, the first a tiled block at sorted position b0 walks.
    ALIGNED: the block works only where a chunk of BLOCK_T of the segment starts (b0 - lo a
    multiple of BLOCK_T); elsewhere hi = lo, an empty walk."""
    lo = tl.load(seg1_start_ptr + seg)
    hi = tl.load(seg1_start_ptr + seg + 1)
    if ALIGNED:
        hi = tl.where((b0 - lo) % BLOCK_T == 0, hi, lo)
    return lo, hi


@triton.jit
def _next_segment(seg1_start_ptr, seg, hi, num_segs, ALIGNED: tl.constexpr):
    """(lo, hi) of segment ``seg`` after a tiled block finished the one ending at ``hi``;
    ALIGNED blocks take one chunk of one segment: an empty range ends their walk."""
    nxt = hi if ALIGNED else tl.load(seg1_start_ptr + tl.minimum(seg + 1, num_segs))
    return hi, nxt


def row_source(pool_layer: torch.Tensor, meta: LoraMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """(the pool as the kernels read the A and B^T rows, the pool as fp32 for their scales):
    with ``meta.fp8_rows`` e4m3 bytes, which the kernels see in their pool pointer's type (FP8,
    and SUB from the model dtype's element bytes); else the pool itself twice (scales unread)."""
    if not meta.fp8_rows:
        return pool_layer, pool_layer
    return pool_layer.view(torch.float8_e4m3fn), pool_layer.view(torch.float32)


def module_tables(meta: LoraMeta) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(rank table, scale table, slot stride, target stride) of the launch's layer: a module's
    rank is rank_table[slot * slot stride + target * target stride], its scale likewise.
    ``LoraMeta.layer_rank`` [N, L, T] gives the layer's [N, T] view (strides L * T and 1: a
    view starts 4 * T bytes a layer further, 16-byte aligned with T = 12 targets); without it
    slot_rank [N] serves every target (strides 1 and 0)."""
    if meta.layer_rank is None:
        return meta.slot_rank, meta.slot_scale, 1, 0
    rank, scale = meta.layer_rank[:, meta.layer], meta.layer_scale[:, meta.layer]
    return rank, scale, rank.stride(0), rank.stride(1)


@triton.jit
def _vector_token(
    b_slot_ptr,
    token_order_ptr,
    seg1_start_ptr,
    seg_slot_ptr,
    pos_seg_ptr,
    num_segs,
    vector_max,
    i,
    ALL: tl.constexpr,
    INDEXED: tl.constexpr,
):
    """(token, slot) of program i when the vector path owns that token, else (_, -1). ALL: every
    adapter token is on the vector path (CUDA-graph decode steps) and program i is token i, its
    slot one load away. INDEXED: token_order_ptr holds the vector path's tokens
    (``LoraMeta.vector_tokens``) and program i takes the i-th. Else i is a sorted position, owned
    when its segment (one load from pos_seg) has at most vector_max tokens and an adapter."""
    if ALL:
        tok = i.to(tl.int64)
        slot = tl.load(b_slot_ptr + i)
    elif INDEXED:
        tok = tl.load(token_order_ptr + i).to(tl.int64)
        slot = tl.load(b_slot_ptr + tok)
    else:
        seg = tl.load(pos_seg_ptr + i)
        safe = tl.minimum(seg, num_segs - 1)
        length = tl.load(seg1_start_ptr + safe + 1) - tl.load(seg1_start_ptr + safe)
        mine = (seg < num_segs) & (length <= vector_max)
        tok = tl.load(token_order_ptr + i).to(tl.int64)
        slot = tl.where(mine, tl.load(seg_slot_ptr + safe), -1)
    return tok, slot


def position_segments(meta: LoraMeta, num_tokens: int) -> torch.Tensor:
    """``meta.pos_seg``: the first segment ending after each sorted position, so a program finds
    its segment with one load instead of a binary search of seg1_start (9 dependent loads at 264
    segments). When the step did not bring it, a fresh one is built from seg1_start on the device
    at each call and never kept in meta: a CUDA graph captured from such a meta rebuilds it at
    every replay instead of replaying one built from the warm-up's segments."""
    if meta.pos_seg is not None:
        return meta.pos_seg
    positions = torch.arange(num_tokens, dtype=torch.int32, device=meta.seg1_start.device)
    return torch.searchsorted(meta.seg1_start[1:], positions, right=True).to(torch.int32)


def aligned_step(meta: LoraMeta) -> bool:
    """Whether the step runs every segment on the tiled kernels one adapter chunk a program
    (BLOCKS["valign"], graph decode steps only): each adapter's rows are read once a step for
    all its tokens, and a program's bytes are its rank block's, not its token count's."""
    return meta.vector_max >= VECTOR_ALL and bool(BLOCKS["valign"])


def _tiled_span(meta: LoraMeta, num_tokens: int) -> int:
    """The sorted positions the tiled kernels cover: ``meta.tiled_tokens`` when the step brings
    it (its long segments first), else all of them."""
    return num_tokens if meta.tiled_tokens is None else meta.tiled_tokens


def _vector_pick(meta: LoraMeta, num_tokens: int) -> tuple[int, torch.Tensor, dict, torch.Tensor]:
    """How the vector kernels find their tokens: (programs, the array passed as token_order,
    the ALL/INDEXED flags, the array passed as pos_seg). Graph decode steps: every token, in
    slot order (token_order, base tokens last) or in batch order, its slot from b_slot. Steps with ``vector_tokens``: just those tokens. Else every sorted
    position, its segment from ``position_segments``. pos_seg is read only in the last case."""
    if meta.vector_max >= VECTOR_ALL:
        # in slot order (BLOCKS["vsorted"]): the programs of one adapter's tokens run side by
        # side and read its rows once from memory, the others from L2; else in batch order
        in_slots = bool(BLOCKS["vsorted"])
        pick = {"ALL": not in_slots, "INDEXED": in_slots}
        return num_tokens, meta.token_order, pick, meta.seg1_start
    if meta.vector_tokens is not None:
        picked = meta.vector_tokens
        return picked.shape[0], picked, {"ALL": False, "INDEXED": True}, meta.seg1_start
    pick = {"ALL": False, "INDEXED": False}
    return num_tokens, meta.token_order, pick, position_segments(meta, num_tokens)


def _check(x: torch.Tensor, pool_layer: torch.Tensor, meta: LoraMeta, out: torch.Tensor) -> None:
    assert pool_layer.dim() == 2 and pool_layer.is_contiguous(), "pool_layer: [P, page_size]"
    assert pool_layer.shape[1] % 16 == 0, f"page_size {pool_layer.shape[1]}: a multiple of 16"
    assert x.dim() == 2 and out.dim() == 2 and x.shape[0] == out.shape[0], (x.shape, out.shape)
    assert x.stride(1) == 1 and out.stride(1) == 1, "rows must be contiguous"
    for name in ("b_slot", "token_order", "seg1_start", "seg_slot", "slot_rank", "slot_pages"):
        tensor = getattr(meta, name)
        assert tensor.dtype == torch.int32 and tensor.is_contiguous(), f"{name}: contiguous int32"
    assert meta.slot_offsets.dtype == torch.int32 and meta.slot_offsets.is_contiguous()
    assert meta.slot_scale.dtype == torch.float32
    if meta.slot_vectors is not None:
        assert meta.slot_vectors.dtype == torch.int32 and meta.slot_vectors.is_contiguous()
        assert meta.slot_vectors.shape == meta.slot_offsets.shape, "(bias, DoRA) a target"
    if meta.layer_rank is not None:
        assert meta.layer_rank.dtype == torch.int32 and meta.layer_rank.is_contiguous()
        assert meta.layer_scale.dtype == torch.float32 and meta.layer_scale.is_contiguous()
        assert meta.layer_rank.shape == meta.layer_scale.shape
        assert meta.layer_rank.shape[2] == meta.slot_offsets.shape[1], "one column a target"
    if meta.vector_tokens is not None:
        assert meta.vector_tokens.dtype == torch.int32 and meta.vector_tokens.is_contiguous()
    if meta.tiled_tokens is not None:
        assert 0 <= meta.tiled_tokens <= x.shape[0], (meta.tiled_tokens, x.shape[0])
    assert meta.b_slot.shape[0] == x.shape[0] == meta.token_order.shape[0]


def _padded(targets: tuple[int, ...]) -> tuple[int, int, int]:
    """A group of targets padded to 3 for the kernels' scalar arguments."""
    return targets + (targets[-1],) * (3 - len(targets))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"
