"""The Triton LoRA kernels on PEFT's variants against their torch twins (kernels/ref.py), in
Triton's interpreter: each module at its own rank and scale per layer (rank_pattern,
alpha_pattern, a layer the adapter leaves out), lora_B's bias and DoRA's rescaling, in one step
with plain LoRA and base rows, on the tiled and the vector paths and on groups of targets.

The interpreter is chosen when Triton is imported: ``test_variants_in_interpreter`` runs this
file's tests in a child process with TRITON_INTERPRET=1 (``interpreter.run_interpreted``).
Shapes are tiny: the interpreter runs every program instance in Python.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import INTERPRETED, run_interpreted

from slora_kernels import ref
from slora_kernels.meta import VECTOR_ALL, LoraMeta

PAGE = 32
DIMS = {"q": (64, 64), "k": (64, 32), "down": (96, 64)}  # rows of 1, 2 and 3 pages
LAYERS = 2
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2)}

if not INTERPRETED:

    @pytest.mark.slow
    def test_variants_in_interpreter():
        run_interpreted(__file__)


@pytest.fixture(scope="module")
def kernels():
    """The Triton launchers, imported only once the process is known to interpret (elsewhere
    ``test_variants_in_interpreter`` runs these tests in such a child)."""
    if not INTERPRETED:
        pytest.skip("runs under TRITON_INTERPRET=1, in test_variants_in_interpreter's child")
    from slora_kernels import lora_expand, lora_shrink

    return lora_shrink.lora_shrink, lora_expand.lora_expand


# vector rows of d_out a target of the kind has: lora_B's bias; DoRA's g and c
VECTOR_ROWS = {"bias": 1, "dora": 2}


def adapter_ranks(kind: str, gen: torch.Generator) -> torch.Tensor:
    """[LAYERS, targets] ranks of one adapter: "plain" 8 everywhere; "patterns" (and "bias",
    "dora") a rank per module (2 to 16, a target left out of one layer); "layers" in the last
    layer only."""
    t = len(DIMS)
    if kind == "plain":
        return torch.full((LAYERS, t), 8, dtype=torch.int32)
    if kind in ("patterns", "bias", "dora"):
        ranks = torch.randint(2, 17, (LAYERS, t), generator=gen, dtype=torch.int32)
        ranks[0, 1] = 0  # k is left out of layer 0
        return ranks
    ranks = torch.zeros(LAYERS, t, dtype=torch.int32)
    ranks[-1] = torch.tensor([3, 0, 5])
    return ranks


def variant_case(kinds: list[str], num_tokens: int, dtype: torch.dtype, seed: int):
    """A pool holding one adapter per kind (plus an empty slot), each target's rows at its
    largest rank over layers, then its vector rows (``VECTOR_ROWS``), pages placed at random.
    The rows past a layer's own rank hold noise in that layer: a kernel that reads past the
    module's rank fails. Returns (pool [LAYERS, P, PAGE], meta over the step's tokens)."""
    gen = torch.Generator().manual_seed(seed)
    per_row = lambda width: -(-width // PAGE)
    slots = len(kinds) + 1
    layer_rank = torch.zeros(slots, LAYERS, len(DIMS), dtype=torch.int32)
    layer_scale = torch.zeros(slots, LAYERS, len(DIMS))
    for slot, kind in enumerate(kinds):
        layer_rank[slot] = adapter_ranks(kind, gen)
        layer_scale[slot] = (torch.rand(LAYERS, len(DIMS), generator=gen) * 2 + 0.5) * (
            layer_rank[slot] > 0
        )
    top = layer_rank.amax(dim=1)  # [slots, targets]: each target's rows in pages
    vector_rows = [VECTOR_ROWS.get(kind, 0) for kind in kinds] + [0]
    sizes = [
        sum(
            int(top[s, t]) * (per_row(i) + per_row(o))
            + (top[s, t] > 0) * vector_rows[s] * per_row(o)
            for t, (i, o) in enumerate(DIMS.values())
        )
        for s in range(slots)
    ]
    num_pages = sum(sizes) + 11
    pool = torch.randn(LAYERS, num_pages, PAGE, generator=gen)
    perm = torch.randperm(num_pages, generator=gen).int()
    slot_pages = torch.full((slots, max(sizes)), -1, dtype=torch.int32)
    slot_offsets = torch.full((slots, len(DIMS), 2), -1, dtype=torch.int32)
    slot_vectors = torch.full((slots, len(DIMS), 2), -1, dtype=torch.int32)
    cursor = 0
    for slot in range(slots):
        slot_pages[slot, : sizes[slot]] = perm[cursor : cursor + sizes[slot]]
        cursor, used = cursor + sizes[slot], 0
        for t, (d_in, d_out) in enumerate(DIMS.values()):
            if top[slot, t] == 0:
                continue
            for which, width in enumerate((d_in, d_out)):
                slot_offsets[slot, t, which] = used
                used += int(top[slot, t]) * per_row(width)
            if vector_rows[slot]:
                slot_vectors[slot, t, vector_rows[slot] - 1] = used  # bias: 0, DoRA: 1
                used += vector_rows[slot] * per_row(d_out)
    meta = LoraMeta(
        b_slot=torch.zeros(0, dtype=torch.int32),
        token_order=torch.zeros(0, dtype=torch.int32),
        seg1_start=torch.zeros(1, dtype=torch.int32),
        seg_slot=torch.zeros(0, dtype=torch.int32),
        slot_rank=top.amax(dim=1).int(),
        slot_scale=torch.ones(slots),
        slot_pages=slot_pages,
        slot_offsets=slot_offsets,
        max_rank=int(top.max()),
        layer_rank=layer_rank,
        layer_scale=layer_scale,
        slot_vectors=slot_vectors,
        has_vectors=any(vector_rows),
    )
    b_slot = torch.randint(-1, len(kinds), (num_tokens,), generator=gen)
    b_slot[: len(kinds)] = torch.arange(len(kinds))  # every adapter has a token
    b_slot[-3:] = 0  # and the plain one a segment long enough for the tiled kernels
    segment(meta, b_slot)
    return pool.to(dtype), meta


def segment(meta: LoraMeta, b_slot: torch.Tensor) -> None:
    """The step's tokens on ``b_slot``: sorted by slot, base tokens last, one segment a slot."""
    key = torch.where(b_slot < 0, torch.iinfo(torch.int64).max, b_slot)
    order = torch.sort(key, stable=True).indices
    used = b_slot[order][b_slot[order] >= 0]
    seg_slot, counts = torch.unique_consecutive(used, return_counts=True)
    meta.b_slot, meta.token_order = b_slot.int(), order.int()
    meta.seg1_start = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).int()
    meta.seg_slot = seg_slot.int()


