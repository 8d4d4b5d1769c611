"""What the engine needs to know of a model, read from its ``config.json`` (no weights)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE = ("default", "linear", "llama3")
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

# LoRA targets in their canonical order; the page layout and kernels index them by position.
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
MODULE_OF = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


class ModelError(ValueError):
    """The model cannot be run; the message names the model and the reason."""


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
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Tensor parallelism: a spec with tp_size N describes one rank's shard (``shard``): its
    # heads, KV heads and intermediate size are 1/N of the model's, its hidden size is whole.
    tp_size: int = 1

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
        """Longest context the engine serves exactly (Mistral's window caps it)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def target_dims(self, target: str) -> tuple[int, int]:
        """(d_in, d_out) of a LoRA target's base projection; of a shard's factors under tensor
        parallelism, where both sides are 1/N (``adapters.store.shard_adapter`` cuts them)."""
        h, i = self.hidden_size // self.tp_size, self.intermediate_size
        return {
            "q": (h, self.q_dim),
            "k": (h, self.kv_dim),
            "v": (h, self.kv_dim),
            "o": (self.q_dim, h),
            "gate": (h, i),
            "up": (h, i),
            "down": (i, h),
        }[target]

    def shard(self, size: int) -> ModelSpec:
        """One rank's spec under ``size``-way tensor parallelism (Megatron cuts: heads, KV
        heads and the intermediate size by ``size``); raises ``ModelError`` with the numbers
        when the model does not divide."""
        if size == 1:
            return self
        dims = {
            "attention heads": self.num_heads,
            "KV heads": self.num_kv_heads,
            "intermediate size": self.intermediate_size,
            "hidden size": self.hidden_size,
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
            tp_size=size,
        )

    def pages_per_row(self, width: int) -> int:
        return math.ceil(width / self.page_size)

    def adapter_pages(self, rank: int, targets: tuple[str, ...]) -> int:
        """Pages an adapter takes: its rank times the row pages of its targets' two factors."""
        return rank * sum(
            self.pages_per_row(d_in) + self.pages_per_row(d_out)
            for d_in, d_out in map(self.target_dims, targets)
        )


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
    # transformers 5 writes rope settings as rope_parameters; older configs as rope_theta/rope_scaling.
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE:
        raise ModelError(
            f"model {str(model_dir)!r}: rope scaling {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE)})"
        )
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if arch == "Qwen2ForCausalLM" and cfg.get("use_sliding_window"):
        raise ModelError(f"model {str(model_dir)!r}: Qwen2 use_sliding_window is not supported")
    if cfg.get("mlp_bias"):
        raise ModelError(f"model {str(model_dir)!r}: mlp_bias is not supported")
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    qkv_bias = arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias"))
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
        rope_theta=theta,
        rope_scaling=rope if rope_type != "default" else None,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=qkv_bias,
        o_bias=bool(cfg.get("attention_bias")) and arch != "Qwen2ForCausalLM",
        sliding_window=cfg.get("sliding_window") if arch == "MistralForCausalLM" else None,
        eos_token_ids=eos_ids,
        bos_token_id=cfg.get("bos_token_id"),
    )
