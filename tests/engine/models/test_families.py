"""Every model family against transformers + PEFT, token for token in fp32 on CPU: Qwen3, Gemma 2,
Gemma 3, Phi-3 (fused targets, longrope, partial rotary) and sliding windows (Mistral, Qwen2).

Tiny random models whose switches all matter: windows shorter than most prompts, soft-caps
small enough to bite, an explicit head_dim apart from hidden / heads, a query scale apart from
head_dim, a local RoPE apart from the global one. Adapters: attention and MLP targets (the
fused modules for Phi-3), ranks 1, 3, 5 and 16 (rslora), base rows beside them; a roomy pool
and one small enough to preempt and evict; scored rows against the reference's log-probs.
"""

from __future__ import annotations

import random

import pytest
import torch
from factory import make_adapter, make_rows, reference
from test_scoring import peft_model, reference_logprobs

from slora_batch import Engine, EngineConfig, Request

VOCAB = 300
ROWS = 30
WINDOW = 8
LONGROPE_FROM = 32  # Phi-3's original context in the tiny model
SPLIT = {
    "attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj"],
    "qo": ["q_proj", "o_proj"],
}
FUSED = {  # Phi-3's modules
    "attn": ["qkv_proj", "o_proj"],
    "all": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "mlp": ["gate_up_proj", "down_proj"],
    "qo": ["qkv_proj"],
}
# (name, rank, targets, alpha, rslora)
ADAPTERS = [
    ("r1-attn", 1, "attn", 2, False),
    ("r3-all", 3, "all", 6, False),
    ("r16-mlp-rs", 16, "mlp", 8, True),
    ("r5-qo", 5, "qo", 5, False),
]
FAMILIES = ("qwen3", "gemma2", "gemma3", "phi3", "mistral-window", "qwen2-window")


def family_config(kind: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False)  # fmt: skip
    if kind == "qwen3":  # head_dim 24, not 64 / 4
        return tf.Qwen3Config(head_dim=24, **common)
    if kind == "gemma2":  # layer 0 local, layer 1 global; both soft-caps; scale 24 ** -0.5
        return tf.Gemma2Config(head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
                               attn_logit_softcapping=5.0, final_logit_softcapping=4.0,
                               **{**common, "tie_word_embeddings": True})  # fmt: skip
    if kind == "gemma3":
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        }
        return tf.Gemma3TextConfig(head_dim=16, query_pre_attn_scalar=20, sliding_window=WINDOW,
                                   layer_types=["sliding_attention", "full_attention"],
                                   rope_parameters=rope, **common)  # fmt: skip
    if kind == "phi3":  # longrope from 32 positions, half of each head rotated
        gen = torch.Generator().manual_seed(5)
        rot_half = 4  # head_dim 16 * 0.5 / 2
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "short_factor": (1 + torch.rand(rot_half, generator=gen)).tolist(),
                "long_factor": (1 + 3 * torch.rand(rot_half, generator=gen)).tolist(),
                "original_max_position_embeddings": LONGROPE_FROM}  # fmt: skip
        return tf.Phi3Config(rope_parameters=rope, original_max_position_embeddings=LONGROPE_FROM,
                             **common)  # fmt: skip
    if kind == "mistral-window":
        return tf.MistralConfig(sliding_window=WINDOW, **common)
    if kind == "qwen2-window":  # layer 1 sliding, layer 0 full
        return tf.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                              **common)  # fmt: skip
    raise ValueError(kind)


