"""The LoRA kernel variant sweeps of ``benchmarks.kernels`` (``--vector-sweep``,
``--tiled-sweep``): block-size overrides of ``slora_kernels.lora_blocks.BLOCKS`` timed on decode steps
like the bench's (many adapters), on few adapters, and on a step with prefill chunks.
"""

from __future__ import annotations

import torch

from benchmarks.kernels import DTYPE, SHAPES, _graph_us, lora_meta
from slora_batch.engine.execution import batch as step_batch
from slora_kernels import triton_ops
from slora_kernels.lora_blocks import BLOCKS
from slora_kernels.meta import VECTOR_ALL, LoraMeta

SHRINK_VARIANTS = [  # BLOCKS overrides swept by --vector-sweep, timed on the shrinks alone
    {},  # vk, vr, vstages, vwarps and vgrid overrides were swept on an H200: defaults kept
    {"vwaves": 16},  # more splits of d_in: smaller programs, a shorter tail
    {"vwaves": 16, "split_min_k": 512},
    {"vr": 8},  # rank blocks of 8 rows: no half-empty block on rank-8 adapters
    {"vsorted": 0},  # the tokens in batch order: an adapter's rows read once per token
    {"valign": 1},  # the tiled kernel, one adapter chunk a program: its rows read once a step
    {"valign": 1, "ar": 32},
]
EXPAND_VARIANTS = [  # likewise, timed on the expands alone
    {},  # the rank loop software-pipelined in 2 stages timed the same on an H200
    {"vn": 128},
    {"vn": 512},
    {"vnwarps": 8},
    {"vsorted": 0},
    {"valign": 1},
    {"valign": 1, "an": 128},
    {"valign": 1, "an": 512},
]
# (decode tokens, adapters drawn from); 365 from 300: about 213 adapters, as the engine's decode
# steps at slora@1000 on Llama-3-8B shapes hold them (several tokens an adapter, in batch order)
VECTOR_CASES = [(247, 2000), (256, 1000), (365, 300)]
TILED_SHRINK_VARIANTS = [  # a step with prefill: both families run; the tiled knobs vary
    {},
    {"k": 64},  # 138 -> 96 registers on sm_90, yet 18% slower on an H200
]
TILED_EXPAND_VARIANTS = [  # on an H200 none of et 32, n 128 and 8 warps beat the default by
    {},  # more than 3%
    {"et": 32, "n": 128},
]


TILED_DECODE_SHRINKS = [  # the tiled decode graph's shrink: tokens per block, warps, blocks
    {},
    {"dt": 32},
    {"dt": 64},
    {"dt": 32, "twarps": 8},
    {"dt": 64, "twarps": 8},
    {"dt": 64, "k": 64, "twarps": 8},
    {"dt": 64, "rank": 64, "twarps": 8},
]
TILED_DECODE_EXPANDS = [
    {},
    {"det": 32},
    {"det": 64},
    {"det": 64, "twarps": 8},
    {"det": 32, "n": 128, "twarps": 8},
    {"det": 64, "n": 128, "twarps": 8},
]
TILED_DECODE_CASES = {  # a CUDA-graph decode step of 248 rows on the tiled kernels
    "1 adapter (slora@1)": [0] * 248,
    "2 adapters of ranks 32 and 64 (slora@10, grouped)": [2] * 124 + [3] * 124,
    "10 adapters, arrival order": "random 10",
    "16 adapters (slora@100, grouped)": [s for s in range(16) for _ in range(16)][:248],
    "62 adapters of 4 rows (the tiled threshold)": [s for s in range(62) for _ in range(4)],
}


def tiled_decode_rows(bw: float) -> list[tuple]:
    """The tiled kernels of a decode step (``runner.tiled_decode``: at least 4 rows an adapter),
    tokens per block and warps varied, replayed from CUDA graphs."""
    rows = []
    for label, slots in TILED_DECODE_CASES.items():
        if isinstance(slots, str):
            gen = torch.Generator().manual_seed(10)
            b_slot = torch.randint(0, 10, (248,), generator=gen)
        else:
            b_slot = torch.tensor(slots)
        adapters = int(b_slot.max()) + 1
        rows += _lora_case(
            b_slot, adapters, 0, f"T=248 {label}", TILED_DECODE_SHRINKS, TILED_DECODE_EXPANDS, bw
        )
    return rows


def vector_case(tokens: int, adapters: int, bw: float, fp8: bool = False) -> list[tuple]:
    """A graph decode step of ``tokens`` rows on adapters drawn from ``adapters``; ``fp8``: their
    rows in e4m3 (``adapter_dtype: fp8``), the default blocks only."""
    gen = torch.Generator().manual_seed(tokens + adapters)
    b_slot = torch.randint(0, adapters, (tokens,), generator=gen)
    label = f"mha decode T={tokens} {adapters} adapters{' e4m3 rows' if fp8 else ''}"
    shrinks, expands = ([{}], [{}]) if fp8 else (SHRINK_VARIANTS, EXPAND_VARIANTS)
    return _lora_case(b_slot, adapters, VECTOR_ALL, label, shrinks, expands, bw, fp8=fp8)


def few_adapters_case(bw: float, tokens: int = 256, adapters: int = 10) -> list[tuple]:
    """A decode step on few adapters (the runner's tiled-graph case, runner.tiled_decode): the
    tiled kernels, then the vector kernels on the same tokens (defaults both),
    which tell whether runner.TILED_TOKENS_PER_ADAPTER still picks the faster family."""
    gen = torch.Generator().manual_seed(tokens + adapters)
    b_slot = torch.randint(0, adapters, (tokens,), generator=gen)
    label = f"mha decode T={tokens} {adapters} adapters"
    rows = _lora_case(
        b_slot, adapters, 0, f"{label} tiled", TILED_SHRINK_VARIANTS, TILED_EXPAND_VARIANTS, bw
    )
    return rows + _lora_case(b_slot, adapters, VECTOR_ALL, f"{label} vector", [{}], [{}], bw)


