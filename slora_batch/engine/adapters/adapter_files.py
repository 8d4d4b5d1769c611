"""PEFT LoRA adapter directories: listing, parsing and validation against the model.

Reads ``adapter_config.json`` and the safetensors header (names and shapes) only, never the
weights, and imports no torch: the job tool checks every adapter of a job with it before any
work. ``store.py`` reads the weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from safetensors import safe_open

from slora_batch.engine.adapters.adapter_info import AdapterInfo, ModuleRanks
from slora_batch.engine.adapters.changes import change_refusal
from slora_batch.engine.adapters.expert_files import (
    FUSED_KEY,
    check_experts,
    is_expert_key,
    pattern_value,
    scale_of,
)
from slora_batch.engine.adapters.head_files import (
    BASE_COPY_KEY,
    HEAD_KEY,
    HEAD_MODULES,
    SAVED_KEY,
    check_base_copies,
    check_heads,
    is_head_key,
)
from slora_batch.engine.adapters.saved_modules import check_saved, saved_modules
from slora_batch.engine.models.spec import EXPERT_TARGETS, MODULE_OF, TARGETS, ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# A LoRA tensor on one linear module: a projection, or a mixture-of-experts router ("gate";
# under "block_sparse_moe" in Mixtral's transformers 4 names): lora_A.weight, lora_B.weight,
# lora_B.bias (lora_bias), lora_magnitude_vector (DoRA), the adapter's name after the tensor's
# where a file keeps it ("lora_A.default.weight"). The experts' keys are expert_files'.
_KEY = re.compile(
    r"layers\.(\d+)\.(self_attn|mlp|block_sparse_moe)\.(\w+_proj|gate)\."
    r"(lora_A|lora_B|lora_magnitude_vector)(?:\.(?!weight$|bias$)\w+)?(?:\.(weight|bias))?$"
)
# (tensor, parameter) of a _KEY match -> the factor it is
_FACTORS = {
    ("lora_A", "weight"): "A",
    ("lora_B", "weight"): "B",
    ("lora_B", "bias"): "bias",
    ("lora_magnitude_vector", None): "magnitude",
    ("lora_magnitude_vector", "weight"): "magnitude",
}
_FACTOR_NAMES = {
    "A": "lora_A",
    "B": "lora_B",
    "bias": "lora_B's bias",
    "magnitude": "lora_magnitude_vector (DoRA's magnitude)",
}
# the config field a factor needs beside A and B
_FACTOR_FIELDS = {"bias": "lora_bias", "magnitude": "use_dora"}
_MODULE_TO_TARGET = {
    module.split(".")[-1]: target
    for target, module in MODULE_OF.items()
    if target not in EXPERT_TARGETS
}
# Embeddings of other model families (GPT-2, GPT-NeoX): refused by name. Llama-style
# embed_tokens and lm_head run (``head_files``).
_EMBEDDING_NAMES = ("wte", "embed_out")


class AdapterError(ValueError):
    """An adapter cannot be used; the message names the adapter, its path and the reason."""

    def __init__(self, name: str, path: str | Path, reason: str) -> None:
        self.name, self.path, self.reason = name, str(path), reason
        super().__init__(f"adapter {name!r} ({path}): {reason}")


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
    on_heads, weights, copies, dense, on_experts = _partition(shapes, spec)
    try:  # patterns first: a rank they set would otherwise read as a wrong shape
        saved_modules(cfg)  # a module it cannot run, before its tensor reads as unexpected
        _check_expert_patterns(cfg, [k for k in on_experts if not FUSED_KEY.search(k)])
        experts, expert_format = check_experts(on_experts, spec, cfg) if on_experts else ((), "")
        for field in ("lora_bias", "use_dora"):
            if experts and cfg.get(field):
                raise ValueError(f"{field} on the experts (mlp.experts) is not supported")
        modules = _check_shapes(dense, spec, cfg)
        heads = check_heads(on_heads, spec, cfg)
        saved, unsaved = check_saved(weights, spec, cfg, tuple(h.module for h in heads))
        check_base_copies({**copies, **unsaved}, spec)
    except ValueError as exc:
        raise AdapterError(name, path, str(exc)) from exc
    targets = tuple(m.target for m in modules) + tuple(f.target for f in experts)
    rank = int(cfg["r"])
    info = AdapterInfo(
        name=name,
        path=path,
        rank=rank,
        alpha=float(cfg.get("lora_alpha", rank)),
        use_rslora=bool(cfg.get("use_rslora", False)),
        targets=tuple(t for t in TARGETS if t in targets),
        experts=experts,
        expert_format=expert_format,
        modules=modules,
        lora_bias=bool(cfg.get("lora_bias", False)),
        dora=bool(cfg.get("use_dora", False)),
        heads=tuple(sorted(heads + saved, key=lambda h: HEAD_MODULES.index(h.module))),
    )
    nothing = change_refusal(info, cfg, spec, shapes)  # every target unmatched, or no change
    if nothing is not None:
        raise AdapterError(name, path, nothing)
    return info


def _partition(shapes: dict[str, tuple], spec: ModelSpec) -> tuple[dict, ...]:
    """An adapter's tensors (key -> shape) by what they are: LoRA factors on embed_tokens and
    lm_head, those modules' own weights (saved copies or base copies: ``check_saved`` tells
    them apart by the config), base copies beside LoRA factors, LoRA on the other linear
    modules, and on the experts."""
    on_heads = {k: v for k, v in shapes.items() if HEAD_KEY.search(k)}
    weights = {k: v for k, v in shapes.items() if SAVED_KEY.search(k)}
    copies = {k: v for k, v in shapes.items() if BASE_COPY_KEY.search(k)}
    dense = {
        k: v
        for k, v in shapes.items()
        if not is_head_key(k) and k not in copies and not (spec.num_experts and is_expert_key(k))
    }
    on_experts = {
        k: v for k, v in shapes.items() if k not in dense and not is_head_key(k) and k not in copies
    }
    return on_heads, weights, copies, dense, on_experts


def _refusal(cfg: dict) -> str | None:
    """Why PEFT could write this adapter but the engine cannot run it, or None."""
    if cfg.get("peft_type", "LORA") != "LORA":
        return f"peft_type {cfg.get('peft_type')!r} is not LORA"
    if cfg.get("use_dora") and cfg.get("lora_bias"):
        return "DoRA with lora_bias is not supported (PEFT refuses the pair as well)"
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    hit = [t for t in targets if any(e in t for e in _EMBEDDING_NAMES)]
    if hit:
        return f"embedding targets {hit} are not supported (embed_tokens and lm_head are)"
    if cfg.get("ensure_weight_tying") and any(any(h in t for h in HEAD_MODULES) for t in targets):
        return "ensure_weight_tying on embed_tokens or lm_head is not supported"
    if cfg.get("bias", "none") != "none":
        return (
            f"bias {cfg['bias']!r} is not supported: the base model's biases trained with the "
            "adapter replace the model's own (lora_bias, a bias on lora_B, is another field)"
        )
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        return f"rank r must be an integer >= 1, got {cfg.get('r')!r}"
    return None


def _check_shapes(shapes: dict[str, tuple], spec: ModelSpec, cfg: dict) -> tuple:
    """The ``ModuleRanks`` of the LoRA tensors on linear modules (every tensor but the experts'),
    each tensor checked against the model at its module's rank, and each target for its factors
    (A, B, lora_bias's bias, DoRA's magnitude) in every layer the config says it is in. Raises
    ``ValueError`` naming the tensor or target."""
    wanted = _wanted_layers(cfg)
    seen: dict[str, dict[int, set[str]]] = {}
    ranks: dict[str, dict[int, tuple[int, str]]] = {}  # target -> layer -> (rank, module)
    for key, shape in shapes.items():
        layer, target, factor = _key_target(key, shape, spec)
        module = _module_name(key)
        _check_layer_pattern(cfg, module, wanted)
        rank = pattern_value(cfg.get("rank_pattern"), module, cfg["r"])
        _check_shape(key, shape, spec, (layer, target, factor), rank, cfg)
        seen.setdefault(target, {}).setdefault(layer, set()).add(factor)
        ranks.setdefault(target, {})[layer] = (rank, module)
    modules = []
    for target in TARGETS:
        if target in seen:
            _check_layers(target, seen[target], spec, cfg, wanted)
            modules.append(_module_ranks(target, ranks[target], spec, cfg))
    return tuple(modules)


def _check_shape(
    key: str, shape: tuple, spec: ModelSpec, where: tuple[int, str, str], rank: int, cfg: dict
) -> None:
    """Raises unless tensor ``key`` (``where``: its layer, target and factor) has the shape the
    model needs at ``rank``, in a layer the target exists in, and is a factor the config has."""
    layer, target, factor = where
    field = _FACTOR_FIELDS.get(factor)
    if field is not None and not cfg.get(field):
        raise ValueError(
            f"tensor {key!r} is {_FACTOR_NAMES[factor]}, and the config's {field} is false"
        )
    d_in, d_out = spec.target_dims(target)
    want = {"A": (rank, d_in), "B": (d_out, rank)}.get(factor, (d_out,))
    layers = spec.target_layers(target)
    if layer not in layers or tuple(shape) != want:
        raise ValueError(
            f"tensor {key!r} has shape {list(shape)}, the model "
            f"({spec.num_layers} layers) needs {list(want)} at layers {_span(layers)}"
            + (f" (rank {rank}: rank_pattern)" if rank != cfg["r"] and factor in ("A", "B") else "")
        )


def _module_name(key: str) -> str:
    """A tensor's module as PEFT's patterns see it: "model.layers.0.self_attn.q_proj"."""
    return key.split(".lora_")[0].removeprefix("base_model.model.")


def _module_ranks(
    target: str, ranks: dict[int, tuple[int, str]], spec: ModelSpec, cfg: dict
) -> ModuleRanks:
    """A target's rank and scale per layer from its layers' (rank, module name), alpha per
    module from ``alpha_pattern``."""
    rslora = bool(cfg.get("use_rslora", False))
    per_layer, scales = [0] * spec.num_layers, [0.0] * spec.num_layers
    for layer, (rank, module) in ranks.items():
        alpha = pattern_value(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", cfg["r"]))
        per_layer[layer], scales[layer] = rank, scale_of(float(alpha), rank, rslora)
    return ModuleRanks(target, tuple(per_layer), tuple(scales))


def _wanted_layers(cfg: dict) -> set[int] | None:
    """The layers ``layers_to_transform`` names (None: every layer; an empty list too, as PEFT
    reads it); raises where it is neither a layer index nor a list of them."""
    layers = cfg.get("layers_to_transform")
    if layers is None or layers == []:
        return None
    if isinstance(layers, int) and not isinstance(layers, bool):
        return {layers}
    if isinstance(layers, list) and all(isinstance(i, int) for i in layers):
        return set(layers)
    raise ValueError(f"layers_to_transform {layers!r} is not a layer index or a list of them")


def _check_layer_pattern(cfg: dict, module: str, wanted: set[int] | None) -> None:
    """Raises where ``layers_pattern`` (with ``layers_to_transform``) matches no layer name of
    ``module``: PEFT finds the layer index after the pattern, so a pattern that names no layer of
    this model (GPT-2's "h" on Llama's "layers") leaves nothing it could have adapted."""
    patterns = cfg.get("layers_pattern")
    if wanted is None or not patterns:
        return
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    if not any(re.match(rf"(?:^|.*?\.){p}\.(\d+)\.", module) for p in patterns):
        raise ValueError(
            f"layers_pattern {cfg['layers_pattern']!r} matches no layer name in {module!r} "
            '(this model\'s layers are model.layers.N: the pattern is "layers")'
        )


def _check_layers(
    target: str, got: dict[int, set[str]], spec: ModelSpec, cfg: dict, wanted: set[int] | None
) -> None:
    """Raises unless ``got`` (layer -> the factors read there) has every factor (A and B, the
    bias with lora_bias, the magnitude with use_dora) in each layer the config puts the target
    in: every layer it exists in, those of ``layers_to_transform``, or with a
    regular-expression ``target_modules`` whichever layers it matched."""
    exists = spec.target_layers(target)
    if wanted is not None:
        need = [i for i in exists if i in wanted]
        where = f"every layer of layers_to_transform {sorted(wanted)}"
    elif isinstance(cfg.get("target_modules"), str):
        need, where = sorted(got), "every layer the target_modules pattern matched"
    else:
        need = list(exists)
        where = f"every layer {'with experts ' if len(exists) < spec.num_layers else ''}"
    factors = ["A", "B"] + [f for f, field in _FACTOR_FIELDS.items() if cfg.get(field)]
    count = sum(len(f) for f in got.values())
    if sorted(got) != need or count != len(factors) * len(need):
        names = [_FACTOR_NAMES[f] for f in factors]
        raise ValueError(
            f"target {target} has {count} of {len(factors) * len(need)} factors in layers "
            f"{sorted(got)} ({where.rstrip()} needs {', '.join(names[:-1])} and {names[-1]})"
        )


def lora_key(key: str) -> tuple[int, str, str] | None:
    """(layer, module, factor) of a LoRA tensor on a linear module: its layer, its module's last
    name ("q_proj", "gate"), and "A", "B", "bias" or "magnitude"; None for any other key."""
    m = _KEY.search(key)
    factor = _FACTORS.get((m.group(4), m.group(5))) if m is not None else None
    return None if factor is None else (int(m.group(1)), m.group(3), factor)


def _key_target(key: str, shape: tuple, spec: ModelSpec) -> tuple[int, str, str]:
    """(layer, target, factor) of a LoRA tensor on a linear module of ``spec``'s model
    (``lora_key``); raises naming the tensor where it is not one (embeddings, a module the model
    lacks, the shared expert)."""
    if any(e in key for e in _EMBEDDING_NAMES):
        raise ValueError(f"embedding weights ({key}) are not supported")
    found = lora_key(key)
    if found is None or found[1] not in _MODULE_TO_TARGET:
        refusal = spec.lora_refusal(key)
        raise ValueError(refusal or f"unexpected tensor {key!r} {list(shape)}")
    layer, module, factor = found
    target = _MODULE_TO_TARGET[module]
    if target not in spec.lora_targets:
        raise ValueError(
            f"tensor {key!r} targets {module}, which {spec.architecture} does not have "
            f"(its LoRA modules: {spec.lora_modules}); was the adapter trained on another base "
            "model?"
        )
    return layer, target, factor


def _span(layers: tuple[int, ...]) -> str:
    """Layers as a message names them: "< 24", or the list (a MoE model's expert layers)."""
    if layers == tuple(range(len(layers))):
        return f"< {len(layers)}"
    return str(list(layers))


def _check_expert_patterns(cfg: dict, keys: list[str]) -> None:
    """Raises where a ``rank_pattern`` or ``alpha_pattern`` key matches a per-expert module
    (transformers 4's ``experts.{e}.w1``): the experts' ranks are read per fused parameter
    (``expert_files``), never per expert."""
    for kind in ("rank_pattern", "alpha_pattern"):
        patterns = cfg.get(kind) or {}
        for key in keys:
            module = _module_name(key)
            for pattern in patterns:
                if pattern_value({pattern: 0}, module, None) is not None:
                    raise ValueError(
                        f"{kind} {pattern!r} matches {module}: per-module ranks on the experts "
                        "are supported on their fused parameters only (mlp.experts.gate_up_proj, "
                        "mlp.experts.down_proj)"
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


def fp8_refusals(infos: list[AdapterInfo]) -> dict[str, AdapterError]:
    """Why each DoRA adapter cannot run with ``adapter_dtype: fp8``: its magnitudes' norms are
    computed from the factors in the pool's pages, read in the model dtype (``residency``)."""
    reason = "DoRA is not supported with adapter_dtype fp8 (use adapter_dtype auto)"
    return {i.name: AdapterError(i.name, i.path, reason) for i in infos if i.dora}
