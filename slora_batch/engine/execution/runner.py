"""Runs one step's forward: eager for prefill and mixed steps, CUDA-graph replay for decode.

Decode steps are captured once per batch-size bucket (1, 2, 4, 8, then every 16) into graphs
that share one memory pool; with adapters, twice: once with the tiled LoRA kernels (a few
adapters, many tokens each) and once with the vector ones (about one token per adapter), and each
step replays the one that suits its mix. Every tensor a graph reads lives in a static buffer filled before
replay; rows past the real batch are padding that writes its K/V to a reserved scratch page and
attends to it alone, and the LoRA segment arrays are padded with empty segments of slot -1. The
adapter slot tables are read in place, so the set of adapters may change from step to step.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import numpy as np
import torch

from slora_batch.engine.adapters.head_weights import head_step
from slora_batch.engine.adapters.residency import AdapterResidency
from slora_batch.engine.adapters.store import vector_rows
from slora_batch.engine.device import copy_in, to_device
from slora_batch.engine.execution.batch import (
    HostStep,
    lora_meta,
    position_segments,
    upload,
)
from slora_batch.engine.execution.memory import graph_buckets
from slora_batch.engine.execution.staging import StagedInputs
from slora_batch.engine.models.decoder import DecoderModel
from slora_batch.engine.models.layers import target_weight
from slora_batch.engine.models.spec import TARGETS
from slora_batch.engine.models.step import StepInput
from slora_batch.engine.pool import PagePool
from slora_kernels.meta import VECTOR_ALL, AttnMeta

log = logging.getLogger(__name__)


# A decode step replays its tiled-LoRA graph when its tokens per distinct adapter reach this
# (H200, Llama-2-7B q/k/v/o: 256 tokens on 8 adapters, tiled 136 us a layer against 585 us
# vector; 256 tokens on 256 adapters, vector 670 us against 772 us tiled).
TILED_TOKENS_PER_ADAPTER = 4


def tiled_decode(b_slot: np.ndarray) -> bool:
    """Whether a decode step's LoRA suits the tiled kernels: at least TILED_TOKENS_PER_ADAPTER
    adapter tokens per distinct adapter (example: 256 tokens on 8 adapters), else the vector ones
    (256 tokens on 200 adapters)."""
    used = b_slot[b_slot >= 0]
    # distinct slots by a count per slot (slots are small table rows; np.unique sorts)
    return used.size > 0 and used.size >= TILED_TOKENS_PER_ADAPTER * np.count_nonzero(
        np.bincount(used)
    )


def gather_previous(
    input_ids: torch.Tensor, rows: torch.Tensor, prev_tokens, every: bool = False
) -> None:
    """Input ids drawn by the previous step, gathered on the device (no wait for it): row b
    takes prev_tokens[rows[b]] where rows[b] >= 0 (-1: its id came from the host). ``every``:
    no row is -1 (a steady decode step), so one gather writes them all, one launch, not five."""
    assert prev_tokens is not None, "a step needs the previous step's tokens"
    if every and prev_tokens.dtype == input_ids.dtype:
        torch.index_select(prev_tokens, 0, rows, out=input_ids)
        return
    taken = prev_tokens[rows.clamp(min=0)].to(input_ids.dtype)
    input_ids.copy_(torch.where(rows >= 0, taken, input_ids))


def fill_lora(arrays: dict[str, np.ndarray]) -> None:
    """A decode step's LoRA segments of its staged b_slot (padded to the bucket), as
    ``lora_segments`` with ``pad_to`` lays them out, into the staged set's views, and pos_seg.
    Segments by a count per slot: b_slot [5, 2, 2, -1] -> counts at slots 2 and 5 of [2, 1],
    seg_slot [2, 5, -1, -1], seg1_start [0, 2, 3, 3, 3]; order [1, 2, 0, 3] (base tokens last)."""
    b_slot = arrays["b_slot"]
    used = b_slot >= 0
    key = np.where(used, b_slot, np.iinfo(np.int32).max)  # base tokens last
    arrays["token_order"][:] = np.argsort(key, kind="stable")
    counts = np.bincount(b_slot[used])
    seg_slot = np.flatnonzero(counts)
    segments = seg_slot.size
    seg1_start = arrays["seg1_start"]
    seg1_start[0] = 0
    np.cumsum(counts[seg_slot], out=seg1_start[1 : segments + 1])
    seg1_start[segments + 1 :] = seg1_start[segments]
    arrays["seg_slot"][:segments] = seg_slot
    arrays["seg_slot"][segments:] = -1
    arrays["pos_seg"][:] = position_segments(seg1_start, b_slot.size)


# A decode graph's per-row inputs staged on the host (``StagedInputs``), and the value of a
# padding row past the batch (out_pages: the scratch page pair); b_slot -1: no adapter.
STAGED_PADDING = {"input_ids": 0, "positions": 0, "out_pages": None, "b_seq_len": 1, "b_slot": -1}


class ModelRunner:
    # Whether some adapter of the store has vector rows (lora_bias, DoRA): the decode graphs then
    # hold the expand kernels that read them.
    vectors = False

    def __init__(
        self,
        model: DecoderModel,
        pool: PagePool,
        lora_pool: PagePool,
        residency: AdapterResidency,
        ops: ModuleType,
        device: torch.device,
        max_batch: int,
        max_model_len: int,
        use_graphs: bool,
    ) -> None:
        self.model, self.pool, self.lora_pool = model, pool, lora_pool
        self.residency, self.ops, self.device = residency, ops, device
        residency.base_weight = functools.partial(target_weight, model)  # DoRA's magnitudes
        self.max_model_len = max_model_len
        # (bucket, tiled LoRA) -> (graph, its static input, its logits)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, StepInput, torch.Tensor]]
        self.graphs = {}
        self.buckets: list[int] = []
        self.graph_steps = 0
        self.tiled_graph_steps = 0  # of those, replays of a tiled-LoRA graph
        if use_graphs and device.type == "cuda":
            self.scratch = pool.alloc(2, "CUDA-graph padding rows")  # K and V of padding rows
            infos = [residency.store.info(n) for n in residency.store.names]
            self.max_rank = max((info.max_rank for info in infos), default=0)
            self.vectors = any(vector_rows(info) for info in infos)
            # Graphs launch LoRA kernels for every target some adapter of the store has.
            self.targets = tuple(
                i for i, t in enumerate(TARGETS) if any(t in info.targets for info in infos)
            )
            self.graph_table(max_batch)
            self._capture(graph_buckets(max_batch))

    def graph_table(self, max_batch: int) -> None:
        """The decode graphs' page table, and what each of its rows holds.

        One table for every bucket (graphs replay one at a time, each fills its rows):
        [max_batch, max_model_len, 2] int32 is 268 MB at 256 rows and a 128K context. Row b
        holds the first ``_graph_lens[b]`` entries of the row table's run ``_graph_tenure[b]``
        (-1: none), so that a step writes only what its rows added (``_fill``)."""
        self._graph_page_table = torch.zeros(
            max_batch, self.max_model_len, 2, dtype=torch.int32, device=self.device
        )
        self._graph_tenure = np.full(max_batch, -1, dtype=np.int64)
        self._graph_lens = np.zeros(max_batch, dtype=np.int64)
        self._staging: dict[int, StagedInputs] = {}
        # (bucket, tiled LoRA) -> the graph's packed device inputs and their views
        self._packed: dict[tuple[int, bool], tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}

    def forward(self, host: HostStep, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [S, vocab] fp32 of the rows in ``host.logits_index``. ``prev_tokens``: the
        previous step's drawn tokens on the device, read where ``host.prev_rows`` points."""
        batch = len(host.b_seq_len)
        # LoRA on embed_tokens or lm_head, and saved copies of them, run eagerly (the graphs
        # hold none)
        heads = head_step(self.residency.head_slots, host.b_slot, host.logits_index, self.device)
        graphable = host.decode_only and host.score_index is None and heads is None
        if graphable and self.buckets and batch <= self.buckets[-1]:
            bucket = min(b for b in self.buckets if b >= batch)
            tiled = self._tiled(host.b_slot)
            graph, _, logits = self.graphs[bucket, tiled]
            self._fill(host, bucket, tiled, prev_tokens)
            graph.replay()
            self.graph_steps += 1
            self.tiled_graph_steps += tiled
            return logits[:batch]
        step = upload(host, self.residency, self.device, self.model.needs_prompt_lens)
        if host.prev_rows is not None:
            gather_previous(step.input_ids, to_device(host.prev_rows, self.device), prev_tokens)
        return self.model.forward(step, self.pool, self.ops, self.lora_pool, heads)

    def _tiled(self, b_slot: np.ndarray) -> bool:
        return self.max_rank > 0 and tiled_decode(b_slot)

    def _static_input(self, bucket: int, tiled: bool) -> StepInput:
        """The graph's inputs: the per-step ones views of its packed device buffer
        (``StagedInputs``), refilled by ``_fill`` with one copy."""
        dev = self.device
        if bucket not in self._staging:
            self._staging[bucket] = StagedInputs(bucket, dev)
        self._packed[bucket, tiled] = packed = self._staging[bucket].device_buffer(dev)
        views = packed[1]

        attn = AttnMeta(
            b1_start=torch.arange(bucket + 1, dtype=torch.int32, device=dev),
            b_seq_len=views["b_seq_len"],
            page_table=self._graph_page_table[:bucket],
            max_new=1,
        )
        lora = None
        if self.max_rank > 0:
            lora = lora_meta(
                views["b_slot"],
                views["token_order"],
                views["seg1_start"],
                views["seg_slot"],
                self.residency,
                self.max_rank,
                self.targets,
                has_vectors=self.vectors,
            )
            lora.vector_max = 0 if tiled else VECTOR_ALL  # which LoRA kernels the graph holds
            # where each tiled block starts its segment walk, refilled every step (the vector
            # graphs' aligned steps, ``lora_paths.aligned_step``, run tiled kernels too)
            lora.pos_seg = views["pos_seg"]
        return StepInput(
            input_ids=views["input_ids"],
            positions=views["positions"],
            out_pages=views["out_pages"],
            attn=attn,
            lora=lora,
            logits_index=torch.arange(bucket, dtype=torch.int64, device=dev),
            decode_only=True,
        )

    def _fill(self, host: HostStep, bucket: int, tiled: bool, prev_tokens=None) -> None:
        """Copies the step into the graph's buffers (one copy of a staged set, then the page
        table and the input ids drawn by the previous step); rows past the batch are padding."""
        batch = len(host.b_seq_len)
        packed, views = self._packed[bucket, tiled]
        staged, arrays = self._staging[bucket].next()
        for name, fill in STAGED_PADDING.items():
            array = arrays[name]
            array[:batch] = getattr(host, name)
            array[batch:] = self.scratch if name == "out_pages" else fill
        if self.max_rank > 0:
            fill_lora(arrays)
        if host.prev_rows is not None:
            arrays["prev_rows"][:batch] = host.prev_rows
        packed.copy_(staged, non_blocking=True)
        # The batch's rows; a padding row has length 1, so only its first entry is ever read
        # (entries past a row's length are stale from earlier steps and never read either).
        self._fill_pages(host)
        if batch < bucket:
            self._graph_page_table[batch:bucket, 0].copy_(views["out_pages"][batch:])
            self._graph_tenure[batch:bucket] = -1
        if host.prev_rows is not None:
            every = bool((host.prev_rows >= 0).all())
            gather_previous(
                views["input_ids"][:batch], views["prev_rows"][:batch], prev_tokens, every
            )

    def _fill_pages(self, host: HostStep) -> None:
        """A decode-only step's page-table rows into the graphs' table: of a row that held the
        same run of the row table (``HostStep.b_tenure``) at the last step, only the entries
        added since (one a step), of any other row all of them. Running example: row 0 held run 7's
        16 entries and holds run 7 at length 17 now: entry 16 is written; row 1 held run 3 and
        holds run 9 (run 3 left, run 9 moved in): entries 0..len-1."""
        batch = len(host.b_seq_len)
        table = self._graph_page_table
        if host.b_tenure is None:  # every entry, and no row's run known afterwards
            copy_in(table[:batch, : host.page_table.shape[1]], host.page_table)
            self._graph_tenure[:batch] = -1
            return
        lens = host.b_seq_len.astype(np.int64)
        held = self._graph_lens[:batch]
        kept = (self._graph_tenure[:batch] == host.b_tenure) & (held <= lens)
        # Kept rows: each row's last `added` entries, `added` the most any kept row added (1 in
        # a decode step, 2 after a mixed step ran eagerly); a row that added fewer writes again
        # an entry it had, with its value (a run's pages only grow). Example: lens [17, 9],
        # held [16, 8], added 1 -> entries (0, 16), (1, 8).
        added = int((lens - held).max(initial=0, where=kept))
        if added:
            b_kept = np.flatnonzero(kept)
            b_cols = np.maximum(lens[b_kept, None] - np.arange(added, 0, -1), 0)  # [k, added]
            b_rows = np.repeat(b_kept, added)
            b_cols = b_cols.reshape(-1)
            # one host-to-device copy: [n, 3] flat entry index (row * table width + column),
            # K page, V page
            entries = np.empty((b_rows.size, 3), dtype=np.int64)
            entries[:, 0] = b_rows * table.shape[1] + b_cols
            # one entry a row: its last, the pair of the token the step computes (out_pages,
            # dense, where the page table's entries lie a row apart)
            entries[:, 1:] = (
                host.out_pages[b_kept] if added == 1 else host.page_table[b_rows, b_cols]
            )
            entries = to_device(entries, self.device)
            table.view(-1, 2).index_copy_(0, entries[:, 0], entries[:, 1:].to(torch.int32))
        # Other rows (new to their place): their whole run, one block a row.
        moved = np.flatnonzero(~kept)
        if moved.size:
            width = host.page_table.shape[1]
            table[:, :width].index_copy_(
                0, to_device(moved, self.device), to_device(host.page_table[moved], self.device)
            )
        self._graph_tenure[:batch] = host.b_tenure
        self._graph_lens[:batch] = lens

    def _capture(self, buckets: list[int]) -> None:
        mempool = torch.cuda.graph_pool_handle()
        variants = [(b, tiled) for b in sorted(buckets, reverse=True) for tiled in (False, True)]
        if self.max_rank == 0:
            variants = [(b, False) for b, tiled in variants if not tiled]
        for bucket, tiled in variants:  # largest first: smaller ones reuse its pool
            static = self._static_input(bucket, tiled)
            host = HostStep(
                input_ids=np.zeros(bucket, np.int64),
                positions=np.zeros(bucket, np.int64),
                out_pages=np.tile(self.scratch.astype(np.int32), (bucket, 1)),
                b1_start=np.arange(bucket + 1, dtype=np.int32),
                b_seq_len=np.ones(bucket, np.int32),
                page_table=np.tile(self.scratch.astype(np.int32), (bucket, 1, 1)),
                b_slot=np.full(bucket, -1),
                logits_index=np.arange(bucket),
                logit_rows=list(range(bucket)),
                max_new=1,
            )
            self._fill(host, bucket, tiled)
            for _ in range(2):  # warm up: compile kernels outside the capture
                self.model.forward(static, self.pool, self.ops, self.lora_pool)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                logits = self.model.forward(static, self.pool, self.ops, self.lora_pool)
            self.graphs[bucket, tiled] = (graph, static, logits)
        torch.cuda.synchronize()
        self.buckets = sorted(buckets)
        log.info("captured %d decode CUDA graphs for batch sizes %s", len(variants), self.buckets)
