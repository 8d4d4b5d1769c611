"""The LoRA kernels build for the H200 (sm_90) at the block sizes the launchers pick for
Llama-2-7B shapes, without register spills: Triton compiles for the target with no GPU (the
interpreter tests check what the kernels compute, not that they compile)."""

from __future__ import annotations

import os

import pytest

from kernels import lora
from kernels.build_check import cuobjdump, resource_usage

pytestmark = pytest.mark.skipif(not os.path.exists(cuobjdump()), reason="Triton ships no cuobjdump")

PAGE = 4096  # Llama-2-7B: kv_dim
VECTOR = dict(PAGE=PAGE, NUM_TARGETS=7, BLOCK_R=16)
BUILDS = {
    "shrink vector, graph": (
        lora._shrink_vector_kernel,
        dict(VECTOR, BLOCK_K=1024, PARTIAL=False, ALL=True, INDEXED=False, STAGES=0, ONE_PAGE=True),
        4,
    ),
    "shrink vector, indexed, split": (
        lora._shrink_vector_kernel,
        dict(VECTOR, BLOCK_K=1024, PARTIAL=True, ALL=False, INDEXED=True, STAGES=0, ONE_PAGE=True),
        4,
    ),
    "shrink vector, searched, pipelined, pages per chunk": (
        lora._shrink_vector_kernel,
        dict(
            VECTOR, BLOCK_K=1024, PARTIAL=False, ALL=False, INDEXED=False, STAGES=2, ONE_PAGE=False
        ),  # fmt: skip
        4,
    ),
    "expand vector, indexed": (
        lora._expand_vector_kernel,
        dict(VECTOR, BLOCK_N=512, ALL=False, INDEXED=True),
        4,
    ),
    "split reduction, indexed": (
        lora._shrink_reduce_kernel,
        dict(NUM_TARGETS=7, BLOCK_R=64, BLOCK_SPLIT=4, VECTOR=True, ALL=False, INDEXED=True),
        4,
    ),
    "shrink tiled": (
        lora._shrink_kernel,
        dict(
            PAGE=PAGE,
            NUM_TARGETS=7,
            BLOCK_T=32,
            BLOCK_R=32,
            BLOCK_K=64,
            PARTIAL=True,
            PRECISION="tf32",
        ),  # fmt: skip
        8,
    ),
    "expand tiled, prefill": (
        lora._expand_kernel,
        dict(PAGE=PAGE, NUM_TARGETS=7, BLOCK_T=64, BLOCK_R=64, BLOCK_N=64, PRECISION="tf32"),
        8,
    ),
}


@pytest.mark.parametrize("name", list(BUILDS))
def test_lora_kernel_builds_for_sm90_without_spills(name):
    fn, constexprs, warps = BUILDS[name]
    pointers = {"out_ptr": "*bf16"} if "expand" in name else {}
    usage = resource_usage(fn, constexprs, warps, pointers)
    spilled = usage["LOCAL"] + usage["STACK"]  # ptxas puts spills on the stack
    assert spilled == 0, f"{name}: {spilled} bytes spilled, {usage}"
    assert 0 < usage["REG"] <= 255, usage
