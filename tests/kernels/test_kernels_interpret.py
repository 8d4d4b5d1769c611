"""Triton kernels against their torch twins (kernels/ref.py) on the CPU, in Triton's interpreter.

Triton chooses between compiling and interpreting when it is imported, for the whole process.
So these tests run in a child process started with TRITON_INTERPRET=1
(``test_kernels_in_interpreter``), whatever the order in which pytest imports the suite's files;
``TRITON_INTERPRET=1 pytest tests/kernels/test_kernels_interpret.py`` runs them in-process.
The interpreter runs every program instance in Python, at a cost that grows with the program
instances and their loop steps: the cases are the few that reach every kernel, path and block
setting once, on the fewest tokens that still give each its segments (the vector kernels run a
program per token), and each LoRA case checks the seven targets through the launch groups of
GROUPS, which hold each of them. The case builders here are shared with
tests/kernels/test_kernels_gpu.py.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from interpreter import INTERPRETED, run_interpreted

from slora_batch.engine.execution.batch import lora_layout, vector_tokens
from slora_kernels import ref
from slora_kernels.meta import VECTOR_ALL, AttnMeta, LoraMeta

TARGET_DIMS = {  # hidden 64, q_dim 64, kv_dim 32, intermediate 96: rows of 1, 2 and 3 pages of 32
    "q": (64, 64),
    "k": (64, 32),
    "v": (64, 32),
    "o": (64, 64),
    "gate": (64, 96),
    "up": (64, 96),
    "down": (96, 64),
}
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (3e-2, 3e-2)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


if not INTERPRETED:

    @pytest.mark.slow
    def test_kernels_in_interpreter():
        run_interpreted(f"{__file__}::TestInterpreted", f"{__file__}::TestModelInterpreted")


@pytest.fixture(scope="module")
def tk() -> SimpleNamespace:
    """The kernel modules, imported only once the process is known to interpret."""
    from slora_kernels import (
        act_quant,
        attention,
        attention_decode,
        fused,
        kv,
        lora_blocks,
        lora_shrink,
        triton_ops,
    )

    return SimpleNamespace(
        act_quant=act_quant,
        lora_blocks=lora_blocks,
        lora_shrink=lora_shrink,
        attention=attention,
        attention_decode=attention_decode,
        kv=kv,
        fused=fused,
        triton_ops=triton_ops,
    )


# ----------------------------------------------------------------------------- case builders


def use_blocks(tk: SimpleNamespace, monkeypatch, blocks: dict) -> None:
    """The LoRA launchers' BLOCKS set to ``blocks`` for one test, knob by knob: the shrink and
    expand modules hold the dict itself, so rebinding the name would not reach them."""
    assert blocks.keys() == tk.lora_blocks.BLOCKS.keys(), set(blocks) ^ set(tk.lora_blocks.BLOCKS)
    for knob, value in blocks.items():
        monkeypatch.setitem(tk.lora_blocks.BLOCKS, knob, value)


def lora_case(
    *,
    page: int,
    target_dims: dict[str, tuple[int, int]],
    ranks: list[int],
    num_tokens: int,
    popularity: str,
    base_share: float,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int,
    b_slot: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LoraMeta]:
    """A pool holding one adapter per rank (plus an empty slot), pages placed at random, adapters
    after the first lacking random targets, and the step's LoraMeta as batch.py builds it.

    Page tails past a row's width hold noise, so a kernel that reads past the width fails.
    popularity: "uniform", "skewed" (slot i drawn with weight 1 / (i + 1)^3) or "one" (slot 0);
    b_slot, when given, is the tokens' slots instead.
    """
    gen = torch.Generator().manual_seed(seed)
    targets = list(target_dims)
    num_slots = len(ranks) + 1  # the last slot stays empty (rank 0)
    layout = []  # per slot: {target: (rank, d_in, d_out)}
    for slot, rank in enumerate(ranks):
        keep = torch.rand(len(targets), generator=gen) < 0.7
        keep[0] |= slot == 0  # the first adapter has every target
        keep[int(torch.randint(len(targets), (1,), generator=gen))] = True
        layout.append(
            {
                t: (rank,) + target_dims[t]
                for t, k in zip(targets, keep.tolist(), strict=True)
                if k or slot == 0
            }
        )
    per_row = lambda width: -(-width // page)
    sizes = [sum(r * (per_row(i) + per_row(o)) for r, i, o in slot.values()) for slot in layout]
    num_pages = sum(sizes) + 17
    perm = torch.randperm(num_pages, generator=gen)
    pool = torch.randn(num_pages, page, generator=gen)
    slot_pages = torch.full((num_slots, max(sizes)), -1, dtype=torch.int32)
    slot_offsets = torch.full((num_slots, len(targets), 2), -1, dtype=torch.int32)
    cursor = 0
    for slot, entry in enumerate(layout):
        pages = perm[cursor : cursor + sizes[slot]]
        cursor += sizes[slot]
        slot_pages[slot, : sizes[slot]] = pages.int()
        used = 0
        for t_index, target in enumerate(targets):
            if target not in entry:
                continue
            rank, d_in, d_out = entry[target]
            for which, (width, std) in enumerate(((d_in, d_in**-0.5), (d_out, rank**-0.5))):
                slot_offsets[slot, t_index, which] = used
                rows = torch.randn(rank, width, generator=gen) * std
                for j in range(rank):
                    for c in range(per_row(width)):
                        piece = rows[j, c * page : (c + 1) * page]
                        pool[pages[used + j * per_row(width) + c], : piece.numel()] = piece
                used += rank * per_row(width)
    weights = {
        "uniform": torch.ones(len(ranks)),
        "one": torch.eye(len(ranks))[0],
        "skewed": 1.0 / torch.arange(1, len(ranks) + 1).float() ** 3,
    }[popularity]
    if b_slot is None:
        b_slot = torch.multinomial(weights, num_tokens, replacement=True, generator=gen)
        b_slot[torch.rand(num_tokens, generator=gen) < base_share] = -1
    key = torch.where(b_slot < 0, torch.iinfo(torch.int64).max, b_slot)
    order = torch.sort(key, stable=True).indices
    used_slots = b_slot[order][b_slot[order] >= 0]
    change = torch.nonzero(used_slots[1:] != used_slots[:-1]).flatten() + 1
    seg1_start = torch.cat(
        [torch.zeros(1, dtype=torch.int64), change, torch.tensor([used_slots.numel()])]
    )
    seg_slot = used_slots[seg1_start[:-1]]
    slot_rank = torch.tensor(ranks + [0], dtype=torch.int32)
    meta = LoraMeta(
        b_slot=b_slot.int().to(device),
        token_order=order.int().to(device),
        seg1_start=seg1_start.int().to(device),
        seg_slot=seg_slot.int().to(device),
        slot_rank=slot_rank.to(device),
        slot_scale=(torch.rand(num_slots, generator=gen) * 2 + 0.5).to(device),
        slot_pages=slot_pages.to(device),
        slot_offsets=slot_offsets.to(device),
        max_rank=int(slot_rank[seg_slot].max()) if seg_slot.numel() else 0,
    )
    return pool.to(device=device, dtype=dtype), meta


def attn_case(
    *,
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int,
    num_pages: int | None = None,
    max_ctx: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttnMeta]:
    """(q, pool, meta) for sequences given as (new tokens, context length incl. new), every
    position's K and V in a random page; page_table is -1 past each context (and up to max_ctx
    columns wide, when given). The pool is made on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    page = num_kv_heads * head_dim
    total = sum(ctx for _, ctx in seqs)
    num_pages = num_pages or 2 * total + 5
    perm = torch.randperm(num_pages, generator=gen).int()
    pool = torch.randn(num_pages, page, generator=torch.Generator(device).manual_seed(seed),
                       device=device)  # fmt: skip
    max_ctx = max_ctx or max(ctx for _, ctx in seqs)
    table = torch.full((len(seqs), max_ctx, 2), -1, dtype=torch.int32)
    cursor = 0
    for b, (_, ctx) in enumerate(seqs):
        table[b, :ctx] = perm[cursor : cursor + 2 * ctx].view(ctx, 2)
        cursor += 2 * ctx
    news = [n for n, _ in seqs]
    b1_start = torch.tensor([0] + news).cumsum(0).int()
    q = torch.randn(sum(news), num_heads, head_dim, generator=gen)
    meta = AttnMeta(
        b1_start=b1_start.to(device),
        b_seq_len=torch.tensor([c for _, c in seqs], dtype=torch.int32).to(device),
        page_table=table.to(device),
        max_new=max(news),
    )
    return q.to(device=device, dtype=dtype), pool.to(device=device, dtype=dtype), meta


