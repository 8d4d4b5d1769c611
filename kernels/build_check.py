"""Build a Triton kernel for sm_90 with no GPU and read its resource usage: Triton compiles for
the target, and the cuobjdump that ships with Triton reads the cubin. Used by
``benchmarks/registers.py`` (tile screening) and ``tests/test_kernels_build.py`` (every kernel
builds for the card, without spills)."""

from __future__ import annotations

import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)
REGISTERS_PER_SM = 65536
POINTERS = {  # pointer arguments that are not int32 tables
    "x_ptr": "*bf16",
    "v_ptr": "*fp32",
    "pool_ptr": "*bf16",
    "out_ptr": "*fp32",
    "part_ptr": "*fp32",
    "scale_ptr": "*fp32",
}


def cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resource_usage(fn, constexprs: dict, warps: int, pointers: dict | None = None) -> dict:
    """{"REG": registers per thread, "LOCAL": spill bytes, "SHARED": ...} of ``fn`` (a
    ``triton.jit`` function) built for sm_90 with ``constexprs`` and ``warps``; integer
    arguments are int32, pointers as ``POINTERS`` and ``pointers`` say (else int32 tables)."""
    pointers = {**POINTERS, **(pointers or {})}
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*i32")
        else:
            signature[name] = "i32"
    index = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs=index), target=SM90, options={"num_warps": warps}
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        text = subprocess.run(
            [cuobjdump(), "--dump-resource-usage", cubin.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    line = next(row for row in text.splitlines() if "REG:" in row)
    fields = (field.split(":")[:2] for field in line.split() if ":" in field)
    return {key: int(value) for key, value in fields if value.isdigit()}
