"""Tiny random mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE) and their
adapters in Hugging Face / PEFT format, beside ``factory`` (whose ``make_adapter``, ``make_rows``
and ``reference`` they share).

Each model has 2 layers, hidden 64, GQA 4/2, top-2 routing over 4 or 8 experts, and weights
large enough (``initializer_range`` 0.2) that the router spreads tokens over every expert.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from factory import make_adapter

from slora_batch import Engine, EngineConfig, Request

VOCAB = 300
MOE_KINDS = ("qwen3-moe", "mixtral", "qwen2-moe", "olmoe")
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
# (name, rank, targets, alpha, rslora): mixed ranks on attention targets, the MoE adapters' case
ATTENTION_ADAPTERS = [
    ("r1-qv", 1, ["q_proj", "v_proj"], 2, False),
    ("r3-attn", 3, ATTN, 6, False),
    ("r8-attn-rs", 8, ATTN, 16, True),
    ("r5-qo", 5, ["q_proj", "o_proj"], 5, False),
    ("r16-kv", 16, ["k_proj", "v_proj"], 8, False),
]


def moe_config(kind: str):
    """The transformers config of one tiny MoE model: Qwen3-MoE with norm_topk_prob and 8
    experts; Mixtral with 4; Qwen2-MoE with a shared expert and layer 1 dense
    (``mlp_only_layers``); OLMoE with whole-projection q/k norms and no top-k renormalization."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        num_experts_per_tok=2,
    )
    if kind == "qwen3-moe":  # head_dim 24, not 64 / 4
        return tf.Qwen3MoeConfig(
            head_dim=24,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            norm_topk_prob=True,
            **common,
        )
    if kind == "mixtral":
        return tf.MixtralConfig(intermediate_size=48, num_local_experts=4, **common)
    if kind == "qwen2-moe":
        return tf.Qwen2MoeConfig(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            **common,
        )
    if kind == "olmoe":
        return tf.OlmoeConfig(intermediate_size=32, num_experts=8, **common)
    raise ValueError(kind)


def moe_hf_model(kind: str, seed: int = 0):
    """The transformers model of ``kind`` with random weights, in fp32 on the CPU."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(kind), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    return model.eval()


def make_moe_model(root: Path, kind: str, seed: int = 0) -> Path:
    """``moe_hf_model`` saved with ``save_pretrained``: one tensor per expert, as on the Hub."""
    out = root / f"model-{kind}"
    moe_hf_model(kind, seed).save_pretrained(out, safe_serialization=True)
    return out


def save_fused(model, out: Path) -> Path:
    """``model``'s state dict as it is in memory under transformers 5 (fused 3-D experts:
    ``mlp.experts.gate_up_proj`` [E, 2 * I, H], ``mlp.experts.down_proj`` [E, H, I]) in one
    safetensors file, with its config."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, out / "model.safetensors")
    model.config.to_json_file(out / "config.json")
    return out


def make_attention_adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    """``ATTENTION_ADAPTERS`` for ``model_dir`` (random non-zero A and B)."""
    return {
        name: make_adapter(model_dir, root / name, r, t, a, rs, seed=i + 1)
        for i, (name, r, t, a, rs) in enumerate(ATTENTION_ADAPTERS)
    }


