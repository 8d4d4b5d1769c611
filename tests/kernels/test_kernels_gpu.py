"""Triton kernels against their torch twins on a CUDA device: bf16 and fp16 at realistic shapes
(hidden 4096, head_dim 128, 32 heads, MHA and GQA 32/8; Gemma-2-9B's 16/8 heads of 256 with its
4096-key sliding window and logit soft-cap), pools past 2^31 elements, and a decode step
(attention + LoRA) captured in a CUDA graph and replayed on new metadata.

Run on the device machine: ``.venv/bin/python -m pytest -q -m gpu tests/kernels/test_kernels_gpu.py``.
The case builders are those of tests/kernels/test_kernels_interpret.py.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from test_kernels_interpret import (
    assert_close,
    attn_case,
    check_lora_groups,
    lora_case,
    pad_segments,
    set_path,
)

from slora_kernels import ref
from slora_kernels.meta import VECTOR_ALL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled kernels only"),
]

DTYPES = [torch.bfloat16, torch.float16]
RANKS = [1, 3, 8, 16, 32, 64, 128, 5, 24]
MODELS = {  # name: (target dims in canonical order, page size = kv_dim)
    "llama2-7b": (
        {"q": (4096, 4096), "k": (4096, 4096), "v": (4096, 4096), "o": (4096, 4096),
         "gate": (4096, 11008), "up": (4096, 11008), "down": (11008, 4096)},
        4096,
    ),
    "llama3-8b": (
        {"q": (4096, 4096), "k": (4096, 1024), "v": (4096, 1024), "o": (4096, 4096),
         "gate": (4096, 14336), "up": (4096, 14336), "down": (14336, 4096)},
        1024,
    ),
    "phi3-mini": (  # fused targets: one B over q | k | v (3 x 3072), one over gate | up
        {"qkv": (3072, 9216), "o": (3072, 3072), "gate_up": (3072, 16384), "down": (8192, 3072)},
        3072,
    ),
}  # fmt: skip
HEADS = {"mha": (32, 32), "gqa": (32, 8), "gemma2": (16, 8)}  # gemma2: head_dim 256
LARGE_PAGE_OFFSET = 2**31  # elements: pages placed past it need int64 offsets


@pytest.fixture(scope="module")
def ops():
    from slora_kernels import attention, attention_decode, lora_blocks, triton_ops

    fields = ["lora_blocks", "attention", "attention_decode", "triton_ops"]
    return dataclasses.make_dataclass("Ops", fields)(
        lora_blocks, attention, attention_decode, triton_ops
    )


def _lora(model: str, num_tokens: int, popularity: str, dtype, seed: int, b_slot=None):
    dims, page = MODELS[model]
    return lora_case(page=page, target_dims=dims, ranks=RANKS, num_tokens=num_tokens,
                     popularity=popularity, base_share=0.2, dtype=dtype, device="cuda",
                     seed=seed, b_slot=b_slot)  # fmt: skip


def _check_lora(shrink, expand, pool, meta, dims, dtype, targets=None) -> None:
    gen = torch.Generator("cuda").manual_seed(0)
    num_tokens = meta.b_slot.shape[0]
    for index, (d_in, d_out) in enumerate(dims.values()):
        if targets is not None and index not in targets:
            continue
        x = torch.randn(num_tokens, d_in, generator=gen, device="cuda").to(dtype)
        buf = torch.randn(num_tokens, meta.max_rank, generator=gen, device="cuda")
        mine, theirs = buf.clone(), buf.clone()
        shrink(x, pool, meta, index, mine)
        ref.lora_shrink(x, pool, meta, index, theirs)
        assert_close(mine, theirs, dtype)
        wide = torch.randn(num_tokens, d_out + 64, generator=gen, device="cuda").to(dtype)
        mine, theirs = wide.clone(), wide.clone()
        expand(buf, pool, meta, index, mine[:, 32 : 32 + d_out])
        ref.lora_expand(buf, pool, meta, index, theirs[:, 32 : 32 + d_out])
        assert_close(mine, theirs, dtype)
    if targets is None and num_tokens <= 256:  # groups: decode-sized steps (the ref is slow)
        check_lora_groups(shrink, expand, pool, meta, dims, dtype, seed=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize(
    "num_tokens,popularity",
    [(1, "uniform"), (16, "skewed"), (96, "skewed"), (256, "uniform"), (512, "one"),
     (1024, "uniform"), (2048, "skewed")],
)  # fmt: skip
def test_lora(ops, dtype, model, num_tokens, popularity):
    """Decode-sized steps (16-token blocks, split reductions) to prefill-sized ones (32)."""
    pool, meta = _lora(model, num_tokens, popularity, dtype, seed=num_tokens)
    shrink, expand = ops.triton_ops.lora_shrink, ops.triton_ops.lora_expand
    _check_lora(shrink, expand, pool, meta, MODELS[model][0], dtype)


# The tiled expand's rank rows a dot (slora_kernels.lora_blocks.BLOCKS "er"): "launcher" runs the default,
# "other" the other setting (the step's whole largest rank in one dot, or 16 rows a dot).
EXPAND_KNOBS = ["launcher", "other"]


def _expand_knobs(ops, monkeypatch, knobs: str, tiled: bool) -> None:
    if knobs == "other":
        if not tiled:
            pytest.skip("the knob changes the tiled expand only")
        monkeypatch.setitem(ops.lora_blocks.BLOCKS, "er", 0 if ops.lora_blocks.BLOCKS["er"] else 16)


@pytest.mark.parametrize("knobs", EXPAND_KNOBS)
@pytest.mark.parametrize("path", ["tiled", "indexed", "vector"])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("num_tokens,popularity", [(256, "uniform"), (1024, "skewed")])
def test_lora_paths(ops, monkeypatch, model, num_tokens, popularity, path, knobs):
    """Every segment on one kernel family, the tiled (matrix) or the vector (per-token) one, or
    both, the vector kernels given their tokens ("indexed")."""
    _expand_knobs(ops, monkeypatch, knobs, tiled=path != "vector")
    pool, meta = _lora(model, num_tokens, popularity, torch.bfloat16, seed=num_tokens + 1)
    set_path(meta, path)
    shrink, expand = ops.triton_ops.lora_shrink, ops.triton_ops.lora_expand
    _check_lora(shrink, expand, pool, meta, MODELS[model][0], torch.bfloat16)


def _attn(kind: str, seqs, dtype, seed: int, **kw):
    num_heads, num_kv_heads = HEADS[kind]
    head_dim = 256 if kind == "gemma2" else 128
    return attn_case(seqs=seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     dtype=dtype, device="cuda", seed=seed, **kw)  # fmt: skip


PREFILL_SEQS = [(512, 512), (100, 1000), (1, 300), (37, 37), (256, 2048), (3, 3000), (64, 65)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(HEADS))
def test_attention_prefill(ops, dtype, kind):
    q, pool, meta = _attn(kind, PREFILL_SEQS, dtype, seed=1)
    scale = 128**-0.5
    num_kv_heads = HEADS[kind][1]
    assert_close(ops.triton_ops.attention(q, pool, meta, num_kv_heads, scale),
                 ref.attention(q, pool, meta, num_kv_heads, scale), dtype)  # fmt: skip


@pytest.mark.parametrize("splits", [1, 4, None])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(HEADS))
def test_attention_decode(ops, dtype, kind, splits):
    contexts = torch.randint(1, 4000, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    q, pool, meta = _attn(kind, [(1, c) for c in contexts + [1, 4096]], dtype, seed=2)
    scale = 128**-0.5
    num_kv_heads = HEADS[kind][1]
    mine = ops.attention_decode.decode_splits(q, pool, meta, num_kv_heads, scale, splits)
    assert_close(mine, ref.attention_decode(q, pool, meta, num_kv_heads, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_decode_mha_cuda_cores(ops, monkeypatch, dtype):
    """MHA decode with DECODE["mha_dot"] False: dot products on CUDA cores, 32 keys a step."""
    monkeypatch.setitem(ops.attention_decode.DECODE, "mha_dot", False)
    test_attention_decode(ops, dtype, "mha", None)


@pytest.mark.parametrize("kind", list(HEADS))
def test_attention_decode_heads_fastest(ops, monkeypatch, kind):
    """DECODE["heads_fastest"]: a sequence's KV heads in adjacent programs, the same output."""
    monkeypatch.setitem(ops.attention_decode.DECODE, "heads_fastest", True)
    test_attention_decode(ops, torch.bfloat16, kind, None)


