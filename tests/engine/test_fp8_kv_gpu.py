"""The fp8 KV cache on the Triton backend in bf16 on a GPU with fp8 (sm 8.9+, run on the device
machine): the engine with ``kv_cache_dtype: fp8`` against the same engine with bf16 KV, on the
random models of tests/engine/test_engine_gpu.py (GQA, MHA at Llama-2-7B's shape, Gemma 2's
head_dim 256 with windows and soft-caps), CUDA graphs on and off.

Widened margin: the bf16 tests call a step a near tie when the reference's top-2 margin is under
max(MARGIN, NOISE_MARGINS x transformers' own bf16 logit noise). Here the noise is the fp8 KV
engine's: the per-logit rms of its first-step logits minus the bf16 KV engine's, which e4m3's
3 mantissa bits (a rounding step 16x bf16's) make several times larger; it is bounded in turn
by FP8_REL_ERR against the fp32 reference, so a broken kernel cannot widen its own margin.
"""

from __future__ import annotations

import pytest
import torch
from test_engine_gpu import MARGIN, NOISE_MARGINS, SHAPES, build_case, fp32_first_logits, rows

from slora_batch import Engine, EngineConfig, Request
from slora_batch.engine.engine import assemble
from slora_batch.engine.execution.parts import EngineParts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA card with fp8",
    ),
]

# First-step logits of the fp8 KV engine within this relative error (norm of the difference
# over the norm) of the fp32 reference; ignored scales or V read from K's bytes give O(1). The
# H200 measured up to 0.317 (llama2-7b shape, row 3 on adapter r16; the same with bf16 and with
# fp16 dots on the fp8 pages, commits 75e871d and f917561, graphs and eager alike) and 0.15-0.17
# on the other rows and shapes: 3 mantissa bits per K and V element, over 32 layers of a random
# model. The bound was 0.3 from the first run's other rows; widened to 0.4, under the O(1) of a
# broken read. The kernels themselves match the twin on the same bytes at bf16 tolerance
# (tests/kernels/test_attention_fp8_gpu.py).
FP8_REL_ERR = 0.4
# Shapes whose fp8 noise leaves no decisive step: on the random 32-layer llama2-7b shape (H100,
# 59ac112) the fp8 KV engine's first-step logits sit 0.18-0.41 nats rms from the bf16 KV
# engine's (0.02-0.07 on smollm2-135m), so six times that is over every top-2 gap of bf16's
# first 12 steps (at most 1.66), and the rows part at steps 0-4, each at a gap under 1.5x the
# noise. Decode on fp8 pages is checked token for token on the other shapes and, kernel by
# kernel, in tests/kernels/test_attention_fp8_gpu.py.
NOISY = {"llama2-7b"}


@pytest.fixture(scope="module", params=["smollm2-135m", "llama2-7b", "gemma2"])
def fp8_case(request, tmp_path_factory):
    return build_case(tmp_path_factory.mktemp(request.param), SHAPES[request.param])


def _engine(model_dir, weights, adapters, **knobs) -> Engine:
    pages = 60_000 if "llama" in str(model_dir) else 200_000
    config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=16, num_pages=pages,
                          backend="triton", **knobs)  # fmt: skip
    return assemble(model_dir, adapters, config, parts=EngineParts(weights))


def _run(engine: Engine, cases: list[dict]) -> tuple[dict, dict]:
    """(first-step logits by row id, results by row id) of the engine on the rows."""
    first = {row["id"]: engine.prompt_logits(Request(**row)) for row in cases}
    results = {r.id: r for r in engine.generate(Request(**row, logprobs=2) for row in cases)}
    assert all(r.error is None for r in results.values()), [r.error for r in results.values()]
    return first, results


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_fp8_kv_tokens_match_bf16_kv_up_to_widened_ties(request, fp8_case, graphs):
    model_dir, weights, adapters, peft_model = fp8_case
    bf16 = _engine(model_dir, weights, adapters, cuda_graphs=graphs)
    cases = rows(bf16.spec.vocab_size)
    want_first, want = _run(bf16, cases)
    del bf16
    torch.cuda.empty_cache()
    fp8 = _engine(model_dir, weights, adapters, cuda_graphs=graphs, kv_cache_dtype="fp8")
    assert fp8.pool.kv_pages_per_token == 1 and fp8.pool.scales is not None
    got_first, got = _run(fp8, cases)
    assert (fp8.counters.graph_steps > 0) == graphs
    exact = fp32_first_logits(peft_model, cases)
    compared = 0
    for row in cases:
        key = row["id"]
        ref = exact[key]
        err = float((got_first[key] - ref).norm() / ref.norm())
        assert err < FP8_REL_ERR, (key, row["adapter"], err)
        noise = float((got_first[key] - want_first[key]).pow(2).mean().sqrt())
        margin = max(MARGIN, NOISE_MARGINS * noise)
        g, w = got[key], want[key]
        for step, (a, b) in enumerate(zip(g.token_ids, w.token_ids, strict=True)):
            top = w.logprobs[step]["top"]
            tie = top[0]["logprob"] - top[1]["logprob"] < margin
            if a != b:  # the first divergence must be a near tie under fp8 rounding
                assert tie, (key, row["adapter"], step, margin, g.token_ids, w.token_ids)
                break  # the rest follows other tokens
            compared += not tie  # agreeing at a near tie checks little; the contexts stay equal
    # the margin must leave decisive steps to compare, or the test would check nothing of decode;
    # not on the 7B shape, where it is the first-step bound and the divergences at ties alone
    if request.node.callspec.params["fp8_case"] not in NOISY:
        assert compared > 0, "no decisive step compared"
    del fp8
    torch.cuda.empty_cache()
