"""What an adapter changes in the base model, as ``validate`` reports it: per kind (LoRA, DoRA,
LoRA with ``lora_bias``, LoRA on the experts, LoRA on embed_tokens and lm_head, a trained copy
of a module from ``modules_to_save``) which modules, on which layers; the config's
``target_modules`` and ``target_parameters`` entries that match no module of the model; and why
an adapter that changes nothing the model has is refused.

Torch-free and file-free, like ``adapter_files`` whose ``AdapterInfo`` it reads: the caller
passes the adapter's ``adapter_config.json`` as a dict (and its tensors' names for a refusal).

Example: r 8 on q_proj, v_proj of a 24-layer Llama with ``layers_to_transform`` [0, 1, 2, 3, 8]
and on lm_head, ``target_modules`` ["q_proj", "v_proj", "lm_head", "qv_proj"]: the summary
"LoRA: q_proj, v_proj on layers 0-3, 8 | head LoRA: lm_head", and "qv_proj" unmatched (a note:
the adapter runs on the modules that match). With ``target_modules`` ["qv_proj"] alone it is
refused: PEFT refuses to load an adapter none of whose targets the model has.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from slora_batch.engine.models.spec import EXPERT_TARGETS, MODULE_OF, ModelSpec

if TYPE_CHECKING:
    from collections.abc import Iterable

    from slora_batch.engine.adapters.adapter_info import AdapterInfo

# The config fields whose entries name the modules (parameters) the adapter's LoRA is on
TARGET_FIELDS = ("target_modules", "target_parameters")
ALL_LINEAR = "all-linear"  # PEFT's shorthand for every linear module but the output layer
SHOWN = 3  # names (tensors, adapters) a message lists before "and N more"


@dataclass(frozen=True)
class Change:
    """One kind of change and where: ("LoRA", "q_proj, v_proj on layers 0-23")."""

    kind: str  # "LoRA", "DoRA", "LoRA + bias", "expert LoRA", "head LoRA" or "trained copy"
    modules: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.modules}"


@dataclass(frozen=True)
class AdapterChanges:
    """What one adapter changes, and the config's target entries that match no module of the
    model: (field, entry) pairs such as ("target_modules", "qv_proj")."""

    name: str
    changes: tuple[Change, ...]
    unmatched: tuple[tuple[str, str], ...] = ()

    @property
    def summary(self) -> str:
        """One line: the changes, kind by kind ("nothing" for none)."""
        return " | ".join(map(str, self.changes)) or "nothing"


def adapter_changes(info: AdapterInfo, cfg: dict, spec: ModelSpec) -> AdapterChanges:
    """What the parsed adapter ``info`` (its config ``cfg``) changes in ``spec``'s model."""
    changes = (
        *_linear_changes(info, spec),
        *_expert_changes(info, spec),
        *_head_changes(info),
    )
    return AdapterChanges(info.name, changes, unmatched_targets(cfg, spec))


def change_refusal(
    info: AdapterInfo, cfg: dict, spec: ModelSpec, tensors: Iterable[str] = ()
) -> str | None:
    """Why the parsed adapter ``info`` (its config ``cfg``, its tensors' names ``tensors``)
    changes nothing ``spec``'s model has, or None: every ``target_modules`` /
    ``target_parameters`` entry matches no module of the model (PEFT refuses to load it too),
    or none of its tensors is a change (saved copies of the base embedding matrices only)."""
    entries = [(field, entry) for field in TARGET_FIELDS for entry in _entries(cfg, field)]
    unmatched = unmatched_targets(cfg, spec)
    if entries and len(unmatched) == len(entries):
        return (
            f"{unmatched_text(unmatched)} {'matches' if len(unmatched) == 1 else 'match'} no "
            f"module of {spec.architecture} (its LoRA modules: {spec.lora_modules}), so the "
            "adapter changes nothing in this model; was it trained on another base model?"
        )
    if adapter_changes(info, cfg, spec).changes:
        return None
    shown = names_text(sorted(tensors)) or "none"
    return (
        f"it changes nothing in {spec.architecture}: none of its tensors ({shown}) is "
        f"a LoRA factor on a module of the model (its LoRA modules: {spec.lora_modules}, "
        "embed_tokens, lm_head)"
    )