# Sliding windows and soft-caps: (heads, window, softcap). gemma2: Gemma-2-9B's local layers
# (head_dim 256, window 4096, softcap 50) and its global ones (no window); the Mistral-style
# window on the head_dim 128 tiles.
WINDOW_RUNS = [("gemma2", 4096, 50.0), ("gemma2", 0, 50.0), ("gqa", 1024, 0.0), ("mha", 300, 30.0)]
WINDOW_PREFILL_SEQS = [(512, 5000), (1000, 1000), (37, 4096), (1, 4097), (300, 6000), (64, 65)]


def _scale(kind: str) -> float:
    return (256 if kind == "gemma2" else 128) ** -0.5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("run", WINDOW_RUNS, ids=lambda r: "-".join(map(str, r)))
def test_attention_prefill_window_softcap(ops, dtype, run):
    """Chunks whose windows start inside the earlier context (512 new on 5000), contexts past,
    at and under the window; the key loop skips the blocks before each tile's window."""
    kind, window, softcap = run
    q, pool, meta = _attn(kind, WINDOW_PREFILL_SEQS, dtype, seed=7)
    scale, num_kv_heads = _scale(kind), HEADS[kind][1]
    mine = ops.triton_ops.attention(q, pool, meta, num_kv_heads, scale, window, softcap)
    expected = ref.attention(q, pool, meta, num_kv_heads, scale, window, softcap)
    assert_close(mine, expected, dtype)