# ------------------------------------------------------------------------------------- tests


SMALL_LORA_BLOCKS = {
    "rank": 16,
    "k": 16,
    "n": 16,
    "split_min_k": 16,
    "vk": 16,
    "vn": 16,
    "vwarps": 4,
    "vnwarps": 4,
    "vwaves": 4,
    "et": 32,
    "dt": 16,
    "det": 16,
    "vr": 16,
    "vgrid": 0,
    "vsorted": 0,  # graph decode steps' vector programs in batch order (default: slot order)
    "vstages": 0,
    "twarps": 8,
    "er": 0,
    "valign": 0,
    "at": 16,
    "ar": 16,
    "an": 16,
}  # splits; blocks in pages
# the vector shrink with rank-row blocks of 8 in the grid, its d_in loop pipelined
# ... and the tiled expand 16 rank rows a dot (up to rank 64: several dots)
GRID_LORA_BLOCKS = {**SMALL_LORA_BLOCKS, "vr": 8, "vgrid": 1, "vstages": 2, "er": 16}
# graph decode steps on the tiled kernels, one adapter chunk of 16 tokens a program, d_in split
ALIGNED_LORA_BLOCKS = {**SMALL_LORA_BLOCKS, "valign": 1}
LORA_CASES = {  # popularity, share of base-model tokens, tokens, dtype, page size
    "uniform": ("uniform", 0.25, 13, torch.float32, 32),
    "skewed": ("skewed", 0.1, 23, torch.float16, 32),
    "one": ("one", 0.3, 36, torch.float32, 64),
}
# Their segments (slot: tokens) at seed = tokens, which the test after LORA_RUNS checks: every
# rank; a segment across the first block of 16, one of 3 and one of 1; one long segment on
# pages of 64 (rows of 1 and 2 pages, with tails past the width). Each token is a program of
# the vector kernels, so the cases are as short as these allow.
LORA_SEGMENTS = {
    "uniform": {0: 2, 1: 2, 2: 1, 3: 3, 4: 1},
    "skewed": {0: 18, 1: 3, 3: 1},
    "one": {0: 30},
}
VECTOR_PATHS = {  # LoraMeta.vector_max: which kernels take which segments
    "tiled": 0,  # every segment on the tiled (matrix) kernels
    "both": 2,  # segments of 1-2 tokens token by token, longer ones tiled
    "indexed": 2,  # the same, the vector kernels given their tokens (LoraMeta.vector_tokens)
    "vector": VECTOR_ALL,  # every token on the vector kernels (CUDA-graph decode steps)
    "upload": 2,  # "indexed" in upload's layout: long segments first, the tiled grid cut to them
}


def set_path(meta: LoraMeta, path: str) -> None:
    """Routes the step's segments as VECTOR_PATHS[path] says (upload's vector_tokens for
    "indexed"; for "upload" also its segment order, tiled_tokens and pos_seg)."""
    meta.vector_max = VECTOR_PATHS[path]
    if path == "upload":
        device = meta.b_slot.device
        layout = lora_layout(meta.b_slot.cpu().numpy().astype(np.int64), meta.vector_max)
        meta.token_order, meta.seg1_start, meta.seg_slot = (
            torch.from_numpy(a).to(device)
            for a in (layout.order, layout.seg1_start, layout.seg_slot)
        )
        layout.hint(meta, lambda array: torch.from_numpy(array).to(device))
    if path == "indexed":
        tokens = vector_tokens(
            meta.token_order.cpu().numpy(), meta.seg1_start.cpu().numpy(), meta.vector_max
        )
        meta.vector_tokens = torch.from_numpy(tokens).to(meta.b_slot.device)


LORA_RUNS = [  # (case, blocks, tokens per block (None: the launcher's choice), path): every
    # case, block setting and path at least once, not their product (the interpreter is slow)
    ("uniform", "default", None, "tiled"),
    ("skewed", "default", None, "both"),
    ("one", "default", None, "upload"),
    ("uniform", "small", None, "indexed"),
    ("skewed", "small", 32, "tiled"),
    ("one", "small", 64, "tiled"),
    ("skewed", "grid", None, "vector"),
    ("uniform", "grid", None, "upload"),
    ("skewed", "aligned", None, "vector"),  # a segment of 18 tokens: two chunks
]


def lora_run_case(case: str) -> tuple[torch.Tensor, LoraMeta]:
    """LORA_CASES[case]'s pool and metadata: ranks 1, 3, 8, 16 and 64, seeded by its tokens."""
    popularity, base_share, num_tokens, dtype, page = LORA_CASES[case]
    return lora_case(page=page, target_dims=TARGET_DIMS, ranks=[1, 3, 8, 16, 64],
                     num_tokens=num_tokens, popularity=popularity, base_share=base_share,
                     dtype=dtype, device="cpu", seed=num_tokens)  # fmt: skip


def test_lora_runs_reach_every_case_block_setting_and_path():
    """LORA_RUNS holds each case, block setting and path, and each case has the segments it is
    there for (LORA_SEGMENTS), so a change to lora_case or a seed that loses one fails here."""
    assert {run[0] for run in LORA_RUNS} == set(LORA_CASES)
    assert {run[1] for run in LORA_RUNS} == {"default", "small", "grid", "aligned"}
    assert {run[3] for run in LORA_RUNS} == set(VECTOR_PATHS)
    for case in LORA_CASES:
        _, meta = lora_run_case(case)
        assert {slot: hi - lo for slot, lo, hi in meta.segments()} == LORA_SEGMENTS[case], case


def pad_segments(meta: LoraMeta, num_segs: int, max_rank: int) -> LoraMeta:
    """The runner's CUDA-graph layout: segment arrays padded with empty segments of slot -1."""
    extra = num_segs - meta.seg_slot.shape[0]
    return dataclasses.replace(
        meta,
        seg1_start=torch.cat([meta.seg1_start, meta.seg1_start[-1:].expand(extra)]),
        seg_slot=torch.cat([meta.seg_slot, meta.seg_slot.new_full((extra,), -1)]),
        max_rank=max_rank,
    )


def meta_fields(meta) -> dict:
    """Each field of a metadata object: (the object it holds, a copy of its value)."""
    fields = {}
    for f in dataclasses.fields(meta):
        value = getattr(meta, f.name)
        fields[f.name] = (value, value.clone() if isinstance(value, torch.Tensor) else value)
    return fields


