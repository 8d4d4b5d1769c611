"""The bench's model: random weights of a preset's shapes (Llama-2 7B and 70B, the families users
fine-tune, Qwen3-30B-A3B's mixture of experts, tiny ones for the CPU), and the PEFT adapters
written for it, one directory per rank (``bench/adapters.py``; benchmarks/README.md)."""

from __future__ import annotations

import logging
import math
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from slora_batch.bench.adapters import (
    write_attention_adapters,
    write_dora_adapters,
    write_expert_adapters,
)
from slora_batch.bench.roofline import kv_bytes_per_token
from slora_batch.engine.models.spec import ModelSpec, read_spec

log = logging.getLogger(__name__)

# Adapter id i has rank RANKS[i % 4] on q, k, v, o (--adapter-targets attention), or
# EXPERT_RANKS[i % 2] on q, k, v, o and every expert's gate_up and down (experts): rank 16 on
# Qwen3-30B-A3B's 48 x 128 experts is 1.3 GB in bf16 (workload.adapter_sources).
RANKS = (8, 16, 32, 64)
EXPERT_RANKS = (8, 16)
ADAPTER_TARGETS = ("attention", "experts")
# The base weights' standard deviation: RandomWeights' normal(0, WEIGHT_STD), and transformers'
# initializer_range (its default) where the model is built
WEIGHT_STD = 0.02

