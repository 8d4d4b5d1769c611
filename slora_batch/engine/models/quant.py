"""FP8 weights (W8A8): e4m3 weights with one scale per output channel, activations quantized per
token on the fly, for the base projections only. LoRA reads the unquantized activations and its
bf16 factors (feeding it the fp8 input ruined adapters in vLLM #42007), the embedding and the LM
head stay in the model's dtype.

Where the card has fp8 matmuls (compute capability 8.9 and up) the product is one
``torch._scaled_mm`` with row-wise scales; elsewhere (the CPU, CI) it is emulated exactly:
quantize, dequantize, multiply in fp32. Checkpoints: a bf16 one quantized on load
(``weights: fp8``), compressed-tensors ``float-quantized`` per channel, and the HF ``fp8``
block-wise (128 x 128) format, whose blocks are requantized per channel on load.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slora_kernels import act_quant

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest e4m3 value
_TINY = 1e-12
GEMM_ROWS = 16  # the fp8 GEMM wants its activation rows a multiple of this


@dataclass
class Fp8Weight:
    """A projection's weight in e4m3 [out, in] and its per-output-channel fp32 scales [out]."""

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def to(self, device: torch.device) -> Fp8Weight:
        return Fp8Weight(self.weight.to(device), self.scale.to(device))

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Fp8Weight:
        """Per output channel: scale = amax / 448, so every channel spans e4m3's range."""
        w = w.float()
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=_TINY)
        return cls(to_fp8(w / scale[:, None]), scale)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * self.scale[:, None]).to(dtype)


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(x: torch.Tensor, pad_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization (``slora_kernels.act_quant``): (x_fp8 [T + pad, in],
    scales [T + pad, 1] fp32), rows padded with zeros to a multiple of pad_to. On CUDA one
    Triton launch, elsewhere its torch twin (the same values)."""
    if x.is_cuda:
        return act_quant.quantize_rows(x.contiguous(), pad_to)
    return act_quant.quantize_rows_ref(x, pad_to)


@functools.lru_cache(maxsize=16)
def fp8_matmul_supported(device: torch.device) -> bool:
    """Whether ``device`` multiplies fp8 natively (Ada and Hopper: compute capability >= 8.9);
    cached: every fp8 projection of every step asks."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def linear(
    x: torch.Tensor,
    w: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None = None,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """``F.linear`` for a weight in the model's dtype or in fp8 (out: x's dtype). x_fp8: x's
    rows already quantized (``quantize_rows(x, pad_to=GEMM_ROWS)``'s values, as the fused ops
    ``rms_norm_fp8`` and ``silu_mul_fp8`` make them); None: quantized here."""
    if not isinstance(w, Fp8Weight):
        return F.linear(x, w, bias)
    rows = x.shape[0]
    if fp8_matmul_supported(x.device):
        xq, x_scale = x_fp8 or quantize_rows(x, pad_to=GEMM_ROWS)
        assert xq.shape[0] % GEMM_ROWS == 0 and xq.shape[0] - rows < GEMM_ROWS, xq.shape
        out = torch._scaled_mm(
            xq,
            w.weight.t(),
            scale_a=x_scale,
            scale_b=w.scale[None, :],
            bias=bias,
            out_dtype=x.dtype,
        )
        return out[:rows]
    xq, x_scale = x_fp8 or quantize_rows(x)
    out = (xq[:rows].float() * x_scale[:rows]) @ (w.weight.float() * w.scale[:, None]).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def dequantize_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]):
    """The HF ``fp8`` block-wise format: w [out, in] e4m3 times one scale per (block[0] x
    block[1]) block (``weight_scale_inv`` [ceil(out / b0), ceil(in / b1)]), in fp32."""
    b0, b1 = block
    scale = scale_inv.float().repeat_interleave(b0, dim=0).repeat_interleave(b1, dim=1)
    return w.float() * scale[: w.shape[0], : w.shape[1]]
