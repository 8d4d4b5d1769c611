"""What the engine knows of an adapter before loading its weights (``AdapterInfo``): its rank,
scale and targets, each linear module's rank and scale per layer (``ModuleRanks``), its expert
and head factors. ``adapter_files`` reads it from a PEFT directory; ``changes`` says what it
changes in the model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from slora_batch.engine.adapters.expert_files import ExpertFactor
from slora_batch.engine.adapters.head_files import HeadFactor


@dataclass(frozen=True)
class ModuleRanks:
    """One target of an adapter on linear modules (not the experts): its rank and LoRA scale in
    each layer of the model. A module's rank and alpha are the config's ``r`` and
    ``lora_alpha``, or those of the first ``rank_pattern`` / ``alpha_pattern`` key matching its
    name, as PEFT picks them; rank 0 (scale 0.0) in a layer the adapter leaves out
    (``layers_to_transform``, a regular-expression ``target_modules``). Example: r 8,
    rank_pattern {"model.layers.1.self_attn.q_proj": 4}, layers_to_transform [1, 2] on 3
    layers: q's ranks (0, 4, 8)."""

    target: str
    ranks: tuple[int, ...]  # [num_layers]
    scales: tuple[float, ...]  # [num_layers]

    @property
    def max_rank(self) -> int:
        """The rank its rows take in pool pages: a page spans every layer."""
        return max(self.ranks)


@dataclass(frozen=True)
class AdapterInfo:
    """What the engine needs of an adapter before loading its weights."""

    name: str
    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...]  # in TARGETS order
    # The expert targets among ``targets``, each with its rank per expert and its scale, and the
    # format their tensors are in ("fused" or "per_expert": ``expert_files``); none without.
    experts: tuple[ExpertFactor, ...] = ()
    expert_format: str = ""
    # The other targets' ranks and scales per layer; a target missing here has ``rank`` and
    # ``scale`` in every layer it exists in.
    modules: tuple[ModuleRanks, ...] = ()
    lora_bias: bool = False  # each module's lora_B has a bias (PEFT's ``lora_bias``)
    dora: bool = False  # DoRA (``use_dora``): each module has a magnitude per output channel
    # LoRA on embed_tokens and lm_head (``head_files``), and saved copies of them
    # (``modules_to_save``, ``saved_modules``), in HEAD_MODULES order
    heads: tuple[HeadFactor, ...] = ()

    @property
    def kind(self) -> str:
        """What the adapter is, as ``validate`` reports it: "LoRA", "LoRA + bias" or "DoRA"."""
        return "DoRA" if self.dora else "LoRA + bias" if self.lora_bias else "LoRA"

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def expert_ranks(self) -> dict[str, int]:
        """Rank per expert of each expert target."""
        return {f.target: f.rank for f in self.experts}

    @property
    def max_rank(self) -> int:
        """The largest rank of the adapter's modules outside the experts (``rank`` without
        per-module ranks): the width its LoRA takes in a step's scratch."""
        return max((m.max_rank for m in self.modules), default=self.rank)

    def module_ranks(
        self, target: str, num_layers: int
    ) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """A target's (ranks, scales) per layer (``ModuleRanks``)."""
        for module in self.modules:
            if module.target == target:
                return module.ranks, module.scales
        return (self.rank,) * num_layers, (self.scale,) * num_layers
