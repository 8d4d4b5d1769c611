"""The Triton LoRA kernels on fp8 adapter rows (``LoraMeta.fp8_rows``) against their torch
twins, in Triton's interpreter: mixed ranks 1 to 64, pages at random places among noise, base
rows, a lora_B bias row in the model dtype beside the e4m3 rows, fp32 and fp16 pools, on the
tiled, vector and mixed paths, alone and in groups of targets, with and without split sums.

``test_fp8_adapters_in_interpreter`` runs this file's tests in a child process with
TRITON_INTERPRET=1 (``interpreter.run_interpreted``); shapes are tiny.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import INTERPRETED, run_interpreted
from test_fp8_adapters_rows import fp8_case

from slora_kernels import ref
from slora_kernels.meta import VECTOR_ALL

TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (3e-2, 3e-2)}
SMALL_BLOCKS = {"rank": 16, "k": 16, "n": 16, "split_min_k": 16, "vk": 16, "vn": 16, "vr": 8,
                "vgrid": 1, "vstages": 0, "er": 16}  # fmt: skip
RUNS = [  # (pool dtype, page elements, LoraMeta.vector_max, blocks)
    (torch.float32, 16, 0, "default"),  # 64-byte pages: rows of 1 and 2 pages, 4 scale pages
    (torch.float16, 32, VECTOR_ALL, "default"),
    (torch.float16, 32, 2, "small"),  # splits of d_in, rank rows 8 at a time
    (torch.float32, 16, VECTOR_ALL, "small"),
    (torch.float16, 32, VECTOR_ALL, "aligned"),  # the tiled kernels, one adapter chunk a program
]

if not INTERPRETED:

    @pytest.mark.slow
    def test_fp8_adapters_in_interpreter():
        run_interpreted(__file__)


@pytest.fixture(scope="module")
def kernels():
    """The Triton launchers and their blocks, imported only once the process interprets."""
    if not INTERPRETED:
        pytest.skip("runs under TRITON_INTERPRET=1, in test_fp8_adapters_in_interpreter's child")
    from slora_kernels import lora_blocks, lora_expand, lora_shrink

    return lora_shrink.lora_shrink, lora_expand.lora_expand, lora_blocks.BLOCKS


def assert_close(actual, expected, dtype) -> None:
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def check_groups(shrink, expand, case, dtype, seed) -> None:
    """q and k as one group (one input), then down alone, through shrink and expand against
    ref: stale buffer columns survive, each target adds into its own output columns."""
    gen = torch.Generator(case.pool.device).manual_seed(seed)
    meta, rank, device = case.meta, case.meta.max_rank, case.pool.device
    widths = list(case.dims.values())
    tokens = meta.b_slot.shape[0]
    for group in ((0, 1), (2,)):
        x = torch.randn(tokens, widths[group[0]][0], generator=gen, device=device).to(dtype)
        buf = torch.randn(tokens, len(group) * rank + 3, generator=gen, device=device)
        mine, theirs = buf.clone(), buf.clone()
        shrink(x, case.pool, meta, group, mine[:, : len(group) * rank])
        for j, t in enumerate(group):
            ref.lora_shrink(x, case.pool, meta, t, theirs[:, j * rank : (j + 1) * rank])
        assert_close(mine, theirs, dtype)
        cols, lo = [], 3
        for t in group:
            cols.append((lo, lo + widths[t][1]))
            lo += widths[t][1] + 2
        out = torch.randn(tokens, lo + 4, generator=gen, device=device).to(dtype)
        mine, theirs = out.clone(), out.clone()
        expand(buf[:, : len(group) * rank], case.pool, meta, group, mine, tuple(cols))
        for j, (t, (c0, c1)) in enumerate(zip(group, cols, strict=True)):
            ref.lora_expand(buf[:, j * rank : (j + 1) * rank], case.pool, meta, t, theirs[:, c0:c1])
        assert_close(mine, theirs, dtype)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[0]}-page{r[1]}-vmax{r[2]}-{r[3]}")
def test_kernels_on_fp8_rows_match_twins(kernels, monkeypatch, run):
    shrink, expand, blocks = kernels
    dtype, page, vector_max, setting = run
    if setting in ("small", "aligned"):
        for knob, value in SMALL_BLOCKS.items():
            monkeypatch.setitem(blocks, knob, value)
    if setting == "aligned":
        monkeypatch.setitem(blocks, "valign", 1)
        monkeypatch.setitem(blocks, "at", 16)
    case = fp8_case(ranks=[1, 3, 64, 16], num_tokens=10, dtype=dtype, seed=page + vector_max % 7,
                    page=page, bias_slots=(1,))  # fmt: skip
    case.meta.vector_max = vector_max
    check_groups(shrink, expand, case, dtype, seed=1)
