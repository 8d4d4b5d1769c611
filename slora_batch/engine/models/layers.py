"""Layers the model families share: RoPE (default, linear and llama3 scaling) and the
LoRA-decomposed projection ``h = x W + (x A) B * scale`` whose deltas ``add_lora`` adds. RMSNorm,
attention and the activation run through the kernel backend (``slora_kernels.ref`` and its Triton twins).
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

from slora_batch.engine.models.quant import Fp8Weight
from slora_batch.engine.models.shard import RankGroup
from slora_batch.engine.models.spec import TARGETS, ModelSpec
from slora_kernels.meta import LoraMeta

TARGET_INDEX = {t: i for i, t in enumerate(TARGETS)}


def rope_cos_sin(
    spec: ModelSpec, max_pos: int, device: torch.device, rope: dict | None = None
) -> torch.Tensor:
    """[max_pos, rotary_dim] fp32: cos in the first half, sin in the second (HF's inv_freq
    rules). ``rope`` ({"rope_theta", "scaling"}): another RoPE than the spec's own (Gemma 3's
    local layers). longrope: [2 * max_pos, rotary_dim], the short factors' rows then the long
    factors', both times the attention factor."""
    dim = spec.rotary_dim or spec.head_dim
    theta, scaling = (
        (spec.rope_theta, spec.rope_scaling)
        if rope is None
        else (rope["rope_theta"], rope["scaling"])
    )
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    pos = torch.arange(max_pos, dtype=torch.float32)
    if rope_type == "longrope":
        factor = _longrope_attention_factor(scaling)
        tables = [
            _table(pos, inv_freq / torch.tensor(scaling[key], dtype=torch.float32), factor)
            for key in ("short_factor", "long_factor")
        ]
        return torch.cat(tables).to(device)
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    return _table(pos, inv_freq, 1.0).to(device)


def _table(pos: torch.Tensor, inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    freqs = torch.outer(pos, inv_freq)
    return torch.cat([freqs.cos() * factor, freqs.sin() * factor], dim=-1)


def _longrope_attention_factor(s: dict) -> float:
    """The factor longrope multiplies cos and sin by (the config's, or LongRoPE's default)."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    original = float(s["original_max_position_embeddings"])
    factor = s.get("factor") or s["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling of the rotary frequencies."""
    factor, low, high = (
        float(s["factor"]),
        float(s["low_freq_factor"]),
        float(s["high_freq_factor"]),
    )
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def add_lora(
    x: torch.Tensor,
    out: torch.Tensor,
    cols: dict[str, tuple[int, int]],
    pool_layer: torch.Tensor,
    meta: LoraMeta | None,
    buf: torch.Tensor | None,
    ops: ModuleType,
    tp: RankGroup | None = None,
    in_cols: tuple[int, int] | None = None,
) -> None:
    """Adds the LoRA deltas of a projection group (q, k, v; o; gate, up; down) into their
    column ranges of the fused output, in place: one shrink and one expand launch for the
    targets of the group that some adapter of the step has.

    Shapes: ``x`` [T, d_in], ``out`` [T, d_out] with ``cols`` {target: (lo, hi)} of its columns,
    ``buf`` fp32 [T, 3 * max_rank] scratch (None: no adapter in the step). Under tensor
    parallelism ``tp`` is the rank's group and ``in_cols`` the rank's columns of ``x`` for a
    column-parallel group (None: ``x`` is already the rank's)."""
    if buf is None:
        return
    group = [(TARGET_INDEX[t], lo_hi) for t, lo_hi in cols.items()]
    group = [(index, lo_hi) for index, lo_hi in group if index in meta.targets]
    if not group:
        return  # no adapter of the step has a target of this group: no launch
    targets = tuple(index for index, _ in group)
    if in_cols is not None and tp is not None:  # column-parallel: the rank's input columns
        x = x[:, in_cols[0] : in_cols[1]].contiguous()
    width = len(group) * meta.max_rank
    if tp is None:
        v = buf[:, :width]
    else:  # contiguous, for the all-reduce
        v = buf.view(-1)[: buf.shape[0] * width].view(buf.shape[0], width)
    ops.lora_shrink(x, pool_layer, meta, targets, v)
    if tp is not None:  # the shards' partial x A summed: tokens x rank, small
        tp.all_reduce(v)
    ops.lora_expand(v, pool_layer, meta, targets, out, tuple(lo_hi for _, lo_hi in group))


def target_weight(model, layer: int, target: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The base weight [d_out, d_in] of a LoRA target's module in ``layer`` of ``model`` (a
    ``DecoderModel``; under tensor parallelism its shard, rows of the shard's spec) and its bias
    [d_out] or None: q, k, v (gate, up) are row ranges of the fused qkv (gate_up) projection. In
    the model's dtype; an FP8 weight dequantized. DoRA's magnitudes need it (``residency``)."""
    weights, spec = model.layers[layer], model.spec
    q, kv, inter = spec.q_dim, spec.kv_dim, spec.intermediate_size
    qkv = (weights.qkv, weights.qkv_bias)
    module, bias, rows = {
        "q": (*qkv, (0, q)),
        "k": (*qkv, (q, q + kv)),
        "v": (*qkv, (q + kv, q + 2 * kv)),
        "qkv": (*qkv, None),
        "o": (weights.o, weights.o_bias, None),
        "gate": (weights.gate_up, None, (0, inter)),
        "up": (weights.gate_up, None, (inter, 2 * inter)),
        "gate_up": (weights.gate_up, None, None),
        "down": (weights.down, None, None),
        "router": (weights.moe.router if weights.moe is not None else None, None, None),
    }[target]
    lo, hi = rows if rows is not None else (0, module.shape[0])
    if isinstance(module, Fp8Weight):
        dtype = model.embed.dtype
        module = Fp8Weight(module.weight[lo:hi], module.scale[lo:hi]).dequantize(dtype)
    else:
        module = module[lo:hi]
    return module, bias[lo:hi] if bias is not None else None
