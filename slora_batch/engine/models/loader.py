"""Hugging Face safetensors directories (and the built-in sample) into the model of their family
(``registry``), under Llama's tensor names."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from slora_batch.engine.models.decoder import DecoderModel
from slora_batch.engine.models.registry import model_class
from slora_batch.engine.models.shard import RankGroup, vocab_shard
from slora_batch.engine.models.spec import ModelError, ModelSpec
from slora_batch.engine.models.weights import TensorReader

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
    tp: RankGroup | None = None,
    fp8_weights: bool = False,
) -> DecoderModel:
    """Builds the model of ``spec``'s family on ``device`` in ``dtype`` from the safetensors of
    ``spec.path``, or from ``weights`` (Hugging Face names) when given, e.g. a transformers
    model's state dict. Under tensor parallelism (``tp``) only this rank's shard reaches the
    device: q/k/v, gate and up by output rows, o and down by input columns, the LM head by
    vocabulary rows. ``fp8_weights``: the projections quantized to fp8 (``models.quant``)."""
    if weights is None:
        raw = load_tensors(Path(spec.path))
    else:  # a dict, or tensors made on demand (``pop``/``keys``: the bench's RandomWeights)
        raw = dict(weights) if isinstance(weights, dict) else weights
    family = model_class(spec)
    w = TensorReader(spec, raw, dtype, device, tp, fp8_weights)
    layers = [family.read_layer(w, spec, i) for i in range(spec.num_layers)]
    embed = w.take("model.embed_tokens.weight")
    head = w.take("lm_head.weight", required=not spec.tie_word_embeddings)
    head = head if head is not None else embed
    if w.size > 1:
        head = vocab_shard(head, w.rank, w.size)
    model = family(
        spec.shard(w.size), embed, layers, w.norm("model.norm.weight"), head, max_pos, tp
    )
    leftover = [k for k in raw.keys() if "rotary_emb" not in k]  # noqa: SIM118
    if leftover:
        log.warning("model %s: %d unused tensors, e.g. %s", spec.path, len(leftover), leftover[:3])
    return model
