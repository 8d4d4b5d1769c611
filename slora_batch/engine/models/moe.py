"""The mixture-of-experts block that Mixtral, Qwen2/3-MoE and OLMoE put in place of the dense MLP:
a router picks each token's top-k experts, the experts' SwiGLU MLPs run through the kernel
backend's ``fused_moe`` (tokens grouped by expert, the routing weights applied in it), and
Qwen2-MoE adds a shared expert scaled by a sigmoid gate.

Routing runs in torch on the device for every backend, as transformers computes it: router
logits in the model dtype, softmax in fp32, ``torch.topk``, then the top-k weights renormalized
where the model says so (``ModelSpec.norm_topk``). The weights stay fp32 into the kernel.

LoRA: the router is a linear of E outputs whose deltas join its logits before the softmax (the
decoder's ``add_lora``); the experts' deltas are added to each (token, expert) slot's gate_up and
down outputs, of the token's adapter and that expert (``fused_moe_lora``, when an adapter of the
step has expert targets), before the activation and the routing weight, as PEFT's merged
expert weights give them.

Under tensor parallelism each rank holds every expert's share of the intermediate size
(gate/up by output rows, down by input columns) and the whole router: the block's output is a
partial sum, joined by the decoder's all-reduce after the MLP, as the dense MLP's is.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from slora_batch.engine.models.layers import TARGET_INDEX, add_lora
from slora_batch.engine.models.spec import EXPERT_TARGETS, ModelSpec
from slora_batch.engine.models.weights import TensorReader

# The expert targets' indices (gate_up, down), as ``ops.fused_moe_lora`` takes them.
EXPERT_INDEX = tuple(TARGET_INDEX[t] for t in EXPERT_TARGETS)


@dataclass
class SharedExpert:
    """Qwen2-MoE's shared expert: a dense SwiGLU MLP every token runs, times a sigmoid gate."""

    gate_up: torch.Tensor  # [2 * I_shared, H]: gate rows, then up rows
    down: torch.Tensor  # [H, I_shared]
    gate: torch.Tensor  # [1, H]


@dataclass
class MoeWeights:
    """One MoE layer's weights (``TensorReader.experts`` reads both checkpoint layouts)."""

    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor  # [E, 2 * I, H]: per expert, gate rows then up rows
    down: torch.Tensor  # [E, H, I]
    top_k: int
    norm_topk: bool
    shared: SharedExpert | None = None


def route(
    h: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts and their weights.

    Semantics: p = softmax(h @ router^T) in fp32; (w, ids) = topk(p, top_k); with ``norm_topk``
    w = w / sum(w). Shape: h [T, H]; router [E, H]. Returns w [T, top_k] fp32 and ids
    [T, top_k] int32."""
    return top_experts(F.linear(h, router), top_k, norm_topk)


def top_experts(
    logits: torch.Tensor, top_k: int, norm_topk: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` from the router's logits [T, E] (with their LoRA deltas added)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def moe_mlp(
    h: torch.Tensor, moe: MoeWeights, ops: ModuleType, lora: tuple | None = None
) -> torch.Tensor:
    """The MoE block's output [T, H] for the normalized hidden states ``h`` [T, H]: the routed
    experts' weighted sum, plus the gated shared expert where the layer has one.

    ``lora``: (pool layer, ``LoraMeta`` or None, LoRA scratch, ops) as the decoder's ``_lora``
    takes them. The router's LoRA deltas are added to its logits; the experts' are applied to
    each (token, expert) the router chose, from the pool pages of the token's adapter and that
    expert (``ops.fused_moe_lora``), when some adapter of the step has expert targets."""
    logits = F.linear(h, moe.router)
    meta = lora[1] if lora is not None else None
    if meta is not None:
        add_lora(h, logits, {"router": (0, logits.shape[1])}, *lora)
    weights, ids = top_experts(logits, moe.top_k, moe.norm_topk)
    experts = EXPERT_INDEX if meta is not None and set(EXPERT_INDEX) & set(meta.targets) else None
    if experts is None:
        out = ops.fused_moe(h, moe.gate_up, moe.down, weights, ids)
    else:
        out = ops.fused_moe_lora(h, moe.gate_up, moe.down, weights, ids, lora[0], meta, experts)
    shared = moe.shared
    if shared is not None:
        dense = F.linear(ops.silu_mul(F.linear(h, shared.gate_up)), shared.down)
        out = out + torch.sigmoid(F.linear(h, shared.gate)) * dense
    return out


def read_moe(
    w: TensorReader, spec: ModelSpec, i: int, block: str, names: tuple[str, str, str]
) -> MoeWeights:
    """Layer ``i``'s MoE block. ``block``: the module the checkpoint keeps it under ("mlp." for
    Qwen and OLMoE, "block_sparse_moe." for Mixtral's Hub files; transformers 5's fused tensors
    are always under "mlp."); ``names``: the per-expert projections (``TensorReader.experts``).
    """
    p = f"model.layers.{i}."
    router = w.take(p + "mlp.gate.weight", required=False)
    if router is None:
        router = w.take(p + block + "gate.weight")
    gate_up, down = w.experts(p + "mlp.experts.", p + block + "experts.", names)
    shared = None
    if spec.shared_expert_size:
        s = p + "mlp.shared_expert."
        shared = SharedExpert(
            gate_up=w.cat([w.linear(s + f"{t}_proj.weight", dim=0) for t in ("gate", "up")]),
            down=w.linear(s + "down_proj.weight", dim=1),
            gate=w.take(p + "mlp.shared_expert_gate.weight"),
        )
    return MoeWeights(router, gate_up, down, spec.experts_per_token, spec.norm_topk, shared)