def assert_meta_unchanged(meta, before: dict) -> None:
    """Launches read the step's metadata and keep nothing in it: a CUDA graph captured after a
    warm-up launch would replay whatever a launch had stored there."""
    for name, (held, value) in meta_fields(meta).items():
        assert held is before[name][0], f"{name} was replaced"
        same = torch.equal if isinstance(value, torch.Tensor) else (lambda a, b: a == b)
        assert same(value, before[name][1]), f"{name} was changed"


def check_lora(shrink, expand, pool, meta, dtype, seed=1, dims=None) -> None:
    """Every target through shrink and expand against ref, on stale buffers and column slices;
    the metadata comes out as it went in. TARGET_DIMS's seven targets in the launch groups of
    GROUPS (each target at least once, alone or beside others); ``dims`` (other targets: no
    groups) target by target, each given as an int."""
    before = meta_fields(meta)
    if dims is None:
        check_lora_groups(shrink, expand, pool, meta, TARGET_DIMS, dtype, seed)
    else:
        check_lora_targets(shrink, expand, pool, meta, dims, dtype, seed)
    assert_meta_unchanged(meta, before)


def check_lora_targets(shrink, expand, pool, meta, dims, dtype, seed) -> None:
    """One launch per target (its index as an int) equals ref: shrink into a buffer of stale
    rows, expand into a column slice of a wider output."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = meta.b_slot.shape[0]
    for index, (d_in, d_out) in enumerate(dims.values()):
        x = torch.randn(num_tokens, d_in, generator=gen).to(dtype)
        buf = torch.randn(num_tokens, meta.max_rank, generator=gen)  # stale rows must survive
        mine, theirs = buf.clone(), buf.clone()
        shrink(x, pool, meta, index, mine)
        ref.lora_shrink(x, pool, meta, index, theirs)
        assert_close(mine, theirs, dtype)
        wide = torch.randn(num_tokens, d_out + 24, generator=gen).to(dtype)
        mine, theirs = wide.clone(), wide.clone()
        expand(buf, pool, meta, index, mine[:, 8 : 8 + d_out])  # out: a column slice
        ref.lora_expand(buf, pool, meta, index, theirs[:, 8 : 8 + d_out])
        assert_close(mine, theirs, dtype)


# Phi-3's fused targets: one A, one B over the whole fused output (q | k | v: 64 + 32 + 32; gate |
# up: 96 + 96), rows of 4 and 6 pages of 32
FUSED_DIMS = {"qkv": (64, 128), "o": (64, 64), "gate_up": (64, 192), "down": (96, 64)}


GROUPS = [(0, 1, 2), (3,), (4, 5), (6,), (0, 2), (1, 2)]  # q k v; o; gate up; down; partial groups


def lora_groups(dims: dict[str, tuple[int, int]]) -> list[tuple[int, ...]]:
    """The groups to launch: GROUPS on the seven separate targets; on another layout (phi3's
    fused qkv and gate_up: 4 targets) each target alone and every target of the first one's
    input width in one group (a launch only needs the input shared)."""
    if list(dims) == ["q", "k", "v", "o", "gate", "up", "down"]:
        return GROUPS
    widths = [d_in for d_in, _ in dims.values()]
    shared = tuple(i for i, d_in in enumerate(widths) if d_in == widths[0])
    return [(i,) for i in range(len(widths))] + ([shared] if len(shared) > 1 else [])


def check_lora_groups(shrink, expand, pool, meta, dims, dtype, seed) -> None:
    """One launch for a group of targets sharing an input equals one ref call per target: the
    group's rank columns of the buffer side by side, each target into its own output columns."""
    device = pool.device
    gen = torch.Generator(device).manual_seed(seed)
    widths = list(dims.values())
    for group in lora_groups(dims):
        d_in = widths[group[0]][0]
        rank = meta.max_rank
        x = torch.randn(meta.b_slot.shape[0], d_in, generator=gen, device=device).to(dtype)
        buf = torch.randn(x.shape[0], len(group) * rank + 5, generator=gen, device=device)
        mine, theirs = buf.clone(), buf.clone()
        shrink(x, pool, meta, group, mine[:, : len(group) * rank])
        for j, t in enumerate(group):
            ref.lora_shrink(x, pool, meta, t, theirs[:, j * rank : (j + 1) * rank])
        assert_close(mine, theirs, dtype)
        cols, lo = [], 3
        for t in group:
            cols.append((lo, lo + widths[t][1]))
            lo += widths[t][1] + 2
        wide = torch.randn(x.shape[0], lo + 4, generator=gen, device=device).to(dtype)
        mine, theirs = wide.clone(), wide.clone()
        v = buf[:, : len(group) * rank]
        expand(v, pool, meta, group, mine, tuple(cols))
        for j, (t, (c0, c1)) in enumerate(zip(group, cols, strict=True)):
            ref.lora_expand(buf[:, j * rank : (j + 1) * rank], pool, meta, t, theirs[:, c0:c1])
        assert_close(mine, theirs, dtype)


HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (8, 1), "wide": (2, 1)}  # "wide": head_dim 256
# Sliding windows and soft-caps ride on the runs below (every path once, not the product):
# window 0 is none, softcap 0.0 none; scale 4 with softcap 1 gives logits past 44, where e^2x
# overflows fp32.
DECODE_RUNS = [  # (heads, dtype, splits (None: the launcher's choice), window, softcap, scale)
    ("mha", torch.float16, 8, 0, 0.0, 0.25),
    ("mha", torch.float32, None, 0, 1.0, 0.25),  # CUDA-core dot products
    ("gqa", torch.float16, 1, 0, 0.0, 0.25),
    ("gqa", torch.float32, 4, 129, 0.0, 0.25),
    ("mqa", torch.float16, 4, 129, 1.0, 4.0),
    ("wide", torch.float16, 2, 129, 5.0, 0.0625),
]
# Window 129 against DECODE_CONTEXTS: contexts shorter than (64), equal to (129) and longer
# than the window; at 600 its keys 471..599 fill two splits of 128-key blocks (32 for "wide").
DECODE_CONTEXTS = [1, 7, 64, 65, 300, 129, 600]
PREFILL_RUNS = [  # (heads, dtype, "short": 64-query tiles, "long": 128-query, window, softcap, scale)
    ("mha", torch.float32, "short", 0, 0.0, 0.25),
    ("gqa", torch.float16, "short", 16, 2.0, 1.0),
    ("mqa", torch.float32, "short", 0, 1.0, 0.25),
    ("gqa", torch.float32, "long", 0, 0.0, 0.25),
    ("mha", torch.float16, "long", 16, 0.0, 0.25),
    ("wide", torch.float32, "short", 40, 1.0, 0.0625),  # PREFILL_WIDE's tiles
]
ATTN_SEQS = [
    (5, 5),
    (3, 20),
    (1, 7),
    (17, 80),
    (64, 130),
    (2, 2),
]  # (new, context): prefill, chunked, decode
# With window 16, (16, 16) sets the context equal to the window, (5, 5) under it; chunks see
# windows that start inside the earlier context (17 new on 80: the first query sees keys
# 49..64), and in the 128-query tile of (130, 140) the queries at positions 79 and later see no
# key of the first block the loop reads (keys 0..63).
WINDOW_SEQS = [(16, 16)]
WIDE_SEQS = [(17, 80), (64, 130), (2, 2)]  # head_dim 256: the interpreter's slowest tiles


