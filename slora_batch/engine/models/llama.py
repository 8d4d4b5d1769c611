"""The Llama family (Llama, Mistral, Qwen2): RMSNorm, RoPE (incl. llama3 / linear scaling), GQA,
tied embeddings, q/k/v bias (Qwen2), with LoRA deltas added per target and the KV cache in the
pool. RoPE and the LoRA deltas are ``layers``'s, shared with the families to come.

``h = x W + (x A) B * scale``: the base projection runs once for the whole batch; the LoRA
factors of every token's own adapter are gathered from pool pages by the kernel backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels.meta import AttnMeta, LoraMeta
from slora_batch.engine.models.layers import add_lora, rope_cos_sin
from slora_batch.engine.models.spec import ModelSpec
from slora_batch.engine.pool import PagePool

if TYPE_CHECKING:  # the type of the rank's group, handed in by execution.tp
    from slora_batch.engine.execution.tp import TensorParallel


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [q_dim + 2 * kv_dim, H]
    qkv_bias: torch.Tensor | None  # [q_dim + 2 * kv_dim]
    o: torch.Tensor  # [H, q_dim]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 * I, H]
    down: torch.Tensor  # [H, I]


@dataclass
class StepInput:
    """Everything one forward step reads besides the weights, built by ``execution.batch``."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_pages: torch.Tensor  # [T, 2] int32: where each token's K and V go
    attn: AttnMeta
    lora: LoraMeta | None  # None when no token of the step uses an adapter
    logits_index: torch.Tensor  # [S] int64: tokens whose next-token logits are needed
    decode_only: bool  # every sequence has exactly one new token
    # Mixed steps whose first d sequences bring one token each: (d, their AttnMeta, the rest's),
    # so decode rows take the decode kernel; None: the whole step on the prefill kernel.
    attn_split: tuple[int, AttnMeta, AttnMeta] | None = None


class LlamaModel:
    """Weights plus a forward over one step's flat tokens; stateless besides the pool."""

    def __init__(
        self,
        spec: ModelSpec,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        max_pos: int,
        tp: TensorParallel | None = None,
    ) -> None:
        self.spec = spec  # under tensor parallelism, this rank's shard of the model (spec.shard)
        self.tp = tp
        self.embed, self.layers, self.final_norm, self.lm_head = embed, layers, final_norm, lm_head
        self.cos_sin = rope_cos_sin(spec, max_pos, embed.device)
        self.scale = spec.head_dim**-0.5
        q, kv = spec.q_dim, spec.kv_dim
        # Column ranges of q, k, v inside the fused qkv output.
        self.qkv_cols = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
        inter = spec.intermediate_size
        self.gate_up_cols = {"gate": (0, inter), "up": (inter, 2 * inter)}
        # The rank's columns of the hidden size: the input slice its column-parallel LoRA
        # shrinks read, the output slice its row-parallel LoRA expands write.
        hidden = spec.hidden_size // spec.tp_size
        rank = tp.rank if tp is not None else 0
        self.hidden_cols = (rank * hidden, (rank + 1) * hidden)

    def forward(
        self, step: StepInput, pool: PagePool, ops: ModuleType, lora_pool: PagePool | None = None
    ) -> torch.Tensor:
        """Runs every layer on the step's tokens; returns logits [S, vocab] for logits_index.
        K/V pages are ``pool``'s; adapter rows are ``lora_pool``'s, which is ``pool`` itself
        (the default) under S-LoRA's unified paging."""
        lora_pool = lora_pool if lora_pool is not None else pool
        spec = self.spec
        x = F.embedding(step.input_ids, self.embed)  # [T, H]
        residual = None
        lora_buf = None
        if step.lora is not None and step.lora.max_rank > 0:
            lora_buf = torch.zeros(  # fp32 [T, 3 * max_rank]: a group of up to 3 targets
                x.shape[0], 3 * step.lora.max_rank, dtype=torch.float32, device=x.device
            )
        tp = self.tp
        row_cols = self.hidden_cols  # o's and down's LoRA output: all columns, or the rank's
        for index, layer in enumerate(self.layers):
            pool_layer, lora_layer = pool.layer(index), lora_pool.layer(index)
            h, residual = ops.rms_norm(x, layer.input_norm, spec.rms_norm_eps, residual)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            self._lora(h, qkv, self.qkv_cols, lora_layer, step.lora, lora_buf, ops, cut=True)
            q, k, v = (qkv[:, lo:hi] for lo, hi in self.qkv_cols.values())
            q = q.reshape(-1, spec.num_heads, spec.head_dim)
            k = k.reshape(-1, spec.num_kv_heads, spec.head_dim)
            q, k = q.contiguous(), k.contiguous()
            ops.rope(q, k, step.positions, self.cos_sin)
            ops.kv_write(pool_layer, k.view(-1, spec.kv_dim), v, step.out_pages)
            attn = self._attend(q, pool_layer, step, ops).view(-1, spec.q_dim)
            # o and down are row-parallel under tensor parallelism: partial sums with the rank's
            # LoRA columns in them, joined by one all-reduce (o's bias added once, after it)
            o = F.linear(attn, layer.o, layer.o_bias if tp is None else None)
            self._lora(attn, o, {"o": row_cols}, lora_layer, step.lora, lora_buf, ops)
            if tp is not None:
                tp.all_reduce(o)
                if layer.o_bias is not None:
                    o += layer.o_bias
            h, residual = ops.rms_norm(o, layer.post_norm, spec.rms_norm_eps, residual)
            gate_up = F.linear(h, layer.gate_up)
            self._lora(
                h, gate_up, self.gate_up_cols, lora_layer, step.lora, lora_buf, ops, cut=True
            )
            act = ops.silu_mul(gate_up)
            down = F.linear(act, layer.down)
            self._lora(act, down, {"down": row_cols}, lora_layer, step.lora, lora_buf, ops)
            if tp is not None:
                tp.all_reduce(down)
            x = down
        h, _ = ops.rms_norm(
            x[step.logits_index], self.final_norm, spec.rms_norm_eps, residual[step.logits_index]
        )
        logits = F.linear(h, self.lm_head).float()
        return logits if tp is None else tp.gather_vocab(logits, spec.vocab_size)

    def _attend(
        self, q: torch.Tensor, pool_layer: torch.Tensor, step: StepInput, ops: ModuleType
    ) -> torch.Tensor:
        """Attention of the step's queries: decode kernel, prefill kernel, or both on a split."""
        kv_heads = self.spec.num_kv_heads
        if step.decode_only:
            return ops.attention_decode(q, pool_layer, step.attn, kv_heads, self.scale)
        if step.attn_split is None:
            return ops.attention(q, pool_layer, step.attn, kv_heads, self.scale)
        d, decode, prefill = step.attn_split
        out = torch.empty_like(q)
        out[:d] = ops.attention_decode(q[:d], pool_layer, decode, kv_heads, self.scale)
        out[d:] = ops.attention(q[d:], pool_layer, prefill, kv_heads, self.scale)
        return out

    def _lora(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        cols: dict[str, tuple[int, int]],
        pool_layer: torch.Tensor,
        meta: LoraMeta | None,
        buf: torch.Tensor | None,
        ops: ModuleType,
        cut: bool = False,
    ) -> None:
        """``layers.add_lora`` with this rank's group and columns."""
        add_lora(
            x, out, cols, pool_layer, meta, buf, ops, self.tp, self.hidden_cols if cut else None
        )
