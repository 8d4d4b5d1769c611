"""What each family's ``config.json`` says beyond the shapes: RoPE, windows, norms, soft-caps,
experts.

Torch-free (the job tool checks models with it). Both config formats are read: transformers 5
(``rope_parameters``, per layer type for Gemma 3; ``layer_types``) and the older one that most
Hub checkpoints carry (``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``,
``sliding_window_pattern``, ``partial_rotary_factor`` at the top level).
"""

from __future__ import annotations

from typing import Any

SUPPORTED_ROPE = ("default", "linear", "llama3", "longrope")
MOE_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "OlmoeForCausalLM",
)
QWEN_MOE = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SLIDING = "sliding_attention"
ROPE_ALIASES = {"su": "longrope"}  # Phi-3's first configs named longrope "su"


class ModelError(ValueError):
    """The model cannot be run; the message names the model and the reason."""


def family_fields(path: str, arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``ModelSpec`` fields of ``arch`` read from ``cfg`` (besides the shapes)."""
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    layer_types = _layer_types(path, arch, cfg)
    window = cfg.get("sliding_window") if SLIDING in layer_types else None
    theta, scaling, partial = _rope(
        path, cfg, "full_attention" if arch.startswith("Gemma3") else None
    )
    fields: dict[str, Any] = dict(
        quantization=quantization(path, cfg),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias")),
        o_bias=bool(cfg.get("attention_bias")) and arch != "Qwen2ForCausalLM",
        sliding_window=window,
        layer_windows=tuple(window if t == SLIDING else 0 for t in layer_types) if window else (),
        rotary_dim=None if partial == 1.0 else int(head_dim * partial),
    )
    fields.update(_arch_fields(path, arch, cfg, head_dim))
    act = cfg.get("hidden_act", "silu")
    if fields.get("activation", "silu") == "silu" and act != "silu":
        raise ModelError(f"model {path!r}: hidden_act {act!r} is not supported (silu)")
    return fields


def _arch_fields(path: str, arch: str, cfg: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The fields one family sets beyond the common ones (``family_fields``)."""
    fields: dict[str, Any] = {}
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        fields.update(qk_norm=True)
    if arch in MOE_ARCHITECTURES:
        fields.update(moe_fields(path, arch, cfg))
    elif arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise ModelError(f"model {path!r}: Gemma activation {act!r} is not supported")
        scalar = cfg.get("query_pre_attn_scalar") or head_dim
        fields.update(
            gemma_norms=True,
            embed_scale=True,
            activation="gelu_tanh",  # Gemma's "gelu" checkpoints run the tanh GELU in HF too
            query_scale=float(scalar) ** -0.5,
            attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
            final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
            o_bias=False,
            attention_bias=bool(cfg.get("attention_bias")),
        )
        if arch == "Gemma3ForCausalLM":
            local_theta, local_scaling, _ = _rope(path, cfg, SLIDING)
            fields.update(
                qk_norm=True,
                local_rope=dict(rope_theta=local_theta, scaling=local_scaling),
            )
    elif arch == "Phi3ForCausalLM":
        fields.update(fused_projections=True, attention_bias=False, o_bias=False)
    return fields


def moe_fields(path: str, arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A mixture-of-experts model's ``ModelSpec`` fields, as transformers builds its layers.

    Mixtral and OLMoE: every layer's MLP is the experts, each of ``intermediate_size``; Mixtral
    always renormalizes the top-k weights. Qwen2/3-MoE: experts of ``moe_intermediate_size``,
    ``norm_topk_prob``, and a dense MLP of ``intermediate_size`` in the layers of
    ``mlp_only_layers`` and those that ``decoder_sparse_step`` skips; Qwen2-MoE adds a shared
    expert (``shared_expert_intermediate_size``) and q/k/v biases (``qkv_bias``). OLMoE
    normalizes the whole q and k projections (``clip_qkv`` is refused)."""
    n = cfg["num_hidden_layers"]
    if cfg.get("quantization_config"):
        raise ModelError(
            f"model {path!r}: quantized weights are not supported for {arch} "
            "(mixture-of-experts models run in float32, bfloat16 or float16)"
        )
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if experts < 1 or not cfg.get("num_experts_per_tok"):
        raise ModelError(
            f"model {path!r}: {arch} needs num_experts (or num_local_experts) and "
            f"num_experts_per_tok, got {experts} and {cfg.get('num_experts_per_tok')}"
        )
    fields: dict[str, Any] = dict(
        num_experts=experts,
        experts_per_token=int(cfg["num_experts_per_tok"]),
        expert_size=int(cfg["intermediate_size"]),
        norm_topk=arch == "MixtralForCausalLM" or bool(cfg.get("norm_topk_prob", False)),
    )
    if arch in QWEN_MOE:
        step = int(cfg.get("decoder_sparse_step") or 1)
        only = set(cfg.get("mlp_only_layers") or ())
        fields.update(
            expert_size=int(cfg["moe_intermediate_size"]),
            dense_layers=tuple(i for i in range(n) if i in only or (i + 1) % step),
        )
    if arch == "Qwen2MoeForCausalLM":
        fields.update(
            shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            attention_bias=bool(cfg.get("qkv_bias", True)),
            o_bias=False,
        )
    if arch == "OlmoeForCausalLM":
        if cfg.get("clip_qkv") is not None:
            raise ModelError(f"model {path!r}: OLMoE's clip_qkv {cfg['clip_qkv']} is not supported")
        fields.update(qk_norm=True, qk_norm_whole=True)
    return fields


def quantization(path: str, cfg: dict[str, Any]) -> dict | None:
    """The checkpoint's weight quantization as the loader reads it, or None (unquantized):
    {"kind": "channel"} (compressed-tensors ``float-quantized`` fp8, one scale per output
    channel or per tensor) or {"kind": "block", "block": (rows, cols)} (HF ``fp8``, one
    ``weight_scale_inv`` per block). Any other format is refused naming it."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size")
        if q.get("activation_scheme", "dynamic") != "dynamic" or not block:
            raise ModelError(
                f"model {path!r}: quantization fp8 is supported block-wise with dynamic "
                f"activations (weight_block_size, activation_scheme dynamic), got {q}"
            )
        return {"kind": "block", "block": (int(block[0]), int(block[1]))}
    if method == "compressed-tensors" and q.get("format") in ("float-quantized", "naive-quantized"):
        for group in (q.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            if (
                w.get("type") != "float"
                or w.get("num_bits") != 8
                or w.get("strategy")
                not in (
                    "channel",
                    "tensor",
                )
            ):
                raise ModelError(
                    f"model {path!r}: compressed-tensors weights {w} are not supported "
                    "(fp8: type float, 8 bits, strategy channel or tensor)"
                )
        return {"kind": "channel"}
    raise ModelError(
        f"model {path!r}: quantization {method!r} ({q.get('format', '')}) is not supported "
        "(supported: compressed-tensors float-quantized fp8, fp8 block-wise)"
    )


def _layer_types(path: str, arch: str, cfg: dict[str, Any]) -> list[str]:
    """Per layer "sliding_attention" or "full_attention", as transformers derives them."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types:
        if len(types) != n:
            raise ModelError(f"model {path!r}: {len(types)} layer_types for {n} layers")
        return list(types)
    window = cfg.get("sliding_window")
    if not window:
        return ["full_attention"] * n
    if arch in QWEN_MOE:
        return _qwen_moe_layer_types(arch, cfg)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not cfg.get("use_sliding_window"):
            return ["full_attention"] * n
        first = cfg.get("max_window_layers", n)
        return [SLIDING if i >= first else "full_attention" for i in range(n)]
    if arch == "Gemma2ForCausalLM":  # even layers local
        return [SLIDING if i % 2 == 0 else "full_attention" for i in range(n)]
    if arch == "Gemma3ForCausalLM":
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        return [SLIDING if (i + 1) % pattern else "full_attention" for i in range(n)]
    return [SLIDING] * n  # Mistral, Phi-3: every layer


def _qwen_moe_layer_types(arch: str, cfg: dict[str, Any]) -> list[str]:
    """Qwen2/3-MoE without ``layer_types``: no window unless ``use_sliding_window``; then every
    layer (Qwen3-MoE), or the even layers below ``max_window_layers`` (Qwen2-MoE)."""
    n = cfg["num_hidden_layers"]
    if not cfg.get("use_sliding_window"):
        return ["full_attention"] * n
    if arch == "Qwen3MoeForCausalLM":
        return [SLIDING] * n
    first = cfg.get("max_window_layers", n)
    return [SLIDING if (i + 1) % 2 and i < first else "full_attention" for i in range(n)]


def _rope(
    path: str, cfg: dict[str, Any], layer_type: str | None
) -> tuple[float, dict | None, float]:
    """(theta, scaling parameters or None, partial rotary factor) of one layer type."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:  # per layer type (Gemma 3)
        params = params[layer_type]
    if params is None and layer_type == SLIDING:  # the older Gemma 3 config
        params = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    rope = dict(params or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_type = ROPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE:
        raise ModelError(
            f"model {path!r}: rope scaling {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE)})"
        )
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if rope_type == "default":
        return theta, None, partial
    rope["rope_type"] = rope_type
    if rope_type == "longrope":
        original = rope.get("original_max_position_embeddings") or cfg.get(
            "original_max_position_embeddings"
        )
        if not original or "short_factor" not in rope or "long_factor" not in rope:
            raise ModelError(
                f"model {path!r}: longrope needs short_factor, long_factor and "
                "original_max_position_embeddings"
            )
        rope["original_max_position_embeddings"] = int(original)
        rope["max_position_embeddings"] = int(cfg.get("max_position_embeddings", original))
    return theta, rope, partial
