"""The expand kernels that read vector rows (``VECTORS``: lora_B's bias, DoRA's g and c) build
for the H200 (sm_90) at the launchers' block sizes for Llama-2-7B shapes without register
spills and with vector loads of bf16 tiles, as the plain kernels do
(tests/kernels/test_kernels_build.py): Triton compiles for the target with no GPU."""

from __future__ import annotations

import os

import pytest

from slora_kernels import lora_blocks, lora_expand
from slora_kernels.build_check import EXPAND_ALIGNED, build, cuobjdump, global_loads, resource_usage

pytestmark = pytest.mark.skipif(not os.path.exists(cuobjdump()), reason="Triton ships no cuobjdump")

PAGE, RANK = 4096, 64  # Llama-2-7B's kv_dim; the acceptance workload's largest rank
B = lora_blocks.BLOCKS
VR, VN = lora_blocks.vector_block(PAGE, RANK, "vn")
BUILDS = {  # name: (kernel, constexprs, warps)
    "expand vector, indexed": (
        lora_expand._expand_vector_kernel,
        dict(PAGE=PAGE, NUM_TARGETS=12, BLOCK_R=VR, BLOCK_N=VN, ALL=False, INDEXED=True),
        B["vnwarps"],
    ),
    "expand vector, graph": (
        lora_expand._expand_vector_kernel,
        dict(PAGE=PAGE, NUM_TARGETS=12, BLOCK_R=VR, BLOCK_N=VN, ALL=True, INDEXED=False),
        B["vnwarps"],
    ),
    "expand tiled, prefill": (
        lora_expand._expand_kernel,
        dict(
            PAGE=PAGE,
            NUM_TARGETS=12,
            PRECISION="tf32",
            BLOCK_T=lora_blocks.block_tokens(4096, expand=True),
            BLOCK_R=lora_blocks.expand_rank_block(RANK),
            BLOCK_N=lora_blocks._pow2_divisor(PAGE, B["n"]),
            ALIGNED=False,
        ),
        B["twarps"],
    ),
    "expand tiled, decode": (
        lora_expand._expand_kernel,
        dict(
            PAGE=PAGE,
            NUM_TARGETS=12,
            PRECISION="tf32",
            BLOCK_T=lora_blocks.block_tokens(256, expand=True),
            BLOCK_R=lora_blocks.expand_rank_block(RANK),
            BLOCK_N=lora_blocks._pow2_divisor(PAGE, B["n"]),
            ALIGNED=False,
        ),
        B["twarps"],
    ),
    "expand tiled, aligned decode": (  # BLOCKS["valign"]: one adapter chunk a program
        lora_expand._expand_kernel,
        dict(
            PAGE=PAGE,
            NUM_TARGETS=12,
            PRECISION="tf32",
            BLOCK_T=B["at"],
            BLOCK_R=lora_blocks.expand_rank_block(RANK),
            BLOCK_N=lora_blocks._pow2_divisor(PAGE, B["an"]),
            ALIGNED=True,
        ),
        B["twarps"],
    ),
}


@pytest.mark.parametrize("vectors", [True, False], ids=["vectors", "plain"])
@pytest.mark.parametrize("name", list(BUILDS))
def test_expand_builds_for_sm90_without_spills(name, vectors):
    fn, constexprs, warps = BUILDS[name]
    cubin = build(
        fn, {**constexprs, "VECTORS": vectors}, warps, {"out_ptr": "*bf16"}, EXPAND_ALIGNED
    )
    usage = resource_usage(cubin)
    assert usage["LOCAL"] + usage["STACK"] == 0, f"{name}: spills, {usage}"
    assert 0 < usage["REG"] <= 255, usage
    assert global_loads(cubin)["LDG.E.U16"] == 0, f"{name}: scalar bf16 loads"
