"""LoRA on a mixture-of-experts block's experts, as PEFT writes it: which tensors an adapter has
there, their shapes, and each expert target's rank and scale (torch-free, like
``adapter_files``, which calls it; ``expert_weights`` reads the tensors).

Two formats, both read into the same two targets per MoE layer, ``expert_gate_up`` (d_in H,
d_out 2I: gate columns, then up) and ``expert_down`` (d_in I, d_out H), one factor pair per
expert at the target's own rank r_t:

- fused: PEFT's ``target_parameters`` on transformers 5's 3-D parameters
  ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] (``lora.ParamWrapper``),
  also what PEFT writes there for ``target_modules`` naming the experts. Per layer and
  parameter ``lora_A.weight`` [r_t * E, d_in] and ``lora_B.weight`` [d_out, r_t * E]; the second
  parameter wrapped on the module nests one level down, under ``base_layer.`` (PEFT wraps
  gate_up_proj first: ``experts.base_layer.lora_A`` is gate_up's when both are targeted). The
  shapes say which parameter a pair is. Expert e's A is rows e * r_t .. e * r_t + r_t - 1 of
  lora_A (expert-major) and its B the columns j * E + e, j < r_t (rank-major) of lora_B
  (``ParamWrapper.get_delta_weight``). r_t and the scale come from the config's ``r`` and
  ``lora_alpha``, or from its ``rank_pattern`` / ``alpha_pattern`` where a pattern matches the
  parameter's name as PEFT matches it (for ``target_modules`` gate and up PEFT writes
  ``.*\\.gate_up_proj``: 2r and 2 x alpha).
- per expert: transformers 4's modules, which adapters trained then name:
  ``experts.{e}.{gate}``, ``{up}``, ``{down}`` (``ModelSpec.expert_names``; Mixtral's under
  ``block_sparse_moe``), each an ordinary pair of rank r. gate and up become one gate_up pair of
  rank 2r, A rows gate's then up's and B block-diagonal, as PEFT converts them when it loads
  such an adapter under transformers 5 (and, as PEFT, one of gate and up without the other is
  refused). Their scale is the one they were trained with: lora_alpha / r (rslora: / sqrt r).

Example (Qwen3-30B-A3B, E 128, H 2048, I 768, rank 16 on both fused parameters): expert_gate_up
holds 128 x 16 A rows of 2048 and B^T rows of 1536 per layer, expert_down 128 x 16 rows of 768
and of 2048.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from slora_batch.engine.models.spec import ModelSpec

FUSED_KEY = re.compile(
    r"layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)*)lora_([AB])(?:\.\w+)?\.weight$"
)
PER_EXPERT_KEY = re.compile(
    r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.lora_([AB])"
    r"(?:\.\w+)?\.weight$"
)
PARAMETER_OF = {"expert_gate_up": "gate_up_proj", "expert_down": "down_proj"}


@dataclass(frozen=True)
class ExpertFactor:
    """One expert target of an adapter: its rank per expert and its LoRA scale."""

    target: str  # "expert_gate_up" or "expert_down"
    rank: int
    scale: float


def is_expert_key(key: str) -> bool:
    return FUSED_KEY.search(key) is not None or PER_EXPERT_KEY.search(key) is not None


def check_experts(
    shapes: dict[str, tuple], spec: ModelSpec, cfg: dict
) -> tuple[tuple[ExpertFactor, ...], str]:
    """The expert targets of an adapter's expert tensors ``shapes`` (key -> shape) and their
    format ("fused" or "per_expert"); raises ``ValueError`` with the reason when they are not
    what PEFT writes for ``spec``'s model."""
    fused = {k: s for k, s in shapes.items() if FUSED_KEY.search(k)}
    if fused and len(fused) < len(shapes):
        raise ValueError("both fused (target_parameters) and per-expert expert tensors")
    if fused:
        return _fused_factors(fused, spec, cfg), "fused"
    return _per_expert_factors(shapes, spec, cfg), "per_expert"


def pattern_value(patterns: dict | None, key: str, default):
    """``rank_pattern`` / ``alpha_pattern``'s value for a module or parameter ``key``, as PEFT
    picks it: the first pattern p that ``(.*\\.)?(p)$`` matches, else ``default``."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def scale_of(alpha: float, rank: int, rslora: bool) -> float:
    return alpha / (math.sqrt(rank) if rslora else rank)


def _fused_factors(shapes: dict[str, tuple], spec: ModelSpec, cfg: dict) -> tuple:
    """``check_experts`` of the fused format: each (layer, nesting) pair named by its shapes,
    every MoE layer with the same targets at one rank, that rank the config's."""
    pairs: dict[tuple[int, str], dict[str, tuple]] = {}
    names: dict[tuple[int, str], str] = {}  # the pair's lora_A tensor, for messages
    for key, shape in shapes.items():
        m = FUSED_KEY.search(key)
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tuple(shape)
        if m.group(3) == "A":
            names[int(m.group(1)), m.group(2)] = key
    ranks: dict[str, dict[int, int]] = {}
    for (layer, depth), factors in sorted(pairs.items()):
        if set(factors) != {"A", "B"} or not spec.is_moe_layer(layer):
            raise ValueError(
                f"layer {layer}'s mlp.experts.{depth}lora_* has factors {sorted(factors)}; "
                f"a mixture-of-experts layer (of {spec.target_layers('expert_down')}) needs A "
                "and B"
            )
        target, rank = _fused_pair(factors["A"], factors["B"], spec, names[layer, depth])
        if layer in ranks.setdefault(target, {}):
            raise ValueError(f"layer {layer} has two LoRA pairs on mlp.experts.{target}")
        ranks[target][layer] = rank
    return tuple(_fused_factor(t, ranks[t], spec, cfg) for t in PARAMETER_OF if t in ranks)


