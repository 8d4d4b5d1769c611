"""PEFT's ``modules_to_save``: whole trained copies of modules saved beside the LoRA factors,
which replace the base model's modules for the adapter's rows. Parsing and validation against
the model (no torch, like ``adapter_files``); the copies sit in the adapter's head block
(``head_weights``) and count in its pages (``head_files.head_pages``).

A causal LM's generation has two such modules the engine runs: ``embed_tokens`` (the rows'
input embeddings come from the adapter's own [V, H] matrix) and ``lm_head`` (their logits from
its own [V, H] matrix). PEFT saves each as ``<module>.weight`` ("base_model.model.lm_head.weight")
and keeps them apart under tied embeddings (a saved lm_head leaves the embedding the base's, a
saved embed_tokens leaves the logits the base's), unless ``ensure_weight_tying`` ties the two
copies, which the engine refuses on a model with tied embeddings. Any other module (a sequence
classifier's ``score``, a norm, a layer of the decoder) is refused by name.
"""

from __future__ import annotations

from slora_batch.engine.adapters.head_files import HEAD_MODULES, SAVED_KEY, HeadFactor
from slora_batch.engine.models.spec import ModelSpec

# Each head module's full name in the causal LM, which PEFT matches a modules_to_save entry
# against: the name itself or a suffix of it after a dot ("embed_tokens", "model.embed_tokens").
_FULL_NAMES = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}


def _names(value) -> list[str]:
    """A config field that PEFT takes as a list of module names (or one name) as a list."""
    if not value:
        return []
    return [value] if isinstance(value, str) else list(value)


def _module_of(name: str) -> str | None:
    """The head module a modules_to_save (or target_modules) entry names, or None."""
    for module, full in _FULL_NAMES.items():
        if full == name or full.endswith(f".{name}"):
            return module
    return None


def saved_modules(cfg: dict) -> tuple[str, ...]:
    """The head modules the config's ``modules_to_save`` names, in ``HEAD_MODULES`` order;
    raises naming an entry that is neither embed_tokens nor lm_head."""
    found = set()
    for name in _names(cfg.get("modules_to_save")):
        module = _module_of(name)
        if module is None:
            raise ValueError(
                f"modules_to_save {name!r} is not supported: the engine runs saved copies of "
                "embed_tokens and lm_head only (a score or classifier head belongs to a "
                "classification model, not to generation with the causal LM's lm_head)"
            )
        found.add(module)
    return tuple(m for m in HEAD_MODULES if m in found)


def check_saved(
    shapes: dict[str, tuple], spec: ModelSpec, cfg: dict, lora_modules: tuple[str, ...]
) -> tuple[tuple[HeadFactor, ...], dict[str, tuple]]:
    """The adapter's saved head modules (``HeadFactor`` with ``saved``) from its module-weight
    tensors ``shapes`` (``SAVED_KEY``: key -> shape), and those tensors that are not saved
    modules (base copies, ``head_files.check_base_copies``). Raises naming the module and the
    tensor where a saved copy is missing or has another shape than the model's [V, H], where
    a module is saved and adapted by LoRA at once (``lora_modules``: the head modules with LoRA
    factors), or where ``ensure_weight_tying`` would tie the copies of a tied model."""
    modules = saved_modules(cfg)
    if not modules:
        return (), shapes
    if cfg.get("ensure_weight_tying") and spec.tie_word_embeddings:
        raise ValueError(
            f"modules_to_save {list(modules)} with ensure_weight_tying on a model with tied "
            "embeddings is not supported (it ties the saved embed_tokens and lm_head copies)"
        )
    targets = {_module_of(t) for t in _names(cfg.get("target_modules"))}
    by_module = {SAVED_KEY.search(k).group(1): (k, tuple(v)) for k, v in shapes.items()}
    want = (spec.vocab_size, spec.hidden_size)
    for module in modules:
        if module in lora_modules or module in targets:
            raise ValueError(
                f"{module} is both in modules_to_save and a LoRA target: not supported"
            )
        if module not in by_module:
            raise ValueError(
                f"modules_to_save {module}: no tensor '{_FULL_NAMES[module]}.weight' (its "
                "saved copy) in the adapter's weights"
            )
        key, shape = by_module[module]
        if shape != want:
            raise ValueError(
                f"modules_to_save {module}: tensor {key!r} has shape {list(shape)}, the model's "
                f"{module} is {list(want)} (vocab {spec.vocab_size}, hidden {spec.hidden_size}); "
                "a resized vocabulary is not supported"
            )
    rest = {k: v for k, v in shapes.items() if SAVED_KEY.search(k).group(1) not in modules}
    return tuple(HeadFactor(m, 0, 1.0, saved=True) for m in modules), rest
