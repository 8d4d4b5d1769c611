"""Registers, spills and occupancy of the vector LoRA kernels on sm_90, with no GPU: Triton compiles
them for the target, and the cuobjdump that ships with Triton reads the cubin's resource usage.

    python -m benchmarks.registers          # Llama-2-7B shapes (page 4096), 16 rank rows

Prints one Markdown row per (kernel, block, warps): registers per thread, spilled bytes (local and stack),
how many programs fit on an SM by registers (65536 per SM), and the global loads by width. Use it to screen tile sizes
before spending device time on them; it says nothing about speed.
"""

from __future__ import annotations

from slora_kernels import lora_expand, lora_shrink
from slora_kernels.build_check import (
    EXPAND_ALIGNED,
    REGISTERS_PER_SM,
    VECTOR_SHRINK_ALIGNED,
    build,
    global_loads,
    resource_usage,
)


def main() -> None:
    common = dict(PAGE=4096, NUM_TARGETS=7, BLOCK_R=16, ALL=True, INDEXED=False)
    rows = []
    for block_k in (256, 512, 1024, 2048):
        for warps in (4, 8):
            consts = dict(common, BLOCK_K=block_k, PARTIAL=False, STAGES=0, ONE_PAGE=True)
            cubin = build(
                lora_shrink._shrink_vector_kernel, consts, warps, aligned=VECTOR_SHRINK_ALIGNED
            )
            rows.append(("shrink", f"16 x {block_k}", warps, cubin))
    for block_n in (128, 256, 512, 1024):
        for warps in (4, 8):
            consts = dict(common, BLOCK_N=block_n)
            cubin = build(
                lora_expand._expand_vector_kernel,
                consts,
                warps,
                {"out_ptr": "*bf16"},
                EXPAND_ALIGNED,
            )
            rows.append(("expand", f"16 x {block_n}", warps, cubin))
    print("| kernel | tile | warps | registers | spill bytes | programs per SM | global loads |")
    print("|---|---|---:|---:|---:|---:|---|")
    for kernel, tile, warps, cubin in rows:
        usage, loads = resource_usage(cubin), global_loads(cubin)
        fit = REGISTERS_PER_SM // (usage["REG"] * 32 * warps)
        spilled = usage.get("LOCAL", 0) + usage.get("STACK", 0)
        widths = ", ".join(f"{n} {op}" for op, n in sorted(loads.items()))
        print(f"| {kernel} | {tile} | {warps} | {usage['REG']} | {spilled} | {fit} | {widths} |")


if __name__ == "__main__":
    main()
