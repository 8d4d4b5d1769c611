"""An adapter's expert tensors read into the rows its pages hold (``expert_files`` says which
tensors and formats there are): per MoE layer and expert target, A rows [E * r_t, d_in] and
B^T rows [E * r_t, d_out], expert by expert, the B^T rows times the target's scale (the expert
kernels apply none). Layers without experts get zero rows (their pages are never read).

Running example (E 2, r_t 2, fused format): lora_A rows [a0 a1 | a2 a3] are experts 0 and 1
already; lora_B columns [b0 b1 b2 b3] are rank-major (column j * E + e), so expert 0's B is
columns b0, b2 and expert 1's b1, b3: B^T rows [b0 b2 | b1 b3].
"""

from __future__ import annotations

import torch

from slora_batch.engine.adapters.adapter_files import AdapterInfo
from slora_batch.engine.adapters.expert_files import FUSED_KEY, PER_EXPERT_KEY
from slora_batch.engine.models.spec import ModelSpec


class ExpertRows:
    """Collects an adapter's expert tensors as they are read (``add``), then lays them out as
    rows per target and layer (``rows``)."""

    def __init__(self, info: AdapterInfo, spec: ModelSpec) -> None:
        self.info, self.spec = info, spec
        self._fused: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        self._split: dict[tuple[int, int, str, str], torch.Tensor] = {}

    def add(self, key: str, tensor: torch.Tensor) -> bool:
        """Keeps ``tensor`` if ``key`` names an expert tensor; returns whether it did."""
        m = FUSED_KEY.search(key)
        if m is not None:
            self._fused.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
            return True
        m = PER_EXPERT_KEY.search(key)
        if m is not None:
            layer, expert, name, factor = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
            self._split[(layer, expert, name, factor)] = tensor
            return True
        return False

    def rows(self) -> tuple[dict[str, list], dict[str, list]]:
        """(A rows, B^T rows): per expert target, a list over layers of [E * r_t, width]."""
        a = {f.target: self._zeros(f.target, 0) for f in self.info.experts}
        b = {f.target: self._zeros(f.target, 1) for f in self.info.experts}
        if self.info.expert_format == "fused":
            self._fused_rows(a, b)
        else:
            self._split_rows(a, b)
        return a, b

    def _zeros(self, target: str, which: int) -> list[torch.Tensor]:
        rank = self.info.expert_ranks[target]
        width = self.spec.target_dims(target)[which]
        return [torch.zeros(self.spec.num_experts * rank, width)] * self.spec.num_layers

    def _fused_rows(self, a: dict[str, list], b: dict[str, list]) -> None:
        """lora_A rows are expert-major already; lora_B [d_out, r * E] is rank-major."""
        experts, scales = self.spec.num_experts, {f.target: f.scale for f in self.info.experts}
        for (layer, _), pair in self._fused.items():
            target = self._fused_target(pair["A"], pair["B"])
            lora_b = pair["B"].float() * scales[target]
            d_out, rows = lora_b.shape
            a[target][layer] = pair["A"]
            b[target][layer] = (
                lora_b.view(d_out, rows // experts, experts).permute(2, 1, 0).reshape(rows, d_out)
            )

    def _fused_target(self, lora_a: torch.Tensor, lora_b: torch.Tensor) -> str:
        """The expert target a fused pair is on, by its shapes (``expert_files._fused_pair``)."""
        for factor in self.info.experts:
            d_in, d_out = self.spec.target_dims(factor.target)
            if lora_a.shape[1] == d_in and lora_b.shape[0] == d_out:
                return factor.target
        raise ValueError(f"no expert target has shapes {list(lora_a.shape)}, {lora_b.shape}")

    def _split_rows(self, a: dict[str, list], b: dict[str, list]) -> None:
        """Per layer: gate_up's A rows [gate A; up A] per expert and B^T rows block-diagonal
        (gate's B^T in the gate columns, up's in the up columns), down's as they are."""
        gate, up, down = self.spec.expert_names
        factors = {f.target: f for f in self.info.experts}
        for layer in self.spec.target_layers("expert_down"):
            if "expert_gate_up" in factors:
                scale = factors["expert_gate_up"].scale
                a["expert_gate_up"][layer] = self._stacked(layer, (gate, up), "A")
                b["expert_gate_up"][layer] = self._block_diagonal(layer, gate, up) * scale
            if "expert_down" in factors:
                scale = factors["expert_down"].scale
                a["expert_down"][layer] = self._stacked(layer, (down,), "A")
                b["expert_down"][layer] = self._stacked(layer, (down,), "B", t=True) * scale

    def _stacked(self, layer: int, names: tuple[str, ...], factor: str, t: bool = False):
        """Each expert's factors of ``names`` one after the other, expert by expert:
        [E * len(names) * r, width] (B transposed to B^T rows with ``t``)."""
        parts = []
        for e in range(self.spec.num_experts):
            for name in names:
                tensor = self._split[(layer, e, name, factor)].float()
                parts.append(tensor.t() if t else tensor)
        return torch.cat(parts)

    def _block_diagonal(self, layer: int, gate: str, up: str) -> torch.Tensor:
        """gate_up's B^T rows: per expert [[B_gate^T, 0], [0, B_up^T]] of [2r, 2I]."""
        blocks = []
        for e in range(self.spec.num_experts):
            b_gate = self._split[(layer, e, gate, "B")].float().t()  # [r, I]
            b_up = self._split[(layer, e, up, "B")].float().t()
            blocks.append(torch.block_diag(b_gate, b_up))
        return torch.cat(blocks)
