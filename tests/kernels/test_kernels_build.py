"""The LoRA kernels build for the H200 (sm_90) at the block sizes the launchers pick for
Llama-2-7B shapes, without register spills, and read bf16 tiles (pool pages, activations, the
output they add into) with vector loads, never 2 bytes at a time: Triton compiles for the target
with no GPU (the interpreter tests check what the kernels compute, not how they compile)."""

from __future__ import annotations

import os

import pytest

from slora_kernels import lora_blocks, lora_expand, lora_shrink
from slora_kernels.build_check import (
    EXPAND_ALIGNED,
    SHRINK_ALIGNED,
    VECTOR_SHRINK_ALIGNED,
    build,
    cuobjdump,
    global_loads,
    resource_usage,
    shared_loads,
)

pytestmark = pytest.mark.skipif(not os.path.exists(cuobjdump()), reason="Triton ships no cuobjdump")

PAGE = 4096  # Llama-2-7B: kv_dim, and d_in and d_out of q, k, v and o
RANK = 64  # the largest rank of the acceptance workload
B = lora_blocks.BLOCKS  # the launchers' knobs; their tiles come from the launchers' own helpers
VR, VK = lora_blocks.vector_block(PAGE, RANK, "vk")
_, VN = lora_blocks.vector_block(PAGE, RANK, "vn")
VECTOR = dict(PAGE=PAGE, NUM_TARGETS=7, BLOCK_R=VR)
TILED = dict(PAGE=PAGE, NUM_TARGETS=7, PRECISION="tf32", ALIGNED=False)


def vector_shrink(*, partial: bool, all_tokens: bool, indexed: bool, one_page: bool) -> tuple:
    """The vector shrink at the launchers' blocks, in one of its modes."""
    constexprs = dict(VECTOR, BLOCK_K=VK, STAGES=B["vstages"], PARTIAL=partial, ALL=all_tokens,
                      INDEXED=indexed, ONE_PAGE=one_page)  # fmt: skip
    return lora_shrink._shrink_vector_kernel, constexprs, B["vwarps"], VECTOR_SHRINK_ALIGNED


def split_reduction(*, vector: bool) -> tuple:
    """The split reduction of one shrink family, at that family's split bound."""
    splits = lora_shrink.MAX_VECTOR_SPLITS if vector else lora_shrink.MAX_SPLITS
    constexprs = dict(NUM_TARGETS=7, BLOCK_R=RANK, BLOCK_SPLIT=splits, VECTOR=vector, ALL=False,
                      INDEXED=vector)  # fmt: skip
    return lora_shrink._shrink_reduce_kernel, constexprs, 4, ("out_stride",)


