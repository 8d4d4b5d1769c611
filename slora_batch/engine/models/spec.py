"""What the engine needs to know of a model, read from its ``config.json`` (no weights)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from slora_batch.engine.models.configs import (
    MOE_ARCHITECTURES,
    SUPPORTED_ROPE,
    ModelError,
    family_fields,
)

__all__ = ["SUPPORTED_ROPE", "ModelError", "ModelSpec", "read_spec"]

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    *MOE_ARCHITECTURES,
)
MODEL_TYPES = {  # for configs without "architectures"
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}

# LoRA targets in their canonical order; the page layout and kernels index them by position.
# qkv and gate_up are the fused modules of Phi-3: one A, and one B spanning the q | k | v (gate |
# up) columns of the fused projection. router, expert_gate_up and expert_down are a
# mixture-of-experts block's: the router is an ordinary linear (E outputs); an expert target holds
# one factor pair per expert, each of the target's own rank (``adapters.expert_files``).
TARGETS = (
    "q",
    "k",
    "v",
    "o",
    "gate",
    "up",
    "down",
    "qkv",
    "gate_up",
    "router",
    "expert_gate_up",
    "expert_down",
)
MODULE_OF = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
    "qkv": "self_attn.qkv_proj",
    "gate_up": "mlp.gate_up_proj",
    "router": "mlp.gate",
    "expert_gate_up": "mlp.experts.gate_up_proj",
    "expert_down": "mlp.experts.down_proj",
}
FUSED_TARGETS = ("qkv", "o", "gate_up", "down")  # the modules a fused-projection model has
SPLIT_TARGETS = TARGETS[:7]
ATTENTION_TARGETS = TARGETS[:4]
EXPERT_TARGETS = ("expert_gate_up", "expert_down")
# What a mixture-of-experts model's adapters may target: attention, the router and the experts
# (the shared expert and the dense layers' MLPs take no LoRA).
MOE_TARGETS = (*ATTENTION_TARGETS, "router", *EXPERT_TARGETS)
# An adapter tensor on Qwen2-MoE's shared expert or its gate, which take no LoRA.
_SHARED_EXPERT = re.compile(
    r"layers\.\d+\.(mlp\.shared_expert(?:_gate)?\b.*?)(?:\.base_layer)?\.lora_"
)


@dataclass(frozen=True)
class ModelSpec:
    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2) -- o bias only for Llama's attention_bias
    o_bias: bool
    sliding_window: int | None  # the window of the layers ``layer_windows`` marks
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Tensor parallelism: a spec with tp_size N describes one rank's shard (``shard``): its
    # heads, KV heads and intermediate size are 1/N of the model's, its hidden size is whole.
    tp_size: int = 1
    # What the families beyond Llama add (the defaults are Llama's; ``configs`` reads them).
    layer_windows: tuple[int, ...] = ()  # per layer: its sliding window, 0 for full attention
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    gemma_norms: bool = False  # norms as (1 + w), post-attention and post-MLP norms (Gemma)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    query_scale: float | None = None  # attention logits' scale; None: head_dim ** -0.5
    attn_softcap: float = 0.0  # attention logits soft-capped (Gemma 2); 0: none
    final_softcap: float = 0.0  # LM-head logits soft-capped (Gemma 2); 0: none
    local_rope: dict | None = None  # the sliding layers' own RoPE (Gemma 3: theta, type)
    rotary_dim: int | None = None  # leading dims of a head that RoPE rotates; None: all
    fused_projections: bool = False  # qkv_proj and gate_up_proj weights (Phi-3)
    quantization: dict | None = None  # an FP8 checkpoint's format (``configs.quantization``)
    qk_norm_whole: bool = False  # q/k norms over the whole projection, not per head (OLMoE)
    # Mixture of experts (``configs.moe_fields``); 0 experts: a dense model. Each MoE layer
    # routes a token to its top ``experts_per_token`` of ``num_experts`` SwiGLU experts of
    # ``expert_size`` (a rank's share under tensor parallelism), beside Qwen2-MoE's shared
    # expert of ``shared_expert_size`` (0: none); ``dense_layers`` keep a dense MLP of
    # ``intermediate_size`` (Qwen's ``mlp_only_layers`` and ``decoder_sparse_step``).
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    norm_topk: bool = False  # the top-k weights renormalized to sum to 1 (Mixtral; Qwen's flag)
    shared_expert_size: int = 0
    dense_layers: tuple[int, ...] = ()

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def page_size(self) -> int:
        """One page holds one token's K (or V) of one layer."""
        return self.kv_dim

    @property
    def max_context(self) -> int:
        """Longest context the engine serves: the model's positions (windows are masked)."""
        return self.max_position_embeddings

    @property
    def long_rope_from(self) -> int | None:
        """longrope's original context: longer prompts, and positions past it, take the long
        factors (None: no longrope)."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") != "longrope":
            return None
        return scaling["original_max_position_embeddings"]

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """The LoRA targets this model's adapters may have (fused modules for Phi-3; attention,
        the router and the experts for a mixture-of-experts model)."""
        if self.num_experts:
            return MOE_TARGETS
        return FUSED_TARGETS if self.fused_projections else SPLIT_TARGETS

    def lora_refusal(self, key: str) -> str | None:
        """Why an adapter tensor named ``key`` cannot run on this model where it is LoRA on
        Qwen2-MoE's shared expert (or its gate), else None."""
        m = _SHARED_EXPERT.search(key) if self.num_experts else None
        if m is None:
            return None
        return (
            f"tensor {key!r} is LoRA on {m.group(1)}, in {self.architecture}'s "
            "mixture-of-experts block: LoRA on the shared expert is not supported (this "
            f"model's adapters may target {self.lora_modules})"
        )

    @property
    def lora_modules(self) -> str:
        """The modules this model's adapters may target, as a message names them."""
        return ", ".join(MODULE_OF[t].split(".", 1)[1] for t in self.lora_targets)

    @property
    def expert_names(self) -> tuple[str, str, str]:
        """The per-expert projections (gate, up, down) of transformers 4's MoE modules, which
        adapters trained then are named by: Mixtral's w1, w3, w2; Qwen's and OLMoE's own."""
        if self.architecture == "MixtralForCausalLM":
            return ("w1", "w3", "w2")
        return ("gate_proj", "up_proj", "down_proj")

    def target_layers(self, target: str) -> tuple[int, ...]:
        """The layers a LoRA target exists in: the mixture-of-experts layers for the router and
        the experts, every layer for the others."""
        if target == "router" or target in EXPERT_TARGETS:
            return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))
        return tuple(range(self.num_layers))

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts (not one of ``dense_layers``)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def projection_params(self) -> int:
        """Elements of every layer's projections on one rank (``spec``: a rank's shard under
        tensor parallelism): attention, and the dense MLP or the experts, router and shared
        expert of each layer. Embeddings, norms and biases are left out."""
        h = self.hidden_size
        attention = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        dense = 3 * h * self.intermediate_size
        moe = self.num_experts * (3 * h * self.expert_size + h)  # experts and router rows
        if self.shared_expert_size:
            moe += 3 * h * self.shared_expert_size + h  # the shared expert and its gate
        return sum(
            attention + (moe if self.is_moe_layer(i) else dense) for i in range(self.num_layers)
        )

    @property
    def mlp_step_width(self) -> int:
        """Elements per token of the MLP's temporaries in one step, with head room: the dense
        MLP's 6 x intermediate (gate/up, activation, output), or at least the MoE block's: per
        token K activations of the expert size and K weighted outputs of the hidden size,
        router logits, softmax and top-k (fp32: 2 elements each), the fp32 sum, the shared
        expert's gate/up and activation."""
        dense = 6 * self.intermediate_size
        if not self.num_experts:
            return dense
        k = self.experts_per_token
        moe = k * (self.expert_size + self.hidden_size) + 6 * self.num_experts
        moe += 4 * self.hidden_size + 3 * self.shared_expert_size
        return max(dense, moe)

    def window(self, layer: int) -> int:
        """The sliding window of ``layer`` (0: it attends to the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def attn_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    def target_dims(self, target: str) -> tuple[int, int]:
        """(d_in, d_out) of a LoRA target's base projection (of one expert's, for an expert
        target); of a shard's factors under tensor parallelism, where both sides are 1/N
        (``adapters.store.shard_adapter`` cuts them)."""
        h, i, e = self.hidden_size // self.tp_size, self.intermediate_size, self.expert_size
        return {
            "q": (h, self.q_dim),
            "k": (h, self.kv_dim),
            "v": (h, self.kv_dim),
            "o": (self.q_dim, h),
            "gate": (h, i),
            "up": (h, i),
            "down": (i, h),
            "qkv": (h, self.q_dim + 2 * self.kv_dim),
            "gate_up": (h, 2 * i),
            "router": (h, self.num_experts),
            "expert_gate_up": (h, 2 * e),
            "expert_down": (e, h),
        }[target]

    def shard(self, size: int) -> ModelSpec:
        """One rank's spec under ``size``-way tensor parallelism (Megatron cuts: heads, KV
        heads and the intermediate sizes, the experts' too, by ``size``); raises ``ModelError``
        with the numbers when the model does not divide, or naming the model where its layers
        cannot be cut (OLMoE's whole-projection q/k norms)."""
        if size == 1:
            return self
        if self.qk_norm_whole:
            raise ModelError(
                f"model {self.path!r}: tensor_parallel {size} is not supported for "
                f"{self.architecture} (its q/k norms span every head; use tensor_parallel 1)"
            )
        dims = {
            "attention heads": self.num_heads,
            "KV heads": self.num_kv_heads,
            "intermediate size": self.intermediate_size,
            "hidden size": self.hidden_size,
            "experts' intermediate size": self.expert_size,
            "shared expert's intermediate size": self.shared_expert_size,
        }
        bad = [f"{what} {n}" for what, n in dims.items() if n % size]
        if bad:
            raise ModelError(
                f"model {self.path!r}: tensor_parallel {size} must divide the {', '.join(bad)}"
            )
        return replace(
            self,
            num_heads=self.num_heads // size,
            num_kv_heads=self.num_kv_heads // size,
            intermediate_size=self.intermediate_size // size,
            expert_size=self.expert_size // size,
            shared_expert_size=self.shared_expert_size // size,
            tp_size=size,
        )

    def pages_per_row(self, width: int) -> int:
        return math.ceil(width / self.page_size)

    def adapter_pages(
        self, rank: int, targets: tuple[str, ...], expert_ranks: dict[str, int] | None = None
    ) -> int:
        """Pages an adapter takes: per target, its rows times the row pages of its two factors.
        A target has ``rank`` rows; an expert target one block per expert at its own rank
        (``expert_ranks``, default ``rank``): E x that rank."""
        expert_ranks = expert_ranks or {}
        pages = 0
        for target in targets:
            d_in, d_out = self.target_dims(target)
            rows = rank
            if target in EXPERT_TARGETS:
                rows = self.num_experts * expert_ranks.get(target, rank)
            pages += rows * (self.pages_per_row(d_in) + self.pages_per_row(d_out))
        return pages


def read_spec(model_dir: str | Path) -> ModelSpec:
    """Parse and check ``config.json``; refuses unsupported architectures by name."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"model {str(model_dir)!r}: cannot read config.json: {exc}") from exc
    # A config saved from a bare transformers config object has no "architectures": use model_type.
    archs = cfg.get("architectures") or [
        MODEL_TYPES.get(cfg.get("model_type"), cfg.get("model_type", "?"))
    ]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"model {str(model_dir)!r}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if cfg.get("mlp_bias"):
        raise ModelError(f"model {str(model_dir)!r}: mlp_bias is not supported")
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    fields = family_fields(str(model_dir), arch, cfg)
    return ModelSpec(
        path=str(model_dir),
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids,
        bos_token_id=cfg.get("bos_token_id"),
        **fields,
    )
