"""Micro-benchmark of the Triton kernels on a CUDA device, next to their bandwidth/compute floors.

    python3 -m benchmarks.kernels            # Llama-2-7B (MHA) and Llama-3-8B (GQA) shapes (run from the repo root:
                                             # "python benchmarks/kernels.py" would import this file as "kernels")
    python3 -m benchmarks.kernels --quick    # fewer points

Prints one Markdown table: kernel, case, microseconds, achieved GB/s or TFLOP/s, and the fraction
of the card's measured copy bandwidth (for memory-bound kernels) or bf16 matmul rate. Decode
attention also runs as the engine does at B=256 on bf16 pages and on fp8 pages in the grouped V
layout (``fp8_kernels.engine_decode_rows``); the decode LoRA kernels' fractions count the
distinct adapters' rows a step reads (``lora_rows``, the vector sweep's shrink and expand apart).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import triton.testing

from slora_kernels import attention_decode, lora_fp8, ref, triton_ops
from slora_kernels.lora_blocks import BLOCKS
from slora_kernels.lora_paths import position_segments
from slora_kernels.lora_shrink import shrink_splits
from slora_kernels.meta import VECTOR_ALL, AttnMeta, LoraMeta

DTYPE = torch.bfloat16
SHAPES = {"mha": (32, 32, 4096, 11008), "gqa": (32, 8, 4096, 14336)}  # heads, kv heads, H, I


def _us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3


def copy_gbps() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / _us(lambda: dst.copy_(src)) / 1e3


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    return 2 * 8192**3 / _us(lambda: a @ a) / 1e6


def attn_meta(contexts: list[int], news: list[int], kv_dim: int):
    pages = torch.randperm(2 * sum(contexts) + 1, device="cuda").int()
    pool = torch.randn(pages.numel(), kv_dim, dtype=DTYPE, device="cuda")
    table = torch.full((len(contexts), max(contexts), 2), -1, dtype=torch.int32, device="cuda")
    cursor = 0
    for b, ctx in enumerate(contexts):
        table[b, :ctx] = pages[cursor : cursor + 2 * ctx].view(ctx, 2)
        cursor += 2 * ctx
    b1 = torch.tensor([0] + news, device="cuda").cumsum(0).int()
    seq_len = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    return pool, AttnMeta(b1, seq_len, table, max(news))


def _factor_pages(rank: int, width: int, page: int, fp8: bool) -> tuple[int, int]:
    """(pages of one factor, of them its scale pages before its rows): bf16 rows, or e4m3 rows
    two sub-pages a bf16 page after their scales (``slora_kernels.lora_fp8``)."""
    if not fp8:
        return rank * -(-width // page), 0
    return lora_fp8.factor_pages(rank, width, page, 2), lora_fp8.scale_pages(rank, page, 2)


def lora_meta(
    b_slot: torch.Tensor,
    ranks: list[int],
    dims: list[tuple[int, int]],
    page: int,
    fp8: bool = False,
):
    """Adapters with every target in ``dims``, rows on random pages; metadata as batch.py does.
    ``fp8``: the rows in e4m3 (random finite bytes, every scale 1), ``LoraMeta.fp8_rows``; the
    bytes returned count them at 1 byte an element and their scales."""
    factors = [[_factor_pages(r, w, page, fp8) for i, o in dims for w in (i, o)] for r in ranks]
    per = [sum(n for n, _ in slot) for slot in factors]
    perm = torch.randperm(sum(per), device="cuda").int()
    slot_pages = torch.full((len(ranks), max(per)), -1, dtype=torch.int32, device="cuda")
    offsets = torch.full((len(ranks), len(dims), 2), -1, dtype=torch.int32)
    start = 0
    for s in range(len(ranks)):
        slot_pages[s, : per[s]] = perm[start : start + per[s]]
        start, cursor = start + per[s], 0
        for n, (pages, scale_count) in enumerate(factors[s]):
            offsets[s, n // 2, n % 2] = cursor + scale_count  # rows after their scales
            cursor += pages
    order = torch.sort(torch.where(b_slot < 0, 1 << 40, b_slot), stable=True).indices
    used = b_slot[order][b_slot[order] >= 0]
    seg_slot, counts = torch.unique_consecutive(used, return_counts=True)
    seg1 = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    rank = torch.tensor(ranks, dtype=torch.int32)
    meta = LoraMeta(
        b_slot.int().cuda(),
        order.int().cuda(),
        seg1.int().cuda(),
        seg_slot.int().cuda(),
        rank.cuda(),
        torch.ones(len(ranks), device="cuda"),
        slot_pages,
        offsets.cuda(),
        int(rank[seg_slot].max()),
    )
    meta.pos_seg = position_segments(meta, b_slot.numel())  # as eager steps bring it
    pool = torch.randn(sum(per), page, dtype=DTYPE, device="cuda")
    elements = sum(ranks[s] * sum(i + o for i, o in dims) for s in seg_slot.tolist())
    if not fp8:
        return pool, meta, elements * 2
    meta.fp8_rows = True
    finite = torch.randint(0, 0x78, pool.shape + (2,), dtype=torch.uint8, device="cuda")
    signs = torch.randint(0, 2, finite.shape, dtype=torch.uint8, device="cuda") << 7
    pool.view(torch.uint8).view(finite.shape).copy_(finite | signs)  # no NaN bytes
    pool.view(torch.float32)[_scale_pages(slot_pages, offsets, factors)] = 1.0
    scales = sum(ranks[s] * 2 * len(dims) for s in seg_slot.tolist())
    return pool, meta, elements + 4 * scales


def _scale_pages(slot_pages: torch.Tensor, offsets: torch.Tensor, factors) -> torch.Tensor:
    """The pool pages holding the fp8 factors' scales (just before each factor's rows)."""
    pages = []
    for s, slot in enumerate(factors):
        for n, (_, scale_count) in enumerate(slot):
            first = int(offsets[s, n // 2, n % 2])
            pages.append(slot_pages[s, first - scale_count : first])
    return torch.cat(pages).long()


def lora_grouped(x, pool, meta, buf, out, dims, fns) -> None:
    """As the model runs them: q, k, v in one shrink and one expand launch, then o."""
    rank, q, kv = meta.max_rank, dims[0][1], dims[1][1]
    fns[0](x, pool, meta, (0, 1, 2), buf[:, : 3 * rank])
    fns[1](
        buf[:, : 3 * rank], pool, meta, (0, 1, 2), out, ((0, q), (q, q + kv), (q + kv, q + 2 * kv))
    )
    fns[0](x, pool, meta, 3, buf[:, :rank])
    fns[1](buf[:, :rank], pool, meta, 3, out[:, : dims[3][1]])


def _graph_us(fn) -> float:
    """GPU time of fn replayed from a CUDA graph: no Python launch cost."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=50) * 1e3


