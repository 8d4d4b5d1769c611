"""The bench's model: random weights of a preset's shapes (Llama-2 7B and 70B, a tiny one for
the CPU), and the PEFT adapters written for it, one directory per rank (benchmarks/README.md)."""

from __future__ import annotations

import json
import logging
import math
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from slora_batch.bench.roofline import kv_bytes_per_token
from slora_batch.engine.models.spec import ModelSpec, read_spec

log = logging.getLogger(__name__)

RANKS = (8, 16, 32, 64)  # adapter id i has rank RANKS[i % 4] (workload.adapter_sources)
LORA_TARGETS = ("q", "k", "v", "o")

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
    ``engine.loader.load_model`` reads; ``items`` makes every tensor (for a directory)."""

    spec: ModelSpec
    seed: int
    dtype: torch.dtype

    def names(self) -> list[str]:
        s = self.spec
        per_layer = [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            *(f"self_attn.{t}_proj.weight" for t in "qkvo"),
            *(f"mlp.{t}_proj.weight" for t in ("gate", "up", "down")),
        ]
        if s.attention_bias:
            per_layer += [f"self_attn.{t}_proj.bias" for t in "qkv"]
        if s.qk_norm:
            per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        if s.gemma_norms:
            per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
        names = [f"model.layers.{i}.{n}" for i in range(s.num_layers) for n in per_layer]
        names += ["model.embed_tokens.weight", "model.norm.weight"]
        return names + ([] if s.tie_word_embeddings else ["lm_head.weight"])

    def shape(self, name: str) -> tuple[int, ...]:
        s = self.spec
        h, q, kv, i = s.hidden_size, s.q_dim, s.kv_dim, s.intermediate_size
        last = name.split(".")[-2]
        if last in ("q_norm", "k_norm"):
            return (s.head_dim,)
        if name.endswith("norm.weight") or last.endswith("layernorm"):
            return (h,)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (s.vocab_size, h)
        out_in = {
            "q_proj": (q, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, q),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
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
        return values.normal_(0.0, 0.02, generator=gen).to(self.dtype)

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
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.spec.num_layers, self.spec.kv_dim, self.dtype)

    def write_adapters(self, root: Path, seed: int) -> dict[int, Path]:
        """One PEFT LoRA directory per rank in RANKS, targets q/k/v/o, A and B random non-zero."""
        dirs = {}
        for rank in RANKS:
            gen = torch.Generator().manual_seed(seed * 1000 + rank)
            tensors = {}
            for layer in range(self.spec.num_layers):
                for target in LORA_TARGETS:
                    d_in, d_out = self.spec.target_dims(target)
                    key = f"base_model.model.model.layers.{layer}.self_attn.{target}_proj"
                    a = torch.randn(rank, d_in, generator=gen) / d_in**0.5  # [r, d_in]
                    b = torch.randn(d_out, rank, generator=gen) * 0.02  # [d_out, r]
                    tensors[f"{key}.lora_A.weight"] = a.to(self.dtype)
                    tensors[f"{key}.lora_B.weight"] = b.to(self.dtype)
            out = root / f"rank{rank}"
            out.mkdir(parents=True)
            save_file(tensors, str(out / "adapter_model.safetensors"))
            (out / "adapter_config.json").write_text(json.dumps(_peft_config(rank), indent=1))
            dirs[rank] = out
        return dirs


def _peft_config(rank: int) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": [f"{t}_proj" for t in LORA_TARGETS],
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": None,
    }


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
