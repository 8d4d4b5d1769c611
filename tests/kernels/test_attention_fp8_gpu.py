"""The Triton attention kernels on fp8 KV pages against their torch twins on a CUDA card with
fp8 (sm 8.9+): prefill, split-KV decode (and MHA's CUDA-core path), Gemma-2-9B's head_dim 256
with its window and soft-cap, and a decode step captured in a CUDA graph and replayed on other
steps' pages and scales. Shapes as tests/kernels/test_kernels_gpu.py's; cases from
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(HEADS))
def test_attention_fp8_prefill(ops, dtype, kind):
    q, pool, scales, meta = _case(kind, PREFILL_SEQS, dtype, seed=1)
    scale, kv_heads = _scale(kind), HEADS[kind][1]
    mine = ops[1].attention(q, pool, meta, kv_heads, scale, scales=scales)
    check_fp8(mine, q, pool, scales, meta, kv_heads, scale, 0, 0.0, dtype, ref.attention)


@pytest.mark.parametrize("window", [0, 256], ids=["full", "window"])
@pytest.mark.parametrize("kind", list(HEADS))
def test_attention_fp8_prefill_reads_the_steps_own_rows(ops, kind, window):
    """bf16: the step's keys from its own K/V rows (random, V's rows strided) rounded through
    e4m3 in registers, the earlier ones from the fp8 pages."""
    seqs = WINDOW_PREFILL_SEQS if window else PREFILL_SEQS
    q, pool, scales, meta = _case(kind, seqs, torch.bfloat16, seed=3)
    scale, kv_heads = _scale(kind), HEADS[kind][1]
    own = own_rows(meta, kv_heads * q.shape[2], torch.bfloat16, seed=4)
    args = (q, pool, meta, kv_heads, scale, window)
    expected = ref.attention(*args, scales=scales, own=own)
    assert_close(ops[1].attention(*args, scales=scales, own=own), expected, torch.bfloat16)
    assert not torch.allclose(ref.attention(*args, scales=scales).float(), expected.float(),
                              atol=0.1)  # fmt: skip


@pytest.mark.parametrize("splits", [1, 4, None])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(HEADS))
def test_attention_fp8_decode(ops, dtype, kind, splits):
    contexts = torch.randint(1, 4000, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    q, pool, scales, meta = _case(kind, [(1, c) for c in contexts + [1, 4096]], dtype, seed=2)
    scale, kv_heads = _scale(kind), HEADS[kind][1]
    mine = ops[0].decode_splits(q, pool, meta, kv_heads, scale, splits, scales=scales)
    check_fp8(mine, q, pool, scales, meta, kv_heads, scale, 0, 0.0, dtype, ref.attention_decode)


def test_attention_fp8_decode_mha_cuda_cores(ops, monkeypatch):
    """MHA decode with DECODE["mha_dot"] False: dot products on CUDA cores."""
    monkeypatch.setitem(ops[0].DECODE, "mha_dot", False)
    test_attention_fp8_decode(ops, torch.bfloat16, "mha", None)


@pytest.mark.parametrize("kind", list(HEADS))
def test_attention_fp8_decode_heads_fastest(ops, monkeypatch, kind):
    """DECODE["heads_fastest"]: a sequence's KV heads in adjacent programs, the same output."""
    monkeypatch.setitem(ops[0].DECODE, "heads_fastest", True)
    test_attention_fp8_decode(ops, torch.bfloat16, kind, None)


@pytest.mark.parametrize("run", WINDOW_RUNS, ids=lambda r: "-".join(map(str, r)))
def test_attention_fp8_window_softcap(ops, run):
    """Prefill chunks whose windows start inside the earlier context, and decode over 1, 4 and
    the launcher's splits of the window's keys (bf16)."""
    kind, window, softcap = run
    dtype, scale, kv_heads = torch.bfloat16, _scale(kind), HEADS[kind][1]
    q, pool, scales, meta = _case(kind, WINDOW_PREFILL_SEQS, dtype, seed=7)
    mine = ops[1].attention(q, pool, meta, kv_heads, scale, window, softcap, scales=scales)
    check_fp8(mine, q, pool, scales, meta, kv_heads, scale, window, softcap, dtype, ref.attention)
    gen = torch.Generator().manual_seed(8)
    contexts = torch.randint(1, 2 * max(window, 2048), (32,), generator=gen).tolist()
    contexts += [1, window or 7, window + 1]
    q, pool, scales, meta = _case(kind, [(1, c) for c in contexts], dtype, seed=8)
    for splits in (1, 4, None):
        mine = ops[0].decode_splits(q, pool, meta, kv_heads, scale, splits, window, softcap,
                                    scales=scales)  # fmt: skip
        check_fp8(mine, q, pool, scales, meta, kv_heads, scale, window, softcap, dtype,
                  ref.attention_decode)  # fmt: skip


@pytest.mark.parametrize("kind", list(HEADS))
def test_attention_fp8_decode_cuda_graph(ops, kind):
    """attention_decode on fp8 pages captured once, replayed on two other steps whose pages,
    scales, queries and lengths were copied into the captured buffers: equal to eager runs on
    those steps, and close to the twin (the graph reads the scale table through its pointer,
    as the engine's decode graphs read the pool's)."""
    dtype, batch, max_ctx = torch.bfloat16, 24, 2048
    scale, kv_heads = _scale(kind), HEADS[kind][1]
    window, softcap = (1024, 50.0) if kind == "gemma2" else (0, 0.0)
    gen = torch.Generator().manual_seed(5)
    steps = []
    for seed in range(3):
        contexts = torch.randint(1, max_ctx, (batch,), generator=gen).tolist()
        steps.append(_case(kind, [(1, c) for c in contexts], dtype, seed,
                           num_pages=2 * batch * max_ctx + 8, max_ctx=max_ctx))  # fmt: skip

    def step(q, pool, scales, meta):
        return ops[1].attention_decode(q, pool, meta, kv_heads, scale, window, softcap, scales)

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
        expected = ref.attention_decode(cq, cpool, cmeta, kv_heads, scale, window, softcap,
                                        scales=cscales)  # fmt: skip
        assert_close(o_eager, expected, dtype)
