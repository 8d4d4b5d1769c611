"""Gemma 2 and Gemma 3 (text): norms as (1 + w), folded into the weights when read; a norm after
attention and one before and after the MLP; embeddings times sqrt(hidden); GeGLU; the query
scale ``query_pre_attn_scalar ** -0.5``; sliding-window layers as ``layer_types`` marks them.
Gemma 2 soft-caps attention and final logits; Gemma 3 adds q/k norms and a RoPE of the local
layers' own (``spec.local_rope``). The forward is ``decoder``'s."""

from __future__ import annotations

from slora_batch.engine.models.llama import LlamaModel
from slora_batch.engine.models.spec import ModelSpec
from slora_batch.engine.models.weights import TensorReader


class GemmaModel(LlamaModel):
    @classmethod
    def extra_norms(cls, w: TensorReader, spec: ModelSpec, prefix: str) -> dict:
        norms = {
            "ff_norms": (
                w.norm(prefix + "pre_feedforward_layernorm.weight"),
                w.norm(prefix + "post_feedforward_layernorm.weight"),
            )
        }
        if spec.qk_norm:  # Gemma 3
            norms["q_norm"] = w.norm(prefix + "self_attn.q_norm.weight")
            norms["k_norm"] = w.norm(prefix + "self_attn.k_norm.weight")
        return norms
