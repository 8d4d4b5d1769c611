"""The Triton attention kernels on fp8 KV pages against their torch twins on a CUDA card with
fp8 (sm 8.9+): prefill, split-KV decode (and MHA's CUDA-core path), Gemma-2-9B's head_dim 256
with its window and soft-cap, and a decode step captured in a CUDA graph and replayed on other
steps' pages and scales; each also with V in the grouped layout (``v_group`` 16), and the
grouped kv_write byte for byte. Shapes as tests/kernels/test_kernels_gpu.py's; cases from
tests/kernels/attn_fp8.py (K/V quantized by the twin's kv_write, so both sides read the same
bytes and the usual bf16 / fp16 tolerances hold).

Run on the device machine: ``.venv/bin/python -m pytest -q -o addopts= -m gpu
tests/kernels/test_attention_fp8_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from attn_fp8 import check_fp8, fp8_attn_case, own_rows
from test_kernels_gpu import HEADS, PREFILL_SEQS, WINDOW_PREFILL_SEQS, WINDOW_RUNS, _scale
from test_kernels_interpret import assert_close

from slora_kernels import ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled kernels only"),
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA card with fp8",
    ),
]

DTYPES = [torch.bfloat16, torch.float16]
GROUP = 16  # the grouped V layout's group (slora_kernels.fp8.KV_GROUP)
V_GROUPS = pytest.mark.parametrize("v_group", [0, GROUP], ids=["per-token", "grouped"])


@pytest.fixture(scope="module")
def ops():
    from slora_kernels import attention_decode, triton_ops

    return attention_decode, triton_ops


def _case(kind: str, seqs, dtype, seed: int, **kw):
    num_heads, num_kv_heads = HEADS[kind]
    head_dim = 256 if kind == "gemma2" else 128
    return fp8_attn_case(seqs=seqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, dtype=dtype, device="cuda", seed=seed,
                         **kw)  # fmt: skip


@V_GROUPS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(HEADS))
def test_attention_fp8_prefill(ops, dtype, kind, v_group):
    q, pool, scales, meta = _case(kind, PREFILL_SEQS, dtype, seed=1, v_group=v_group)
    scale, kv_heads = _scale(kind), HEADS[kind][1]
    mine = ops[1].attention(q, pool, meta, kv_heads, scale, scales=scales, v_group=v_group)
    check_fp8(mine, q, pool, scales, meta, kv_heads, scale, 0, 0.0, dtype, ref.attention, v_group)


@V_GROUPS
@pytest.mark.parametrize("window", [0, 256], ids=["full", "window"])
@pytest.mark.parametrize("kind", list(HEADS))
def test_attention_fp8_prefill_reads_the_steps_own_rows(ops, kind, window, v_group):
    """bf16: the step's keys from its own K/V rows (random, V's rows strided) rounded through
    e4m3 in registers, the earlier ones from the fp8 pages."""
    seqs = WINDOW_PREFILL_SEQS if window else PREFILL_SEQS
    q, pool, scales, meta = _case(kind, seqs, torch.bfloat16, seed=3, v_group=v_group)
    scale, kv_heads = _scale(kind), HEADS[kind][1]
    own = own_rows(meta, kv_heads * q.shape[2], torch.bfloat16, seed=4)
    args = (q, pool, meta, kv_heads, scale, window)
    expected = ref.attention(*args, scales=scales, own=own, v_group=v_group)
    mine = ops[1].attention(*args, scales=scales, own=own, v_group=v_group)
    assert_close(mine, expected, torch.bfloat16)
    pages_only = ref.attention(*args, scales=scales, v_group=v_group)
    assert not torch.allclose(pages_only.float(), expected.float(), atol=0.1)


@pytest.mark.parametrize("splits", [1, 4, None])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(HEADS))
def test_attention_fp8_decode(ops, dtype, kind, splits, v_group=0):
    contexts = torch.randint(1, 4000, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    seqs = [(1, c) for c in contexts + [1, 4096]]
    q, pool, scales, meta = _case(kind, seqs, dtype, seed=2, v_group=v_group)
    scale, kv_heads = _scale(kind), HEADS[kind][1]
    mine = ops[0].decode_splits(
        q, pool, meta, kv_heads, scale, splits, scales=scales, v_group=v_group
    )
    check_fp8(
        mine, q, pool, scales, meta, kv_heads, scale, 0, 0.0, dtype, ref.attention_decode, v_group
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(HEADS))
def test_attention_fp8_decode_grouped_values(ops, dtype, kind):
    """Decode in the grouped V layout (contexts at, inside and across group ends), over the
    launcher's splits (one case: the twin's grouped write walks every token)."""
    test_attention_fp8_decode(ops, dtype, kind, None, GROUP)


@V_GROUPS
def test_attention_fp8_decode_mha_cuda_cores(ops, monkeypatch, v_group):
    """MHA decode with DECODE["mha_dot"] False: dot products on CUDA cores."""
    monkeypatch.setitem(ops[0].DECODE, "mha_dot", False)
    test_attention_fp8_decode(ops, torch.bfloat16, "mha", None, v_group)


@pytest.mark.parametrize("kind", list(HEADS))
def test_attention_fp8_decode_heads_fastest(ops, monkeypatch, kind):
    """DECODE["heads_fastest"]: a sequence's KV heads in adjacent programs, the same output."""
    monkeypatch.setitem(ops[0].DECODE, "heads_fastest", True)
    test_attention_fp8_decode(ops, torch.bfloat16, kind, None)


