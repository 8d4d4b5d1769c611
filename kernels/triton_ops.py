"""The Triton backend: every function of ``slora_kernels.ref`` under the same name and signature.

The engine picks it with ``backend="triton"`` (``from slora_kernels import triton_ops``). The host
helpers ``gather_kv``, ``gather_lora_rows``, ``gather_expert_rows`` and ``lora_group`` are no
per-step kernels and come from ``ref``.
With ``scales`` (an fp8 KV cache, ``slora_kernels.fp8``) ``kv_write`` writes e4m3 pages and
``attention`` / ``attention_decode`` read them, as the twins do (with ``v_group``, V in the
grouped layout).
"""

from __future__ import annotations

from slora_kernels.act_quant import gelu_tanh_mul_fp8, rms_norm_fp8, silu_mul_fp8
from slora_kernels.attention import attention
from slora_kernels.attention_decode import attention_decode
from slora_kernels.fused import gelu_tanh_mul, rms_norm, rope, silu_mul
from slora_kernels.kv import kv_write
from slora_kernels.lora_expand import lora_expand
from slora_kernels.lora_shrink import lora_shrink
from slora_kernels.moe import fused_moe
from slora_kernels.moe_lora import fused_moe_lora
from slora_kernels.ref import gather_expert_rows, gather_kv, gather_lora_rows, lora_group

CUDA_GRAPHS = True  # every op is capturable: the engine captures decode steps with this backend

__all__ = [
    "attention",
    "attention_decode",
    "fused_moe",
    "fused_moe_lora",
    "gather_expert_rows",
    "gather_kv",
    "gather_lora_rows",
    "gelu_tanh_mul",
    "gelu_tanh_mul_fp8",
    "kv_write",
    "lora_expand",
    "lora_group",
    "lora_shrink",
    "rms_norm",
    "rms_norm_fp8",
    "rope",
    "silu_mul",
    "silu_mul_fp8",
]