def attention_rows(kind: str, batches: list[int], bw: float, rate: float) -> list[tuple]:
    heads, kv_heads, _, _ = SHAPES[kind]
    kv_dim, rows = kv_heads * 128, []
    for batch in batches:
        for ctx in [512, 4096]:
            pool, meta = attn_meta([ctx] * batch, [1] * batch, kv_dim)
            q = torch.randn(batch, heads, 128, dtype=DTYPE, device="cuda")
            us = _us(partial(triton_ops.attention_decode, q, pool, meta, kv_heads, 0.088))
            gbs = batch * ctx * 2 * kv_dim * 2 / us / 1e3
            splits = attention_decode.num_splits_for(q.device, batch, kv_heads, ctx)
            rows.append(
                (
                    "attention_decode",
                    f"{kind} B={batch} ctx={ctx} splits={splits}",
                    us,
                    f"{gbs:.0f} GB/s",
                    f"{gbs / bw:.2f}",
                )
            )
            del pool
    pool, meta = attn_meta([1024] * 8, [512] * 8, kv_dim)
    q = torch.randn(8 * 512, heads, 128, dtype=DTYPE, device="cuda")
    us = _us(partial(triton_ops.attention, q, pool, meta, kv_heads, 0.088))
    tflops = 8 * heads * 128 * 4 * sum(512 + i for i in range(512)) / us / 1e6  # causal QK^T, PV
    rows.append(
        (
            "attention",
            f"{kind} 8 x 512 new on 512 context",
            us,
            f"{tflops:.0f} TFLOP/s",
            f"{tflops / rate:.2f}",
        )
    )
    return rows


DECODE_VARIANTS = [  # attention_decode.DECODE overrides swept by --decode-sweep
    {},
    {"mha_dot": False},
    {"mha_dot": False, "stages": 2},
    {"stages": 2},
    {"stages": 4},
    {"warps": 8},
    {"gqa_block_n": 32},
    {"gqa_block_n": 128},
    {"gqa_block_n": 128, "warps": 8},
]


