"""The expert LoRA kernels build for the H200 (sm_90) at Qwen3-30B-A3B's and Mixtral-8x7B's
expert shapes and the block sizes the launcher picks (decode and prefill), without register
spills: Triton compiles for the target with no GPU (the interpreter tests check what the kernels
compute, not that they compile)."""

from __future__ import annotations

import os

import pytest

from slora_kernels import moe_lora
from slora_kernels.build_check import build, cuobjdump, resource_usage

pytestmark = pytest.mark.skipif(not os.path.exists(cuobjdump()), reason="Triton ships no cuobjdump")

POINTERS = {name: "*bf16" for name in ("x_ptr", "w_ptr", "act_ptr", "y_ptr", "pool_ptr")} | {
    "weights_ptr": "*fp32",
    "v_ptr": "*fp32",
}
# (hidden, expert size, experts, top-k, page): the page is the model's kv_dim
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8, 512), "mixtral-8x7b": (4096, 14336, 8, 2, 1024)}


def pages(width: int, page: int) -> int:
    return -(-width // page)


@pytest.mark.slow
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("model", list(SHAPES))
def test_expert_lora_kernels_build_without_spills(model, block_m):
    hidden, inter, experts, top_k, page = SHAPES[model]
    common = dict(NUM_EXPERTS=experts, NUM_TARGETS=12, PAGE=page)
    for step, (d_in, d_out) in enumerate(((hidden, 2 * inter), (inter, hidden))):
        per_in, per_out = pages(d_in, page), pages(d_out, page)
        shrink = dict(TOP_K=top_k, PER_SLOT=step == 1, D_IN=d_in, PER_IN=per_in, **common)
        shrink.update(BLOCK_R=moe_lora.BLOCK_R, BLOCK_K=moe_lora.SHRINK_K)
        gemm = dict(TOP_K=top_k, HIDDEN=hidden, INTER=inter, BLOCK_M=block_m, BLOCK_N=64)
        gemm.update(BLOCK_K=64, PRECISION="tf32", PER_IN=per_in, PER_OUT=per_out, **common)
        kernel = moe_lora._gate_up_lora_kernel if step == 0 else moe_lora._down_lora_kernel
        for fn, constexprs in ((moe_lora._shrink_kernel, shrink), (kernel, gemm)):
            usage = resource_usage(build(fn, constexprs, 4, POINTERS))
            assert usage["LOCAL"] == 0, (fn.__name__, usage)
