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

from slora_batch.engine.models.spec import MODULE_OF, TARGETS, ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.\w+)?\.weight$")
_MODULE_TO_TARGET = {module.split(".")[1]: target for target, module in MODULE_OF.items()}
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

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


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
    rank = int(cfg.get("r", 0))
    targets = _check_shapes(name, path, shapes, spec, rank)
    return AdapterInfo(
        name=name,
        path=path,
        rank=rank,
        alpha=float(cfg.get("lora_alpha", rank)),
        use_rslora=bool(cfg.get("use_rslora", False)),
        targets=targets,
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
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        return "rank_pattern / alpha_pattern (per-module ranks) are not supported"
    if cfg.get("layers_to_transform") is not None:
        return "layers_to_transform (adapters on a subset of layers) is not supported"
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        return f"rank r must be an integer >= 1, got {cfg.get('r')!r}"
    return None


def _check_shapes(
    name: str, path: Path, shapes: dict[str, tuple], spec: ModelSpec, rank: int
) -> tuple[str, ...]:
    seen: dict[str, set[int]] = {}
    for key, shape in shapes.items():
        if any(e in key for e in _EMBEDDING_NAMES):
            raise AdapterError(
                name, path, f"embedding or lm_head weights ({key}) are not supported"
            )
        m = _KEY.search(key)
        if m is None or m.group(3) not in _MODULE_TO_TARGET:
            refusal = spec.lora_refusal(key)
            raise AdapterError(name, path, refusal or f"unexpected tensor {key!r} {list(shape)}")
        layer, target, factor = int(m.group(1)), _MODULE_TO_TARGET[m.group(3)], m.group(4)
        if target not in spec.lora_targets:
            modules = ", ".join(MODULE_OF[t].split(".")[1] for t in spec.lora_targets)
            raise AdapterError(
                name,
                path,
                f"tensor {key!r} targets {m.group(3)}, which {spec.architecture} does not have "
                f"(its LoRA modules: {modules}); was the adapter trained on another base model?",
            )
        d_in, d_out = spec.target_dims(target)
        want = (rank, d_in) if factor == "A" else (d_out, rank)
        if layer >= spec.num_layers or tuple(shape) != want:
            raise AdapterError(
                name,
                path,
                f"tensor {key!r} has shape {list(shape)}, the model "
                f"({spec.num_layers} layers) needs {list(want)} at layers < {spec.num_layers}",
            )
        seen.setdefault(target, set()).add(layer * 2 + (factor == "B"))
    if not seen:
        raise AdapterError(name, path, f"no LoRA tensors in {WEIGHTS_FILE}")
    for target, got in seen.items():
        if len(got) != 2 * spec.num_layers:
            raise AdapterError(
                name,
                path,
                f"target {target} has {len(got)} of "
                f"{2 * spec.num_layers} factors (every layer needs A and B)",
            )
    return tuple(t for t in TARGETS if t in seen)


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