PRESETS: dict[str, dict] = {
    "llama2-7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
    "llama2-70b": dict(  # GQA: 8 KV heads; built as RandomWeights only (one card cannot hold it)
        vocab_size=32000,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
    # The families users fine-tune; "config" names the transformers config class.
    "llama3-8b": dict(  # GQA, 128k vocabulary
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
    ),
    "qwen3-8b": dict(  # q/k norms, head_dim 128
        config="Qwen3Config",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    "gemma2-9b": dict(  # head_dim 256, soft-caps, every other layer a 4096-token window
        config="Gemma2Config",
        vocab_size=256000,
        hidden_size=3584,
        intermediate_size=14336,
        num_hidden_layers=42,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "qwen3-30b-a3b": dict(  # 128 experts of 768, 8 a token: 30.5B parameters, 3.3B active
        config="Qwen3MoeConfig",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,  # a dense layer's MLP: none here (every layer has experts)
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    "tiny-moe": dict(  # Qwen3-MoE's layer at CPU size: 8 experts of 32, 2 a token
        config="Qwen3MoeConfig",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
    ),
    "tiny": dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
    ),
}


@dataclass(frozen=True)
class RandomWeights:
    """A model's weights made on demand, one tensor at a time, by name (Hugging Face names):
    normal(0, 0.02), norms 1. A tensor's values depend on the seed and its name alone, so a
    tensor-parallel rank makes the same tensor as one device does and keeps its shard, and
    a data-parallel worker the same model, each from this small picklable object, on its own
    device (the current CUDA device, else the CPU). ``pop`` and ``keys`` are what
    ``engine.loader.load_model`` reads; ``items`` makes every tensor (for a directory). A
    mixture of experts' router is normal(0, 0.02) too: it spreads a batch's tokens over the
    experts about as uniformly as the floor assumes (``floor.Routing``; benchmarks/README.md),
    as a trained router roughly does."""

    spec: ModelSpec
    seed: int
    dtype: torch.dtype

    def names(self) -> list[str]:
        s = self.spec
        names = [f"model.layers.{i}.{n}" for i in range(s.num_layers) for n in self._layer(i)]
        names += ["model.embed_tokens.weight", "model.norm.weight"]
        return names + ([] if s.tie_word_embeddings else ["lm_head.weight"])

    def _layer(self, i: int) -> list[str]:
        """Layer ``i``'s tensors, under the names the engine's loader reads."""
        s = self.spec
        names = [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            *(f"self_attn.{t}_proj.weight" for t in "qkvo"),
            *self._mlp(i),
        ]
        if s.attention_bias:
            names += [f"self_attn.{t}_proj.bias" for t in "qkv"]
        if s.qk_norm:
            names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        if s.gemma_norms:
            names += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
        return names

    def _mlp(self, i: int) -> list[str]:
        """A dense layer's gate, up and down; a mixture-of-experts layer's router and experts
        as transformers 5 holds them, fused 3-D (``TensorReader.experts`` reads that layout:
        one tensor a layer instead of 3 x E), and Qwen2-MoE's shared expert and its gate."""
        s = self.spec
        if not s.is_moe_layer(i):
            return [f"mlp.{t}_proj.weight" for t in ("gate", "up", "down")]
        names = ["mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        if s.shared_expert_size:
            names += [f"mlp.shared_expert.{t}_proj.weight" for t in ("gate", "up", "down")]
            names.append("mlp.shared_expert_gate.weight")
        return names

    def shape(self, name: str) -> tuple[int, ...]:
        s = self.spec
        h, q, kv = s.hidden_size, s.q_dim, s.kv_dim
        if name.endswith("mlp.experts.gate_up_proj"):
            return (s.num_experts, 2 * s.expert_size, h)  # per expert: gate rows, then up rows
        if name.endswith("mlp.experts.down_proj"):
            return (s.num_experts, h, s.expert_size)
        last = name.split(".")[-2]
        if last in ("q_norm", "k_norm"):
            whole = q if last == "q_norm" else kv  # OLMoE normalizes the whole projection
            return (whole if s.qk_norm_whole else s.head_dim,)
        if name.endswith("norm.weight") or last.endswith("layernorm"):
            return (h,)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (s.vocab_size, h)
        i = s.shared_expert_size if ".shared_expert." in name else s.intermediate_size
        out_in = {
            "q_proj": (q, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, q),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
            "gate": (s.num_experts, h),  # the router
            "shared_expert_gate": (1, h),
        }[last]
        return out_in[:1] if name.endswith(".bias") else out_in

    def pop(self, name: str, default=None) -> torch.Tensor | None:
        if name not in self._known:
            return default
        shape = self.shape(name)
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        if name.endswith("norm.weight"):  # Gemma's norms are 1 + w
            fill = 0.0 if self.spec.gemma_norms else 1.0
            return torch.full(shape, fill, dtype=self.dtype, device=device)
        gen = torch.Generator(device=device).manual_seed(
            self.seed * 1_000_003 + zlib.crc32(name.encode())
        )
        values = torch.empty(shape, dtype=torch.float32, device=device)
        return values.normal_(0.0, WEIGHT_STD, generator=gen).to(self.dtype)

    def keys(self) -> list[str]:
        return []  # nothing is left over: every name is made when asked

    def items(self):
        return ((name, self.pop(name)) for name in self.names())

    @property
    def _known(self) -> set[str]:
        known = self.__dict__.get("_names")
        if known is None:
            known = set(self.names())
            object.__setattr__(self, "_names", known)
        return known

    def num_params(self) -> int:
        return sum(math.prod(self.shape(n)) for n in self.names())


def active_params(spec: ModelSpec, num_params: int) -> int:
    """Parameters a token computes with: all but the experts it is not routed to (per
    mixture-of-experts layer, E - k experts of 3 x hidden x expert size). Qwen3-30B-A3B: 30.5B
    parameters, 3.3B active (the embedding table and LM head counted, as for every preset)."""
    idle = spec.num_experts - spec.experts_per_token
    per_expert = 3 * spec.hidden_size * spec.expert_size
    moe_layers = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
    return num_params - moe_layers * idle * per_expert


@dataclass
class BenchModel:
    """The transformers model every system runs, and what the engine and the roofline need."""

    hf_model: torch.nn.Module | None  # None: not built (no peft run; a model past one card)
    # its state dict, taken before PEFT wraps any module; or RandomWeights when not built
    weights: dict[str, torch.Tensor] | RandomWeights
    model_dir: Path  # config.json only: the engine reads the shapes there, the weights above
    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    num_params: int

    @property
    def active_params(self) -> int:
        """Parameters a token computes with (``num_params`` on a dense model)."""
        return active_params(self.spec, self.num_params)

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.spec.num_layers, self.spec.kv_dim, self.dtype)

    def write_adapters(self, root: Path, seed: int, targets: str = "attention") -> dict[int, Path]:
        """One PEFT LoRA directory per rank, A and B random non-zero: ranks RANKS on q, k, v, o
        (``targets`` "attention"), or EXPERT_RANKS on q, k, v, o and the experts' gate_up and
        down ("experts", a mixture-of-experts model). Returns rank -> directory."""
        if targets == "experts":
            return write_expert_adapters(self.spec, self.dtype, root, seed, EXPERT_RANKS)
        return write_attention_adapters(self.spec, self.dtype, root, seed, RANKS)

    def write_dora_adapters(
        self, root: Path, seed: int, plain_dirs: dict[int, Path]
    ) -> dict[int, Path]:
        """One PEFT DoRA directory per rank of ``plain_dirs`` (attention adapters): their A and B,
        and magnitudes about the base weights' row norms (``adapters.dora_magnitude``)."""
        return write_dora_adapters(self.spec, self.dtype, root, seed, plain_dirs, WEIGHT_STD)


def build_model(
    preset: str,
    device: torch.device,
    dtype: torch.dtype,
    root: Path,
    seed: int,
    hf: bool = True,
    vocab_size: int | None = None,
) -> BenchModel:
    """A random model of the preset's family and shapes, initialized on ``device`` in ``dtype``;
    its config.json (nothing else) goes to ``root / "model"`` for the engine. Without ``hf`` no
    transformers model is built: the engine runs take ``RandomWeights`` (every rank or worker
    makes its own), and PEFT cannot run. ``vocab_size`` replaces the preset's (a tokenizer's)."""
    import transformers
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    fields = dict(PRESETS[preset])
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    config_class = getattr(transformers, fields.pop("config", "LlamaConfig"))
    fields.setdefault("tie_word_embeddings", False)
    config = config_class(**fields, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.architectures = [config_class.__name__.replace("Config", "ForCausalLM")]
    model_dir = root / "model"
    model_dir.mkdir(parents=True)
    config.to_json_file(str(model_dir / "config.json"))
    spec = read_spec(model_dir)
    if not hf:
        weights = RandomWeights(spec, seed, dtype)
        num_params = weights.num_params()
        log.info(
            "model %s: %.2fB parameters, made on demand by each engine", preset, num_params / 1e9
        )
        return BenchModel(None, weights, model_dir, spec, device, dtype, num_params)
    torch.manual_seed(seed)
    with torch.device(device):
        hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    placed = next(hf_model.parameters()).device
    if placed.type != device.type:
        log.warning("transformers built the model on %s, not %s: moving it", placed, device)
        hf_model.to(device)
    hf_model.eval()
    hf_model.generation_config.eos_token_id = None  # EOS ignored (PEFT's generate as well)
    num_params = sum(p.numel() for p in hf_model.parameters())
    log.info(
        "model %s: %.2fB parameters, %s on %s, built in %.1f s",
        preset,
        num_params / 1e9,
        str(dtype).removeprefix("torch."),
        device,
        time.perf_counter() - start,
    )
    return BenchModel(
        hf_model=hf_model,
        weights=dict(hf_model.state_dict()),
        model_dir=model_dir,
        spec=spec,
        device=device,
        dtype=dtype,
        num_params=num_params,
    )