def unmatched_targets(cfg: dict, spec: ModelSpec) -> tuple[tuple[str, str], ...]:
    """The (field, entry) pairs of ``cfg``'s ``target_modules`` and ``target_parameters`` that
    match no module of ``spec``'s model, as PEFT matches them: a list entry is a module's name
    or the end of one after a dot ("q_proj", "self_attn.q_proj"), a string is a regular
    expression the whole name must match (``re.fullmatch``); "all-linear" always matches."""
    layout = _layout(spec)
    unmatched = []
    for field in TARGET_FIELDS:
        value = cfg.get(field)
        if isinstance(value, str):
            if value != ALL_LINEAR and not _pattern_matches(value, layout):
                unmatched.append((field, value))
        else:
            unmatched += [(field, e) for e in value or () if not _entry_matches(field, e, layout)]
    return tuple(unmatched)


def _entry_matches(field: str, entry: str, layout: _Layout) -> bool:
    """A list entry names a module (or its end); a ``target_parameters`` entry may name a
    module's own weight too, as PEFT writes the router's: "gate.weight"."""
    if field == "target_parameters" and entry.endswith(".weight"):
        entry = entry.removesuffix(".weight")
    return entry in _name_ends(layout)


def unmatched_text(unmatched: Iterable[tuple[str, str]]) -> str:
    """(field, entry) pairs as a message names them: "target_modules 'qv_proj', 'qproj'"."""
    by_field: dict[str, list[str]] = {}
    for field, entry in unmatched:
        by_field.setdefault(field, []).append(repr(entry))
    return " and ".join(f"{field} {', '.join(entries)}" for field, entries in by_field.items())


def layer_span(layers: Iterable[int]) -> str:
    """Layers as runs: "layer 3", "layers 0-23", "layers 0-3, 8"."""
    layers = sorted(layers)
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    text = ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
    return f"{'layer' if len(layers) == 1 else 'layers'} {text or 'none'}"


def _linear_changes(info: AdapterInfo, spec: ModelSpec) -> list[Change]:
    """The LoRA on linear modules (projections, the router), targets on the same layers named
    together: "q_proj, v_proj on layers 0-23; o_proj on layer 1"."""
    by_layers: dict[tuple[int, ...], list[str]] = {}
    for target in info.targets:
        if target in EXPERT_TARGETS:
            continue
        ranks, _ = info.module_ranks(target, spec.num_layers)
        layers = tuple(i for i in spec.target_layers(target) if ranks[i] > 0)
        by_layers.setdefault(layers, []).append(_module_label(target))
    if not by_layers:
        return []
    where = "; ".join(f"{', '.join(n)} on {layer_span(ls)}" for ls, n in by_layers.items())
    return [Change(info.kind, where)]


def _expert_changes(info: AdapterInfo, spec: ModelSpec) -> list[Change]:
    """The LoRA on the experts: every expert of each mixture-of-experts layer."""
    if not info.experts:
        return []
    names = ", ".join(_module_label(f.target) for f in info.experts)
    layers = spec.target_layers(info.experts[0].target)
    return [Change("expert LoRA", f"{names} on {layer_span(layers)}")]


def _head_changes(info: AdapterInfo) -> list[Change]:
    """LoRA on embed_tokens and lm_head, and the head modules the adapter's trained copies
    (``modules_to_save``) replace."""
    changes = []
    for kind, saved in (("head LoRA", False), ("trained copy", True)):
        modules = [h.module for h in info.heads if h.saved == saved]
        if modules:
            changes.append(Change(kind, ", ".join(modules)))
    return changes


def _module_label(target: str) -> str:
    """A target as the summary names it: its module's last name ("q_proj"), the experts' with
    "experts." ("experts.down_proj"), the router's as "gate (router)"."""
    if target == "router":
        return "gate (router)"
    return MODULE_OF[target].split(".", 1)[1].removeprefix("self_attn.").removeprefix("mlp.")


def _entries(cfg: dict, field: str) -> list[str]:
    value = cfg.get(field)
    return [value] if isinstance(value, str) else list(value or ())


# What decides a model's module names (ModelSpec holds dicts, so it is no cache key itself)
_Layout = tuple[int, bool, int, tuple[int, ...], int, tuple[str, str, str]]


