"""The bench's inputs (benchmarks/README.md): a random-weight model, rank-cycling adapters, requests."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from slora_batch.bench.roofline import kv_bytes_per_token
from slora_batch.engine.request import Request
from slora_batch.engine.spec import ModelSpec, read_spec

log = logging.getLogger(__name__)

RANKS = (8, 16, 32, 64)  # adapter id i has rank RANKS[i % 4]
LORA_TARGETS = ("q", "k", "v", "o")
PEFT_MAX_ADAPTERS = 100  # PEFT holds every adapter as modules: more only measures its loading

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


def adapter_name(i: int) -> str:
    return f"a{i:04d}"


def adapter_sources(n: int, rank_dirs: dict[int, Path]) -> dict[str, Path]:
    """n adapter ids over the shared weight sets: id i -> the directory of rank RANKS[i % 4]."""
    return {adapter_name(i): rank_dirs[RANKS[i % len(RANKS)]] for i in range(n)}


@dataclass
class BenchModel:
    """The transformers model every system runs, and what the engine and the roofline need."""

    hf_model: torch.nn.Module
    weights: dict[str, torch.Tensor]  # its state dict, taken before PEFT wraps any module
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
    preset: str, device: torch.device, dtype: torch.dtype, root: Path, seed: int
) -> BenchModel:
    """A random ``LlamaForCausalLM`` of the preset's shapes, initialized on ``device`` in ``dtype``;
    its config.json (nothing else) goes to ``root / "model"`` for the engine."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    start = time.perf_counter()
    config = LlamaConfig(
        **PRESETS[preset],
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(seed)
    with torch.device(device):
        hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    placed = next(hf_model.parameters()).device
    if placed.type != device.type:
        log.warning("transformers built the model on %s, not %s: moving it", placed, device)
        hf_model.to(device)
    hf_model.eval()
    hf_model.generation_config.eos_token_id = None  # EOS ignored (PEFT's generate as well)
    model_dir = root / "model"
    model_dir.mkdir(parents=True)
    config.to_json_file(str(model_dir / "config.json"))
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
        spec=read_spec(model_dir),
        device=device,
        dtype=dtype,
        num_params=num_params,
    )


@dataclass
class Workload:
    """The requests, fixed by the seed. Adapter counts only change which adapter a request names:
    request i uses adapter ``int(draw[i] * n)`` with draw ~ numpy power(alpha)."""

    prompts: list[list[int]]
    output_lens: list[int]
    draws: np.ndarray  # [requests] in [0, 1)

    @classmethod
    def generate(cls, config, vocab_size: int) -> Workload:
        rng = np.random.default_rng(config.seed)
        count = config.requests
        input_lens = rng.integers(config.min_input, config.max_input + 1, size=count)
        output_lens = rng.integers(config.min_output, config.max_output + 1, size=count)
        draws = rng.power(0.1 if config.skewed else 1.0, size=count)
        # ids 0-2 are pad, BOS and EOS; prompts draw from the rest of the vocabulary
        prompts = [rng.integers(3, vocab_size, size=int(n)).tolist() for n in input_lens]
        return cls(prompts=prompts, output_lens=[int(n) for n in output_lens], draws=draws)

    def adapters(self, n: int) -> list[str | None]:
        """The adapter of every request when n adapters exist (None for all when n == 0)."""
        if n == 0:
            return [None] * len(self.prompts)
        return [adapter_name(min(int(d * n), n - 1)) for d in self.draws]

    def requests(self, n: int, count: int | None = None) -> list[Request]:
        count = len(self.prompts) if count is None else min(count, len(self.prompts))
        names = self.adapters(n)
        return [
            Request(
                id=i,
                adapter=names[i],
                prompt_token_ids=self.prompts[i],
                max_new_tokens=self.output_lens[i],
                ignore_eos=True,
                temperature=0.0,
            )
            for i in range(count)
        ]