def decode_sweep_rows(kind: str, bw: float) -> list[tuple]:
    """Decode attention at B=256, contexts 256-1024 (the acceptance workload's), for each
    DECODE variant: graph-replayed time, bandwidth, and the largest difference to the default."""
    heads, kv_heads, _, _ = SHAPES[kind]
    kv_dim, rows = kv_heads * 128, []
    gen = torch.Generator().manual_seed(0)
    contexts = torch.randint(256, 1025, (256,), generator=gen).tolist()
    pool, meta = attn_meta(contexts, [1] * len(contexts), kv_dim)
    q = torch.randn(len(contexts), heads, 128, dtype=DTYPE, device="cuda")
    nbytes = sum(contexts) * 2 * kv_dim * 2
    default = triton_ops.attention_decode(q, pool, meta, kv_heads, 0.088)
    saved = dict(attention_decode.DECODE)
    for variant in DECODE_VARIANTS:
        attention_decode.DECODE.update(variant)
        try:
            fn = partial(triton_ops.attention_decode, q, pool, meta, kv_heads, 0.088)
            diff = float((fn().float() - default.float()).abs().max())
            us = _graph_us(fn)
            gbs = nbytes / us / 1e3
            rows.append(
                (
                    "attention_decode sweep",
                    f"{kind} B=256 ctx 256-1024 {variant or 'default'}",
                    us,
                    f"{gbs:.0f} GB/s",
                    f"{gbs / bw:.2f}; max diff {diff:.1e}",
                )
            )
        except Exception as exc:
            rows.append(
                (
                    "attention_decode sweep",
                    f"{kind} {variant}",
                    float("nan"),
                    type(exc).__name__,
                    "",
                )
            )
        finally:
            attention_decode.DECODE.clear()
            attention_decode.DECODE.update(saved)
    return rows


def lora_rows(kind: str, bw: float) -> list[tuple]:
    """q, k, v, o LoRA of one layer: per-target launches against grouped ones, eager (Python
    launch cost included) and replayed from a CUDA graph (GPU time alone), next to the base
    model's own q/k/v projection at the same token count; then block-size variants."""
    heads, kv_heads, hidden, _ = SHAPES[kind]
    kv_dim, rows = kv_heads * 128, []
    dims = [(hidden, heads * 128), (hidden, kv_dim), (hidden, kv_dim), (heads * 128, hidden)]
    cases = [("decode", 128, 128), ("decode", 256, 256), ("decode", 256, 8), ("prefill", 4096, 8)]
    for label, tokens, adapters in cases:
        b_slot = torch.randint(0, adapters, (tokens,))
        ranks = [(8, 16, 32, 64)[s % 4] for s in range(adapters)]
        pool, meta, nbytes = lora_meta(b_slot, ranks, dims, kv_dim)
        x = torch.randn(tokens, hidden, dtype=DTYPE, device="cuda")
        buf = torch.zeros(tokens, 3 * meta.max_rank, device="cuda")
        out = torch.zeros(tokens, heads * 128 + 2 * kv_dim, dtype=DTYPE, device="cuda")
        w = torch.randn(heads * 128 + 2 * kv_dim, hidden, dtype=DTYPE, device="cuda")
        case = f"{kind} {label} T={tokens} {adapters} adapters"
        base = _graph_us(lambda: torch.nn.functional.linear(x, w))  # noqa: B023
        rows.append(("base qkv projection (graph)", case, base, "", ""))
        args = (x, pool, meta, buf, out, dims)
        triton_fns = (triton_ops.lora_shrink, triton_ops.lora_expand)
        tiled, vector = 0, VECTOR_ALL
        variants = [
            ("grouped tiled", lora_grouped, {}, tiled),
            ("grouped tiled n64", lora_grouped, {"n": 64}, tiled),
            ("grouped tiled n64 k128", lora_grouped, {"n": 64, "k": 128}, tiled),
        ]
        if label == "decode":
            variants += [
                ("grouped vector", lora_grouped, {}, vector),
                ("grouped vector vk256 vn256", lora_grouped, {"vk": 256, "vn": 256}, vector),
                ("grouped vector no split", lora_grouped, {"split_min_k": 1 << 30}, vector),
                ("grouped vector 8 warps", lora_grouped, {"vwarps": 8}, vector),
                ("grouped vector vr16", lora_grouped, {"vr": 16}, vector),
                ("grouped vector vr16 8 warps", lora_grouped, {"vr": 16, "vwarps": 8}, vector),
                ("grouped vector vr32", lora_grouped, {"vr": 32}, vector),
                ("grouped vector 16 waves", lora_grouped, {"vwaves": 16}, vector),
                (
                    "grouped vector vk512 vn512 8 warps",
                    lora_grouped,
                    {"vk": 512, "vn": 512, "vwarps": 8},
                    vector,
                ),
            ]
        else:
            variants += [
                ("grouped tiled+vector (8)", lora_grouped, {}, 8),
                ("grouped tiled et64", lora_grouped, {"et": 64}, tiled),
                ("grouped tiled et64 n128", lora_grouped, {"et": 64, "n": 128}, tiled),
                ("grouped tiled et128", lora_grouped, {"et": 128}, tiled),
            ]
        saved = dict(BLOCKS)
        reference = None
        for name, step, blocks, vector_max in variants:
            BLOCKS.update(blocks)
            meta.vector_max = vector_max
            try:
                out.zero_()
                step(*args, triton_fns)
                if reference is None:
                    reference = out.clone()
                diff = float((out.float() - reference.float()).abs().max())
                splits = shrink_splits(x.device, tokens, meta.max_rank, hidden, 3)
                fn = partial(step, *args, triton_fns)
                eager, graph = _us(fn), _graph_us(fn)
            except Exception as exc:  # a variant that fails to build must not stop the table
                rows.append((f"lora q,k,v,o {name}", case, float("nan"), type(exc).__name__, ""))
                continue
            finally:
                BLOCKS.clear()
                BLOCKS.update(saved)
            gbs = nbytes / graph / 1e3
            rows.append((f"lora q,k,v,o {name} (eager)", case, eager, "", ""))
            rows.append(
                (
                    f"lora q,k,v,o {name} (graph, splits {splits})",
                    case,
                    graph,
                    f"{gbs:.0f} GB/s",
                    f"{gbs / bw:.2f}; {graph / base:.2f}x base qkv; max diff {diff:.1e}",
                )
            )
        meta.vector_max = 8
        if adapters == 8 and label == "decode":
            us = _us(partial(lora_grouped, *args, (ref.lora_shrink, ref.lora_expand)))
            rows.append(("lora (torch ref)", case, us, "", ""))
    return rows