def check_window_softcap(mine, q, pool, meta, kv_heads, scale, window, softcap, dtype, fn):
    """``mine`` against the ref ``fn`` with the window and soft-cap, which must matter (the ref
    without them differs), so a kernel ignoring either fails."""
    expected = fn(q, pool, meta, kv_heads, scale, window, softcap)
    assert_close(mine, expected, dtype)
    if window:
        assert not torch.allclose(fn(q, pool, meta, kv_heads, scale, 0, softcap), expected)
    if softcap:
        assert not torch.allclose(fn(q, pool, meta, kv_heads, scale, window, 0.0), expected)


GROUP = 16  # the grouped V layout's group (slora_kernels.fp8.KV_GROUP)


def on(group: int, slots: range) -> list[int]:
    """The pages of slots ``slots`` of group ``group`` in the grouped V layout."""
    return [group * GROUP + i for i in slots]


GROUPED_WRITES = {  # launch: (V pages of its rows in order, slots it zeroes, slots it keeps)
    # E fills group 0 (its last row's next page, 16, is page + 1: no tail); F: 3 tokens on
    # group 1 (tail 3..15); A: 21 tokens, group 3 then group 4's slots 0..4 (tail 5..15);
    # a padding row; B decoding at slot 3 of group 5 (its slot 0 not in the launch: no tail)
    "prefill": (
        on(0, range(16))
        + on(1, range(3))
        + on(3, range(16))
        + on(4, range(5))
        + [-1]
        + on(5, range(3, 4)),
        on(1, range(3, 16)) + on(4, range(5, 16)),
        on(5, range(4, 16)),
    ),
    # A's next chunk at slots 5..9 of group 4, B's next token, D's decode token at slot 0 of
    # group 2 (tail 1..15), a padding row, C's at slot 15 of group 6
    "continue": (
        on(4, range(5, 10)) + on(5, range(4, 5)) + on(2, range(1)) + [-1] + on(6, range(15, 16)),
        on(2, range(1, 16)),
        on(4, range(10, 16)) + on(5, range(5, 16)),
    ),
}


