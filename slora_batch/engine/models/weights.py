"""The checkpoint's tensors taken by name onto the device (``TensorReader``): what the model
families' ``read_layer`` read, apart from the loader that picks the family, so that the family
files import no module that imports them."""

from __future__ import annotations

import torch

from slora_batch.engine.models.quant import FP8, Fp8Weight, dequantize_blocks
from slora_batch.engine.models.shard import RankGroup
from slora_batch.engine.models.spec import ModelError, ModelSpec


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
        tp: RankGroup | None,
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

    def experts(
        self, fused: str, split: str, names: tuple[str, str, str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MoE layer's experts: gate_up [E, 2 * I, H] (each expert's gate rows, then its
        up rows) and down [E, H, I], I the rank's share of ``spec.expert_size``.

        Read from either layout a checkpoint may have: transformers 5's fused 3-D tensors
        ``{fused}gate_up_proj`` [E, 2 * I, H] and ``{fused}down_proj`` [E, H, I] (a loaded
        model's state dict), or one tensor per expert as the Hub and ``save_pretrained`` store
        them, ``{split}{e}.{gate}.weight``, ``{up}``, ``{down}`` with ``names`` = (gate, up,
        down): ("gate_proj", "up_proj", "down_proj") for Qwen and OLMoE, ("w1", "w3", "w2")
        for Mixtral."""
        spec = self.spec
        if self.fp8:
            raise ModelError(
                f"model {spec.path!r}: fp8 weights are not supported for {spec.architecture} "
                "(mixture-of-experts models run in float32, bfloat16 or float16; weights: auto)"
            )
        inter = spec.expert_size
        gate_up = self.take(fused + "gate_up_proj", required=False, dim=1, parts=(inter, inter))
        if gate_up is not None:
            return gate_up, self.take(fused + "down_proj", dim=2)
        gate, up, down = names
        return self._stack_experts(split, gate, up, down)

    def _stack_experts(
        self, split: str, gate: str, up: str, down: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-expert tensors copied into one [E, ...] tensor each, one expert at a time (no
        second copy of a layer's experts on the device)."""
        count = self.spec.num_experts
        gate_up = down_all = None
        for e in range(count):
            prefix = f"{split}{e}."
            g, u = (self.take(prefix + name + ".weight", dim=0) for name in (gate, up))
            d = self.take(prefix + down + ".weight", dim=1)
            if gate_up is None:
                gate_up = g.new_empty(count, 2 * g.shape[0], g.shape[1])
                down_all = d.new_empty(count, *d.shape)
            gate_up[e, : g.shape[0]], gate_up[e, g.shape[0] :] = g, u
            down_all[e] = d
        return gate_up, down_all
