"""Per-step metadata the kernels read: flat tensors, built once per step by ``slora_batch.engine.execution.batch``.

Running example (used in the comments below): three sequences in a step, sequence 0 decodes one
token with adapter slot 2, sequence 1 prefills a chunk of 3 tokens on the base model, sequence 2
decodes with slot 2 as well. Tokens of the step: t0 (seq 0), t1 t2 t3 (seq 1), t4 (seq 2).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class AttnMeta:
    """Where each sequence's queries are and where its keys live.

    b1_start [B+1]: cumulative new tokens, leading 0.           example: [0, 1, 4, 5]
    b_seq_len [B]: context length after this step (new included). example: [17, 3, 9]
    page_table [B, max_ctx, 2] int32: (K page, V page) per position, -1 past b_seq_len[b].
    max_new: the largest new-token count of a sequence (1 in a pure decode step).
    """

    b1_start: torch.Tensor
    b_seq_len: torch.Tensor
    page_table: torch.Tensor
    max_new: int


VECTOR_ALL = 1 << 30  # LoraMeta.vector_max that sends every segment to the vector kernels


@dataclass
class LoraMeta:
    """Which adapter each token uses and where each adapter's rows are in the pool.

    b_slot [T]: adapter slot per token, -1 for the base model.        example: [2, -1, -1, -1, 2]
    token_order [T]: token indices stably sorted by slot, base tokens last. example: [0, 4, 1, 2, 3]
      (``slora_batch.engine.execution.batch.lora_segments`` may put the segments longer than vector_max first.)
    seg1_start [S+1]: segments of token_order sharing one slot (adapter tokens only). ex.: [0, 2]
    seg_slot [S]: the slot of each segment.                            example: [2]
    slot_rank [N]: rank per slot, the largest of the adapter's modules (0 for an empty slot).
    slot_scale [N] fp32: lora_alpha / r, or lora_alpha / sqrt(r) with rslora.
    layer_rank [N, L, num_targets] int32 (optional): the rank of each module, per slot, layer and
      target (``rank_pattern``); 0 where the adapter leaves the module out
      (``layers_to_transform``): no compute there. None: slot_rank for every module.
    layer_scale [N, L, num_targets] fp32 (optional): each module's scale (``alpha_pattern``);
      None: slot_scale. Both are read at ``layer``, the layer of the launch (``at_layer``).
    slot_pages [N, W] int32: an adapter's pages, -1 padded. Target by target (canonical order
      q, k, v, o, gate, up, down), first the A rows (rank x ceil(d_in / page_size) pages), then
      the B^T rows (rank x ceil(d_out / page_size) pages).
    slot_offsets [N, num_targets, 2] int32: start in slot_pages of (A, B^T) per target; -1 when
      the adapter does not target it. A mixture-of-experts adapter's expert targets (gate_up,
      down) hold E blocks of their own rank r_t per factor, expert by expert, the B^T rows times
      the target's scale (``slora_kernels.ref.gather_expert_rows``); slot_rank and slot_scale
      are the other targets'.
    max_rank: the largest rank among this step's slots (0 when no token uses an adapter).
    targets: the target indices some slot of the step has (host tuple).
    """

    b_slot: torch.Tensor
    token_order: torch.Tensor
    seg1_start: torch.Tensor
    seg_slot: torch.Tensor
    slot_rank: torch.Tensor
    slot_scale: torch.Tensor
    slot_pages: torch.Tensor
    slot_offsets: torch.Tensor
    max_rank: int
    layer_rank: torch.Tensor | None = None
    layer_scale: torch.Tensor | None = None
    layer: int = 0  # host int: the layer whose modules the kernels run (``at_layer``)
    # slot_vectors [N, num_targets, 2] int32 (optional): start in slot_pages of a target's
    # vector rows, rows of d_out laid out like B^T rows, -1 where there are none: column 0
    # lora_B's bias (PEFT's lora_bias, added inside the scale), column 1 DoRA's two rows, g then
    # c (out = g * out + c + g * delta; ``adapters.residency`` computes them).
    slot_vectors: torch.Tensor | None = None
    # Host: the A and B^T rows are e4m3 with a scale per row (``adapter_dtype: fp8``; the layout:
    # ``slora_kernels.lora_fp8``), for every slot of the engine; vector rows stay in the pool's
    # dtype. False: the rows are in the pool's dtype.
    fp8_rows: bool = False
    # Host: some slot of the step has vector rows (the expand kernels compile their reads only
    # then: a step of plain adapters runs the kernels it always ran).
    has_vectors: bool = False
    # Host: the targets some slot of the step has in each layer (``at_layer`` narrows ``targets``
    # to them, so a layer the step's adapters leave out launches nothing). None: ``targets``.
    layer_targets: tuple[tuple[int, ...], ...] | None = None
    # Targets (indices into TARGETS) that some adapter of the step has; the model launches no
    # LoRA kernels for the others. Host-side; every target by default.
    targets: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6)
    # Which Triton kernels run (results are the same either way; slora_kernels.ref ignores these):
    # segments of at most vector_max tokens go token by token through the vector kernels
    # (S-LoRA's MBGMV), longer ones through the tiled matrix kernels (MBGMM). longest and
    # shortest are host hints of the step's segment lengths that let a launcher skip a kernel
    # with no work; the defaults (unknown) launch both. CUDA-graph decode steps use
    # vector_max = VECTOR_ALL: every token on the vector kernels.
    vector_max: int = 8
    longest: int = 1 << 30
    shortest: int = 1
    # vector_tokens [V] int32 (optional): the tokens of the segments of at most vector_max
    # tokens, in token_order. The vector kernels then run V programs, one per such token, instead
    # of one per token of the step searching its segment (a step mixing decodes with prefill
    # chunks: 248 programs, not 4700). ``slora_batch.engine.execution.batch.vector_tokens`` builds it.
    vector_tokens: torch.Tensor | None = None
    # pos_seg [T] int32 (optional): the first segment ending after each sorted position (S past
    # the adapter tokens), where the tiled kernels' blocks start their walk. example: [0, 0, 1,
    # 1, 1]. ``slora_batch.engine.execution.batch.position_segments`` builds it (eager steps) and the runner
    # refills it (tiled CUDA-graph steps); without it each Triton launch builds it on the device
    # (``slora_kernels.lora_paths.position_segments``).
    pos_seg: torch.Tensor | None = None
    # tiled_tokens (optional, host int): every segment longer than vector_max lies in the first
    # tiled_tokens sorted positions (``slora_batch.engine.execution.batch.lora_segments`` puts them first), so the
    # tiled kernels' grid covers only those. None: the whole step. example: 2 with vector_max 1.
    tiled_tokens: int | None = None

    def at_layer(self, layer: int) -> LoraMeta:
        """This step's metadata for the kernels of one layer (a shallow copy: the tensors are
        shared). Example: ``layer_targets`` ((0, 2), (0,)): layer 1 launches for q alone."""
        meta = copy.copy(self)
        meta.layer = layer
        if self.layer_targets is not None:
            meta.targets = self.layer_targets[layer]
        return meta

    def segments(self) -> Iterator[tuple[int, int, int]]:
        """(slot, lo, hi) per segment, on the host (the torch backend walks these)."""
        starts = self.seg1_start.tolist()
        for i, slot in enumerate(self.seg_slot.tolist()):
            yield slot, starts[i], starts[i + 1]