class TestInterpreted:
    """Run in the interpreter child process (see the module docstring)."""

    def test_interpreter_shortcuts_apply(self):
        """This Triton has what ``interpreter.speed_up_interpreter`` relies on: without it the
        interpreted tests compute the same, about twice as slowly."""
        from interpreter import speed_up_interpreter

        assert all(speed_up_interpreter().values()), speed_up_interpreter()

    def test_e4m3_casts_round_as_the_gpu(self, tk):
        """``interpreter.round_e4m3_as_the_gpu`` applies: a kernel's casts to e4m3 give torch's
        values, also where rounding carries into the exponent (125.2 -> 128) and at ties."""
        import triton
        import triton.language as tl
        from interpreter import round_e4m3_as_the_gpu

        assert round_e4m3_as_the_gpu()

        @triton.jit
        def cast(x_ptr, y_ptr, N: tl.constexpr):
            i = tl.arange(0, N)
            tl.store(y_ptr + i, tl.load(x_ptr + i).to(tl.float8e4nv).to(tl.float32))

        x = torch.tensor([125.2, -127.8, 31.07, 0.0, 1.0625, 1.1875, -448.0, 0.001953125])
        y = torch.empty_like(x)
        cast[(1,)](x, y, 8)
        assert torch.equal(y, x.to(torch.float8_e4m3fn).float()), (y, x)

    def test_triton_ops_has_refs_signatures(self, tk):
        public = [
            n
            for n, f in vars(ref).items()
            if inspect.isfunction(f) and f.__module__ == ref.__name__ and not n.startswith("_")
        ]
        for name in public:
            mine, theirs = (
                inspect.signature(getattr(tk.triton_ops, name)),
                inspect.signature(getattr(ref, name)),
            )
            assert [(p.name, p.kind, p.default) for p in mine.parameters.values()] == [
                (p.name, p.kind, p.default) for p in theirs.parameters.values()
            ], name

    @pytest.mark.parametrize("run", LORA_RUNS, ids=lambda r: "-".join(map(str, r)))
    def test_lora_shrink_expand(self, tk, monkeypatch, run):
        case, blocks, block_t, path = run
        num_tokens, dtype = LORA_CASES[case][2:4]
        if blocks == "grid":
            use_blocks(tk, monkeypatch, GRID_LORA_BLOCKS)
        if blocks == "aligned":
            use_blocks(tk, monkeypatch, ALIGNED_LORA_BLOCKS)
        if blocks == "small":
            use_blocks(tk, monkeypatch, SMALL_LORA_BLOCKS)
            splits = tk.lora_shrink.shrink_splits(torch.device("cpu"), num_tokens, 64, 64)
            assert splits > 1 or case != "uniform"  # the split reduction is exercised
        if block_t is not None:  # both tiled kernels' tokens per block in decode-sized steps
            monkeypatch.setitem(tk.lora_blocks.BLOCKS, "dt", block_t)
            monkeypatch.setitem(tk.lora_blocks.BLOCKS, "det", block_t)
        pool, meta = lora_run_case(case)
        set_path(meta, path)
        check_lora(tk.triton_ops.lora_shrink, tk.triton_ops.lora_expand, pool, meta, dtype)

    @pytest.mark.parametrize(
        ("blocks", "vector_max"),
        [("default", 0), ("default", VECTOR_ALL), ("small", 2), ("aligned", VECTOR_ALL)],
        ids=["default-tiled", "default-vector", "small-both", "aligned-vector"],
    )
    def test_lora_padded_segments(self, tk, monkeypatch, blocks, vector_max):
        """The runner's captured layout: segments padded to T with empty slot -1 segments, and
        max_rank the largest rank of all adapters (slot 0: 6 tokens, slot 1: 2, 6 base)."""
        if blocks == "small":
            use_blocks(tk, monkeypatch, SMALL_LORA_BLOCKS)
        if blocks == "aligned":
            use_blocks(tk, monkeypatch, ALIGNED_LORA_BLOCKS)
        pool, meta = lora_case(
            page=32,
            target_dims=TARGET_DIMS,
            ranks=[2, 5, 7, 12, 32, 4, 9],
            num_tokens=14,
            popularity="skewed",
            base_share=0.3,
            dtype=torch.float32,
            device="cpu",
            seed=5,
        )
        padded = dataclasses.replace(pad_segments(meta, 14, 32), vector_max=vector_max)
        check_lora(tk.triton_ops.lora_shrink, tk.triton_ops.lora_expand,
                   pool, padded, torch.float32)  # fmt: skip

    @pytest.mark.parametrize("vector_max", [0, VECTOR_ALL], ids=["tiled", "vector"])
    def test_lora_fused_targets(self, tk, vector_max):
        """A fused B (Phi-3's qkv_proj, gate_up_proj) written over its whole fused output, at
        ranks 1, 3 and 16, on both kernel families."""
        pool, meta = lora_case(page=32, target_dims=FUSED_DIMS, ranks=[1, 3, 16],
                               num_tokens=7, popularity="uniform", base_share=0.2,
                               dtype=torch.float32, device="cpu", seed=9)  # fmt: skip
        meta = dataclasses.replace(meta, vector_max=vector_max)
        check_lora(tk.triton_ops.lora_shrink, tk.triton_ops.lora_expand, pool, meta,
                   torch.float32, dims=FUSED_DIMS)  # fmt: skip

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    def test_kv_write_fp8_matches_twin(self, tk, dtype):
        """The Triton kv_write's fp8 path against its twin (in the interpreter's child: Triton
        interprets or compiles for the whole process)."""
        torch.manual_seed(4)
        kv_heads, head_dim, num_pages = 2, 16, 24
        pools_ = [torch.zeros(num_pages, kv_heads * head_dim, dtype=dtype) for _ in range(2)]
        scales = [torch.ones(num_pages, 2 * kv_heads) for _ in range(2)]
        k = torch.randn(7, kv_heads * head_dim, dtype=dtype) * 3
        v = torch.randn(7, kv_heads * head_dim, dtype=dtype)
        pages = torch.randperm(num_pages)[:7].int()
        out_pages = torch.stack([pages, pages], 1).contiguous()
        out_pages[2] = -1  # the sentinel writes nothing
        tk.kv.kv_write(pools_[0], k, v, out_pages, scales=scales[0])
        ref.kv_write(pools_[1], k, v, out_pages, scales=scales[1])
        assert torch.equal(scales[0], scales[1])
        # The interpreter's e4m3 cast (triton 3.6) rounds some values next to a power of two into
        # the wrong binade (-6 -> -8 in a bare cast, no scaling involved), so here only most bytes
        # must agree; tests/kernels/test_kernels_gpu.py checks byte equality on the card.
        same = pools_[0].view(torch.uint8) == pools_[1].view(torch.uint8)
        assert same.float().mean() > 0.95, float(same.float().mean())
        assert torch.equal(pools_[0][pages[2]], torch.zeros_like(pools_[0][0]))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
    def test_kv_write_fp8_grouped_matches_twin(self, tk, dtype):
        """The Triton kv_write on fp8 pages in the grouped V layout (groups of 16) against its
        twin byte for byte, each launch on the same noisy pool; the rows that start a group
        zero the rest of it after their last token (``fp8._zero_after``), no other row does.
        GROUPED_WRITES holds the launches."""
        from slora_kernels import fp8

        kv_heads, head_dim = 2, 16
        kv_dim = kv_heads * head_dim
        gen = torch.Generator().manual_seed(17)
        pool = torch.randn(8 * GROUP, kv_dim + 8, generator=gen).to(dtype)  # 8 groups
        for name, (rows, zeroed, kept) in GROUPED_WRITES.items():
            pages = torch.tensor(rows, dtype=torch.int32)[:, None].repeat(1, 2).contiguous()
            qkv = torch.randn(len(rows), 3 * kv_dim, generator=gen).to(dtype)
            k, v = qkv[:, kv_dim : 2 * kv_dim] * 3, qkv[:, 2 * kv_dim :]  # strided rows
            scales = torch.rand(pool.shape[0], 2 * kv_heads, generator=gen)
            mine, theirs, mine_scales = pool.clone(), pool.clone(), scales.clone()
            tk.kv.kv_write(mine, k, v, pages, scales=mine_scales, v_group=GROUP)
            ref.kv_write(theirs, k, v, pages, scales=scales, v_group=GROUP)
            assert torch.equal(mine_scales, scales), name
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), name
            where = fp8.v_locations(torch.tensor(zeroed + kept), kv_dim, GROUP)
            before, after = (fp8.bytes_view(x).view(torch.uint8)[where] for x in (pool, mine))
            cut = len(zeroed)  # the zeroed slots held noise; the kept ones hold it still
            assert bool(before[:cut].any()) and not bool(after[:cut].any()), name
            assert torch.equal(after[cut:], before[cut:]), name

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    def test_act_quant_matches_twin(self, tk, dtype):
        """The fused per-token activation quantizer against its twin: K not a multiple of the
        block (3000 > 2048), a row of zeros, rows padded to 16 (zeros, scale 1)."""
        torch.manual_seed(5)
        x = (torch.randn(5, 3000) * torch.tensor([0.01, 1, 30, 0, 1e3])[:, None]).to(dtype)
        q, s = tk.act_quant.quantize_rows(x, pad_to=16)
        q_ref, s_ref = tk.act_quant.quantize_rows_ref(x, pad_to=16)
        assert q.shape == q_ref.shape == (16, 3000) and s.shape == s_ref.shape == (16, 1)
        assert torch.equal(s, s_ref)
        # the interpreter's e4m3 cast misrounds a few values next to a power of two (see
        # test_kv_write_fp8_matches_twin): most bytes here, all on the card (test_kernels_gpu)
        same = q.view(torch.uint8) == q_ref.view(torch.uint8)
        assert same.float().mean() > 0.95, float(same.float().mean())
        assert torch.equal(q[5:].float(), torch.zeros(11, 3000)) and bool((s[5:] == 1).all())
        err = (q_ref[:5].float() * s_ref[:5] - x.float()).abs()  # e4m3: 2^-4 relative at most
        assert bool((err <= x.float().abs() / 16 + s_ref[:5] * 2**-9).all())

    @pytest.mark.parametrize("residual", [False, True], ids=["no-residual", "residual"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
    def test_rms_norm_fp8_is_rms_norm_then_quantize_rows(self, tk, dtype, residual):
        """The fused RMSNorm + quantizer: y and r those of the unfused kernel bit for bit (and
        of the twin within tolerance), its e4m3 bytes and scales the twin quantizer's of that y
        bit for bit; a row of zeros, rows padded to 16."""
        torch.manual_seed(6)
        x = (torch.randn(5, 96) * torch.tensor([0.01, 1, 30, 0, 1e3])[:, None]).to(dtype)
        res = torch.randn(5, 96).to(dtype) if residual else None
        if residual:
            res[3] = -x[3]  # r's row of zeros
        w = torch.rand(96).to(dtype) + 0.5
        y, r, (q, s) = tk.triton_ops.rms_norm_fp8(x, w, 1e-6, res, pad_to=16)
        y_unfused, r_unfused = tk.triton_ops.rms_norm(x, w, 1e-6, res)
        assert torch.equal(y, y_unfused) and torch.equal(r, r_unfused)
        y_ref, r_ref, _ = ref.rms_norm_fp8(x, w, 1e-6, res, pad_to=16)
        assert_close(y, y_ref, dtype)
        assert_close(r, r_ref, dtype)
        q_ref, s_ref = tk.act_quant.quantize_rows_ref(y, pad_to=16)
        assert q.shape == (16, 96) and torch.equal(s, s_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(q[5:].float(), torch.zeros(11, 96)) and bool((s[5:] == 1).all())

    @pytest.mark.parametrize("act", ["silu_mul", "gelu_tanh_mul"])
    def test_act_mul_fp8_is_act_mul_then_quantize_rows(self, tk, act):
        """The fused gated activation + quantizer against its twin, fp16, I = 2500 (two column
        blocks, the second partial), rows padded to 16; its output as the unfused op's."""
        torch.manual_seed(7)
        gate_up = (torch.randn(3, 5000) * torch.tensor([0.1, 3, 20])[:, None]).half()
        a, (q, s) = getattr(tk.triton_ops, f"{act}_fp8")(gate_up, pad_to=16)
        a_ref, (q_ref, s_ref) = getattr(ref, f"{act}_fp8")(gate_up, pad_to=16)
        assert torch.equal(a, getattr(tk.triton_ops, act)(gate_up))
        assert_close(a, a_ref, torch.float16)
        assert q.shape == (16, 2500) and bool((s[3:] == 1).all())
        # the twin's own quantization of the Triton op's output: the same bytes and scales
        q_own, s_own = tk.act_quant.quantize_rows_ref(a, pad_to=16)
        assert torch.equal(s, s_own)
        assert torch.equal(q.view(torch.uint8), q_own.view(torch.uint8))

    def test_lora_all_base_tokens_write_nothing(self, tk):
        pool, meta = lora_case(
            page=32,
            target_dims=TARGET_DIMS,
            ranks=[4],
            num_tokens=6,
            popularity="uniform",
            base_share=0.0,
            dtype=torch.float32,
            device="cpu",
            seed=3,
        )
        meta.b_slot.fill_(-1)
        meta.seg_slot.fill_(-1)  # a padded segment table: every segment empty of adapters
        meta.seg1_start.fill_(0)
        x, buf, out = torch.randn(6, 64), torch.randn(6, 4), torch.randn(6, 64)
        mine, wide = buf.clone(), out.clone()
        tk.triton_ops.lora_shrink(x, pool, meta, 0, mine)
        tk.triton_ops.lora_expand(buf, pool, meta, 0, wide)
        assert torch.equal(mine, buf) and torch.equal(wide, out)

    @pytest.mark.parametrize("run", PREFILL_RUNS, ids=lambda r: "-".join(map(str, r[:5])))
    def test_attention_prefill(self, tk, monkeypatch, run):
        kind, dtype, length, window, softcap, scale = run
        num_heads, num_kv_heads = HEADS[kind]
        seqs = ATTN_SEQS + (WINDOW_SEQS if window else [])
        if length == "long":  # 128-query tiles
            seqs = seqs + [(130, 140)]
            monkeypatch.setattr(tk.attention, "PREFILL_TILE", (128, 8))
        if kind == "wide":
            seqs = WIDE_SEQS
        q, pool, meta = attn_case(seqs=seqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                  head_dim=256 if kind == "wide" else 16, dtype=dtype,
                                  device="cpu", seed=num_kv_heads)  # fmt: skip
        mine = tk.triton_ops.attention(q, pool, meta, num_kv_heads, scale, window, softcap)
        check_window_softcap(mine, q, pool, meta, num_kv_heads, scale, window, softcap, dtype,
                             ref.attention)  # fmt: skip

    @pytest.mark.parametrize("run", DECODE_RUNS, ids=lambda r: "-".join(map(str, r[:5])))
    def test_attention_decode(self, tk, monkeypatch, run):
        kind, dtype, splits, window, softcap, scale = run
        num_heads, num_kv_heads = HEADS[kind]
        if kind == "mha" and dtype == torch.float32 and splits is None:  # the CUDA-core path
            monkeypatch.setitem(tk.attention_decode.DECODE, "mha_dot", False)
        q, pool, meta = attn_case(seqs=[(1, c) for c in DECODE_CONTEXTS], num_heads=num_heads,
                                  num_kv_heads=num_kv_heads,
                                  head_dim=256 if kind == "wide" else 16, dtype=dtype,
                                  device="cpu", seed=splits or 0)  # fmt: skip
        if splits is None:  # the launcher's choice, through the public twin
            mine = tk.triton_ops.attention_decode(q, pool, meta, num_kv_heads, scale, window,
                                                  softcap)  # fmt: skip
        else:
            mine = tk.attention_decode.decode_splits(q, pool, meta, num_kv_heads, scale, splits,
                                                     window, softcap)  # fmt: skip
        check_window_softcap(mine, q, pool, meta, num_kv_heads, scale, window, softcap, dtype,
                             ref.attention_decode)  # fmt: skip

    # fp8 pages (tests/kernels/attn_fp8.py): the interpreter upcasts e4m3 bytes exactly (its
    # cast error is on the way down, in kv_write), so the usual tolerances hold. bf16 is left
    # to the GPU tests: the interpreter computes bf16 attention wrongly with or without fp8.
    def test_attention_fp8_prefill(self, tk):
        """fp16, a window and a soft-cap on prefill, chunk and decode rows (fp32: the decode test)."""
        from attn_fp8 import check_fp8, fp8_attn_case

        dtype, window, softcap = torch.float16, 16, 2.0
        q, pool, scales, meta = fp8_attn_case(seqs=[(5, 5), (17, 40), (1, 7), (16, 16)],
                                              num_heads=4, num_kv_heads=2, head_dim=16,
                                              dtype=dtype, device="cpu", seed=11)  # fmt: skip
        mine = tk.triton_ops.attention(q, pool, meta, 2, 0.25, window, softcap, scales=scales)
        check_fp8(mine, q, pool, scales, meta, 2, 0.25, window, softcap, dtype, ref.attention)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
    def test_attention_fp8_prefill_reads_the_steps_own_rows(self, tk, dtype):
        """``own``: the step's keys come from its K/V rows (random, no page holds them; V's
        rows strided), rounded through e4m3 as kv_write rounds them, earlier ones from the fp8
        pages; fp16 with a window and a soft-cap (fp16 dots), fp32 without."""
        from attn_fp8 import fp8_attn_case, own_rows

        window, softcap = (16, 2.0) if dtype == torch.float16 else (0, 0.0)
        q, pool, scales, meta = fp8_attn_case(seqs=[(5, 5), (17, 40), (1, 7), (16, 16)],
                                              num_heads=4, num_kv_heads=2, head_dim=16,
                                              dtype=dtype, device="cpu", seed=13)  # fmt: skip
        own = own_rows(meta, 32, dtype, seed=14)
        args = (q, pool, meta, 2, 0.25, window, softcap)
        mine = tk.triton_ops.attention(*args, scales=scales, own=own)
        expected = ref.attention(*args, scales=scales, own=own)
        assert_close(mine, expected, dtype)
        assert not torch.allclose(ref.attention(*args, scales=scales), expected, atol=0.1)

    def test_attention_prefill_own_rows_of_the_pages_change_nothing(self, tk):
        """On model-dtype pages the step's own rows hold what its pages hold: the same output."""
        from attn_fp8 import own_rows

        q, pool, meta = attn_case(seqs=[(5, 5), (17, 40), (1, 7), (70, 90)], num_heads=4,
                                  num_kv_heads=2, head_dim=16, dtype=torch.float32,
                                  device="cpu", seed=15)  # fmt: skip
        own = own_rows(meta, 32, torch.float32, seed=0, pool=pool)
        mine = tk.triton_ops.attention(q, pool, meta, 2, 0.25, own=own)
        assert_close(mine, tk.triton_ops.attention(q, pool, meta, 2, 0.25), torch.float32)
        assert_close(mine, ref.attention(q, pool, meta, 2, 0.25), torch.float32)

    @pytest.mark.parametrize("kind,splits,window,heads_fastest",
                             [("gqa", 4, 0, False), ("mha", None, 16, False), ("gqa", 2, 0, True)],
                             ids=str)  # fmt: skip
    def test_attention_fp8_decode(self, tk, monkeypatch, kind, splits, window, heads_fastest):
        """GQA on tensor-core tiles over 4 splits with a soft-cap; MHA on the CUDA-core path;
        GQA with a sequence's heads in adjacent programs (DECODE["heads_fastest"])."""
        from attn_fp8 import check_fp8, fp8_attn_case

        monkeypatch.setitem(tk.attention_decode.DECODE, "mha_dot", False)
        monkeypatch.setitem(tk.attention_decode.DECODE, "heads_fastest", heads_fastest)
        num_heads, num_kv_heads = HEADS[kind]
        softcap = 1.0 if kind == "gqa" else 0.0
        q, pool, scales, meta = fp8_attn_case(seqs=[(1, c) for c in (1, 9, 40, 300)],
                                              num_heads=num_heads, num_kv_heads=num_kv_heads,
                                              head_dim=16, dtype=torch.float32, device="cpu",
                                              seed=12)  # fmt: skip
        mine = tk.attention_decode.decode_splits(q, pool, meta, num_kv_heads, 0.25, splits,
                                                 window, softcap, scales=scales)  # fmt: skip
        check_fp8(mine, q, pool, scales, meta, num_kv_heads, 0.25, window, softcap,
                  torch.float32, ref.attention_decode)  # fmt: skip

    @pytest.mark.parametrize("kind", ["gqa", "mha"])
    def test_attention_fp8_decode_grouped_values(self, tk, kind):
        """The grouped V layout (``fp8.to_grouped``, groups of 16) gives the output of the
        same tokens on per-token pages: contexts inside, at and across group ends, 2 splits."""
        from attn_fp8 import fp8_attn_case

        from slora_kernels import fp8

        num_heads, num_kv_heads = HEADS[kind]
        q, pool, scales, meta = fp8_attn_case(seqs=[(1, c) for c in (1, 15, 16, 17, 70)],
                                              num_heads=num_heads, num_kv_heads=num_kv_heads,
                                              head_dim=16, dtype=torch.float32, device="cpu",
                                              seed=16)  # fmt: skip
        kv_dim = num_kv_heads * 16
        pool_g, scales_g, table_g = fp8.to_grouped(pool, scales, meta.page_table, meta.b_seq_len,
                                                   kv_dim, 16)  # fmt: skip
        meta_g = AttnMeta(meta.b1_start, meta.b_seq_len, table_g, meta.max_new)
        run = tk.attention_decode.decode_splits
        mine = run(q, pool_g, meta_g, num_kv_heads, 0.25, 2, scales=scales_g, v_group=16)
        expected = run(q, pool, meta, num_kv_heads, 0.25, 2, scales=scales)
        assert_close(mine, expected, torch.float32)
        assert_close(mine, ref.attention_decode(q, pool, meta, num_kv_heads, 0.25, scales=scales),
                     torch.float32)  # fmt: skip

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32-own"])
    def test_attention_fp8_prefill_grouped_values(self, tk, dtype):
        """Prefill on fp8 pages in the grouped V layout (groups of 16) against the twin, with a
        window (16) and a soft-cap: windows that start inside a group (the 5 new tokens on 60
        see keys from 40, whose group starts at 32) and at a group's start; fp32 with the
        step's own K/V rows, so the pages end inside a group (keys up to 55 of 60)."""
        from attn_fp8 import check_fp8, fp8_attn_case, own_rows

        window, softcap = 16, 2.0
        q, pool, scales, meta = fp8_attn_case(
            seqs=[(5, 5), (17, 40), (1, 7), (16, 16), (5, 60), (1, 33)],
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            dtype=dtype,
            device="cpu",
            seed=18,
            v_group=GROUP,
        )
        args = (q, pool, meta, 2, 0.25, window, softcap)
        if dtype == torch.float16:
            mine = tk.triton_ops.attention(*args, scales=scales, v_group=GROUP)
            case = (q, pool, scales, meta, 2, 0.25, window, softcap, dtype)
            check_fp8(mine, *case, ref.attention, GROUP)
            return
        own = own_rows(meta, 32, dtype, seed=19)
        mine = tk.triton_ops.attention(*args, scales=scales, own=own, v_group=GROUP)
        expected = ref.attention(*args, scales=scales, own=own, v_group=GROUP)
        assert_close(mine, expected, dtype)
        per_token = ref.attention(*args, scales=scales, own=own)  # V read from the wrong bytes
        assert not torch.allclose(per_token, expected, atol=0.1)

    @pytest.mark.parametrize(
        "kind,dtype,splits,softcap",
        [("gqa", torch.float32, 4, 1.0), ("mha", torch.float16, 4, 0.0)],
        ids=["gqa-fp32", "mha-fp16"],
    )
    def test_attention_fp8_decode_grouped_values_window(
        self, tk, monkeypatch, kind, dtype, splits, softcap
    ):
        """Decode on fp8 pages in the grouped V layout with a window of 150 against the twin:
        the split keys start at the window's first group (the context of 300 sees keys from
        150, split from 144), over several splits of 32-key blocks; GQA on tensor-core tiles
        with a soft-cap, MHA on the CUDA-core path, each also with the launcher's splits
        (``attention_decode``)."""
        from attn_fp8 import check_fp8, fp8_attn_case

        monkeypatch.setitem(tk.attention_decode.DECODE, "gqa_block_n", 32)
        monkeypatch.setitem(tk.attention_decode.DECODE, "mha_dot", False)
        num_heads, num_kv_heads = HEADS[kind]
        q, pool, scales, meta = fp8_attn_case(
            seqs=[(1, c) for c in (1, 17, 70, 200, 300)],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=16,
            dtype=dtype,
            device="cpu",
            seed=20,
            v_group=GROUP,
        )
        args = (q, pool, meta, num_kv_heads, 0.25, 150, softcap, scales)
        case = (q, pool, scales, meta, num_kv_heads, 0.25, 150, softcap, dtype)
        mine = tk.attention_decode.decode_splits(*args[:5], splits, *args[5:], v_group=GROUP)
        check_fp8(mine, *case, ref.attention_decode, GROUP)
        mine = tk.triton_ops.attention_decode(*args, v_group=GROUP)
        check_fp8(mine, *case, ref.attention_decode, GROUP)

    @pytest.mark.parametrize("v_group", [0, GROUP], ids=["per-token", "grouped"])
    @pytest.mark.parametrize("kind", ["prefill", "decode"])
    def test_attention_fp8_reads_no_garbage(self, tk, kind, v_group):
        """NaN bytes and scales wherever no sequence wrote, stale pages past each sequence's end
        in the page table (attn_fp8.poisoned): the same output bit for bit. Prefill in fp16
        (fp16 dots, as under bf16 on the GPU), with a window and a soft-cap; decode in fp32
        (pages with bytes past K and V) over 4 splits, merged, with a window in the grouped V
        layout (its groups' slots past a sequence's end hold zeros, not NaN)."""
        from attn_fp8 import fp8_attn_case, poisoned

        dtype = torch.float16 if kind == "prefill" else torch.float32
        seqs = [(5, 5), (17, 40), (1, 7)] if kind == "prefill" else [(1, c) for c in (1, 9, 300)]
        q, pool, scales, meta = fp8_attn_case(
            seqs=seqs,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            dtype=dtype,
            device="cpu",
            seed=16,
            v_group=v_group,
        )
        window = 100 if v_group else 0

        def run(pool, scales, meta):
            if kind == "prefill":
                return tk.triton_ops.attention(
                    q, pool, meta, 2, 0.25, 16, 2.0, scales=scales, v_group=v_group
                )
            return tk.attention_decode.decode_splits(
                q, pool, meta, 2, 0.25, 4, window, 1.0, scales=scales, v_group=v_group
            )

        clean = run(pool, scales, meta)
        dirty = run(*poisoned(pool, scales, meta, 32, v_group))
        assert torch.isfinite(clean).all() and torch.equal(dirty, clean)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
    def test_kv_write(self, tk, dtype):
        gen = torch.Generator().manual_seed(0)
        pool = torch.randn(40, 32, generator=gen).to(dtype)
        qkv = torch.randn(9, 128, generator=gen).to(dtype)
        k, v = qkv[:, 64:96], qkv[:, 96:]  # strided rows, as the model passes them
        pages = torch.randperm(40, generator=gen)[:18].view(9, 2).int()
        mine, theirs = pool.clone(), pool.clone()
        tk.triton_ops.kv_write(mine, k, v, pages)
        ref.kv_write(theirs, k, v, pages)
        assert torch.equal(mine, theirs)
        pages[3] = -1  # no page: nothing written
        before = mine.clone()
        tk.triton_ops.kv_write(mine, k * 2, v * 2, pages)
        assert torch.equal(
            mine[pages[[0, 1, 2, 4]].long().flatten()].view(4, 2, 32)[:, 0], (k * 2)[[0, 1, 2, 4]]
        )
        unwritten = torch.ones(40, dtype=torch.bool)
        unwritten[pages[pages >= 0].long()] = False
        assert torch.equal(mine[unwritten], before[unwritten])
        twin = before.clone()
        ref.kv_write(twin, k * 2, v * 2, pages)  # the twin honours the sentinel the same way
        assert torch.equal(twin, mine)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
    @pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
    def test_rms_norm(self, tk, dtype, with_residual):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(5, 96, generator=gen).to(dtype)
        residual = torch.randn(5, 96, generator=gen).to(dtype) if with_residual else None
        weight = (torch.rand(96, generator=gen) + 0.5).to(dtype)
        y, r = tk.triton_ops.rms_norm(x, weight, 1e-5, residual)
        y_ref, r_ref = ref.rms_norm(x, weight, 1e-5, residual)
        assert y.dtype == y_ref.dtype and r.dtype == r_ref.dtype
        assert_close(y, y_ref, dtype)
        assert torch.equal(r, r_ref)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
    def test_rope(self, tk, dtype):
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(6, 4, 16, generator=gen).to(dtype)
        k = torch.randn(6, 2, 16, generator=gen).to(dtype)
        positions = torch.tensor([0, 5, 6, 7, 99, 3])
        freqs = torch.outer(
            torch.arange(128).float(), 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
        )
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        mine_q, mine_k, ref_q, ref_k = q.clone(), k.clone(), q.clone(), k.clone()
        tk.triton_ops.rope(mine_q, mine_k, positions, cos_sin)
        ref.rope(ref_q, ref_k, positions, cos_sin)
        assert_close(mine_q, ref_q, dtype)
        assert_close(mine_k, ref_k, dtype)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
    @pytest.mark.parametrize("act", ["silu_mul", "gelu_tanh_mul"])
    def test_act_mul(self, tk, act, dtype):
        gate_up = (torch.randn(7, 2 * 96, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
        gate_up[0, :4] = torch.tensor([-30.0, 30.0, 0.0, -3.0])  # tanh saturated both ways
        mine = getattr(tk.triton_ops, act)(gate_up)
        assert_close(mine, getattr(ref, act)(gate_up), dtype)


def tiny_model():
    """A 2-layer Llama (GQA 4/2, head_dim 16, q/k/v bias) with random weights, on the CPU."""
    from factory import tiny_spec

    from slora_batch.engine.models.llama import LayerWeights, LlamaModel

    spec = tiny_spec(attention_bias=True)
    gen = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * shape[-1] ** -0.5

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(64, generator=gen)

    layers = [
        LayerWeights(
            norm(), w(128, 64), 0.1 * w(128), w(64, 64), None, norm(), w(192, 64), w(64, 96)
        )
        for _ in range(spec.num_layers)
    ]
    return LlamaModel(spec, torch.randn(50, 64, generator=gen), layers, norm(), w(50, 64), 128)


def model_step(seqs: list[tuple[int, int, int]], seed: int):
    """(step, KV pool, LoRA pool) for sequences (new tokens, context, adapter slot or -1)."""
    from slora_batch.engine.models.llama import StepInput
    from slora_batch.engine.pool import PagePool

    _, kv_layer, attn = attn_case(
        seqs=[(n, ctx) for n, ctx, _ in seqs],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float32,
        device="cpu",
        seed=seed,
    )
    pool = PagePool(kv_layer.shape[0], 32, 2)
    pool.data[:] = kv_layer  # the earlier context: noise, the same in both layers
    b_slot = torch.cat([torch.full((n,), slot) for n, _, slot in seqs])
    lora_layer, lora = lora_case(
        page=32,
        target_dims=TARGET_DIMS,
        ranks=[1, 3, 8, 16, 64],
        num_tokens=b_slot.numel(),
        popularity="uniform",
        base_share=0.0,
        dtype=torch.float32,
        device="cpu",
        seed=seed,
        b_slot=b_slot,
    )
    positions = torch.cat([torch.arange(ctx - n, ctx) for n, ctx, _ in seqs])
    out_pages = torch.cat([attn.page_table[b, ctx - n : ctx] for b, (n, ctx, _) in enumerate(seqs)])
    step = StepInput(
        input_ids=torch.randint(
            50, (b_slot.numel(),), generator=torch.Generator().manual_seed(seed)
        ),
        positions=positions,
        out_pages=out_pages.contiguous(),
        attn=attn,
        lora=lora,
        logits_index=(attn.b1_start[1:] - 1).long(),
        decode_only=attn.max_new == 1,
    )
    d = next((b for b, (n, _, _) in enumerate(seqs) if n > 1), len(seqs))
    if 0 < d < len(seqs):  # leading decodes, as batch.upload splits them
        step.attn_split = (
            d,
            AttnMeta(attn.b1_start[: d + 1], attn.b_seq_len[:d], attn.page_table[:d], 1),
            AttnMeta(
                (attn.b1_start[d:] - d).contiguous(),
                attn.b_seq_len[d:],
                attn.page_table[d:],
                attn.max_new,
            ),  # fmt: skip
        )
    return step, pool, SimpleNamespace(layer=lambda index: lora_layer)


# (new tokens, context, slot): prefill, chunked prefill with context, decode. Segments of at
# most 8 tokens: every token is a program of the vector LoRA kernels, so prompts are short.
MODEL_STEPS = {
    "mixed": [(3, 3, 0), (2, 20, -1), (1, 9, 3), (1, 30, 0), (2, 12, 4)],
    "decode": [(1, 9, 0), (1, 30, -1), (1, 4, 3), (1, 17, 0), (1, 70, 4), (1, 2, 1)],
    "split": [(1, 9, 0), (1, 30, -1), (1, 17, 3), (3, 3, 0), (2, 20, 4)],  # decodes lead
}


class TestModelInterpreted:
    """The model's forward on the Triton backend equals the torch backend (interpreter only)."""

    @pytest.mark.parametrize("kind", list(MODEL_STEPS))
    def test_forward_matches_torch_backend(self, tk, kind):
        model = tiny_model()
        step, pool, lora_pool = model_step(MODEL_STEPS[kind], seed=len(kind))
        ref_pool = copy.deepcopy(pool)
        logits = model.forward(step, pool, tk.triton_ops, lora_pool)
        whole = dataclasses.replace(step, attn_split=None)  # every row on the prefill kernel
        expected = model.forward(whole, ref_pool, ref, lora_pool)
        assert_close(logits, expected, torch.float32)
        assert_close(pool.data, ref_pool.data, torch.float32)


if not INTERPRETED:  # the child process runs these
    del TestInterpreted, TestModelInterpreted