@pytest.mark.parametrize("splits", [1, 4, None])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("run", WINDOW_RUNS, ids=lambda r: "-".join(map(str, r)))
def test_attention_decode_window_softcap(ops, dtype, run, splits):
    """Contexts up to twice the window (and at it, one past it); the splits cover the window's
    keys only."""
    kind, window, softcap = run
    gen = torch.Generator().manual_seed(8)
    contexts = torch.randint(1, 2 * max(window, 2048), (32,), generator=gen).tolist()
    contexts += [1, window or 7, window + 1]
    q, pool, meta = _attn(kind, [(1, c) for c in contexts], dtype, seed=8)
    scale, num_kv_heads = _scale(kind), HEADS[kind][1]
    mine = ops.attention_decode.decode_splits(
        q, pool, meta, num_kv_heads, scale, splits, window, softcap
    )
    expected = ref.attention_decode(q, pool, meta, num_kv_heads, scale, window, softcap)
    assert_close(mine, expected, dtype)


def _shift_pages(table: torch.Tensor, offset: int) -> torch.Tensor:
    return torch.where(table >= 0, table + offset, table)


def test_pool_past_2_31_elements(ops):
    """Pages whose element offset exceeds 2^31: KV write, attention and LoRA read them right."""
    dtype, kind = torch.bfloat16, "gqa"
    q, small, meta = _attn(kind, [(40, 300), (1, 129)], dtype, seed=3)
    page = small.shape[1]
    offset = LARGE_PAGE_OFFSET // page
    big = torch.zeros(offset + small.shape[0], page, dtype=dtype, device="cuda")
    big[offset:] = small
    far = dataclasses.replace(meta, page_table=_shift_pages(meta.page_table, offset))
    scale = 128**-0.5
    assert_close(ops.triton_ops.attention(q, big, far, 8, scale),
                 ref.attention(q, small, meta, 8, scale), dtype)  # fmt: skip
    kv = torch.randn(5, 2, page, device="cuda").to(dtype)
    pages = torch.arange(10, dtype=torch.int32, device="cuda").view(5, 2)
    ops.triton_ops.kv_write(big, kv[:, 0], kv[:, 1], pages + offset)
    ref.kv_write(small, kv[:, 0], kv[:, 1], pages)
    assert torch.equal(big[offset:], small)
    del big
    lora_pool, lora_meta = _lora("llama3-8b", 64, "uniform", dtype, seed=4)
    lora_big = torch.zeros(offset + lora_pool.shape[0], page, dtype=dtype, device="cuda")
    lora_big[offset:] = lora_pool
    far = dataclasses.replace(lora_meta, slot_pages=_shift_pages(lora_meta.slot_pages, offset))
    x = torch.randn(64, 4096, device="cuda").to(dtype)
    mine = torch.zeros(64, far.max_rank, device="cuda")
    theirs = mine.clone()
    ops.triton_ops.lora_shrink(x, lora_big, far, 0, mine)
    ref.lora_shrink(x, lora_pool, lora_meta, 0, theirs)
    assert_close(mine, theirs, dtype)
    out = torch.zeros(64, 4096, device="cuda").to(dtype)
    mine_out, theirs_out = out.clone(), out.clone()
    ops.triton_ops.lora_expand(theirs, lora_big, far, 0, mine_out)
    ref.lora_expand(theirs, lora_pool, lora_meta, 0, theirs_out)
    assert_close(mine_out, theirs_out, dtype)


