"""Build a Triton kernel for sm_90 with no GPU and read what the cubin holds: Triton compiles for
the target, and the cuobjdump that ships with Triton reads its resource usage and machine code.
Used by ``benchmarks/registers.py`` (tile screening) and ``tests/test_kernels_build.py`` (every
kernel builds for the card without spills, and reads pool pages with 16-byte loads).

At launch Triton specializes each pointer and each integer argument outside the kernel's
``do_not_specialize`` list on whether it is a multiple of 16 (pointers: 16-byte aligned), and
that hint decides whether a load can be vectorized. A build here gives every pointer the hint and
the integers named in ``aligned`` (those that are multiples of 16 at the shapes checked), so the
machine code is the one the card runs at those shapes.
"""

from __future__ import annotations

import collections
import os
import re
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


# Integer arguments of the LoRA kernels that are multiples of 16 at Llama-2-7B shapes, so
# hinted at launch: row strides and d_in 4096, k_per_split a multiple of the block, r_span 16
# rank rows; the q/k/v column starts (0, 4096, 8192), widths (4096) and the output row stride.
SHRINK_ALIGNED = ("x_stride", "d_in", "k_per_split")
VECTOR_SHRINK_ALIGNED = (*SHRINK_ALIGNED, "r_span")
EXPAND_ALIGNED = ("col0", "col1", "col2", "width0", "width1", "width2", "out_stride")


def cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def build(
    fn,
    constexprs: dict,
    warps: int,
    pointers: dict | None = None,
    aligned: tuple[str, ...] = (),
    scalars: dict | None = None,
) -> bytes:
    """The sm_90 cubin of ``fn`` (a ``triton.jit`` function) with ``constexprs`` and ``warps``;
    integer arguments are int32 unless ``scalars`` names their type ({"qk_scale": "fp32"}),
    pointers as ``POINTERS`` and ``pointers`` say (else int32 tables). Every pointer and the
    integers in ``aligned`` carry the multiple-of-16 hint."""
    pointers = {**POINTERS, **(pointers or {})}
    unhinted = set(aligned) & {p.name for p in fn.params if p.do_not_specialize}
    assert not unhinted, f"{sorted(unhinted)}: do_not_specialize, never hinted at launch"
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        pointer = name.endswith("_ptr")
        signature[name] = (
            pointers.get(name, "*i32") if pointer else (scalars or {}).get(name, "i32")
        )
        if pointer or name in aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    index = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    source = ASTSource(fn, signature, constexprs=index, attrs=attrs)
    return triton.compile(source, target=SM90, options={"num_warps": warps}).asm["cubin"]


def _dump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run(
            [cuobjdump(), flag, file.name], capture_output=True, text=True, check=True
        ).stdout


def resource_usage(cubin: bytes) -> dict:
    """{"REG": registers per thread, "LOCAL": spill bytes, "SHARED": ...} of a cubin."""
    line = next(row for row in _dump(cubin, "--dump-resource-usage").splitlines() if "REG:" in row)
    fields = (field.split(":")[:2] for field in line.split() if ":" in field)
    return {key: int(value) for key, value in fields if value.isdigit()}


def global_loads(cubin: bytes) -> collections.Counter:
    """Global-memory load instructions of a cubin by width, e.g. {"LDG.E.128": 16,
    "LDG.E.U16": 2}: a bf16 tile read with LDG.E.U16 moves 2 bytes a thread an instruction."""
    return collections.Counter(
        re.findall(r"\bLDG[A-Z]*(?:\.[A-Z0-9_]+)*", _dump(cubin, "--dump-sass"))
    )


def shared_loads(cubin: bytes) -> collections.Counter:
    """Shared-memory load instructions of a cubin by kind, e.g. {"LDSM.16.M88.4": 16,
    "LDS.U8": 128}: an fp8 tile the tensor cores read byte by byte shows as LDS.U8, one read
    with ldmatrix as LDSM."""
    return collections.Counter(
        re.findall(r"\bLDS(?:M)?(?:\.[A-Z0-9_]+)*", _dump(cubin, "--dump-sass"))
    )
