"""Mixture-of-experts models in bf16 on a GPU against transformers + PEFT (run on the device
machine): tiny random Qwen3-MoE and Mixtral, base rows, attention-only adapters and adapters on
the experts in both PEFT formats (``target_parameters`` and per-expert modules), ranks 1 to 16
mixed in one batch, with and without CUDA graphs. First-step logits are close to fp32 (the
median over the rows: a token near a routing tie flips under any rounding); greedy tokens equal
the reference up to the first near tie (``moe_peft_parity``, the comparison of
test_engine_gpu.py, which test_moe_peft_parity.py runs in fp32 on the CPU; in bf16 on the CPU it
passes too, the torch twins in place of the Triton kernels).

Run: ``python3 -m pytest -q -m gpu -o addopts= tests/engine/models/test_moe_peft_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from moe_peft_parity import assert_parity_up_to_near_ties, moe_case, references

from slora_batch import Engine, EngineConfig

pytestmark = pytest.mark.gpu

KINDS = ("qwen3-moe", "mixtral")


@pytest.fixture(scope="module", params=KINDS)
def gpu_case(request, tmp_path_factory):
    """The case of one kind and its bf16 references on the GPU (PEFT, one adapter at a time)."""
    model_dir, adapters, rows = moe_case(tmp_path_factory.mktemp(request.param), request.param)
    refs = references(model_dir, adapters, rows, "cuda", torch.bfloat16)
    return model_dir, adapters, rows, refs


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_bf16_moe_engine_matches_peft_up_to_near_ties(gpu_case, graphs):
    model_dir, adapters, rows, refs = gpu_case
    config = EngineConfig(device="cuda", dtype="bfloat16", cuda_graphs=graphs, max_num_seqs=32,
                          num_pages=40_000)  # fmt: skip
    engine = Engine(model_dir, adapters=adapters, config=config)
    print(assert_parity_up_to_near_ties(engine, rows, refs))
    assert (engine.counters.graph_steps > 0) == graphs
    engine.close()
    torch.cuda.empty_cache()