@pytest.mark.parametrize("knobs", EXPAND_KNOBS)
@pytest.mark.parametrize("tiled", [False, True], ids=["vector", "tiled"])
@pytest.mark.parametrize("kind", list(HEADS))
def test_cuda_graph_decode_step(ops, monkeypatch, kind, tiled, knobs):
    """Capture attention_decode + shrink/expand of q once; replay on two other steps' metadata
    copied into the same buffers: equal to eager runs on those steps. Vector: every token on the
    vector kernels (VECTOR_ALL). Tiled: every segment on the tiled kernels, with no pos_seg in
    the metadata, so each launch builds it (a warm-up that kept it would fix step 0's segments
    into the graph). gemma2: head_dim 256 with a 1024-key window and a soft-cap, contexts
    past the window in every step."""
    _expand_knobs(ops, monkeypatch, knobs, tiled)
    dtype, batch, max_ctx, num_pages = torch.bfloat16, 24, 2048, 2 * 24 * 2048 + 8
    dims, _ = MODELS["llama2-7b" if kind == "mha" else "llama3-8b"]
    scale, num_kv_heads = _scale(kind), HEADS[kind][1]
    window, softcap = (1024, 50.0) if kind == "gemma2" else (0, 0.0)
    gen = torch.Generator().manual_seed(5)
    steps = []
    for seed in range(3):
        contexts = torch.randint(1, max_ctx, (batch,), generator=gen).tolist()
        q, kv_pool, attn = _attn(kind, [(1, c) for c in contexts], dtype, seed, num_pages=num_pages,
                                 max_ctx=max_ctx)  # fmt: skip
        b_slot = torch.randint(-1, len(RANKS), (batch,), generator=gen)
        lora_pool, lora = _lora(kind == "mha" and "llama2-7b" or "llama3-8b", batch, "uniform",
                                dtype, seed=7, b_slot=b_slot)  # fmt: skip
        x = torch.randn(batch, 4096, device="cuda").to(dtype)
        vector_max = 0 if tiled else VECTOR_ALL
        padded = dataclasses.replace(pad_segments(lora, batch, max(RANKS)), vector_max=vector_max)
        steps.append((q, kv_pool, attn, lora_pool, padded, x))

    def step(q, kv_pool, attn, lora_pool, lora, x, buf, out):
        o = ops.triton_ops.attention_decode(q, kv_pool, attn, num_kv_heads, scale, window, softcap)
        ops.triton_ops.lora_shrink(x, lora_pool, lora, 0, buf)
        ops.triton_ops.lora_expand(buf, lora_pool, lora, 0, out)
        return o

    static = [t.clone() if isinstance(t, torch.Tensor) else _clone_meta(t) for t in steps[0]]
    buf = torch.zeros(batch, max(RANKS), device="cuda")
    out = torch.zeros(batch, dims["q"][1], device="cuda", dtype=dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(*static, buf, out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static = step(*static, buf, out)
    for current in steps[1:]:
        _copy_into(static, current)
        buf.zero_()
        out.zero_()
        graph.replay()
        eager_buf = torch.zeros_like(buf)
        eager_out = torch.zeros_like(out)
        o_eager = step(*current, eager_buf, eager_out)
        assert torch.equal(o_static, o_eager)
        assert torch.equal(buf, eager_buf) and torch.equal(out, eager_out)
        q, kv_pool, attn = current[:3]
        expected = ref.attention_decode(q, kv_pool, attn, num_kv_heads, scale, window, softcap)
        assert_close(o_eager, expected, dtype)


def _clone_meta(meta):
    return dataclasses.replace(meta, **{
        f.name: getattr(meta, f.name).clone()
        for f in dataclasses.fields(meta) if isinstance(getattr(meta, f.name), torch.Tensor)
    })  # fmt: skip


def _copy_into(static: list, current: tuple) -> None:
    for dst, src in zip(static, current, strict=True):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)
            continue
        for f in dataclasses.fields(dst):
            value = getattr(dst, f.name)
            if isinstance(value, torch.Tensor):
                value.copy_(getattr(src, f.name))
            else:
                assert value == getattr(src, f.name), f.name  # host ints must not change


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_ops(ops, dtype):
    gen = torch.Generator("cuda").manual_seed(6)
    x, residual = (torch.randn(300, 4096, generator=gen, device="cuda").to(dtype) for _ in "xr")
    weight = (torch.rand(4096, generator=gen, device="cuda") + 0.5).to(dtype)
    for res in (None, residual):
        y, r = ops.triton_ops.rms_norm(x, weight, 1e-5, res)
        y_ref, r_ref = ref.rms_norm(x, weight, 1e-5, res)
        assert_close(y, y_ref, dtype)
        assert torch.equal(r, r_ref)
    q = torch.randn(300, 32, 128, generator=gen, device="cuda").to(dtype)
    k = torch.randn(300, 8, 128, generator=gen, device="cuda").to(dtype)
    positions = torch.randint(0, 4096, (300,), generator=gen, device="cuda")
    freqs = torch.outer(torch.arange(4096.0), 1e4 ** -(torch.arange(0, 128, 2) / 128)).cuda()
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    mine_q, mine_k, ref_q, ref_k = q.clone(), k.clone(), q.clone(), k.clone()
    ops.triton_ops.rope(mine_q, mine_k, positions, cos_sin)
    ref.rope(ref_q, ref_k, positions, cos_sin)
    assert_close(mine_q, ref_q, dtype)
    assert_close(mine_k, ref_k, dtype)
    gate_up = torch.randn(300, 2 * 11008, generator=gen, device="cuda").to(dtype) * 3
    assert_close(ops.triton_ops.silu_mul(gate_up), ref.silu_mul(gate_up), dtype)
    gate_up = torch.randn(300, 2 * 14336, generator=gen, device="cuda").to(dtype) * 3  # Gemma 2
    assert_close(ops.triton_ops.gelu_tanh_mul(gate_up), ref.gelu_tanh_mul(gate_up), dtype)
    pool = torch.randn(1000, 1024, generator=gen, device="cuda").to(dtype)
    qkv = torch.randn(300, 6144, generator=gen, device="cuda").to(dtype)
    pages = torch.randperm(1000, device="cuda")[:600].view(300, 2).int()
    mine, theirs = pool.clone(), pool.clone()
    ops.triton_ops.kv_write(mine, qkv[:, 4096:5120], qkv[:, 5120:], pages)
    ref.kv_write(theirs, qkv[:, 4096:5120], qkv[:, 5120:], pages)
    assert torch.equal(mine, theirs)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA card with fp8",
)
def test_kv_write_fp8_bytes_equal_twin():
    from slora_kernels import kv, ref

    torch.manual_seed(0)
    kv_heads, head_dim, num_pages = 8, 128, 512
    pools_ = [torch.zeros(num_pages, kv_heads * head_dim, dtype=torch.bfloat16, device="cuda")
              for _ in range(2)]  # fmt: skip
    scales = [torch.ones(num_pages, 2 * kv_heads, device="cuda") for _ in range(2)]
    k = torch.randn(300, kv_heads * head_dim, dtype=torch.bfloat16, device="cuda") * 3
    v = torch.randn_like(k)
    pages = torch.randperm(num_pages, device="cuda")[:300].int()
    out_pages = torch.stack([pages, pages], 1).contiguous()
    out_pages[::7] = -1
    kv.kv_write(pools_[0], k, v, out_pages, scales=scales[0])
    ref.kv_write(pools_[1], k, v, out_pages, scales=scales[1])
    assert torch.equal(scales[0], scales[1])
    assert torch.equal(pools_[0].view(torch.uint8), pools_[1].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA card with fp8",
)
def test_act_quant_bytes_equal_twin():
    from slora_kernels import act_quant

    torch.manual_seed(0)
    x = torch.randn(1021, 14336, dtype=torch.bfloat16, device="cuda")
    x[3] = 0
    x[7] *= 1e4
    q, s = act_quant.quantize_rows(x, pad_to=16)
    q_ref, s_ref = act_quant.quantize_rows_ref(x, pad_to=16)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA card with fp8",
)
@pytest.mark.parametrize("op", ["rms_norm", "silu_mul", "gelu_tanh_mul"])
def test_fused_act_quant_is_the_op_then_quantize_rows(op):
    """bf16, Llama-3-8B widths at 1021 rows: the fused op's output is the unfused kernel's bit
    for bit, and its e4m3 bytes and scales the twin quantizer's of that output."""
    from slora_kernels import act_quant, triton_ops

    torch.manual_seed(1)
    width = 4096 if op == "rms_norm" else 2 * 14336
    x = torch.randn(1021, width, dtype=torch.bfloat16, device="cuda")
    x[3] = 0
    x[7] *= 1e3
    if op == "rms_norm":
        w = torch.rand(width, dtype=torch.bfloat16, device="cuda") + 0.5
        res = torch.randn_like(x)
        out, r, (q, s) = triton_ops.rms_norm_fp8(x, w, 1e-5, res, pad_to=16)
        unfused, r_unfused = triton_ops.rms_norm(x, w, 1e-5, res)
        assert torch.equal(r, r_unfused)
    else:
        out, (q, s) = getattr(triton_ops, f"{op}_fp8")(x, pad_to=16)
        unfused = getattr(triton_ops, op)(x)
    assert torch.equal(out, unfused)
    q_ref, s_ref = act_quant.quantize_rows_ref(out, pad_to=16)
    assert q.shape[0] == 1024 and torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
