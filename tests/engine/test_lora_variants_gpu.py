"""PEFT's LoRA variants in bf16 on a GPU against transformers + PEFT (run on the device machine):
per-module ranks and alphas, layer subsets, lora_B's bias and DoRA, mixed in one batch with
plain LoRA and base rows, on SmolLM2-135M's shape (Llama, tied embeddings) and a small Qwen2
(biased q, k, v). Greedy tokens equal the reference up to the first near tie, as in
test_engine_gpu.py, with CUDA graphs (vector and tiled decode) and eagerly."""

from __future__ import annotations

import pytest
import torch
from test_engine_gpu import (
    SHAPES,
    assert_tokens_match,
    first_step_errors,
    make_engine,
    randomize_lora,
    reference,
    restore_rope,
    rope_buffers,
)

from slora_batch import Request

pytestmark = pytest.mark.gpu

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAMILIES = {
    "smollm2-135m": SHAPES["smollm2-135m"],
    "qwen2": dict(config="Qwen2Config", hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=8, num_attention_heads=14, num_key_value_heads=2,
                  vocab_size=32000, tie_word_embeddings=False, rope_theta=1000000.0),
}  # fmt: skip
VARIANTS = {  # name: LoraConfig fields
    "plain": dict(r=16, lora_alpha=32, target_modules=ALL),
    "patterns": dict(
        r=8,
        lora_alpha=16,
        target_modules=ALL,
        rank_pattern={"q_proj": 32, "model.layers.3.mlp.down_proj": 64},
        alpha_pattern={"v_proj": 4, "model.layers.1.self_attn.o_proj": 64},
    ),
    "subset": dict(
        r=16,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"],
        layers_to_transform=[0, 2, 3],
        layers_pattern="layers",
        rank_pattern={"o_proj": 4},
    ),
    "bias": dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
        lora_bias=True,
    ),
    "dora": dict(r=16, lora_alpha=32, target_modules=ALL, use_dora=True),
    "dora-subset": dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "up_proj"],
        use_dora=True,
        rank_pattern={"k_proj": 4},
        layers_to_transform=[1, 2, 3],
        layers_pattern="layers",
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def variant_case(request, tmp_path_factory):
    return build_case(tmp_path_factory.mktemp(request.param), FAMILIES[request.param], VARIANTS)


def build_case(root, shape: dict, variants: dict):
    """A random bf16 model of ``shape`` on the GPU with ``variants`` (name: LoraConfig fields) in
    one PEFT model: its config in root/model (the weights returned by Hugging Face name), the
    adapters in root/adapters."""
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    shape = dict(shape)
    config_class = getattr(transformers, shape.pop("config", "LlamaConfig"))
    config = config_class(rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                          max_position_embeddings=2048, **shape)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(model).__name__]
    rope = rope_buffers(model)
    model.to(torch.bfloat16)
    restore_rope(model, rope)
    config.save_pretrained(root / "model")
    weights = dict(model.state_dict())  # HF names, taken before PEFT wraps the layers
    peft_model = None
    for name, fields in variants.items():
        cfg = LoraConfig(lora_dropout=0.0, **fields)
        if peft_model is None:
            peft_model = get_peft_model(model, cfg, adapter_name=name)
        else:
            peft_model.add_adapter(name, cfg)
    randomize_lora(peft_model)
    with torch.no_grad():  # DoRA's magnitudes moved off their start, as training moves them
        for name, p in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(0.8 + 0.4 * torch.rand_like(p))
    peft_model.save_pretrained(root / "adapters")
    peft_model.eval()
    peft_model.rope = rope  # for first_step_errors' fp32 logits
    return root / "model", weights, {n: root / "adapters" / n for n in variants}, peft_model


def rows(vocab: int, names: list, count: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 200, (count,), generator=gen).tolist()
    return [
        {
            "id": i,
            "adapter": names[i % len(names)],
            "max_new_tokens": 20,
            "ignore_eos": True,
            "prompt_token_ids": torch.randint(3, vocab, (n,), generator=gen).tolist(),
        }
        for i, n in enumerate(lengths)
    ]


def assert_matches_peft(engine, peft_model, cases) -> None:
    """First-step logits near fp32's as transformers' own bf16 are, tokens equal up to a tie."""
    expected = {row["id"]: reference(peft_model, row) for row in cases}
    errors, margins = first_step_errors(engine, peft_model, cases, expected)
    table = "\n".join(f"row {i} adapter {a} prompt {n}: ours {o:.4f} transformers {h:.4f}"
                      for i, a, n, o, h in errors)  # fmt: skip
    for _, _, _, ours_err, hf_err in errors:
        assert ours_err < max(2 * hf_err, 1e-2), table
    results = {r.id: r for r in engine.generate(Request(**row) for row in cases)}
    for row in cases:
        want, logits = expected[row["id"]]
        assert_tokens_match(results[row["id"]].token_ids, want, logits, row, margins[row["id"]])


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_bf16_variants_mixed_match_peft(variant_case, graphs):
    model_dir, weights, adapters, peft_model = variant_case
    engine = make_engine(model_dir, weights, adapters, cuda_graphs=graphs)
    cases = rows(engine.spec.vocab_size, [None, *VARIANTS], 14, seed=3)
    assert_matches_peft(engine, peft_model, cases)
    assert (engine.counters.graph_steps > 0) == graphs
    del engine
    torch.cuda.empty_cache()


def test_bf16_variants_on_tiled_decode_graphs_match_peft(variant_case):
    """Many rows on few adapters: decode steps replay the tiled-LoRA graph."""
    model_dir, weights, adapters, peft_model = variant_case
    engine = make_engine(model_dir, weights, adapters, cuda_graphs=True)
    names = [n for n in VARIANTS if n != "plain"]
    cases = rows(engine.spec.vocab_size, names, 6 * len(names), seed=11)  # 6 rows an adapter
    assert_matches_peft(engine, peft_model, cases)
    assert engine.runner.tiled_graph_steps > 0
    del engine
    torch.cuda.empty_cache()
