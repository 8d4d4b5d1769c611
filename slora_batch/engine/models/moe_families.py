"""The mixture-of-experts families: Llama's layer with the MLP of ``spec.is_moe_layer`` layers
read as a ``moe.MoeWeights`` block (the forward is ``decoder``'s, which runs ``moe.moe_mlp``
there). Their adapters may target attention, the router and the experts
(``ModelSpec.lora_targets``; the experts' LoRA runs in ``moe.moe_mlp``).

- Mixtral: the block under ``block_sparse_moe`` in the Hub's files, experts ``w1`` (gate),
  ``w3`` (up), ``w2`` (down); top-k weights renormalized.
- Qwen3-MoE: Qwen3's q/k norms per head; ``norm_topk_prob``; dense layers where the config says.
- Qwen2-MoE (``MoeModel`` itself): q/k/v biases and a shared expert with a sigmoid gate.
- OLMoE (``Qwen3MoeModel``): Qwen3-MoE's tensor names, q/k norms over the whole projections
  (``ModelSpec.qk_norm_whole``).
"""

from __future__ import annotations

from slora_batch.engine.models.llama import LlamaModel
from slora_batch.engine.models.moe import read_moe
from slora_batch.engine.models.qwen3 import Qwen3Model
from slora_batch.engine.models.spec import ModelSpec
from slora_batch.engine.models.weights import TensorReader


class MoeModel(LlamaModel):
    """A family whose MoE layers keep the router and experts under ``MOE_BLOCK`` with the
    per-expert projections ``EXPERT_NAMES`` (gate, up, down)."""

    MOE_BLOCK = "mlp."
    EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")

    @classmethod
    def read_mlp(cls, w: TensorReader, spec: ModelSpec, i: int) -> dict:
        if not spec.is_moe_layer(i):
            return super().read_mlp(w, spec, i)
        return dict(
            gate_up=None, down=None, moe=read_moe(w, spec, i, cls.MOE_BLOCK, cls.EXPERT_NAMES)
        )


class MixtralModel(MoeModel):
    MOE_BLOCK = "block_sparse_moe."
    EXPERT_NAMES = ("w1", "w3", "w2")


class Qwen3MoeModel(MoeModel, Qwen3Model):
    """Qwen3's q/k norms (``Qwen3Model.extra_norms``) and the MoE MLP; OLMoE's too, whose norms
    span the whole projections (the decoder reads ``spec.qk_norm_whole``)."""
