"""LoRA on the token embedding (``embed_tokens``) and on the output projection (``lm_head``), as
PEFT saves and runs it, and PEFT's saved copies of those modules (``modules_to_save``,
``saved_modules``): parsing and validation against the model (no torch, like
``adapter_files``); ``head_weights`` holds the factors and copies and applies them.

PEFT's tensors and what the model adds with them (s: the module's scale, V vocab, H hidden):

- ``embed_tokens.lora_embedding_A`` [r, V], ``lora_embedding_B`` [H, r]: the embedding of token
  t gains s * A[:, t]^T B^T, before the model's own embedding scale (Gemma's sqrt(H) scales the
  delta too, as PEFT's ``_get_embed_scale`` and Gemma's scaled inputs do).
- ``lm_head.lora_A.weight`` [r, H], ``lora_B.weight`` [V, r]: a linear LoRA on the output
  projection, logits gain s * (h A^T) B^T, before Gemma's soft cap.

With tied embeddings PEFT adapts each module on its own (the tied weight is the base's, never
the LoRA; PEFT warns without ``ensure_weight_tying``, which the engine refuses), so an adapter
on embed_tokens leaves the logits alone and one on lm_head the input.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slora_batch.engine.adapters.expert_files import pattern_value, scale_of
from slora_batch.engine.models.spec import ModelSpec

HEAD_MODULES = ("embed_tokens", "lm_head")
# A head tensor: the module, then the factor (embed_tokens' parameters have no ".weight")
HEAD_KEY = re.compile(
    r"(?:^|\.)(embed_tokens|lm_head)\.(lora_embedding_A|lora_embedding_B|lora_A|lora_B)"
    r"(?:\.(weight|bias))?$"
)
# A head module's own weight [V, H] under its own name: PEFT's saved copy of a module in
# ``modules_to_save`` (its factor "W" in ``head_factor``), or, for a module not saved, a copy
# of the base matrix as some PEFT versions write it with ``save_embedding_layers``.
SAVED_KEY = re.compile(r"(?:^|\.)(embed_tokens|lm_head)\.weight$")
# PEFT's copy of the base embedding matrices beside LoRA factors on them, saved by default
# (``save_embedding_layers``) for models whose vocabulary was resized in training: the engine
# runs the base model's own, so a copy must have its shape (``check_base_copies``).
BASE_COPY_KEY = re.compile(r"(?:^|\.)(embed_tokens|lm_head)\.base_layer\.weight$")
_FACTORS = {
    ("embed_tokens", "lora_embedding_A"): "A",
    ("embed_tokens", "lora_embedding_B"): "B",
    ("lm_head", "lora_A"): "A",
    ("lm_head", "lora_B"): "B",
}


@dataclass(frozen=True)
class HeadFactor:
    """One head module of an adapter: "embed_tokens" or "lm_head", its LoRA's rank and scale,
    or (``saved``) a whole copy of the module from ``modules_to_save`` in place of the base's:
    rank 0, scale 1.0, [V, H] elements."""

    module: str
    rank: int
    scale: float
    saved: bool = False

    def shapes(self, spec: ModelSpec) -> tuple[tuple[int, int], tuple[int, int]]:
        """(A, B) as PEFT saves them."""
        vocab, hidden, r = spec.vocab_size, spec.hidden_size, self.rank
        if self.module == "embed_tokens":
            return (r, vocab), (hidden, r)
        return (r, hidden), (vocab, r)

    def numel(self, spec: ModelSpec) -> int:
        if self.saved:
            return spec.vocab_size * spec.hidden_size
        return self.rank * (spec.vocab_size + spec.hidden_size)


def is_head_key(key: str) -> bool:
    """Whether a tensor belongs in the head block: a LoRA factor on embed_tokens or lm_head,
    or a module's own weight (``SAVED_KEY``)."""
    return HEAD_KEY.search(key) is not None or SAVED_KEY.search(key) is not None