def mixed_case(bw: float, decode: int = 248, chunks: int = 16, chunk: int = 280) -> list[tuple]:
    """A step with prefill as the acceptance workload makes them at 1000 adapters: 248 decode
    rows, then 16 prompt chunks of 280 tokens, every row on its own adapter. Metadata as
    ``batch.upload`` builds it: first with the segments in slot order (as before
    this change), then long segments first with the tiled grid cut to them (``tiled_tokens``)."""
    gen = torch.Generator().manual_seed(7)
    slots = torch.randperm(1000, generator=gen)[: decode + chunks]
    b_slot = torch.cat([slots[:decode], slots[decode:].repeat_interleave(chunk)])
    label = f"mha mixed T={b_slot.numel()} ({decode} decode + {chunks} x {chunk})"
    rows = _lora_case(
        b_slot,
        1000,
        8,
        f"{label} slot order",
        TILED_SHRINK_VARIANTS[:1],
        TILED_EXPAND_VARIANTS[:1],
        bw,
        upload=False,
    )
    return rows + _lora_case(
        b_slot,
        1000,
        8,
        f"{label} long first",
        TILED_SHRINK_VARIANTS,
        TILED_EXPAND_VARIANTS,
        bw,
        upload=True,
    )


def _as_uploaded(meta: LoraMeta, long_first: bool) -> None:
    """The step's segments and hints as ``batch.upload`` lays them out for vector_max 8;
    long_first False: slot order alone, as before tiled_tokens."""
    layout = step_batch.lora_layout(meta.b_slot.cpu().numpy().astype("int64"), 8, long_first)
    meta.token_order, meta.seg1_start, meta.seg_slot = (
        torch.from_numpy(a).cuda() for a in (layout.order, layout.seg1_start, layout.seg_slot)
    )
    layout.hint(meta, lambda array: torch.from_numpy(array).cuda())


def _lora_case(
    b_slot,
    adapters,
    vector_max,
    case,
    shrink_variants,
    expand_variants,
    bw,
    upload=None,
    rank_cycle=(8, 16, 32, 64),
    fp8=False,
):
    """q/k/v then o LoRA of one Llama-2-7B layer on the step's tokens ``b_slot``, shrinks and
    expands timed apart (replayed from CUDA graphs) for each BLOCKS variant. The fraction is of
    the copy bandwidth for the distinct adapter rows the step reads; the difference to the
    default is relative to the default's largest value."""
    heads, kv_heads, hidden, _ = SHAPES["mha"]
    kv_dim, rows = kv_heads * 128, []
    dims = [(hidden, heads * 128), (hidden, kv_dim), (hidden, kv_dim), (heads * 128, hidden)]
    q, kv = dims[0][1], dims[1][1]
    tokens = b_slot.numel()
    ranks = [rank_cycle[s % len(rank_cycle)] for s in range(adapters)]
    pool, meta, nbytes = lora_meta(b_slot, ranks, dims, kv_dim, fp8)
    meta.vector_max = vector_max
    if upload is not None:
        _as_uploaded(meta, upload)
    rank = meta.max_rank
    x = torch.randn(tokens, hidden, dtype=DTYPE, device="cuda")
    buf = torch.zeros(tokens, 3 * rank, device="cuda")
    out = torch.zeros(tokens, q + 2 * kv, dtype=DTYPE, device="cuda")
    v_in = torch.randn_like(buf)  # the expands' input, the same for every variant
    # A's bytes: 2 an element, or 1 and a 4-byte scale a row
    a_bytes = sum(
        ranks[s] * sum(i + 4 if fp8 else 2 * i for i, _ in dims) for s in meta.seg_slot.tolist()
    )

    def shrinks():
        triton_ops.lora_shrink(x, pool, meta, (0, 1, 2), buf[:, : 3 * rank])
        triton_ops.lora_shrink(x, pool, meta, 3, buf[:, :rank])

    def expands():
        cols = ((0, q), (q, q + kv), (q + kv, q + 2 * kv))
        triton_ops.lora_expand(buf[:, : 3 * rank], pool, meta, (0, 1, 2), out, cols)
        triton_ops.lora_expand(buf[:, :rank], pool, meta, 3, out[:, : dims[3][1]])

    for kind, fn, variants, dst, moved in [
        ("shrink", shrinks, shrink_variants, buf, a_bytes),
        ("expand", expands, expand_variants, out, nbytes - a_bytes),
    ]:
        reference = None
        for variant in variants:
            saved = dict(BLOCKS)
            BLOCKS.update(variant)
            try:
                if kind == "expand":
                    buf.copy_(v_in)
                dst.zero_()
                fn()
                if reference is None:
                    reference = dst.float().clone()
                diff = float((dst.float() - reference).abs().max() / reference.abs().max())
                us = _graph_us(fn)
                gbs = moved / us / 1e3
                rows.append(
                    (
                        f"lora {kind} sweep",
                        f"{case} {variant or 'default'}",
                        us,
                        f"{gbs:.0f} GB/s",
                        f"{gbs / bw:.2f}; rel diff {diff:.1e}",
                    )
                )
            except Exception as exc:  # a variant that fails to build must not stop the table
                rows.append(
                    (
                        f"lora {kind} sweep",
                        f"{case} {variant}",
                        float("nan"),
                        f"{type(exc).__name__}: {str(exc)[:80]}",
                        "",
                    )
                )
            finally:
                BLOCKS.clear()
                BLOCKS.update(saved)
    return rows