def _layout(spec: ModelSpec) -> _Layout:
    return (
        spec.num_layers,
        spec.fused_projections,
        spec.num_experts,
        tuple(spec.dense_layers),
        spec.shared_expert_size,
        spec.expert_names,
    )


@lru_cache(maxsize=8)
def _module_names(layout: _Layout) -> tuple[str, ...]:
    """Every module (and expert parameter) of the model PEFT could adapt, by its full name:
    "model.layers.0.self_attn.q_proj". A mixture-of-experts layer's under both of the names
    transformers has given its block ("mlp", Mixtral's "block_sparse_moe"): its router "gate",
    the fused expert parameters, each expert's projections, the shared expert's."""
    num_layers, fused, num_experts, dense_layers, shared, expert_names = layout
    attention = ("qkv_proj", "o_proj") if fused else ("q_proj", "k_proj", "v_proj", "o_proj")
    mlp = ("gate_up_proj", "down_proj") if fused else ("gate_proj", "up_proj", "down_proj")
    names = ["model.embed_tokens", "lm_head"]
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        names += [f"{prefix}self_attn.{name}" for name in attention]
        if not num_experts or layer in dense_layers:
            names += [f"{prefix}mlp.{name}" for name in mlp]
            continue
        for block in ("mlp", "block_sparse_moe"):
            experts = f"{prefix}{block}.experts"
            names += [f"{prefix}{block}.gate", experts, f"{experts}.gate_up_proj"]
            names.append(f"{experts}.down_proj")
            names += [
                f"{experts}.{e}.{name}"
                for e in range(num_experts)
                for name in dict.fromkeys((*expert_names, "gate_proj", "up_proj", "down_proj"))
            ]
        if shared:
            names += [f"{prefix}mlp.shared_expert.{name}" for name in mlp]
            names.append(f"{prefix}mlp.shared_expert_gate")
    return tuple(names)


@lru_cache(maxsize=8)
def _name_ends(layout: _Layout) -> frozenset[str]:
    """Every module name and every end of one after a dot: what a ``target_modules`` list
    entry may be ("model.layers.0.self_attn.q_proj", "self_attn.q_proj", "q_proj", ...)."""
    ends = set()
    for name in _module_names(layout):
        parts = name.split(".")
        ends.update(".".join(parts[i:]) for i in range(len(parts)))
    return frozenset(ends)


@lru_cache(maxsize=256)
def _pattern_matches(pattern: str, layout: _Layout) -> bool:
    """Whether a ``target_modules`` regular expression matches a whole module name (a pattern
    that is no regular expression matches none)."""
    try:
        compiled = re.compile(pattern)
    except re.error:
        return False
    return any(compiled.fullmatch(name) for name in _module_names(layout))


def grouped(changes: Iterable[AdapterChanges]) -> list[tuple[str, list[str]]]:
    """The distinct summaries, each with the adapters that have it, the most common first:
    thousands of adapters from one recipe read as one line."""
    groups: dict[str, list[str]] = {}
    for adapter in changes:
        groups.setdefault(adapter.summary, []).append(adapter.name)
    return sorted(groups.items(), key=lambda group: (-len(group[1]), group[0]))


def unmatched_notes(changes: Iterable[AdapterChanges], spec: ModelSpec) -> list[str]:
    """One note per distinct set of unmatched entries, naming the adapters that have it."""
    groups: dict[tuple[tuple[str, str], ...], list[str]] = {}
    for adapter in changes:
        if adapter.unmatched:
            groups.setdefault(adapter.unmatched, []).append(adapter.name)
    return [
        f"{_adapters_text(names)}: {unmatched_text(unmatched)} "
        f"{'matches' if len(unmatched) == 1 else 'match'} no module of {spec.architecture} "
        f"(its LoRA modules: {spec.lora_modules}); the adapter runs on the modules that match"
        for unmatched, names in groups.items()
    ]


def names_text(names: list[str], shown: int = SHOWN) -> str:
    """A few names and how many more: "a, b, c and 97 more"."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more:,} more" if more > 0 else "")


def _adapters_text(names: list[str]) -> str:
    quoted = [repr(name) for name in names]
    return f"adapter{'' if len(names) == 1 else 's'} {names_text(quoted)}"