@V_GROUPS
@pytest.mark.parametrize("run", WINDOW_RUNS, ids=lambda r: "-".join(map(str, r)))
def test_attention_fp8_window_softcap(ops, run, v_group):
    """Prefill chunks whose windows start inside the earlier context, and decode over 1, 4 and
    the launcher's splits of the window's keys (bf16); in the grouped V layout windows that
    start inside a group (the context window + 9 sees keys from 9), read from its start."""
    kind, window, softcap = run
    dtype, scale, kv_heads = torch.bfloat16, _scale(kind), HEADS[kind][1]
    q, pool, scales, meta = _case(kind, WINDOW_PREFILL_SEQS, dtype, seed=7, v_group=v_group)
    mine = ops[1].attention(
        q, pool, meta, kv_heads, scale, window, softcap, scales=scales, v_group=v_group
    )
    check_fp8(
        mine, q, pool, scales, meta, kv_heads, scale, window, softcap, dtype, ref.attention, v_group
    )
    gen = torch.Generator().manual_seed(8)
    contexts = torch.randint(1, 2 * max(window, 2048), (32,), generator=gen).tolist()
    contexts += [1, window or 7, window + 1, window + 9]
    q, pool, scales, meta = _case(kind, [(1, c) for c in contexts], dtype, seed=8, v_group=v_group)
    layer = (kv_heads, scale, window, softcap)
    for splits in (1, 4, None):
        mine = ops[0].decode_splits(
            q, pool, meta, kv_heads, scale, splits, window, softcap, scales=scales, v_group=v_group
        )
        check_fp8(mine, q, pool, scales, meta, *layer, dtype, ref.attention_decode, v_group)


