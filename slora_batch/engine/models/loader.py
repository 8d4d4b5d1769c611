"""Hugging Face safetensors directories (and the built-in sample) into the model of their family
(``registry``), under Llama's tensor names."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from slora_batch.engine.models.decoder import DecoderModel
from slora_batch.engine.models.quant import FP8, Fp8Weight, dequantize_blocks
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


class TensorReader:
    """Takes the checkpoint's tensors by name onto the device, each once: under tensor
    parallelism only the rank's shard (``dim``: the dimension cut; ``parts``: the sizes of the
    pieces of a fused weight along it, each cut apart); norms as (1 + w) for Gemma."""

    def __init__(
        self,
        spec: ModelSpec,
        raw,
        dtype: torch.dtype,
        device: torch.device,
        tp,
        fp8: bool = False,
    ) -> None:
        self.spec, self.raw, self.dtype, self.device = spec, raw, dtype, device
        self.rank, self.size = (tp.rank, tp.size) if tp is not None else (0, 1)
        self.fp8 = fp8 or spec.quantization is not None  # projections as Fp8Weight

    def linear(
        self, name: str, dim: int, parts: tuple[int, ...] | None = None
    ) -> torch.Tensor | Fp8Weight:
        """A projection's weight, cut for the rank along ``dim`` (0: output rows, 1: input
        columns): in the model's dtype, or in fp8 (an FP8 checkpoint's, or quantized here per
        output channel after the cut)."""
        quant = self.spec.quantization
        if quant is None:
            tensor = self.take(name, dim=dim, parts=parts)
            return Fp8Weight.quantize(tensor).to(self.device) if self.fp8 else tensor
        weight = self.raw.pop(name, None)
        scale = self.raw.pop(name + ("_scale_inv" if quant["kind"] == "block" else "_scale"), None)
        if weight is None or scale is None:
            raise ModelError(f"model {self.spec.path!r}: missing fp8 tensor {name!r} or its scale")
        if quant["kind"] == "block":  # requantized per output channel once it is the rank's
            full = dequantize_blocks(weight, scale, quant["block"])
            return Fp8Weight.quantize(self._cut(full, dim, parts)).to(self.device)
        scale = scale.float().reshape(-1).expand(weight.shape[0]).contiguous()
        cut = self._cut(weight.view(torch.uint8), dim, parts).view(weight.dtype)
        if dim == 0:  # output rows cut: their scales with them
            scale = self._cut(scale[:, None], 0, parts)[:, 0]
        return Fp8Weight(cut.contiguous(), scale.contiguous()).to(self.device)

    def _cut(self, tensor: torch.Tensor, dim: int, parts: tuple[int, ...] | None) -> torch.Tensor:
        if self.size == 1:
            return tensor
        pieces = tensor.split(parts, dim) if parts is not None else (tensor,)
        return torch.cat([p.chunk(self.size, dim)[self.rank] for p in pieces], dim)

    def take(
        self,
        name: str,
        required: bool = True,
        dim: int | None = None,
        parts: tuple[int, ...] | None = None,
    ) -> torch.Tensor | None:
        tensor = self.raw.pop(name, None)
        if tensor is None:
            if required:
                raise ModelError(f"model {self.spec.path!r}: missing tensor {name!r}")
            return None
        if parts is not None and tensor.shape[dim] != sum(parts):
            raise ModelError(
                f"model {self.spec.path!r}: tensor {name!r} has {tensor.shape[dim]} rows, "
                f"the config needs {sum(parts)} ({' + '.join(map(str, parts))})"
            )
        if dim is not None:
            tensor = self._cut(tensor, dim, parts)
        return tensor.contiguous().to(device=self.device, dtype=self.dtype)

    def norm(self, name: str) -> torch.Tensor:
        if not self.spec.gemma_norms:
            return self.take(name)
        tensor = self.raw.pop(name, None)
        if tensor is None:
            raise ModelError(f"model {self.spec.path!r}: missing tensor {name!r}")
        return (tensor.float() + 1.0).to(device=self.device, dtype=self.dtype)

    @staticmethod
    def cat(tensors: list) -> torch.Tensor | Fp8Weight:
        """Weights side by side along the output rows (fp8 ones with their scales)."""
        if isinstance(tensors[0], Fp8Weight):
            rows = torch.cat([t.weight.view(torch.uint8) for t in tensors]).view(FP8)
            return Fp8Weight(rows.contiguous(), torch.cat([t.scale for t in tensors]))
        return torch.cat(tensors).contiguous()


def load_model(
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    max_pos: int,
    weights: dict[str, torch.Tensor] | None = None,
    tp: TensorParallel | None = None,
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
