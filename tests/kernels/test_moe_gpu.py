"""The fused MoE kernels against their torch twin on a CUDA device: bf16 and fp16 at the expert
shapes of Qwen3-30B-A3B (hidden 2048, 128 experts of 768, top-8) and Mixtral-8x7B (hidden 4096,
8 experts of 14336, top-2), decode and prefill token counts, routing uniform, skewed onto one
expert and with "no expert" slots; and a decode step captured in a CUDA graph, replayed on
other routing.

Run on the device machine: ``.venv/bin/python -m pytest -q -m gpu tests/kernels/test_moe_gpu.py``.
The case builders are those of tests/kernels/test_moe_interpret.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_moe_interpret import routing

from slora_kernels import ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled kernels only"),
]

TOL = {torch.bfloat16: (3e-2, 3e-2), torch.float16: (1e-2, 1e-2), torch.float32: (1e-4, 1e-4)}
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}


def experts(name: str, dtype: torch.dtype, seed: int = 0):
    hidden, inter, num_experts, _ = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen)
    down = torch.randn(num_experts, hidden, inter, device="cuda", generator=gen)
    return (gate_up * hidden**-0.5).to(dtype), (down * inter**-0.5).to(dtype)


def cuda_routing(num_tokens, num_experts, top_k, popularity, seed):
    weights, ids = routing(num_tokens, num_experts, top_k, popularity, seed)
    return weights.cuda(), ids.cuda()


@pytest.mark.parametrize("popularity", ["uniform", "skewed", "gaps"])
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("model", list(SHAPES))
def test_fused_moe_matches_twin(model, dtype, num_tokens, popularity):
    from slora_kernels import triton_ops

    hidden, _, num_experts, top_k = SHAPES[model]
    gate_up, down = experts(model, dtype)
    x = torch.randn(num_tokens, hidden, device="cuda").to(dtype)
    weights, ids = cuda_routing(num_tokens, num_experts, top_k, popularity, seed=num_tokens)
    mine = triton_ops.fused_moe(x, gate_up, down, weights, ids)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(
        mine, ref.fused_moe(x, gate_up, down, weights, ids), rtol=rtol, atol=atol
    )


def test_fused_moe_fp32_is_exact_to_the_twin():
    from slora_kernels import triton_ops

    gate_up, down = experts("qwen3-30b-a3b", torch.float32)
    x = torch.randn(64, 2048, device="cuda")
    weights, ids = cuda_routing(64, 128, 8, "uniform", seed=3)
    mine = triton_ops.fused_moe(x, gate_up, down, weights, ids)
    rtol, atol = TOL[torch.float32]
    torch.testing.assert_close(
        mine, ref.fused_moe(x, gate_up, down, weights, ids), rtol=rtol, atol=atol
    )


@pytest.mark.parametrize("model", list(SHAPES))
def test_cuda_graph_decode_step(model):
    """Capture fused_moe on one decode step's routing; replay on two others copied into the
    same buffers: equal to eager runs on those steps."""
    from slora_kernels import triton_ops

    dtype, batch = torch.bfloat16, 24
    hidden, _, num_experts, top_k = SHAPES[model]
    gate_up, down = experts(model, dtype)
    steps = [
        (
            torch.randn(batch, hidden, device="cuda").to(dtype),
            *cuda_routing(batch, num_experts, top_k, popularity, seed),
        )
        for seed, popularity in enumerate(["uniform", "skewed", "gaps"])
    ]
    static = [t.clone() for t in steps[0]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        triton_ops.fused_moe(static[0], gate_up, down, static[1], static[2])  # compile first
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_ops.fused_moe(static[0], gate_up, down, static[1], static[2])
    for x, weights, ids in steps[1:]:
        for buffer, value in zip(static, (x, weights, ids), strict=True):
            buffer.copy_(value)
        graph.replay()
        eager = triton_ops.fused_moe(x, gate_up, down, weights, ids)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
