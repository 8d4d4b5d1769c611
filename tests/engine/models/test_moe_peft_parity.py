"""The comparison of the bf16 GPU test test_moe_peft_gpu.py (``moe_peft_parity``) on the CPU in
fp32: the same case (a tiny random Qwen3-MoE, base rows, attention-only adapters and adapters on
the experts in both PEFT formats, ranks 1 to 16 in one batch), the engine's first-step logits
within 1e-2 of transformers + PEFT's (relative, the median over the rows) and its tokens equal
up to a near tie. Slow: a
fresh transformers model per adapter for the reference (about 30 s on two busy cores)."""

from __future__ import annotations

import pytest
import torch
from moe_peft_parity import assert_parity_up_to_near_ties, moe_case, references

from slora_batch import Engine, EngineConfig


@pytest.mark.slow
def test_fp32_moe_engine_matches_peft_up_to_near_ties(tmp_path):
    model_dir, adapters, rows = moe_case(tmp_path, "qwen3-moe")
    refs = references(model_dir, adapters, rows, "cpu", torch.float32)
    assert all(ref.error < 1e-5 for ref in refs.values())  # fp32: generate's own rounding only
    config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=32, num_pages=40_000)
    engine = Engine(model_dir, adapters=adapters, config=config)
    table = assert_parity_up_to_near_ties(engine, rows, refs)
    assert len(table.splitlines()) == len(rows)
