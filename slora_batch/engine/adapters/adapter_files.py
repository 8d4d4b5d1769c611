"""PEFT LoRA adapter directories: listing, parsing and validation against the model.

Reads ``adapter_config.json`` and the safetensors header (names and shapes) only, never the
weights, and imports no torch: the job tool checks every adapter of a job with it before any
work. ``store.py`` reads the weights.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from slora_batch.engine.adapters.expert_files import (
    FUSED_KEY,
    ExpertFactor,
    check_experts,
    is_expert_key,
    pattern_value,
)
from slora_batch.engine.models.spec import EXPERT_TARGETS, MODULE_OF, TARGETS, ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# A LoRA pair on one linear module: a projection, or a mixture-of-experts router ("gate"; under
# "block_sparse_moe" in Mixtral's transformers 4 names). The experts' keys are expert_files'.
_KEY = re.compile(
    r"layers\.(\d+)\.(self_attn|mlp|block_sparse_moe)\.(\w+_proj|gate)\.lora_([AB])"
    r"(?:\.\w+)?\.weight$"
)
_MODULE_TO_TARGET = {
    module.split(".")[-1]: target
    for target, module in MODULE_OF.items()
    if target not in EXPERT_TARGETS
}
_EMBEDDING_NAMES = ("embed_tokens", "lm_head", "wte", "embed_out")


class AdapterError(ValueError):
    """An adapter cannot be used; the message names the adapter, its path and the reason."""

    def __init__(self, name: str, path: str | Path, reason: str) -> None:
        self.name, self.path, self.reason = name, str(path), reason
        super().__init__(f"adapter {name!r} ({path}): {reason}")


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

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def expert_ranks(self) -> dict[str, int]:
        """Rank per expert of each expert target."""
        return {f.target: f.rank for f in self.experts}


def parse_adapter(name: str, path: str | Path, spec: ModelSpec) -> AdapterInfo:
    """Read and check one PEFT adapter directory (config and safetensors header only)."""
    path = Path(path)
    cfg_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not path.is_dir():
        raise AdapterError(name, path, "no such adapter directory")
    if not cfg_path.is_file():
        raise AdapterError(name, path, f"missing {CONFIG_FILE}")
    if not weights_path.is_file():
        raise AdapterError(name, path, f"missing {WEIGHTS_FILE}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(name, path, f"unreadable {CONFIG_FILE}: {exc}") from exc
    refuse = _refusal(cfg)
    if refuse:
        raise AdapterError(name, path, refuse)
    try:
        with safe_open(str(weights_path), framework="numpy") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises several types for a corrupt file
        raise AdapterError(name, path, f"unreadable {WEIGHTS_FILE}: {exc}") from exc
    if not shapes:
        raise AdapterError(name, path, f"no LoRA tensors in {WEIGHTS_FILE}")
    rank = int(cfg.get("r", 0))
    dense = {k: v for k, v in shapes.items() if not (spec.num_experts and is_expert_key(k))}
    on_experts = {k: v for k, v in shapes.items() if k not in dense}
    try:  # patterns first: a rank they set would otherwise read as a wrong shape
        _check_patterns(cfg, [k for k in shapes if not FUSED_KEY.search(k)])
        experts, expert_format = check_experts(on_experts, spec, cfg) if on_experts else ((), "")
    except ValueError as exc:
        raise AdapterError(name, path, str(exc)) from exc
    targets = _check_shapes(name, path, dense, spec, rank) + tuple(f.target for f in experts)
    return AdapterInfo(
        name=name,
        path=path,
        rank=rank,
        alpha=float(cfg.get("lora_alpha", rank)),
        use_rslora=bool(cfg.get("use_rslora", False)),
        targets=tuple(t for t in TARGETS if t in targets),
        experts=experts,
        expert_format=expert_format,
    )


def _refusal(cfg: dict) -> str | None:
    """Why PEFT could write this adapter but the engine cannot run it, or None."""
    if cfg.get("peft_type", "LORA") != "LORA":
        return f"peft_type {cfg.get('peft_type')!r} is not LORA"
    if cfg.get("use_dora"):
        return "DoRA adapters (use_dora: true) are not supported"
    if cfg.get("modules_to_save"):
        return (
            f"modules_to_save {cfg['modules_to_save']} is not supported (it replaces base weights)"
        )
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    hit = [t for t in targets if any(e in t for e in _EMBEDDING_NAMES)]
    if hit:
        return f"embedding or lm_head targets {hit} are not supported"
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        return f"LoRA bias ({cfg.get('bias')!r}) is not supported"
    if cfg.get("layers_to_transform") is not None:
        return "layers_to_transform (adapters on a subset of layers) is not supported"
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        return f"rank r must be an integer >= 1, got {cfg.get('r')!r}"
    return None


def _check_shapes(
    name: str, path: Path, shapes: dict[str, tuple], spec: ModelSpec, rank: int
) -> tuple[str, ...]:
    """The targets of the LoRA pairs on linear modules (every tensor but the experts'), each
    checked against the model: its shapes, and A and B in every layer it exists in."""
    seen: dict[str, set[int]] = {}
    for key, shape in shapes.items():
        layer, target, factor = _key_target(name, path, key, shape, spec)
        d_in, d_out = spec.target_dims(target)
        want = (rank, d_in) if factor == "A" else (d_out, rank)
        layers = spec.target_layers(target)
        if layer not in layers or tuple(shape) != want:
            raise AdapterError(
                name,
                path,
                f"tensor {key!r} has shape {list(shape)}, the model "
                f"({spec.num_layers} layers) needs {list(want)} at layers {_span(layers)}",
            )
        seen.setdefault(target, set()).add(layer * 2 + (factor == "B"))
    for target, got in seen.items():
        need = 2 * len(spec.target_layers(target))
        if len(got) != need:
            raise AdapterError(
                name,
                path,
                f"target {target} has {len(got)} of {need} factors (every layer "
                f"{'with experts ' if need < 2 * spec.num_layers else ''}needs A and B)",
            )
    return tuple(t for t in TARGETS if t in seen)


def _key_target(
    name: str, path: Path, key: str, shape: tuple, spec: ModelSpec
) -> tuple[int, str, str]:
    """(layer, target, "A" or "B") of a LoRA tensor on a linear module of ``spec``'s model;
    raises naming the tensor where it is not one (embeddings, a module the model lacks, the
    shared expert)."""
    if any(e in key for e in _EMBEDDING_NAMES):
        raise AdapterError(name, path, f"embedding or lm_head weights ({key}) are not supported")
    m = _KEY.search(key)
    if m is None or m.group(3) not in _MODULE_TO_TARGET:
        refusal = spec.lora_refusal(key)
        raise AdapterError(name, path, refusal or f"unexpected tensor {key!r} {list(shape)}")
    target = _MODULE_TO_TARGET[m.group(3)]
    if target not in spec.lora_targets:
        raise AdapterError(
            name,
            path,
            f"tensor {key!r} targets {m.group(3)}, which {spec.architecture} does not have "
            f"(its LoRA modules: {spec.lora_modules}); was the adapter trained on another base "
            "model?",
        )
    return int(m.group(1)), target, m.group(4)


def _span(layers: tuple[int, ...]) -> str:
    """Layers as a message names them: "< 24", or the list (a MoE model's expert layers)."""
    if layers == tuple(range(len(layers))):
        return f"< {len(layers)}"
    return str(list(layers))


def _check_patterns(cfg: dict, keys: list[str]) -> None:
    """Raises where a ``rank_pattern`` or ``alpha_pattern`` key matches a targeted module:
    per-module ranks are read on the experts' fused parameters only (``expert_files``)."""
    for kind in ("rank_pattern", "alpha_pattern"):
        patterns = cfg.get(kind) or {}
        for key in keys:
            module = key.split(".lora_")[0].removeprefix("base_model.model.")
            for pattern in patterns:
                if pattern_value({pattern: 0}, module, None) is not None:
                    raise ValueError(
                        f"{kind} {pattern!r} matches {module}: per-module ranks are supported "
                        "on a mixture-of-experts model's fused expert parameters only "
                        "(mlp.experts.gate_up_proj, mlp.experts.down_proj)"
                    )


def resolve_sources(sources: dict[str, str | Path] | str | Path | None) -> dict[str, Path]:
    """A directory of adapter directories (name = folder name) or a mapping name -> path."""
    if sources is None:
        return {}
    if isinstance(sources, dict):
        return {str(k): Path(v) for k, v in sources.items()}
    root = Path(sources)
    if not root.is_dir():
        raise AdapterError("*", root, "adapters directory does not exist")
    # Hidden folders (.ipynb_checkpoints, .git, ...) are not adapters.
    return {p.name: p for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith(".")}


def check_adapters(
    spec: ModelSpec, sources: dict[str, str | Path] | str | Path | None
) -> tuple[list[AdapterInfo], dict[str, AdapterError]]:
    """Parse every adapter of ``sources``: the usable ones, and why each broken one is not."""
    infos, broken = [], {}
    for name, path in sorted(resolve_sources(sources).items()):
        try:
            infos.append(parse_adapter(name, path, spec))
        except AdapterError as exc:
            broken[name] = exc
    return infos, broken
