"""S-LoRA tensor parallelism in bf16 on two GPUs (NCCL; run on the two-GPU device machine): the
engine at tensor_parallel 2 gives transformers + PEFT's greedy tokens, as the one-device engine
does, up to a near tie (the margins of test_engine_gpu.py), with CUDA graphs and without.
"""

from __future__ import annotations

import pytest
import torch
from test_engine_gpu import (
    MARGIN,
    NOISE_MARGINS,
    assert_tokens_match,
    build_case,
    fp32_first_logits,
    reference,
    rows,
)

from slora_batch import Engine, EngineConfig, Request

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs 2 GPUs"),
]

# GQA (16 query heads, 4 KV heads: 8 and 2 a rank), small enough to build in seconds
SHAPE = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)


@pytest.fixture(scope="module")
def tp_case(tmp_path_factory):
    """The model on disk (a rank loads its own shard), the adapters, and the reference: PEFT's
    tokens and logits per row, and each row's near-tie margin from its own bf16 noise."""
    from safetensors.torch import save_file

    model_dir, weights, adapters, peft_model = build_case(tmp_path_factory.mktemp("tp"), SHAPE)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(model_dir / "model.safetensors"))
    cases = rows(SHAPE["vocab_size"])
    expected = {row["id"]: reference(peft_model, row) for row in cases}
    exact = fp32_first_logits(peft_model, cases)
    margins = {
        i: max(MARGIN, NOISE_MARGINS * float((logits[0] - exact[i]).pow(2).mean().sqrt()))
        for i, (_, logits) in expected.items()
    }
    del peft_model, weights
    torch.cuda.empty_cache()
    return model_dir, adapters, cases, expected, margins


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_bf16_tensor_parallel_two_matches_peft_and_one_device(tp_case, graphs):
    model_dir, adapters, cases, expected, margins = tp_case
    tokens = {}
    for size in (2, 1):
        config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=16, num_pages=60_000,
                              cuda_graphs=graphs, tensor_parallel=size)  # fmt: skip
        engine = Engine(model_dir, adapters=adapters, config=config)
        try:
            results = list(engine.generate(Request(**row) for row in cases))
            assert not [r.error for r in results if r.error]
            tokens[size] = {r.id: r.token_ids for r in results}
            assert (engine.counters.graph_steps > 0) == graphs
            if size == 2:
                assert engine.tp is not None and engine.pool.page_size == engine.spec.kv_dim // 2
        finally:
            engine.close()
    for row in cases:
        want, logits = expected[row["id"]]
        for size in (2, 1):
            assert_tokens_match(tokens[size][row["id"]], want, logits, row, margins[row["id"]])
