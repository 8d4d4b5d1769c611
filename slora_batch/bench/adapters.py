"""The bench's PEFT LoRA adapters: one directory per rank, A and B random and non-zero, that many
adapter ids share (``workload.adapter_sources``; the engine still loads, pages and evicts each id
on its own).

- attention: q, k, v, o (``target_modules``), the S-LoRA workload's.
- experts: q, k, v, o and, on a mixture-of-experts model, every expert's gate_up and down as PEFT
  writes ``target_parameters`` on transformers 5's fused 3-D parameters
  (``engine.adapters.expert_files``): per MoE layer ``mlp.experts.base_layer.lora_A`` [r * E, H]
  and ``lora_B`` [2I, r * E] (gate_up, wrapped first), ``mlp.experts.lora_A`` [r * E, I] and
  ``lora_B`` [H, r * E] (down). Rank 16 on Qwen3-30B-A3B (48 layers, 128 experts, H 2048, I 768)
  is 16 x 128 x (2048 + 1536 + 768 + 2048) = 13.1M values a layer, 1.3 GB in bf16.
- DoRA (``slora-dora``): per rank, the attention directory's A and B and a magnitude vector m
  [d_out] per module (PEFT's ``lora_magnitude_vector``, ``use_dora: true``; ``dora_magnitude``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from slora_batch.engine.models.spec import ModelSpec

ATTENTION = ("q", "k", "v", "o")
# DoRA magnitudes: the expected row norm of W + s B A for a base weight of normal(0, std) values,
# times a factor uniform in [1 - MAGNITUDE_SPREAD, 1 + MAGNITUDE_SPREAD] (``dora_magnitude``)
MAGNITUDE_SPREAD = 0.2
DORA_SEED = 500  # the magnitudes' generator: seed * 1000 + DORA_SEED + rank (A and B: no offset)
# The fused expert parameters in the order PEFT wraps them; the first nests under base_layer.
EXPERT_PARAMETERS = {"gate_up_proj": "base_layer.", "down_proj": ""}


def write_attention_adapters(
    spec: ModelSpec, dtype: torch.dtype, root: Path, seed: int, ranks: tuple[int, ...]
) -> dict[int, Path]:
    """One PEFT LoRA directory per rank, targets q/k/v/o, A and B random non-zero."""
    dirs = {}
    for rank in ranks:
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        tensors = _attention(spec, rank, gen)
        dirs[rank] = _save(root / f"rank{rank}", tensors, dtype, _config(rank))
    return dirs


def write_expert_adapters(
    spec: ModelSpec, dtype: torch.dtype, root: Path, seed: int, ranks: tuple[int, ...]
) -> dict[int, Path]:
    """One PEFT LoRA directory per rank, targets q/k/v/o and the experts' gate_up and down of
    every mixture-of-experts layer, A and B random non-zero."""
    if not spec.num_experts:
        raise ValueError(
            f"expert adapters need a mixture-of-experts model, not {spec.architecture}"
        )
    dirs = {}
    for rank in ranks:
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        tensors = _attention(spec, rank, gen)
        for layer in spec.target_layers("expert_down"):
            tensors.update(_experts(spec, layer, rank, gen))
        config = _config(rank, parameters=[f"mlp.experts.{p}" for p in EXPERT_PARAMETERS])
        dirs[rank] = _save(root / f"experts-rank{rank}", tensors, dtype, config)
    return dirs


def write_dora_adapters(
    spec: ModelSpec,
    dtype: torch.dtype,
    root: Path,
    seed: int,
    plain_dirs: dict[int, Path],
    weight_std: float,
) -> dict[int, Path]:
    """One PEFT DoRA directory per rank of ``plain_dirs`` (attention adapters): the same A and B
    as that rank's plain directory, a magnitude vector per module (``dora_magnitude``), and its
    config with ``use_dora: true``. ``weight_std``: the base weights' standard deviation."""
    dirs = {}
    for rank, plain in plain_dirs.items():
        gen = torch.Generator().manual_seed(seed * 1000 + DORA_SEED + rank)
        tensors = load_file(str(plain / "adapter_model.safetensors"))
        config = {**_config(rank), "use_dora": True}
        scale = config["lora_alpha"] / rank
        for layer in range(spec.num_layers):
            for target in ATTENTION:
                key = f"base_model.model.model.layers.{layer}.self_attn.{target}_proj"
                a, b = tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"]
                m = dora_magnitude(a.float(), b.float(), scale, weight_std, gen)
                tensors[f"{key}.lora_magnitude_vector"] = m
        dirs[rank] = _save(root / f"dora-rank{rank}", tensors, dtype, config)
    return dirs