@pytest.mark.parametrize(
    "kind,v_group", [(kind, 0) for kind in HEADS] + [("gqa", GROUP), ("gemma2", GROUP)], ids=str
)
def test_attention_fp8_decode_cuda_graph(ops, kind, v_group):
    """attention_decode on fp8 pages captured once, replayed on two other steps whose pages,
    scales, queries and lengths were copied into the captured buffers: equal to eager runs on
    those steps, and close to the twin (the graph reads the scale table through its pointer,
    as the engine's decode graphs read the pool's); also in the grouped V layout."""
    dtype, batch, max_ctx = torch.bfloat16, 24, 2048
    scale, kv_heads = _scale(kind), HEADS[kind][1]
    window, softcap = (1024, 50.0) if kind == "gemma2" else (0, 0.0)
    gen = torch.Generator().manual_seed(5)
    steps = []
    for seed in range(3):
        contexts = torch.randint(1, max_ctx, (batch,), generator=gen).tolist()
        sizes = dict(num_pages=2 * batch * max_ctx + 8, max_ctx=max_ctx, v_group=v_group)
        steps.append(_case(kind, [(1, c) for c in contexts], dtype, seed, **sizes))

    def step(q, pool, scales, meta):
        return ops[1].attention_decode(
            q, pool, meta, kv_heads, scale, window, softcap, scales, v_group
        )

    q, pool, scales = (t.clone() for t in steps[0][:3])
    meta = dataclasses.replace(steps[0][3], **{
        f: getattr(steps[0][3], f).clone() for f in ("b1_start", "b_seq_len", "page_table")
    })  # fmt: skip
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(q, pool, scales, meta)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static = step(q, pool, scales, meta)
    for cq, cpool, cscales, cmeta in steps[1:]:
        for dst, src in ((q, cq), (pool, cpool), (scales, cscales)):
            dst.copy_(src)
        for f in ("b1_start", "b_seq_len", "page_table"):
            getattr(meta, f).copy_(getattr(cmeta, f))
        graph.replay()
        o_eager = step(cq, cpool, cscales, cmeta)
        assert torch.equal(o_static, o_eager)
        expected = ref.attention_decode(
            cq, cpool, cmeta, kv_heads, scale, window, softcap, scales=cscales, v_group=v_group
        )
        assert_close(o_eager, expected, dtype)


# (first position, tokens) of a step's sequences: prefills of fresh groups, chunks continuing
# a group (from 37, 64, 3), decode rows inside a group and at its start (16, 0, 47)
GROUPED_WRITE_ROWS = [
    (0, 300),
    (37, 100),
    (0, 1),
    (16, 1),
    (5, 1),
    (31, 1),
    (0, 16),
    (64, 40),
    (3, 5),
    (0, 7),
    (47, 1),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_write_fp8_grouped_bytes_equal_twin(ops, dtype):
    """The Triton kv_write in the grouped V layout against its twin byte for byte at Llama-3-8B's
    KV (8 heads of 128) on a noisy pool: a step of prefills over fresh groups (tails zeroed),
    chunks continuing groups, decode rows inside and at the start of a group, and padding."""
    kv_heads, head_dim, num_groups = 8, 128, 96
    kv_dim = kv_heads * head_dim
    gen = torch.Generator().manual_seed(9)
    pool = torch.randn(num_groups * GROUP, kv_dim, generator=gen).to(dtype).cuda()
    order = torch.randperm(num_groups, generator=gen)
    rows, cursor = [], 0
    for start, n in GROUPED_WRITE_ROWS:
        groups = order[cursor : cursor + (start + n - 1) // GROUP - start // GROUP + 1]
        cursor += groups.shape[0]
        positions = torch.arange(start, start + n)
        rows.append(groups[positions // GROUP - start // GROUP] * GROUP + positions % GROUP)
    rows.insert(2, torch.tensor([-1]))  # padding rows
    rows.append(torch.tensor([-1, -1]))
    pages = torch.cat(rows).int()[:, None].repeat(1, 2).contiguous().cuda()
    qkv = torch.randn(pages.shape[0], 3 * kv_dim, generator=gen).to(dtype).cuda()
    k, v = qkv[:, kv_dim : 2 * kv_dim] * 3, qkv[:, 2 * kv_dim :]  # strided rows, as the model's
    scales = torch.rand(pool.shape[0], 2 * kv_heads, generator=gen).cuda()
    mine, theirs, mine_scales = pool.clone(), pool.clone(), scales.clone()
    ops[1].kv_write(mine, k, v, pages, scales=mine_scales, v_group=GROUP)
    ref.kv_write(theirs, k, v, pages, scales=scales, v_group=GROUP)
    assert torch.equal(mine_scales, scales)
    assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
