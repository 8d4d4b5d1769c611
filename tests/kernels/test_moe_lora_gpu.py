"""The expert LoRA kernels against their torch twin on a CUDA device: bf16 and fp16 at the expert
shapes of Qwen3-30B-A3B (hidden 2048, 128 experts of 768, top-8, pages of 512) and Mixtral-8x7B
(hidden 4096, 8 experts of 14336, top-2, pages of 1024), decode and prefill token counts,
adapters of mixed ranks beside tokens without one, routing uniform, skewed onto one expert and
with "no expert" slots; and a decode step captured in a CUDA graph, replayed on other routing
and other adapters.

Run on the device machine: ``.venv/bin/python -m pytest -q -m gpu tests/kernels/test_moe_lora_gpu.py``.
The case builders are those of tests/kernels/test_moe_lora_interpret.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_moe_gpu import SHAPES, TOL, cuda_routing, experts
from test_moe_lora_interpret import RANKS, TARGETS, adapter_slots, expert_case

from slora_kernels import ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled kernels only"),
]
PAGES = {"qwen3-30b-a3b": 512, "mixtral-8x7b": 1024}  # kv_dim: 4 and 8 KV heads of 128


def inputs(model: str, dtype: torch.dtype, num_tokens: int, routing: str, adapters: str):
    hidden, inter, num_experts, top_k = SHAPES[model]
    gate_up, down = experts(model, dtype)
    x = torch.randn(num_tokens, hidden, device="cuda").to(dtype)
    weights, ids = cuda_routing(num_tokens, num_experts, top_k, routing, seed=num_tokens)
    b_slot = adapter_slots(num_tokens, len(RANKS), adapters, seed=num_tokens)
    case = expert_case(RANKS, b_slot, (hidden, inter), num_experts, PAGES[model], dtype, seed=1)
    return case.to("cuda"), (x, gate_up, down, weights, ids)


@pytest.mark.parametrize(
    ("routing", "adapters"), [("uniform", "uniform"), ("skewed", "skewed"), ("gaps", "uniform")]
)
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("model", list(SHAPES))
def test_fused_moe_lora_matches_twin(model, dtype, num_tokens, routing, adapters):
    from slora_kernels import triton_ops

    case, args = inputs(model, dtype, num_tokens, routing, adapters)
    mine = triton_ops.fused_moe_lora(*args, case.pool, case.meta, TARGETS)
    expected = ref.fused_moe_lora(*args, case.pool, case.meta, TARGETS)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(mine, expected, rtol=rtol, atol=atol)


def test_fused_moe_lora_fp32_is_exact_to_the_twin():
    from slora_kernels import triton_ops

    case, args = inputs("qwen3-30b-a3b", torch.float32, 64, "uniform", "uniform")
    mine = triton_ops.fused_moe_lora(*args, case.pool, case.meta, TARGETS)
    expected = ref.fused_moe_lora(*args, case.pool, case.meta, TARGETS)
    rtol, atol = TOL[torch.float32]
    torch.testing.assert_close(mine, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("model", list(SHAPES))
def test_cuda_graph_decode_step(model):
    """Capture fused_moe_lora on one decode step's routing and adapters; replay on two others
    copied into the same buffers: equal to eager runs on those steps."""
    from slora_kernels import triton_ops

    dtype, batch = torch.bfloat16, 24
    case, first = inputs(model, dtype, batch, "uniform", "uniform")
    _, _, _, top_k = SHAPES[model]
    steps = []
    for seed, (routing, adapters) in enumerate([("skewed", "skewed"), ("gaps", "uniform")]):
        x = torch.randn(batch, first[0].shape[1], device="cuda").to(dtype)
        weights, ids = cuda_routing(batch, SHAPES[model][2], top_k, routing, seed)
        steps.append((x, weights, ids, adapter_slots(batch, len(RANKS), adapters, seed).cuda()))
    x, gate_up, down, weights, ids = first
    static = [x.clone(), weights.clone(), ids.clone()]
    b_slot = case.meta.b_slot

    def launch():
        return triton_ops.fused_moe_lora(
            static[0], gate_up, down, static[1], static[2], case.pool, case.meta, TARGETS
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch()  # compile first
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch()
    for step in steps:
        for buffer, value in zip([*static, b_slot], step, strict=True):
            buffer.copy_(value)
        graph.replay()
        eager = triton_ops.fused_moe_lora(
            step[0], gate_up, down, step[1], step[2], case.pool, case.meta, TARGETS
        )
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
