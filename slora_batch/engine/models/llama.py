"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2): RMSNorm, RoPE (incl. llama3 / linear
scaling), GQA, tied embeddings, q/k/v bias (Qwen2), sliding windows (Mistral, Qwen2's
``use_sliding_window``). The forward is ``decoder``'s; this file reads the weights."""

from __future__ import annotations

from slora_batch.engine.models.decoder import DecoderModel, LayerWeights
from slora_batch.engine.models.spec import ModelSpec
from slora_batch.engine.models.step import StepInput
from slora_batch.engine.models.weights import TensorReader

__all__ = ["LayerWeights", "LlamaModel", "StepInput"]


class LlamaModel(DecoderModel):
    """Separate q/k/v and gate/up weights, fused here into one projection each."""

    @classmethod
    def read_layer(cls, w: TensorReader, spec: ModelSpec, i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        qkv = [w.linear(p + f"self_attn.{t}_proj.weight", dim=0) for t in "qkv"]
        bias = [w.take(p + f"self_attn.{t}_proj.bias", spec.attention_bias, 0) for t in "qkv"]
        return LayerWeights(
            input_norm=w.norm(p + "input_layernorm.weight"),
            qkv=w.cat(qkv),
            qkv_bias=w.cat(bias) if spec.attention_bias else None,
            o=w.linear(p + "self_attn.o_proj.weight", dim=1),
            o_bias=w.take(p + "self_attn.o_proj.bias", spec.o_bias),
            post_norm=w.norm(p + "post_attention_layernorm.weight"),
            **cls.read_mlp(w, spec, i),
            **cls.extra_norms(w, spec, p),
        )

    @classmethod
    def read_mlp(cls, w: TensorReader, spec: ModelSpec, i: int) -> dict:
        """The ``LayerWeights`` fields of layer ``i``'s MLP: the dense gate_up and down here
        (a mixture-of-experts family reads its experts)."""
        p = f"model.layers.{i}.mlp."
        return dict(
            gate_up=w.cat([w.linear(p + f"{t}_proj.weight", dim=0) for t in ("gate", "up")]),
            down=w.linear(p + "down_proj.weight", dim=1),
        )

    @classmethod
    def extra_norms(cls, w: TensorReader, spec: ModelSpec, prefix: str) -> dict:
        """The norms a family adds to Llama's layer (none here)."""
        return {}