BUILDS = {  # name: (kernel, constexprs, warps, aligned integers)
    "shrink vector, graph, batch order": vector_shrink(
        partial=False, all_tokens=True, indexed=False, one_page=True
    ),
    "shrink vector, indexed (graph in slot order), split": vector_shrink(
        partial=True, all_tokens=False, indexed=True, one_page=True
    ),
    "shrink vector, searched, a row over several pages (down)": vector_shrink(
        partial=False, all_tokens=False, indexed=False, one_page=False
    ),
    "expand vector, indexed": (
        lora_expand._expand_vector_kernel,
        dict(VECTOR, BLOCK_N=VN, ALL=False, INDEXED=True),
        B["vnwarps"],
        EXPAND_ALIGNED,
    ),
    "split reduction, indexed": split_reduction(vector=True),
    "split reduction, tiled": split_reduction(vector=False),
    "shrink tiled, aligned decode": (  # BLOCKS["valign"]: one adapter chunk a program
        lora_shrink._shrink_kernel,
        dict(
            TILED,
            BLOCK_T=B["at"],
            BLOCK_R=lora_blocks.aligned_rank_block(RANK),
            BLOCK_K=lora_blocks._pow2_divisor(PAGE, B["k"]),
            PARTIAL=True,
            ALIGNED=True,
        ),
        B["twarps"],
        SHRINK_ALIGNED,
    ),
    "expand tiled, aligned decode": (
        lora_expand._expand_kernel,
        dict(
            TILED,
            BLOCK_T=B["at"],
            BLOCK_R=lora_blocks.expand_rank_block(RANK),
            BLOCK_N=lora_blocks._pow2_divisor(PAGE, B["an"]),
            ALIGNED=True,
        ),
        B["twarps"],
        EXPAND_ALIGNED,
    ),
    "shrink tiled, prefill": (
        lora_shrink._shrink_kernel,
        dict(
            TILED,
            BLOCK_T=lora_blocks.block_tokens(4096),
            BLOCK_R=lora_blocks.tiled_rank_block(RANK),
            BLOCK_K=lora_blocks._pow2_divisor(PAGE, B["k"]),
            PARTIAL=True,
        ),
        B["twarps"],
        SHRINK_ALIGNED,
    ),
    "expand tiled, prefill": (
        lora_expand._expand_kernel,
        dict(
            TILED,
            BLOCK_T=lora_blocks.block_tokens(4096, expand=True),
            BLOCK_R=lora_blocks.expand_rank_block(RANK),
            BLOCK_N=lora_blocks._pow2_divisor(PAGE, B["n"]),
        ),
        B["twarps"],
        EXPAND_ALIGNED,
    ),
    "expand tiled, prefill, the whole rank in one dot": (  # BLOCKS["er"] 0
        lora_expand._expand_kernel,
        dict(
            TILED,
            BLOCK_T=lora_blocks.block_tokens(4096, expand=True),
            BLOCK_R=RANK,
            BLOCK_N=lora_blocks._pow2_divisor(PAGE, B["n"]),
        ),
        B["twarps"],
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


PREFILL_BUILDS = {  # name: (fp8 pages, own K/V rows, v_group)
    "bf16 pages": (False, False, 0),
    "fp8 pages": (True, False, 0),
    "fp8 pages, own rows": (True, True, 0),
    "fp8 pages, grouped V": (True, False, 16),
    "fp8 pages, grouped V, own rows": (True, True, 16),
}


@pytest.mark.parametrize("name", list(PREFILL_BUILDS))
def test_prefill_attention_builds_for_sm90_without_spills(name):
    """The prefill kernel on bf16 pages, on fp8 pages, on fp8 pages reading the step's own K/V
    rows (``own``), and on fp8 pages in the grouped V layout, compiles for the card at
    Llama-3-8B's heads (8 KV heads of 128, GQA 4) and the launcher's tile without spills, its
    row strides hinted as multiples of 16 as they are at launch (q: 4096 and 128)."""
    from slora_kernels import attention

    fp8, own, v_group = PREFILL_BUILDS[name]
    (block_m, warps), head_dim, kv_heads = attention.PREFILL_TILE, 128, 8
    constexprs = dict(
        PAGE=kv_heads * head_dim * (2 if fp8 else 1),
        KV_HEADS=kv_heads,
        GROUP=4,
        HEAD_DIM=head_dim,
        BLOCK_D=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=64,
        HAS_WINDOW=False,
        SOFTCAP=False,
        FP8=fp8,
        F16=fp8,
        OWN=own,
        PRECISION="tf32",
        V_GROUP=v_group,
    )
    pointers = {
        "q_ptr": "*bf16",
        "o_ptr": "*bf16",
        "pool_ptr": "*fp8e4nv" if fp8 else "*bf16",
        "own_k_ptr": "*bf16",
        "own_v_ptr": "*bf16",
    }
    floats = {"qk_scale": "fp32", "cap_log2": "fp32"}
    aligned = ("q_stride_t", "q_stride_h", "own_k_stride", "own_v_stride")
    cubin = build(attention._prefill_kernel, constexprs, warps, pointers, aligned, floats)
    usage = resource_usage(cubin)
    assert usage["LOCAL"] + usage["STACK"] == 0, f"{name}: spilled, {usage}"
    assert 0 < usage["REG"] <= 255, usage


@pytest.mark.parametrize(
    "v_group,window",
    [(0, False), (16, False), (16, True)],
    ids=["per-token-pages", "grouped-v", "grouped-v-window"],
)
def test_fp8_decode_attention_reads_grouped_values_with_ldmatrix(v_group, window):
    """Decode on fp8 pages at Llama-3-8B's heads and the launcher's GQA tile: per-token pages
    leave V's bytes to single-byte shared loads (the p . V dot's operand is transposed); the
    grouped V layout feeds it with ldmatrix and no byte loads, with a window and soft-cap
    too."""
    from slora_kernels import attention_decode

    kv_heads, head_dim = 8, 128
    tiles = attention_decode.DECODE
    constexprs = dict(NUM_HEADS=4 * kv_heads, PAGE=2 * kv_heads * head_dim, KV_HEADS=kv_heads,
                      GROUP=4, HEAD_DIM=head_dim, BLOCK_G=16, BLOCK_D=head_dim,
                      BLOCK_N=tiles["gqa_block_n"], NUM_SPLITS=4, USE_DOT=True, HAS_WINDOW=window,
                      SOFTCAP=window, FP8=True, F16=True, PRECISION="tf32",
                      HEADS_FASTEST=False, V_GROUP=v_group)  # fmt: skip
    pointers = {"q_ptr": "*bf16", "o_ptr": "*bf16", "pool_ptr": "*fp8e4nv",
                "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"}  # fmt: skip
    floats = {"qk_scale": "fp32", "cap_log2": "fp32"}
    cubin = build(attention_decode._decode_split_kernel, constexprs, tiles["warps"], pointers, (),
                  floats)  # fmt: skip
    usage, loads = resource_usage(cubin), shared_loads(cubin)
    assert usage["LOCAL"] + usage["STACK"] == 0, usage
    if v_group:
        assert loads["LDS.U8"] == 0 and sum(n for k, n in loads.items() if "LDSM" in k) > 0, loads
    else:
        assert loads["LDS.U8"] > 0, loads


@pytest.mark.parametrize("v_group", [0, 16], ids=["per-token-pages", "grouped-v"])
def test_fp8_kv_write_builds_for_sm90_without_spills(v_group):
    """The fp8 kv_write at Llama-3-8B's KV (8 heads of 128), per-token pages and the grouped V
    layout with its tail zeroing, compiles for the card without spills."""
    from slora_kernels import kv

    constexprs = dict(KV_HEADS=8, HEAD_DIM=128, PAGE=2048, BLOCK_D=128, V_GROUP=v_group)
    pointers = {"data_ptr": "*fp8e4nv", "k_ptr": "*bf16", "v_ptr": "*bf16"}
    usage = resource_usage(build(kv._kv_write_fp8_kernel, constexprs, 1, pointers))
    assert usage["LOCAL"] + usage["STACK"] == 0 and 0 < usage["REG"] <= 255, usage