class Table(list):
    """Rows printed as they come (a run cut at its time limit keeps what it measured)."""

    def __init__(self) -> None:
        super().__init__()
        print("| kernel | case | us | achieved | fraction |\n|---|---|---:|---:|---:|", flush=True)

    def append(self, row: tuple) -> None:
        super().append(row)
        name, case, us, achieved, fraction = row
        print(f"| {name} | {case} | {us:.1f} | {achieved} | {fraction} |", flush=True)

    def __iadd__(self, rows):
        for row in rows:
            self.append(row)
        return self


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--lora-only", action="store_true")
    parser.add_argument("--decode-sweep", action="store_true")
    parser.add_argument("--vector-sweep", action="store_true", help="only the vector LoRA sweep")
    parser.add_argument("--tiled-sweep", action="store_true", help="only the tiled decode sweep")
    args = parser.parse_args()
    from benchmarks import fp8_kernels  # it imports this module's helpers

    bw, rate = copy_gbps(), matmul_tflops()
    rows = Table()
    rows.append(("copy", "1 GiB", 0.0, f"{bw:.0f} GB/s", "1.00"))
    rows.append(("matmul", "8192^3 bf16", 0.0, f"{rate:.0f} TFLOP/s", "1.00"))
    if args.tiled_sweep or args.vector_sweep:
        from benchmarks import lora_sweep

        if args.tiled_sweep:
            rows += lora_sweep.tiled_decode_rows(bw)
            return
        # case by case, so that a run cut at its time limit keeps what it measured
        for tokens, adapters in lora_sweep.VECTOR_CASES:
            rows += lora_sweep.vector_case(tokens, adapters, bw)
        rows += lora_sweep.vector_case(256, 1000, bw, fp8=True)
        rows += lora_sweep.mixed_case(bw)
        rows += lora_sweep.few_adapters_case(bw)
        return
    batches = [1, 64, 256] if args.quick else [1, 16, 64, 128, 256]
    for kind in SHAPES:
        if args.decode_sweep:
            rows += decode_sweep_rows(kind, bw)
        if not args.lora_only:
            rows += attention_rows(kind, batches, bw, rate)
            rows += fp8_kernels.engine_decode_rows(kind, bw)
        rows += lora_rows(kind, bw)
    for tokens in [256, 4096]:
        x = torch.randn(tokens, 4096, dtype=DTYPE, device="cuda")
        w = torch.ones(4096, dtype=DTYPE, device="cuda")
        us = _us(partial(triton_ops.rms_norm, x, w, 1e-5, x))
        gbs = tokens * 4096 * 2 * 4 / us / 1e3  # x, residual in; y, r out
        rows.append(
            ("rms_norm+residual", f"T={tokens} H=4096", us, f"{gbs:.0f} GB/s", f"{gbs / bw:.2f}")
        )


if __name__ == "__main__":
    main()
