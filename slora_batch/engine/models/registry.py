"""The model families, keyed by the checkpoint's ``architectures`` (``config.json``).

A family is a class built like ``LlamaModel`` (spec, embedding, layers, final norm, LM head,
max positions, tensor-parallel group) with its ``forward`` over the page pool. ``spec.py`` keeps
the names alone (``SUPPORTED_ARCHITECTURES``), so that the job tool checks a model without torch;
the two must list the same architectures.
"""

from __future__ import annotations

from slora_batch.engine.models.llama import LlamaModel
from slora_batch.engine.models.spec import SUPPORTED_ARCHITECTURES, ModelError, ModelSpec

FAMILIES: dict[str, type[LlamaModel]] = {
    "LlamaForCausalLM": LlamaModel,
    "MistralForCausalLM": LlamaModel,
    "Qwen2ForCausalLM": LlamaModel,  # Llama with q/k/v biases
}


def model_class(spec: ModelSpec) -> type[LlamaModel]:
    """The class of ``spec``'s family; a ``ModelError`` naming the model for one not registered."""
    family = FAMILIES.get(spec.architecture)
    if family is None:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ModelError(
            f"model {spec.path!r}: architecture {spec.architecture!r} has no model family "
            f"(registered: {', '.join(FAMILIES)}; spec.py supports {supported})"
        )
    return family