def _fused_pair(a: tuple, b: tuple, spec: ModelSpec, key: str) -> tuple[str, int]:
    """(target, rank per expert) of one layer's lora_A ``a`` and lora_B ``b`` shapes; ``key``
    names the pair's lora_A tensor in a message."""
    experts = spec.num_experts
    for target in PARAMETER_OF:
        d_in, d_out = spec.target_dims(target)
        rows = a[0]
        if a[1:] == (d_in,) and b == (d_out, rows) and rows % experts == 0 and rows:
            return target, rows // experts
    gate_up, down = (spec.target_dims(t) for t in PARAMETER_OF)
    raise ValueError(
        f"tensor {key!r} and its lora_B have shapes A {list(a)}, B {list(b)}: the model's "
        f"{experts} experts need A [r * {experts}, {gate_up[0]}] and B [{gate_up[1]}, "
        f"r * {experts}] (gate_up_proj) or A [r * {experts}, {down[0]}] and B [{down[1]}, "
        f"r * {experts}] (down_proj)"
    )


def _fused_factor(target: str, ranks: dict[int, int], spec: ModelSpec, cfg: dict) -> ExpertFactor:
    """The target's rank across layers, checked against every MoE layer and the config."""
    layers = spec.target_layers(target)
    if tuple(sorted(ranks)) != layers:
        raise ValueError(
            f"mlp.experts.{PARAMETER_OF[target]} has LoRA in layers {sorted(ranks)}; every "
            f"mixture-of-experts layer needs it ({list(layers)})"
        )
    rank = ranks[layers[0]]
    key = f"model.layers.{layers[0]}.mlp.experts.{PARAMETER_OF[target]}"
    want = pattern_value(cfg.get("rank_pattern"), key, cfg["r"])
    if set(ranks.values()) != {want}:
        raise ValueError(
            f"mlp.experts.{PARAMETER_OF[target]} has ranks {sorted(set(ranks.values()))} per "
            f"expert, the config says {want}"
        )
    alpha = pattern_value(cfg.get("alpha_pattern"), key, cfg.get("lora_alpha", cfg["r"]))
    return ExpertFactor(target, rank, scale_of(float(alpha), rank, cfg.get("use_rslora", False)))


def _per_expert_factors(shapes: dict[str, tuple], spec: ModelSpec, cfg: dict) -> tuple:
    """``check_experts`` of the per-expert format: every expert of every MoE layer with A and
    B of rank r for each projection the adapter has, gate and up together."""
    names = dict(zip(spec.expert_names, ("gate", "up", "down"), strict=True))
    rank = cfg["r"]
    seen: dict[str, set[tuple[int, int, str]]] = {}
    for key, shape in shapes.items():
        m = PER_EXPERT_KEY.search(key)
        layer, expert, name, factor = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        projection = names.get(name)
        if projection is None:
            raise ValueError(
                f"tensor {key!r} is LoRA on expert projection {name!r}; {spec.architecture}'s "
                f"experts have {', '.join(spec.expert_names)}"
            )
        _check_expert_shape(key, shape, projection, factor, rank, spec)
        if not spec.is_moe_layer(layer) or expert >= spec.num_experts:
            raise ValueError(
                f"tensor {key!r}: the model has {spec.num_experts} experts in layers "
                f"{list(spec.target_layers('expert_down'))}"
            )
        seen.setdefault(projection, set()).add((layer, expert, factor))
    return _per_expert_targets(seen, spec, cfg)


def _check_expert_shape(
    key: str, shape: tuple, projection: str, factor: str, rank: int, spec: ModelSpec
) -> None:
    d_in, d_out = spec.target_dims("expert_down" if projection == "down" else "expert_gate_up")
    if projection != "down":
        d_out //= 2  # gate and up each have the expert's intermediate size
    want = (rank, d_in) if factor == "A" else (d_out, rank)
    if tuple(shape) != want:
        raise ValueError(f"tensor {key!r} has shape {list(shape)}, the model needs {list(want)}")


def _per_expert_targets(seen: dict[str, set], spec: ModelSpec, cfg: dict) -> tuple:
    """The expert targets of the per-expert projections ``seen`` (projection -> its (layer,
    expert, factor) triples), each complete; gate and up as one gate_up pair of rank 2r."""
    need = len(spec.target_layers("expert_down")) * spec.num_experts * 2
    for projection, got in seen.items():
        if len(got) != need:
            raise ValueError(
                f"the experts' {projection} projection has {len(got)} of {need} LoRA factors "
                "(every expert of every mixture-of-experts layer needs A and B)"
            )
    if ("gate" in seen) != ("up" in seen):
        gate, up, _ = spec.expert_names
        have, lack = (gate, up) if "gate" in seen else (up, gate)
        raise ValueError(
            f"LoRA on the experts' {have} (experts.0.{have}, ...) without {lack}: they are "
            "one fused gate_up parameter, which PEFT adapts whole (it refuses one without the "
            "other)"
        )
    rank, alpha = cfg["r"], float(cfg.get("lora_alpha", cfg["r"]))
    scale = scale_of(alpha, rank, cfg.get("use_rslora", False))
    factors = []
    if "gate" in seen:
        factors.append(ExpertFactor("expert_gate_up", 2 * rank, scale))
    if "down" in seen:
        factors.append(ExpertFactor("expert_down", rank, scale))
    return tuple(factors)