def check_base_copies(shapes: dict[str, tuple], spec: ModelSpec) -> None:
    """Raises naming a saved base embedding matrix (``BASE_COPY_KEY``, or ``SAVED_KEY`` of a
    module not in modules_to_save) whose shape is not the model's [vocab, hidden]: a
    vocabulary resized in training, which the engine does not run."""
    want = (spec.vocab_size, spec.hidden_size)
    for key, shape in shapes.items():
        if tuple(shape) != want:
            raise ValueError(
                f"tensor {key!r} has shape {list(shape)}, the model's is {list(want)}: an "
                "adapter trained with a resized vocabulary is not supported"
            )


def head_factor(key: str) -> tuple[str, str]:
    """(module, "A", "B" or "W") of a head tensor ("W": the module's own weight, ``SAVED_KEY``);
    raises naming it where PEFT writes no such one (lora_B's bias, lora_A on an embedding)."""
    saved = SAVED_KEY.search(key)
    if saved is not None:
        return saved.group(1), "W"
    m = HEAD_KEY.search(key)
    factor = _FACTORS.get((m.group(1), m.group(2))) if m is not None else None
    weight = m is not None and m.group(3) == "weight"  # lm_head's only, as PEFT saves them
    if factor is None or weight != (m.group(1) == "lm_head"):
        raise ValueError(f"unexpected tensor {key!r} on {m.group(1) if m else 'a head module'}")
    return m.group(1), factor


def check_heads(shapes: dict[str, tuple], spec: ModelSpec, cfg: dict) -> tuple[HeadFactor, ...]:
    """The adapter's head modules with LoRA from their factors' shapes (``HEAD_KEY``), each at the rank and alpha
    its patterns give (``rank_pattern`` / ``alpha_pattern`` on "model.embed_tokens" or
    "lm_head", as PEFT picks them); raises naming the tensor whose shape the model (its vocab
    and hidden size) does not take, or the module that lacks a factor."""
    for field in ("lora_bias", "use_dora"):
        if shapes and cfg.get(field):
            raise ValueError(f"{field} on embed_tokens or lm_head is not supported")
    found: dict[str, dict[str, tuple]] = {}
    for key, shape in shapes.items():
        module, factor = head_factor(key)
        found.setdefault(module, {})[factor] = (key, tuple(shape))
    heads = []
    for module in HEAD_MODULES:
        if module in found:
            heads.append(_head(module, found[module], spec, cfg))
    return tuple(heads)


def _head(module: str, factors: dict[str, tuple], spec: ModelSpec, cfg: dict) -> HeadFactor:
    """A head module's ``HeadFactor``, its A and B checked against the model."""
    name = "model.embed_tokens" if module == "embed_tokens" else "lm_head"
    if set(factors) != {"A", "B"}:
        have = [key for key, _ in factors.values()]
        raise ValueError(f"{module} needs both LoRA factors A and B, the adapter has {have}")
    rank = int(pattern_value(cfg.get("rank_pattern"), name, cfg["r"]))
    alpha = float(pattern_value(cfg.get("alpha_pattern"), name, cfg.get("lora_alpha", cfg["r"])))
    head = HeadFactor(module, rank, scale_of(alpha, rank, bool(cfg.get("use_rslora", False))))
    for (key, shape), want in zip((factors["A"], factors["B"]), head.shapes(spec), strict=True):
        if shape != want:
            raise ValueError(
                f"tensor {key!r} has shape {list(shape)}, the model (vocab {spec.vocab_size}, "
                f"hidden {spec.hidden_size}) needs {list(want)} at rank {rank}"
            )
    return head


def head_numel(heads: tuple[HeadFactor, ...], spec: ModelSpec) -> int:
    """Elements of an adapter's head block (LoRA factors and saved copies)."""
    return sum(h.numel(spec) for h in heads)


def head_pages(heads: tuple[HeadFactor, ...], spec: ModelSpec) -> int:
    """Pages the head block takes: its elements over every layer of a page."""
    per_page = spec.num_layers * spec.page_size
    return -(-head_numel(heads, spec) // per_page)
