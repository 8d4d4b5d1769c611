"""Phi-3, Phi-3.5 and Phi-4 (``Phi3ForCausalLM``): Llama's layer with fused ``qkv_proj`` and
``gate_up_proj`` weights, longrope scaling (short and long factors) and partial rotary (Phi-4
mini). Their PEFT adapters target the fused modules: one LoRA A, and one B whose rows span the
q | k | v (gate | up) columns, added by the kernels over the whole fused output
(``decoder.DecoderModel.qkv_cols``)."""

from __future__ import annotations

from slora_batch.engine.models.decoder import LayerWeights
from slora_batch.engine.models.llama import LlamaModel
from slora_batch.engine.models.spec import ModelSpec
from slora_batch.engine.models.weights import TensorReader


class Phi3Model(LlamaModel):
    @classmethod
    def read_layer(cls, w: TensorReader, spec: ModelSpec, i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        q, kv, inter = spec.q_dim, spec.kv_dim, spec.intermediate_size
        return LayerWeights(
            input_norm=w.norm(p + "input_layernorm.weight"),
            # under tensor parallelism each part is cut by rank: [q_r | k_r | v_r]
            qkv=w.linear(p + "self_attn.qkv_proj.weight", dim=0, parts=(q, kv, kv)),
            qkv_bias=None,
            o=w.linear(p + "self_attn.o_proj.weight", dim=1),
            o_bias=None,
            post_norm=w.norm(p + "post_attention_layernorm.weight"),
            gate_up=w.linear(p + "mlp.gate_up_proj.weight", dim=0, parts=(inter, inter)),
            down=w.linear(p + "mlp.down_proj.weight", dim=1),
        )