def make_family(root, kind: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(FAMILIES.index(kind))
    model = AutoModelForCausalLM.from_config(family_config(kind), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's norms are 1 + w: both forms land near 1 or 2
                p.uniform_(0.8, 1.2)
    out = root / kind
    model.save_pretrained(out, safe_serialization=True)
    modules = FUSED if kind == "phi3" else SPLIT
    adapters = {
        name: make_adapter(out, root / f"{kind}-{name}", r, modules[t], a, rs, seed=i + 1)
        for i, (name, r, t, a, rs) in enumerate(ADAPTERS)
    }
    return out, adapters


def family_rows(kind: str, adapters) -> list[dict]:
    rows = make_rows(ROWS, VOCAB, list(adapters), seed=len(kind))
    if kind == "phi3":  # transformers recomputes a row crossing the original context: none do
        for row in rows:
            room = LONGROPE_FROM - len(row["prompt_token_ids"])
            if room > 0:
                row["max_new_tokens"] = min(row["max_new_tokens"], room)
    return rows


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    model_dir, adapters = make_family(tmp_path_factory.mktemp(request.param), request.param)
    rows = family_rows(request.param, adapters)
    return request.param, model_dir, adapters, rows, reference(model_dir, adapters, rows)


def run(model_dir, adapters, rows, **knobs):
    config = EngineConfig(device="cpu", dtype="float32", **knobs)
    engine = Engine(model_dir, adapters=adapters, config=config)
    requests = (row if isinstance(row, Request) else Request(**row) for row in rows)
    results = {r.id: r for r in engine.generate(requests)}
    assert all(r.error is None for r in results.values()), [r.error for r in results.values()]
    return results, engine


def assert_parity(results, expected) -> None:
    wrong = {i: (results[i].token_ids, want) for i, want in expected.items()
             if results[i].token_ids != want}  # fmt: skip
    assert not wrong, f"{len(wrong)} rows differ from transformers + PEFT: {wrong}"


def test_family_greedy_tokens_equal_transformers_peft(family):
    kind, model_dir, adapters, rows, expected = family
    results, engine = run(model_dir, adapters, rows, num_pages=20000, max_num_batched_tokens=40)
    assert_parity(results, expected)
    assert engine.counters.preemptions == 0 and engine.counters.steps > 10
    assert any(len(r["prompt_token_ids"]) > WINDOW for r in rows)
    if kind in ("gemma2", "gemma3", "mistral-window", "qwen2-window"):
        assert engine.spec.layer_windows and WINDOW in engine.spec.layer_windows


def test_family_parity_with_preemption_and_eviction(family):
    kind, model_dir, adapters, rows, expected = family
    engine = Engine(model_dir, adapters=adapters, config=EngineConfig(device="cpu", num_pages=64))
    spec, store = engine.spec, engine.store  # the pool is not used: no 1 GiB default
    longest = max(2 * (len(r["prompt_token_ids"]) + r["max_new_tokens"]) for r in rows)
    biggest = max(store.pages(name) for name in adapters)
    pages = longest + 2 * biggest  # the longest row beside two adapters
    results, engine = run(model_dir, adapters, rows, num_pages=pages, max_num_batched_tokens=32,
                          max_adapters_per_batch=2)  # fmt: skip
    assert_parity(results, expected)
    assert engine.counters.preemptions > 0, (kind, pages, spec.page_size)
    assert engine.counters.adapter_evictions > 0


def test_family_scores_equal_transformers_peft(family):
    kind, model_dir, adapters, _, _ = family
    rng = random.Random(3)
    names = [None, *adapters]
    rows = []
    for i in range(12):
        length = rng.choice([3, 9, 14, 20])
        if kind == "phi3" and i % 4 == 3:
            length = LONGROPE_FROM + 5  # the long factors for the whole row
        context = [rng.randrange(3, VOCAB) for _ in range(length)]
        stem = context[: rng.choice([0, 4])]
        cont = [rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 4, 9]))]
        rows.append(Request(id=i, adapter=names[i % len(names)], prompt_token_ids=stem + context,
                            continuation_token_ids=cont))  # fmt: skip
    results, _ = run(model_dir, adapters, rows, num_pages=20000, max_num_batched_tokens=24,
                     prefix_caching=True, prefix_block_tokens=4)  # fmt: skip
    model = peft_model(model_dir, adapters)
    for row in rows:
        ctx, cont = row.prompt_token_ids, row.continuation_token_ids
        logp = reference_logprobs(model, row.adapter, ctx + cont)
        want = [float(logp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont)]
        assert results[row.id].token_logprobs == pytest.approx(want, abs=1e-4), (kind, row.id)


def test_family_under_tensor_parallel_two(family):
    """Two gloo ranks: Phi-3's fused weights and fused LoRA B cut part by part ([q_r | k_r |
    v_r]), Gemma 3's per-head norms, extra norms after the all-reduce and its local RoPE on the
    rank's heads: the tokens of transformers + PEFT."""
    kind, model_dir, adapters, rows, expected = family
    if kind not in ("phi3", "gemma3"):
        pytest.skip("the families whose layers tensor parallelism cuts otherwise")
    results, engine = run(model_dir, adapters, rows, tensor_parallel=2, num_pages=8000,
                          max_num_batched_tokens=64, cpu_threads=1)  # fmt: skip
    try:
        assert engine.tp is not None and engine.tp.size == 2
        assert_parity(results, expected)
    finally:
        engine.close()