def assert_close(actual, expected, dtype) -> None:
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def check_layer(kernels, pool, meta, dtype, seed) -> None:
    """Each target alone, then q and k as one group, through shrink and expand against ref, on
    stale buffers and out as a column slice."""
    shrink, expand = kernels
    gen = torch.Generator().manual_seed(seed)
    tokens, rank = meta.b_slot.shape[0], meta.max_rank
    widths = list(DIMS.values())
    for group in ((0,), (1,), (2,), (0, 1)):
        d_in = widths[group[0]][0]
        x = torch.randn(tokens, d_in, generator=gen).to(dtype)
        buf = torch.randn(tokens, len(group) * rank, generator=gen)  # stale rows must survive
        mine, theirs = buf.clone(), buf.clone()
        shrink(x, pool, meta, group, mine)
        for j, t in enumerate(group):
            ref.lora_shrink(x, pool, meta, t, theirs[:, j * rank : (j + 1) * rank])
        assert_close(mine, theirs, dtype)
        cols, lo = [], 5
        for t in group:
            cols.append((lo, lo + widths[t][1]))
            lo += widths[t][1] + 3
        out = torch.randn(tokens, lo + 2, generator=gen).to(dtype)
        mine, theirs = out.clone(), out.clone()
        expand(buf, pool, meta, group, mine, tuple(cols))
        for j, (t, (c0, c1)) in enumerate(zip(group, cols, strict=True)):
            ref.lora_expand(buf[:, j * rank : (j + 1) * rank], pool, meta, t, theirs[:, c0:c1])
        assert_close(mine, theirs, dtype)


@pytest.mark.parametrize(
    ("path", "dtype"),
    [
        ("tiled", torch.float32),
        ("both", torch.float16),
        ("vector", torch.float32),
        ("aligned", torch.float16),  # a graph decode step on the tiled kernels, a chunk a program
    ],
)
def test_variants_mixed_in_one_step(kernels, monkeypatch, path, dtype):
    """rank_pattern / alpha_pattern, layer subsets, lora_B's bias and DoRA beside plain LoRA and
    base rows: every layer's launches read that layer's ranks and scales
    (``LoraMeta.at_layer``), the bias is added inside the scale and DoRA's rows rescale the
    output, in the layers the adapter has the module only."""
    kinds = ["plain", "patterns", "layers", "bias", "dora"]
    pool, meta = variant_case(kinds, 16, dtype, seed=7)
    meta.vector_max = {"tiled": 0, "both": 1, "vector": VECTOR_ALL, "aligned": VECTOR_ALL}[path]
    if path == "aligned":
        from slora_kernels.lora_blocks import BLOCKS

        monkeypatch.setitem(BLOCKS, "valign", 1)
    for layer in range(LAYERS):
        check_layer(kernels, pool[layer], meta.at_layer(layer), dtype, seed=layer)