def write_adapter(out: Path, tensors: dict[str, tuple[int, int]], rank: int = 2, **cfg) -> Path:
    """A PEFT adapter directory written by hand: zero tensors of the given shapes under the given
    names (``base_model.model.`` prepended), and an ``adapter_config.json`` of ``cfg``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    save_file(
        {f"base_model.model.{k}": torch.zeros(shape) for k, shape in tensors.items()},
        out / "adapter_model.safetensors",
    )
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, **cfg}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def make_expert_adapter(
    model_dir: Path,
    out: Path,
    rank: int,
    alpha: float,
    seed: int,
    modules: list[str] = (),
    parameters: list[str] = EXPERT_PARAMETERS,
    rslora: bool = False,
    **extra,
) -> Path:
    """A PEFT adapter on the experts' fused parameters (``target_parameters``) beside LoRA on
    ``modules`` (attention, the router "gate", or the experts' projections, which PEFT turns
    into the fused parameters with a rank_pattern), random non-zero A and B."""
    return make_adapter(
        model_dir,
        out,
        rank,
        list(modules),
        alpha,
        rslora,
        seed,
        target_parameters=list(parameters) or None,
        **extra,
    )


def write_per_expert_adapter(
    model_dir: Path,
    out: Path,
    rank: int,
    alpha: float,
    seed: int,
    projections: tuple[str, ...] = ("gate", "up", "down"),
    router: bool = False,
    attention: tuple[str, ...] = (),
    rslora: bool = False,
) -> Path:
    """An adapter as PEFT saved LoRA on transformers 4's per-expert modules
    (``experts.{e}.gate_proj`` ..., Mixtral's ``block_sparse_moe.experts.{e}.w1`` ...), the
    router ``gate`` and attention projections: random A and B of ``rank`` for every expert of
    every MoE layer."""
    from safetensors.torch import save_file

    from slora_batch.engine.models.spec import read_spec

    spec = read_spec(model_dir)
    gen = torch.Generator().manual_seed(seed)
    names = dict(zip(("gate", "up", "down"), spec.expert_names, strict=True))
    block = "block_sparse_moe" if spec.architecture == "MixtralForCausalLM" else "mlp"
    h, inter = spec.hidden_size, spec.expert_size
    dims = {"gate": (h, inter), "up": (h, inter), "down": (inter, h)}
    modules = {}
    for layer in range(spec.num_layers):
        p = f"base_model.model.model.layers.{layer}."
        for t in attention:
            modules[f"{p}self_attn.{t}_proj"] = spec.target_dims(t)
        if not spec.is_moe_layer(layer):
            continue
        for e in range(spec.num_experts):
            for proj in projections:
                modules[f"{p}{block}.experts.{e}.{names[proj]}"] = dims[proj]
        if router:
            modules[f"{p}{block}.gate"] = (h, spec.num_experts)
    tensors = {}
    for module, (d_in, d_out) in modules.items():
        tensors[f"{module}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) / d_in**0.5
        tensors[f"{module}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * (
            0.5 / rank**0.5
        )
    out.mkdir(parents=True)
    save_file(tensors, out / "adapter_model.safetensors")
    targets = [names[p] for p in projections] + (["gate"] if router else [])
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "target_modules": targets + [f"{t}_proj" for t in attention],
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def reference_each(model_dir: Path, adapters: dict[str, Path], rows: list[dict]) -> dict:
    """Greedy generations of transformers + PEFT with each adapter loaded alone on a fresh
    base (PEFT holds adapters of different ``target_parameters`` in one model only one at a
    time); base rows on the plain model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = {}
    for name in {row["adapter"] for row in rows}:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if name:
            model = PeftModel.from_pretrained(model, adapters[name])
        model.eval()
        eos = model.config.eos_token_id
        for row in rows:
            if row["adapter"] == name:
                out[row["id"]] = _greedy(model, row, eos)
    return out


def _greedy(model, row: dict, eos: int) -> list[int]:
    ids = torch.tensor([row["prompt_token_ids"]])
    with torch.no_grad():
        gen = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=row["max_new_tokens"],
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    tokens = gen[0, ids.shape[1] :].tolist()
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def expert_adapters(model_dir: Path, root: Path, kind: str) -> dict[str, Path]:
    """Adapters of Qwen3-MoE, Mixtral or OLMoE in every format, ranks 1 to 8 per expert target: on the
    fused parameters (both, or down_proj alone with the router), PEFT's conversion of
    target_modules naming the experts (gate_up at 2r, rslora), transformers 4's per-expert
    modules with the router, and an attention-only one."""
    experts = ["w1", "w3", "w2"] if kind == "mixtral" else ["gate_proj", "up_proj", "down_proj"]
    return {
        "fused": make_expert_adapter(model_dir, root / "fused", 3, 6, seed=1, modules=["q_proj"]),
        "down-router": make_expert_adapter(
            model_dir,
            root / "down-router",
            1,
            2,
            seed=2,
            modules=["gate"],
            parameters=["mlp.experts.down_proj"],
        ),
        "modules-rs": make_adapter(
            model_dir, root / "modules-rs", 2, [*experts, "v_proj"], 3, True, seed=3
        ),
        "per-expert": write_per_expert_adapter(
            model_dir, root / "per-expert", 4, 8, seed=4, router=True, attention=("o",)
        ),
        "attention": make_adapter(
            model_dir, root / "attention", 5, ["q_proj", "k_proj"], 5, False, seed=5
        ),
    }


def run(model_dir, adapters, rows, **knobs):
    """The CPU engine in fp32 over ``rows``: (results by id, the engine); no row may fail."""
    config = EngineConfig(device="cpu", dtype="float32", **knobs)
    engine = Engine(model_dir, adapters=adapters, config=config)
    results = {r.id: r for r in engine.generate(Request(**row) for row in rows)}
    assert all(r.error is None for r in results.values()), [r.error for r in results.values()]
    return results, engine


def assert_parity(results, expected) -> None:
    """Every row's tokens are the reference's (transformers + PEFT)."""
    wrong = {
        i: (results[i].token_ids, want)
        for i, want in expected.items()
        if results[i].token_ids != want
    }
    assert not wrong, f"{len(wrong)} rows differ from transformers + PEFT: {wrong}"
