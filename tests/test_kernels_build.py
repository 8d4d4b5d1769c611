"""The LoRA kernels build for the H200 (sm_90) at the block sizes the launchers pick for
Llama-2-7B shapes, without register spills, and read bf16 tiles (pool pages, activations, the
output they add into) with vector loads, never 2 bytes at a time: Triton compiles for the target
with no GPU (the interpreter tests check what the kernels compute, not how they compile)."""

from __future__ import annotations

import os

import pytest

from kernels import lora
from kernels.build_check import build, cuobjdump, global_loads, resource_usage

pytestmark = pytest.mark.skipif(not os.path.exists(cuobjdump()), reason="Triton ships no cuobjdump")

PAGE = 4096  # Llama-2-7B: kv_dim
VECTOR = dict(PAGE=PAGE, NUM_TARGETS=7, BLOCK_R=16)
# integer arguments that are multiples of 16 at these shapes, so hinted at launch: row strides
# and d_in 4096; k_per_split a multiple of BLOCK_K; r_span 16 rank rows; the q/k/v column starts
# (0, 4096, 8192) and widths (4096)
SHRINK_ALIGNED = ("x_stride", "d_in", "k_per_split")
EXPAND_ALIGNED = ("col0", "col1", "col2", "width0", "width1", "width2", "out_stride")
BUILDS = {
    "shrink vector, graph": (
        lora._shrink_vector_kernel,
        dict(VECTOR, BLOCK_K=1024, PARTIAL=False, ALL=True, INDEXED=False, STAGES=2, ONE_PAGE=True),
        4,
        (*SHRINK_ALIGNED, "r_span"),
    ),
    "shrink vector, indexed, split": (
        lora._shrink_vector_kernel,
        dict(VECTOR, BLOCK_K=1024, PARTIAL=True, ALL=False, INDEXED=True, STAGES=0, ONE_PAGE=True),
        4,
        (*SHRINK_ALIGNED, "r_span"),
    ),
    "shrink vector, searched, pipelined, pages per chunk": (
        lora._shrink_vector_kernel,
        dict(
            VECTOR, BLOCK_K=1024, PARTIAL=False, ALL=False, INDEXED=False, STAGES=2, ONE_PAGE=False
        ),  # fmt: skip
        4,
        (*SHRINK_ALIGNED, "r_span"),
    ),
    "expand vector, indexed": (
        lora._expand_vector_kernel,
        dict(VECTOR, BLOCK_N=1024, ALL=False, INDEXED=True),
        4,
        EXPAND_ALIGNED,
    ),
    "split reduction, indexed": (
        lora._shrink_reduce_kernel,
        dict(NUM_TARGETS=7, BLOCK_R=64, BLOCK_SPLIT=4, VECTOR=True, ALL=False, INDEXED=True),
        4,
        ("out_stride",),
    ),
    "shrink tiled": (
        lora._shrink_kernel,
        dict(
            PAGE=PAGE,
            NUM_TARGETS=7,
            BLOCK_T=32,
            BLOCK_R=32,
            BLOCK_K=128,
            PARTIAL=True,
            PRECISION="tf32",
        ),  # fmt: skip
        4,
        SHRINK_ALIGNED,
    ),
    "expand tiled, prefill": (
        lora._expand_kernel,
        dict(PAGE=PAGE, NUM_TARGETS=7, BLOCK_T=64, BLOCK_R=64, BLOCK_N=64, PRECISION="tf32"),
        4,
        EXPAND_ALIGNED,
    ),
}


@pytest.mark.parametrize("name", list(BUILDS))
def test_lora_kernel_builds_for_sm90_without_spills_and_with_vector_loads(name):
    fn, constexprs, warps, aligned = BUILDS[name]
    pointers = {"out_ptr": "*bf16"} if "expand" in name else {}
    cubin = build(fn, constexprs, warps, pointers, aligned)
    usage = resource_usage(cubin)
    spilled = usage["LOCAL"] + usage["STACK"]  # ptxas puts spills on the stack
    assert spilled == 0, f"{name}: {spilled} bytes spilled, {usage}"
    assert 0 < usage["REG"] <= 255, usage
    loads = global_loads(cubin)
    # bf16 read 2 bytes an instruction: the pool-page offsets lost their alignment (a page index
    # times PAGE plus a block start is a multiple of the block only if the kernel says so)
    assert loads["LDG.E.U16"] == 0, f"{name}: scalar bf16 loads {dict(loads)}"
