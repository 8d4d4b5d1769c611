"""The decoder every family runs: pre-norm blocks of attention over the paged KV cache and a
gated MLP or a mixture of experts (``moe``), with LoRA deltas added per target. The families
(``llama``, ``qwen3``, ``gemma``, ``phi3``, ``moe_families``) differ in how they read their
weights and in the ``ModelSpec`` switches read here: q/k norms (per head, or over the whole
projection), Gemma's extra norms and scaled embeddings, GeGLU, soft-capped logits, sliding
windows per layer, a RoPE of the local layers' own, partial rotary, fused LoRA targets.

``h = x W + (x A) B * scale``: the base projection runs once for the whole batch; the LoRA
factors of every token's own adapter are gathered from pool pages by the kernel backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from slora_batch.engine.models.layers import add_lora, rope_cos_sin
from slora_batch.engine.models.moe import MoeWeights, moe_mlp
from slora_batch.engine.models.quant import GEMM_ROWS, Fp8Weight, linear
from slora_batch.engine.models.shard import RankGroup
from slora_batch.engine.models.spec import ModelSpec
from slora_batch.engine.models.step import StepInput
from slora_batch.engine.pool import PagePool

if TYPE_CHECKING:
    from slora_batch.engine.adapters.head_weights import HeadStep
    from slora_kernels.meta import LoraMeta


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [q_dim + 2 * kv_dim, H]; the projections may be Fp8Weight
    qkv_bias: torch.Tensor | None  # [q_dim + 2 * kv_dim]
    o: torch.Tensor  # [H, q_dim]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [H]: before the MLP (Gemma: after attention, see ff_norms)
    gate_up: torch.Tensor | None  # [2 * I, H]; None in a mixture-of-experts layer (moe)
    down: torch.Tensor | None  # [H, I]
    q_norm: torch.Tensor | None = None  # [head_dim] (Qwen3, Gemma 3); [q_dim] (OLMoE)
    k_norm: torch.Tensor | None = None
    # Gemma: (pre-MLP norm, post-MLP norm); post_norm then normalizes the attention output.
    ff_norms: tuple[torch.Tensor, torch.Tensor] | None = None
    moe: MoeWeights | None = None  # the experts in place of gate_up and down (``models.moe``)


class DecoderModel:
    """Weights plus a forward over one step's flat tokens; stateless besides the pool."""

    def __init__(
        self,
        spec: ModelSpec,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        max_pos: int,
        tp: RankGroup | None = None,
    ) -> None:
        self.spec = spec  # under tensor parallelism, this rank's shard of the model (spec.shard)
        self.tp = tp
        self.embed, self.layers, self.final_norm, self.lm_head = embed, layers, final_norm, lm_head
        device = embed.device
        self.max_pos = max_pos
        self.cos_sin = rope_cos_sin(spec, max_pos, device)
        self.local_cos_sin = (  # the sliding layers' own RoPE (Gemma 3)
            rope_cos_sin(spec, max_pos, device, spec.local_rope) if spec.local_rope else None
        )
        # longrope: positions of a sequence past the original context take the long factors
        # (the second half of the table): the token's position, or its prompt's length, past it.
        self.long_from = spec.long_rope_from
        self.rotary_dim = spec.rotary_dim or spec.head_dim
        self.embed_scale = (
            torch.tensor(spec.hidden_size**0.5, dtype=embed.dtype, device=device)
            if spec.embed_scale
            else None  # on the device: a host tensor cannot enter a captured CUDA graph
        )
        self.act = "gelu_tanh_mul" if spec.activation == "gelu_tanh" else "silu_mul"
        q, kv, inter = spec.q_dim, spec.kv_dim, spec.intermediate_size
        # LoRA groups: the column ranges of each target inside the fused projection outputs
        # (Phi-3's adapters target the fused modules themselves: one range over all columns).
        if spec.fused_projections:
            self.qkv_cols = {"qkv": (0, q + 2 * kv)}
            self.gate_up_cols = {"gate_up": (0, 2 * inter)}
        else:
            self.qkv_cols = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
            self.gate_up_cols = {"gate": (0, inter), "up": (inter, 2 * inter)}
        self.split = (q, kv, kv)
        # The rank's columns of the hidden size: the input slice its column-parallel LoRA
        # shrinks read, the output slice its row-parallel LoRA expands write.
        hidden = spec.hidden_size // spec.tp_size
        rank = tp.rank if tp is not None else 0
        self.hidden_cols = (rank * hidden, (rank + 1) * hidden)

    @property
    def needs_prompt_lens(self) -> bool:
        """Whether eager steps must carry ``StepInput.prompt_lens`` (longrope)."""
        return self.long_from is not None

    def forward(
        self,
        step: StepInput,
        pool: PagePool,
        ops: ModuleType,
        lora_pool: PagePool | None = None,
        heads: HeadStep | None = None,
    ) -> torch.Tensor:
        """Runs every layer on the step's tokens; returns logits [S, vocab] for logits_index.
        K/V pages are ``pool``'s; adapter rows are ``lora_pool``'s, which is ``pool`` itself
        (the default) under S-LoRA's unified paging. ``heads``: the step's LoRA on
        embed_tokens and lm_head and its saved copies of them (``modules_to_save``; eager steps
        only; None: no adapter of the step has one)."""
        lora_pool = lora_pool if lora_pool is not None else pool
        spec, eps = self.spec, self.spec.rms_norm_eps
        x = self._embed(step.input_ids, lora_pool, heads)  # [T, H]
        residual = None
        lora_buf = None
        if step.lora is not None and step.lora.max_rank > 0:
            lora_buf = torch.zeros(  # fp32 [T, 3 * max_rank]: a group of up to 3 targets
                x.shape[0], 3 * step.lora.max_rank, dtype=torch.float32, device=x.device
            )
        rope_pos = self._rope_positions(step)
        tp = self.tp
        row_cols = self.hidden_cols  # o's and down's LoRA output: all columns, or the rank's
        for index, layer in enumerate(self.layers):
            pool_layer, lora_layer = pool.layer(index), lora_pool.layer(index)
            kv = pool.kv_args(index)  # fp8 pages: the layer's scale table
            meta = step.lora.at_layer(index) if step.lora is not None else None
            lora = (lora_layer, meta, lora_buf, ops)
            h, residual, h_fp8 = self._norm(ops, x, layer.input_norm, residual, layer.qkv)
            qkv = linear(h, layer.qkv, layer.qkv_bias, h_fp8)
            self._lora(h, qkv, self.qkv_cols, *lora, cut=True)
            q, k, v = qkv.split(self.split, dim=1)
            q, k = self._heads(q, k, layer, ops)
            window = spec.window(index)
            table = self.local_cos_sin if window and self.local_cos_sin is not None else None
            rot = self.rotary_dim
            ops.rope(q[..., :rot], k[..., :rot], rope_pos, self.cos_sin if table is None else table)
            k = k.view(-1, spec.kv_dim)
            ops.kv_write(pool_layer, k, v, step.out_pages, **kv)
            attn = self._attend(q, (k, v), pool_layer, step, ops, window, kv)
            attn = attn.view(-1, spec.q_dim)
            # o and down are row-parallel under tensor parallelism: partial sums with the rank's
            # LoRA columns in them, joined by one all-reduce (o's bias added once, after it)
            o = linear(attn, layer.o, layer.o_bias if tp is None else None)
            self._lora(attn, o, {"o": row_cols}, *lora)
            if tp is not None:
                tp.all_reduce(o)
                if layer.o_bias is not None:
                    o += layer.o_bias
            if layer.ff_norms is None:
                h, residual, h_fp8 = self._norm(ops, o, layer.post_norm, residual, layer.gate_up)
            else:  # Gemma: the attention output normalized, then the pre-MLP norm
                o = ops.rms_norm(o, layer.post_norm, eps)[0]
                h, residual, h_fp8 = self._norm(ops, o, layer.ff_norms[0], residual, layer.gate_up)
            down = self._mlp(h, h_fp8, layer, lora, ops)
            if tp is not None:
                tp.all_reduce(down)
            x = down if layer.ff_norms is None else ops.rms_norm(down, layer.ff_norms[1], eps)[0]
        h, _ = ops.rms_norm(x[step.logits_index], self.final_norm, eps, residual[step.logits_index])
        logits = F.linear(h, self.lm_head).float()
        # PEFT's LoRA on lm_head adds to its output, a saved lm_head replaces its adapter's
        # rows; both before the soft cap
        if heads is not None:
            heads.add_logits(logits, h, lora_pool.data, spec)
        if spec.final_softcap > 0:
            logits = torch.tanh(logits / spec.final_softcap) * spec.final_softcap
        return logits if tp is None else tp.gather_vocab(logits, spec.vocab_size)

    def _embed(
        self, input_ids: torch.Tensor, lora_pool: PagePool, heads: HeadStep | None
    ) -> torch.Tensor:
        """The tokens' embeddings [T, H], with their adapters' LoRA on embed_tokens added, or
        the rows of their adapters' saved embed_tokens in place of the base's, before the
        model's own scale (Gemma's sqrt(H) scales PEFT's delta and its saved copy's rows too)."""
        x = F.embedding(input_ids, self.embed)
        if heads is not None:
            heads.add_embed(x, input_ids, lora_pool.data, self.spec)
        return x * self.embed_scale if self.embed_scale is not None else x

    def _norm(
        self,
        ops: ModuleType,
        x: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor | None,
        projection: torch.Tensor | Fp8Weight | None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """``ops.rms_norm``'s (y, r) and, when the projection that reads y is in fp8, y's e4m3
        rows and scales from the same launch (``rms_norm_fp8``); else None."""
        eps = self.spec.rms_norm_eps
        if isinstance(projection, Fp8Weight):
            return ops.rms_norm_fp8(x, weight, eps, residual, pad_to=GEMM_ROWS)
        return (*ops.rms_norm(x, weight, eps, residual), None)

    def _mlp(
        self,
        h: torch.Tensor,
        h_fp8: tuple[torch.Tensor, torch.Tensor] | None,
        layer: LayerWeights,
        lora: tuple,
        ops: ModuleType,
    ) -> torch.Tensor:
        """The MLP's output [T, H] (under tensor parallelism a partial sum, for the all-reduce):
        the gated MLP or the mixture of experts, with their LoRA deltas (``lora``: ``_lora``'s
        pool, meta, buffer and ops; the router's and the experts' run on one rank only, as
        the store refuses them under tensor parallelism). h_fp8: h's e4m3 rows for an fp8
        gate_up; an fp8 down gets its input's from the activation's launch."""
        if layer.moe is not None:
            return moe_mlp(h, layer.moe, ops, lora)
        gate_up = linear(h, layer.gate_up, None, h_fp8)
        self._lora(h, gate_up, self.gate_up_cols, *lora, cut=True)
        a_fp8 = None
        if isinstance(layer.down, Fp8Weight):
            a, a_fp8 = getattr(ops, f"{self.act}_fp8")(gate_up, pad_to=GEMM_ROWS)
        else:
            a = getattr(ops, self.act)(gate_up)
        down = linear(a, layer.down, None, a_fp8)
        self._lora(a, down, {"down": self.hidden_cols}, *lora)
        return down

    def _heads(
        self, q: torch.Tensor, k: torch.Tensor, layer: LayerWeights, ops: ModuleType
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim] and k [T, kv_heads, head_dim], contiguous; with q/k norms,
        each head normalized (RMSNorm over head_dim), or the whole of q and of k (OLMoE)."""
        spec = self.spec
        d = spec.head_dim
        if layer.q_norm is None:
            q = q.reshape(-1, spec.num_heads, d).contiguous()
            return q, k.reshape(-1, spec.num_kv_heads, d).contiguous()
        eps = spec.rms_norm_eps
        if spec.qk_norm_whole:
            q = ops.rms_norm(q.contiguous(), layer.q_norm, eps)[0]
            k = ops.rms_norm(k.contiguous(), layer.k_norm, eps)[0]
            return q.view(-1, spec.num_heads, d), k.view(-1, spec.num_kv_heads, d)
        q = ops.rms_norm(q.reshape(-1, d), layer.q_norm, eps)[0].view(-1, spec.num_heads, d)
        k = ops.rms_norm(k.reshape(-1, d), layer.k_norm, eps)[0].view(-1, spec.num_kv_heads, d)
        return q, k

    def _rope_positions(self, step: StepInput) -> torch.Tensor:
        """Rows of the RoPE table per token: the position, plus max_pos for longrope's long
        factors (the position past the original context, or the token's prompt longer than it:
        transformers computes a whole prompt with the factors its length picks)."""
        if self.long_from is None:
            return step.positions
        long = step.positions >= self.long_from
        if step.prompt_lens is not None:
            long |= step.prompt_lens > self.long_from
        return step.positions + long.long() * self.max_pos

    def _attend(
        self,
        q: torch.Tensor,
        own: tuple[torch.Tensor, torch.Tensor] | None,
        pool_layer: torch.Tensor,
        step: StepInput,
        ops: ModuleType,
        window: int,
        kv: dict,
    ) -> torch.Tensor:
        """Attention of the step's queries: decode kernel, prefill kernel, or both on a split
        (``kv``: the fp8 scale table, or nothing). On fp8 pages the prefill kernel reads the
        step's own keys from ``own``, its K and V rows [T, kv_dim], rounded as the pages hold
        them, not from e4m3 pages; on model-dtype pages it reads the pages (the same values,
        and the sm_90 build of the kernel reading rows spills more registers)."""
        kv_heads, scale, cap = self.spec.num_kv_heads, self.spec.attn_scale, self.spec.attn_softcap
        extra = dict(window=window, softcap=cap) if window or cap else {}
        extra.update(kv)
        if not kv:
            own = None
        if step.decode_only:
            return ops.attention_decode(q, pool_layer, step.attn, kv_heads, scale, **extra)
        if step.attn_split is None:
            return ops.attention(q, pool_layer, step.attn, kv_heads, scale, own=own, **extra)
        d, decode, prefill = step.attn_split
        out = torch.empty_like(q)
        out[:d] = ops.attention_decode(q[:d], pool_layer, decode, kv_heads, scale, **extra)
        own = (own[0][d:], own[1][d:]) if own is not None else None
        out[d:] = ops.attention(q[d:], pool_layer, prefill, kv_heads, scale, own=own, **extra)
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
