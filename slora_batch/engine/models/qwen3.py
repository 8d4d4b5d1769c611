"""Qwen3 (dense): Llama's layer plus an RMSNorm over each head of q and k before RoPE, an explicit
``head_dim`` (128 at every size, not hidden / heads), no q/k/v bias."""

from __future__ import annotations

from slora_batch.engine.models.llama import LlamaModel
from slora_batch.engine.models.spec import ModelSpec
from slora_batch.engine.models.weights import TensorReader


class Qwen3Model(LlamaModel):
    @classmethod
    def extra_norms(cls, w: TensorReader, spec: ModelSpec, prefix: str) -> dict:
        return {
            "q_norm": w.norm(prefix + "self_attn.q_norm.weight"),
            "k_norm": w.norm(prefix + "self_attn.k_norm.weight"),
        }