def dora_magnitude(
    a: torch.Tensor, b: torch.Tensor, scale: float, weight_std: float, gen: torch.Generator
) -> torch.Tensor:
    """DoRA's magnitude m [d_out] of a module with factors a [r, d_in] and b [d_out, r]: PEFT
    starts m at the row norms of W + s B A, and training moves it. A base row of d_in normal(0,
    std) values has squared norm about std^2 d_in (4096 inputs at 0.02: norm 1.28), and s B A
    adds its own rows' squared norms (the cross term is 0 on average), so m is
    sqrt(std^2 d_in + ||s (B A)_i||^2) times a factor uniform in [1 - MAGNITUDE_SPREAD,
    1 + MAGNITUDE_SPREAD] per channel: DoRA's g = m / ||W + s B A|| lands near that factor, as a
    trained adapter's lands near 1. It depends on the base weights through their role (d_in,
    std) alone, not their values. ||(B A)_i||^2 = B_i (A A^T) B_i^T: no [d_out, d_in] product."""
    d_in = a.shape[1]
    adapter = scale**2 * ((b @ (a @ a.T)) * b).sum(-1)  # [d_out]
    factor = 1 + MAGNITUDE_SPREAD * (2 * torch.rand(b.shape[0], generator=gen) - 1)
    return (weight_std**2 * d_in + adapter).sqrt() * factor  # [d_out]


def _attention(spec: ModelSpec, rank: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    tensors = {}
    for layer in range(spec.num_layers):
        for target in ATTENTION:
            d_in, d_out = spec.target_dims(target)
            key = f"base_model.model.model.layers.{layer}.self_attn.{target}_proj"
            tensors[f"{key}.lora_A.weight"] = _factor_a(rank, d_in, gen)
            tensors[f"{key}.lora_B.weight"] = _factor_b(d_out, rank, gen)
    return tensors


def _experts(
    spec: ModelSpec, layer: int, rank: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """One layer's factors on both fused expert parameters: A [r * E, d_in], B [d_out, r * E]."""
    tensors = {}
    rows = rank * spec.num_experts
    key = f"base_model.model.model.layers.{layer}.mlp.experts."
    for parameter, nesting in EXPERT_PARAMETERS.items():
        target = "expert_gate_up" if parameter == "gate_up_proj" else "expert_down"
        d_in, d_out = spec.target_dims(target)
        tensors[f"{key}{nesting}lora_A.weight"] = _factor_a(rows, d_in, gen)
        tensors[f"{key}{nesting}lora_B.weight"] = _factor_b(d_out, rows, gen)
    return tensors


def _factor_a(rows: int, d_in: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, d_in, generator=gen) / d_in**0.5  # [r, d_in]


def _factor_b(d_out: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(d_out, rows, generator=gen) * 0.02  # [d_out, r]


def _save(out: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype, config: dict) -> Path:
    out.mkdir(parents=True)
    save_file({k: t.to(dtype) for k, t in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out


def _config(rank: int, parameters: list[str] | None = None) -> dict:
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": [f"{t}_proj" for t in ATTENTION],
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": None,
    }
    if parameters:
        config["target_parameters"] = parameters
    return config
