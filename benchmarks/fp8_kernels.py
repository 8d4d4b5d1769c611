"""FP8 on the card: decode and prefill attention on e4m3 pages against the bf16 pages of the
same sequences, the decode tile variants and launch orders on fp8 pages, the same tokens in the
grouped V layout (``slora_kernels.fp8.to_grouped``), and the fused activation quantizers.

    python3 -m benchmarks.fp8_kernels                  # from the repo root, on a CUDA device
    python3 -m benchmarks.fp8_kernels --default-tiles  # every shape, the default tiles only
    python3 -m benchmarks.fp8_kernels --quick          # the default tiles, MHA at B=256

First the fp8 projections' input quantization, alone after its op and fused into it.

Decode: B sequences with contexts U[256, 1024] (the acceptance workload's), Llama-2-7B (MHA,
32 KV heads) and Llama-3-8B (GQA, 8 KV heads) shapes, head_dim 128, graph-replayed. Each row
gives the time, the KV bytes read per second (fp8: 1 byte an element plus a 4-byte scale per
token and head; bf16: 2 bytes) as a fraction of the measured copy bandwidth, and the largest
difference to the twin on the same pages (fp32 inside, bf16 out).
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from benchmarks.kernels import DTYPE, SHAPES, Table, _graph_us, _us, attn_meta, copy_gbps
from slora_kernels import attention, attention_decode, fp8, ref, triton_ops
from slora_kernels.meta import AttnMeta

VARIANTS = [  # attention_decode.DECODE overrides on fp8 pages
    {},
    {"fp8_stages": 3},
    {"heads_fastest": False},
]


GROUPED_VARIANTS = [  # attention_decode.DECODE overrides on fp8 pages in the grouped V layout
    {"fp8_stages": 3},
    {"fp8_stages": 2},
    {"gqa_block_n": 64},
    {"mha_block_n": 64},
    {"warps": 8},
]


def fp8_pages(pool: torch.Tensor, meta: AttnMeta, kv_heads: int):
    """The bf16 pages of ``attn_meta`` rewritten as fp8 pages: each token's K and V quantized
    into its K page (one page a token, named twice), scales per token and head."""
    kv_dim = pool.shape[1]
    packed = torch.empty_like(pool)
    scales = torch.ones(pool.shape[0], 2 * kv_heads, device=pool.device)
    table = meta.page_table
    pages = table[table[..., 0] >= 0]  # [tokens, 2]
    k, v = pool[pages[:, 0].long()], pool[pages[:, 1].long()]
    one = pages[:, :1].repeat(1, 2).contiguous()
    assert 2 * kv_dim <= packed.shape[1] * packed.element_size()
    fp8.kv_write(packed, k, v, one, scales)
    table8 = torch.where(table >= 0, table[..., :1].expand_as(table), table).contiguous()
    return packed, scales, AttnMeta(meta.b1_start, meta.b_seq_len, table8, meta.max_new)


def decode_case(kind: str, batch: int):
    """(bf16 pages, their AttnMeta, queries, KV heads, keys read) of ``batch`` decode rows at
    contexts U[256, 1024], seeded by the batch size."""
    heads, kv_heads, _, _ = SHAPES[kind]
    gen = torch.Generator().manual_seed(batch)
    contexts = torch.randint(256, 1025, (batch,), generator=gen).tolist()
    pool, meta = attn_meta(contexts, [1] * batch, kv_heads * 128)
    q = torch.randn(batch, heads, 128, dtype=DTYPE, device="cuda")
    return pool, meta, q, kv_heads, sum(contexts)


def decode_rows(kind: str, batch: int, bw: float) -> list[tuple]:
    pool, meta, q, kv_heads, tokens = decode_case(kind, batch)
    kv_dim, rows = kv_heads * 128, []
    case = f"{kind} B={batch} ctx 256-1024"
    fn = partial(triton_ops.attention_decode, q, pool, meta, kv_heads, 0.088)
    want = ref.attention_decode(q, pool, meta, kv_heads, 0.088).float()
    default_order = attention_decode.DECODE["heads_fastest"]
    for heads_fastest in (False, True):
        attention_decode.DECODE["heads_fastest"] = heads_fastest
        us = _graph_us(fn)
        gbs = tokens * 2 * kv_dim * 2 / us / 1e3
        diff = float((fn().float() - want).abs().max())
        label = f"{case} heads fastest" if heads_fastest else case
        rows.append(
            ("decode bf16 pages", label, us, f"{gbs:.0f} GB/s", f"{gbs / bw:.2f}; diff {diff:.1e}")
        )
    attention_decode.DECODE["heads_fastest"] = default_order
    packed, scales, meta8 = fp8_pages(pool, meta, kv_heads)
    del pool
    want = ref.attention_decode(q, packed, meta8, kv_heads, 0.088, scales=scales).float()
    nbytes = tokens * 2 * (kv_dim + 4 * kv_heads)
    saved = dict(attention_decode.DECODE)
    for variant in VARIANTS:
        attention_decode.DECODE.update(variant)
        try:
            fn = partial(
                triton_ops.attention_decode, q, packed, meta8, kv_heads, 0.088, scales=scales
            )
            diff = float((fn().float() - want).abs().max())
            us = _graph_us(fn)
            gbs = nbytes / us / 1e3
            rows.append(
                (
                    "decode fp8 pages",
                    f"{case} {variant or 'default'}",
                    us,
                    f"{gbs:.0f} GB/s",
                    f"{gbs / bw:.2f}; diff {diff:.1e}",
                )
            )
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile: say so, go on
            rows.append(
                (
                    "decode fp8 pages",
                    f"{case} {variant}",
                    float("nan"),
                    type(exc).__name__,
                    str(exc)[:80],
                )
            )
        finally:
            attention_decode.DECODE.clear()
            attention_decode.DECODE.update(saved)
    rows += grouped_rows(q, (packed, scales, meta8), kv_heads, want, (case, nbytes, bw))
    return rows


def grouped_rows(q, pages, kv_heads: int, want, labels) -> list[tuple]:
    """The same fp8 tokens in the grouped V layout (``fp8.to_grouped``, groups of 16): decode
    with the sequence fastest, with the default tiles (heads fastest), and unless the tiles are
    the defaults only, GROUPED_VARIANTS."""
    packed, scales, meta8 = pages
    case, nbytes, bw = labels
    pool_g, scales_g, table_g = fp8.to_grouped(
        packed, scales, meta8.page_table, meta8.b_seq_len, kv_heads * 128, 16
    )
    meta_g = AttnMeta(meta8.b1_start, meta8.b_seq_len, table_g, meta8.max_new)
    rows, saved = [], dict(attention_decode.DECODE)
    extra = GROUPED_VARIANTS if len(VARIANTS) > 1 else []  # --default-tiles empties VARIANTS
    tiles = [{"heads_fastest": False}, {}, *extra]
    for variant in tiles:
        attention_decode.DECODE.update(variant)
        fn = partial(
            attention_decode.decode_splits, q, pool_g, meta_g, kv_heads, 0.088, None,
            scales=scales_g, v_group=16,
        )  # fmt: skip
        try:
            diff = float((fn().float() - want).abs().max())
            us = _graph_us(fn)
        except Exception as exc:  # noqa: BLE001 - a build failure is a result here
            rows.append(
                ("decode fp8 grouped V", case, float("nan"), type(exc).__name__, str(exc)[:80])
            )
            continue
        finally:
            attention_decode.DECODE.clear()
            attention_decode.DECODE.update(saved)
        gbs = nbytes / us / 1e3
        label = f"{case} {variant or 'default (heads fastest)'}"
        rows.append(
            (
                "decode fp8 grouped V",
                label,
                us,
                f"{gbs:.0f} GB/s",
                f"{gbs / bw:.2f}; diff {diff:.1e}",
            )
        )
    return rows


def engine_decode_rows(kind: str, bw: float, batch: int = 256) -> list[tuple]:
    """Decode attention as the engine runs it, default tiles, graph-replayed: bf16 pages, then
    the same tokens on fp8 pages in the grouped V layout (the engine's fp8 KV), each as the
    fraction of the copy bandwidth its bytes take (fp8: scales included)."""
    pool, meta, q, kv_heads, tokens = decode_case(kind, batch)
    kv_dim, case = kv_heads * 128, f"{kind} B={batch} ctx 256-1024"
    us = _graph_us(partial(triton_ops.attention_decode, q, pool, meta, kv_heads, 0.088))
    gbs = tokens * 2 * kv_dim * 2 / us / 1e3
    rows = [("attention_decode bf16 pages", case, us, f"{gbs:.0f} GB/s", f"{gbs / bw:.2f}")]
    packed, scales, meta8 = fp8_pages(pool, meta, kv_heads)
    del pool
    pool_g, scales_g, table_g = fp8.to_grouped(
        packed, scales, meta8.page_table, meta8.b_seq_len, kv_dim, fp8.KV_GROUP
    )
    meta_g = AttnMeta(meta8.b1_start, meta8.b_seq_len, table_g, meta8.max_new)
    fn = partial(
        triton_ops.attention_decode,
        q,
        pool_g,
        meta_g,
        kv_heads,
        0.088,
        scales=scales_g,
        v_group=fp8.KV_GROUP,
    )
    us = _graph_us(fn)
    gbs = tokens * 2 * (kv_dim + 4 * kv_heads) / us / 1e3
    rows.append(
        ("attention_decode fp8 pages, grouped V", case, us, f"{gbs:.0f} GB/s", f"{gbs / bw:.2f}")
    )
    return rows


def prefill_rows(kind: str, bw: float) -> list[tuple]:
    heads, kv_heads, _, _ = SHAPES[kind]
    kv_dim, rows = kv_heads * 128, []
    pool, meta = attn_meta([1024] * 8, [512] * 8, kv_dim)
    q = torch.randn(8 * 512, heads, 128, dtype=DTYPE, device="cuda")
    packed, scales, meta8 = fp8_pages(pool, meta, kv_heads)
    case = f"{kind} 8 x 512 new on 512 context"
    # the step's own K/V rows (the engine passes them): the 512 new keys read from them
    own = tuple(torch.randn(8 * 512, kv_dim, dtype=DTYPE, device="cuda") for _ in range(2))
    for label, kw in (("", {}), (", own rows", {"own": own})):
        us = _us(partial(triton_ops.attention, q, pool, meta, kv_heads, 0.088, **kw))
        rows.append((f"prefill bf16 pages{label}", case, us, "", ""))
        for f16 in (True, False):
            attention.FP8_F16 = f16
            fn = partial(triton_ops.attention, q, packed, meta8, kv_heads, 0.088, **kw)
            us = _us(partial(fn, scales=scales))
            rows.append((f"prefill fp8 pages{label}", f"{case} fp16 dots {f16}", us, "", ""))
        attention.FP8_F16 = True
    return rows


ACT_TILES = [  # act_quant.ACT_FP8_TILE choices timed for the fused gated activation
    {},
    {"block": 1024, "warps": 4},
    {"block": 4096, "warps": 8},
    {"block": 2048, "warps": 16},
]


def _act_quant_case(op: str, tokens: int, width: int):
    """(unfused, fused, bytes the fused op moves) of one case of ``act_quant_rows``."""
    from slora_kernels import act_quant

    if op == "rms_norm":
        x = torch.randn(tokens, width, dtype=DTYPE, device="cuda")
        w, res = torch.ones(width, dtype=DTYPE, device="cuda"), torch.randn_like(x)

        def unfused():
            return act_quant.quantize_rows(triton_ops.rms_norm(x, w, 1e-5, res)[0], 16)

        fused = partial(triton_ops.rms_norm_fp8, x, w, 1e-5, res, pad_to=16)
        return unfused, fused, tokens * width * (2 + 2 + 2 + 2 + 1)  # x, res in; r, y, q out
    gate_up = torch.randn(tokens, 2 * width, dtype=DTYPE, device="cuda")

    def unfused_act():
        return act_quant.quantize_rows(triton_ops.silu_mul(gate_up), 16)

    fused = partial(triton_ops.silu_mul_fp8, gate_up, pad_to=16)
    return unfused_act, fused, tokens * width * (4 + 2 + 1)  # gate_up in; a, q out


def act_quant_rows(bw: float) -> list[tuple]:
    """The fp8 projections' input quantization on Llama-3-8B widths: RMSNorm (4096) and
    SiLU-and-multiply (14336) then ``quantize_rows``, against the fused op; graph-replayed.
    Bytes: what the fused op must move (its input, its output and the e4m3 rows)."""
    from slora_kernels import act_quant

    rows, saved = [], dict(act_quant.ACT_FP8_TILE)
    for tokens in (256, 1024):
        for op, width in (("rms_norm", 4096), ("silu_mul", 14336)):
            unfused, fused, nbytes = _act_quant_case(op, tokens, width)
            tiles = [{}] if op == "rms_norm" else ACT_TILES
            runs = [("then quantize_rows", unfused, {})] + [("fused", fused, t) for t in tiles]
            for label, fn, tile in runs:
                act_quant.ACT_FP8_TILE.update(tile)
                us = _graph_us(fn)
                act_quant.ACT_FP8_TILE.update(saved)
                gbs = nbytes / us / 1e3
                case = f"{tokens} rows {tile or ''}"
                rows.append((f"{op} {label}", case, us, f"{gbs:.0f} GB/s", f"{gbs / bw:.2f}"))
    return rows


def main() -> None:
    quick = "--quick" in sys.argv[1:]  # the default tiles only, MHA at B=256 and prefill
    default_tiles = quick or "--default-tiles" in sys.argv[1:]
    bw = copy_gbps()
    rows = Table()
    rows.append(("copy", "1 GiB", 0.0, f"{bw:.0f} GB/s", "1.00"))
    rows += act_quant_rows(bw)
    if default_tiles:
        VARIANTS[1:] = []
    for kind in ["mha"] if quick else SHAPES:
        for batch in (256,) if quick else (256, 512):
            rows += decode_rows(kind, batch, bw)
        rows += prefill_rows(kind, bw)


if __name__ == "__main__":
    main()
