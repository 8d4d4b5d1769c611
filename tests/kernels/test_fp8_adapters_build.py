"""The LoRA kernels on fp8 adapter rows build for the H200 (sm_90) at Llama-2-7B's blocks without
register spills (Triton compiles for the target with no GPU): the pool pointer's e4m3 type
switches their fp8 path on (``slora_kernels.lora_paths.row_source``)."""

from __future__ import annotations

import os

import pytest
from test_kernels_build import BUILDS

from slora_kernels.build_check import build, cuobjdump, resource_usage

pytestmark = pytest.mark.skipif(not os.path.exists(cuobjdump()), reason="Triton ships no cuobjdump")

# the pool's rows in e4m3, the model dtype bf16 (x, the vector rows), the scales in fp32
FP8_POINTERS = {"pool_ptr": "*fp8e4nv", "x_ptr": "*bf16", "vec_ptr": "*bf16",
                "row_scale_ptr": "*fp32"}  # fmt: skip
NAMES = [name for name in BUILDS if "reduction" not in name]  # no pool reads there


@pytest.mark.parametrize("name", NAMES)
def test_fp8_lora_kernels_build_for_sm90_without_spills(name):
    fn, constexprs, warps, aligned = BUILDS[name]
    pointers = dict(FP8_POINTERS, **({"out_ptr": "*bf16"} if "expand" in name else {}))
    if "expand" in name:
        constexprs = dict(constexprs, VECTORS=False)
    usage = resource_usage(build(fn, constexprs, warps, pointers, aligned))
    assert usage["LOCAL"] + usage["STACK"] == 0, f"{name}: spills, {usage}"
    assert 0 < usage["REG"] <= 255, usage
