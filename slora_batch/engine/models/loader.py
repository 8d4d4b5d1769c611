"""Hugging Face safetensors directories (and the built-in sample) into the model of their family
(``registry``), under Llama's tensor names."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from slora_batch.engine.models.llama import LayerWeights, LlamaModel
from slora_batch.engine.models.registry import model_class
from slora_batch.engine.models.shard import vocab_shard
from slora_batch.engine.models.spec import ModelError, ModelSpec

if TYPE_CHECKING:  # the type of the rank's group, handed in by execution.tp
    from slora_batch.engine.execution.tp import TensorParallel

log = logging.getLogger(__name__)


def load_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by name (one file or an index of shards)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ModelError(f"model {str(model_dir)!r}: no .safetensors weights found")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(model_dir / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                tensors[key] = f.get_tensor(key)
    return tensors


def load_model(
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    max_pos: int,
    weights: dict[str, torch.Tensor] | None = None,
    tp: TensorParallel | None = None,
) -> LlamaModel:
    """Builds the model on ``device`` in ``dtype`` from the safetensors of ``spec.path``, or from
    ``weights`` (Hugging Face names) when given, e.g. a transformers model's state dict. Under
    tensor parallelism (``tp``) only this rank's shard reaches the device: q/k/v, gate and up
    by output rows, o and down by input columns, the LM head by vocabulary rows."""
    if weights is None:
        raw = load_tensors(Path(spec.path))
    else:  # a dict, or tensors made on demand (``pop``/``keys``: the bench's RandomWeights)
        raw = dict(weights) if isinstance(weights, dict) else weights
    rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)

    def take(name: str, required: bool = True, dim: int | None = None) -> torch.Tensor | None:
        tensor = raw.pop(name, None)
        if tensor is None:
            if required:
                raise ModelError(f"model {spec.path!r}: missing tensor {name!r}")
            return None
        if dim is not None and size > 1:
            tensor = tensor.chunk(size, dim)[rank].contiguous()
        return tensor.to(device=device, dtype=dtype)

    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        qkv = [take(p + f"self_attn.{t}_proj.weight", dim=0) for t in "qkv"]
        biases = [take(p + f"self_attn.{t}_proj.bias", spec.attention_bias, 0) for t in "qkv"]
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=torch.cat(qkv).contiguous(),
                qkv_bias=torch.cat(biases).contiguous() if spec.attention_bias else None,
                o=take(p + "self_attn.o_proj.weight", dim=1),
                o_bias=take(p + "self_attn.o_proj.bias", spec.o_bias),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat(
                    [take(p + "mlp.gate_proj.weight", dim=0), take(p + "mlp.up_proj.weight", dim=0)]
                ).contiguous(),
                down=take(p + "mlp.down_proj.weight", dim=1).contiguous(),
            )
        )
    embed = take("model.embed_tokens.weight")
    head = take("lm_head.weight", required=not spec.tie_word_embeddings)
    head = head if head is not None else embed
    if size > 1:
        head = vocab_shard(head, rank, size)
    model = model_class(spec)(
        spec.shard(size), embed, layers, take("model.norm.weight"), head, max_pos, tp
    )
    leftover = [k for k in raw.keys() if "rotary_emb" not in k]  # noqa: SIM118
    if leftover:
        log.warning("model %s: %d unused tensors, e.g. %s", spec.path, len(leftover), leftover[:3])
    return model
