"""The model families, keyed by the checkpoint's ``architectures`` (``config.json``).

A family is a ``decoder.DecoderModel`` whose ``read_layer`` reads its checkpoint's layer
weights; the forward is the decoder's, switched by the spec. ``spec.py`` keeps
the names alone (``SUPPORTED_ARCHITECTURES``), so that the job tool checks a model without torch;
the two must list the same architectures.
"""

from __future__ import annotations

from slora_batch.engine.models.gemma import GemmaModel
from slora_batch.engine.models.llama import LlamaModel
from slora_batch.engine.models.moe_families import MixtralModel, MoeModel, Qwen3MoeModel
from slora_batch.engine.models.phi3 import Phi3Model
from slora_batch.engine.models.qwen3 import Qwen3Model
from slora_batch.engine.models.spec import SUPPORTED_ARCHITECTURES, ModelError, ModelSpec

FAMILIES: dict[str, type[LlamaModel]] = {
    "LlamaForCausalLM": LlamaModel,
    "MistralForCausalLM": LlamaModel,  # Llama with a sliding window
    "Qwen2ForCausalLM": LlamaModel,  # Llama with q/k/v biases
    "Qwen3ForCausalLM": Qwen3Model,
    "Gemma2ForCausalLM": GemmaModel,
    "Gemma3ForCausalLM": GemmaModel,
    "Phi3ForCausalLM": Phi3Model,
    "MixtralForCausalLM": MixtralModel,
    "Qwen3MoeForCausalLM": Qwen3MoeModel,
    "Qwen2MoeForCausalLM": MoeModel,  # q/k/v biases and the shared expert, read from the spec
    "OlmoeForCausalLM": Qwen3MoeModel,  # Qwen3-MoE's names; q/k norms over whole projections
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
