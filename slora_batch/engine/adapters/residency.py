"""Adapters resident in the page pool: slots, pages, reference counts, LRU eviction.

An adapter in use by a running request is pinned (refcount > 0). Idle adapters stay resident
(a later request reuses them for free) until their pages are needed, then leave least recently
used first. The slot tables here are what ``LoraMeta`` carries to the kernels.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from contextlib import nullcontext as _nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from slora_batch.engine.adapters.head_files import head_pages
from slora_batch.engine.adapters.head_weights import SlotHeads
from slora_batch.engine.adapters.store import AdapterInfo, AdapterStore, PagedAdapter
from slora_batch.engine.device import copy_in, to_device
from slora_batch.engine.models.spec import TARGETS, ModelSpec
from slora_batch.engine.pool import PagePool, PoolExhausted

log = logging.getLogger(__name__)

COPY_CHUNK_BYTES = 256 << 20  # an adapter's pages go to the device at most this much at a time

# (layer, target) -> the base weight [d_out, d_in] and the bias [d_out] (or None) of that module,
# on the device (``models.layers.target_weight``)
BaseWeight = Callable[[int, str], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class Resident:
    slot: int
    pages: np.ndarray
    refcount: int = 0
    last_used: int = 0  # the scheduler's step when it last became idle (LRU with cached blocks)
    prefetched: bool = False
    copying: torch.cuda.Event | None = None  # its prefetch copy, no device-stream wait yet


def table_pages(store: AdapterStore, name: str) -> int:
    """Pages of an adapter that its slot's row of the page table lists: all but its head block
    (LoRA on embed_tokens and lm_head, saved copies of them), which ``SlotHeads`` lists. Head
    blocks run unsharded only (the store refuses them under tensor parallelism), where the
    pages are the model's own (``store.spec``)."""
    return store.pages(name) - head_pages(store.info(name).heads, store.spec)


class AdapterResidency:
    def __init__(
        self, pool: PagePool, store: AdapterStore, max_slots: int, device: torch.device
    ) -> None:
        self.pool, self.store, self.spec = pool, store, store.spec
        self.max_slots = max_slots
        # the slot table holds the pages the LoRA kernels read: an adapter's head block, as
        # large as the vocabulary times the hidden size with a saved lm_head, stays out of it
        width = max([table_pages(store, n) for n in store.names] + [1])
        self.slot_rank = np.zeros(max_slots, dtype=np.int32)
        self.slot_scale = np.zeros(max_slots, dtype=np.float32)
        self.slot_pages = np.full((max_slots, width), -1, dtype=np.int32)
        self.slot_offsets = np.full((max_slots, len(TARGETS), 2), -1, dtype=np.int32)
        self.slot_vectors = np.full((max_slots, len(TARGETS), 2), -1, dtype=np.int32)
        # each module's rank and scale, per slot, layer and target (``LoraMeta.layer_rank``)
        modules = (max_slots, self.spec.num_layers, len(TARGETS))
        self.layer_rank = np.zeros(modules, dtype=np.int32)
        self.layer_scale = np.zeros(modules, dtype=np.float32)
        self.device = device
        self.dev_rank = torch.zeros(max_slots, dtype=torch.int32, device=device)
        self.dev_scale = torch.zeros(max_slots, dtype=torch.float32, device=device)
        self.dev_pages = torch.full((max_slots, width), -1, dtype=torch.int32, device=device)
        self.dev_offsets = torch.full(
            (max_slots, len(TARGETS), 2), -1, dtype=torch.int32, device=device
        )
        self.dev_vectors = torch.full(
            (max_slots, len(TARGETS), 2), -1, dtype=torch.int32, device=device
        )
        self.dev_layer_rank = torch.zeros(modules, dtype=torch.int32, device=device)
        self.dev_layer_scale = torch.zeros(modules, dtype=torch.float32, device=device)
        self._resident: OrderedDict[str, Resident] = OrderedDict()  # LRU order, most recent last
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self.loads = 0
        self.evictions = 0
        self.prefetch_hits = 0  # acquired an adapter that a prefetch had loaded
        self.prefetch_misses = 0  # acquired an adapter that had to be loaded on the spot
        self.bytes_copied = 0
        # The device stream's point after the latest eviction's slot-table writes. A prefetch on
        # a side stream may reuse that slot (and its pages) at once, while those writes still
        # wait behind a step in flight; its copy waits for this point first, or the late "-1"
        # row would land over the new adapter's row.
        self._evicted: torch.cuda.Event | None = None
        # Under tensor parallelism rank 0 decides and its workers repeat: every load ("load",
        # name, slot, pages) and eviction ("evict", slot), in order, goes here (None: off).
        self.journal: list[tuple] | None = None
        self.cache = None  # the scheduler's PrefixCache: make_room evicts its idle blocks too
        self.clock = 0  # the scheduler's step number
        # DoRA's magnitudes need the base weights: the runner sets this to its model's
        self.base_weight: BaseWeight | None = None
        # slot -> where its adapter's LoRA on embed_tokens and lm_head, or its saved copies of
        # them (modules_to_save), sit in the pool (``head_weights.head_step`` reads it); slots
        # of adapters without are absent
        self.head_slots: dict[int, SlotHeads] = {}

    def is_resident(self, name: str) -> bool:
        return name in self._resident

    @property
    def num_resident(self) -> int:
        return len(self._resident)

    def slot(self, name: str) -> int:
        return self._resident[name].slot

    def evictable_pages(self) -> int:
        return sum(r.pages.size for r in self._resident.values() if r.refcount == 0)

    def cost(self, name: str | None) -> int:
        """Pages that admitting a request on ``name`` takes beyond its KV (0 when resident)."""
        if not name or name in self._resident:
            return 0
        return self.footprint(name)

    def footprint(self, name: str) -> int:
        """Pages loading ``name`` takes from the pool's free count: its pages, in whole groups
        where the pool hands out groups (``PagePool.footprint``)."""
        return self.pool.footprint(self.store.pages(name))

    def make_room(self, need: int, pool: PagePool | None = None) -> bool:
        """Evicts until ``need`` pages are free in ``pool`` (default: the adapters' own): idle
        adapters (in the adapters' pool) and idle cached prefix blocks (in the KV pool), one at
        a time, whichever became idle longest ago first."""
        pool = pool or self.pool
        if pool.num_free >= need:  # the common case, once per running sequence and step
            return True
        # Two LRU queues merged by age: idle adapters (``_resident``'s order) and idle cached
        # blocks (the cache's order). Each round evicts the head of the two whose ``last_used``
        # (the step it became idle) is older; the cache counts only when it shares ``pool``.
        cache = self.cache if self.cache is not None and self.cache.pool is pool else None
        # Idle adapters in the order they became idle (released, or loaded and not used yet).
        idle = (
            [n for n, r in self._resident.items() if r.refcount == 0] if pool is self.pool else []
        )
        idle.reverse()  # pop() takes the oldest
        # evicted blocks' pages go back in one free at the end (one a block cost ~30 us each)
        freed: list[np.ndarray] = []
        pending = 0
        try:
            while pool.num_free + pending < need:
                block = cache.oldest_idle() if cache is not None else None
                name = idle[-1] if idle else None
                if block is None and name is None:
                    return False
                if name is not None and (
                    block is None or self._resident[name].last_used <= block.last_used
                ):
                    self._evict(idle.pop())
                else:
                    freed.append(cache.evict(block, free=False))
                    pending += freed[-1].size
            return True
        finally:
            if freed:
                pool.free(np.concatenate(freed))

    def acquire(self, name: str) -> int:
        """Pin an adapter for one request, loading it into pool pages first if needed."""
        entry = self._resident.get(name)
        if entry is None:
            entry = self._load(name)
            self.prefetch_misses += 1
        elif entry.prefetched:
            entry.prefetched = False
            self.prefetch_hits += 1
        entry.refcount += 1
        self._resident.move_to_end(name)
        return entry.slot

    def release(self, name: str) -> None:
        entry = self._resident[name]
        if entry.refcount <= 0:
            raise ValueError(f"adapter {name!r} released more often than acquired")
        entry.refcount -= 1
        if entry.refcount == 0:  # idle from now: the LRU order is the order of becoming idle
            entry.last_used = self.clock
            self._resident.move_to_end(name)

    def prefetch(self, name: str, stream: torch.cuda.Stream | None = None) -> bool:
        """Loads an adapter ahead of need (idle, unpinned) if its pages are free right now; the
        copy goes on ``stream``. Returns whether it loaded."""
        if name in self._resident or not self._free_slots or not self.store.ready(name):
            return False  # not yet in host memory: the loader thread reads it meanwhile
        if self.footprint(name) > self.pool.num_free:
            return False
        self._load(name, stream).prefetched = True
        return True

    def mark_copying(self, names: list[str], event: torch.cuda.Event) -> None:
        """The prefetch copies of ``names`` end at ``event`` (recorded on the side stream)."""
        for name in names:
            self._resident[name].copying = event

    def _load(self, name: str, stream: torch.cuda.Stream | None = None) -> Resident:
        info = self.store.info(name)
        need = self.store.pages(name)
        if not self._free_slots:
            idle = [n for n, r in self._resident.items() if r.refcount == 0]
            if not idle:
                raise PoolExhausted(1, 0, self.max_slots, f"adapter slot for {name!r}")
            self._evict(idle[0])
        if not self.make_room(self.footprint(name)):
            raise PoolExhausted(need, self.pool.num_free, self.pool.num_pages, f"adapter {name!r}")
        self.store.paged(name)  # read first: a file that fails raises before pages are taken
        pages = self.pool.alloc(need, f"adapter {name!r}")
        slot = self._free_slots.pop()
        self.install(name, slot, pages, stream)
        log.debug("loaded adapter %r (rank %d) into slot %d, %d pages", name, info.rank, slot, need)
        if self.journal is not None:
            self.journal.append(("load", name, slot, pages))
        entry = Resident(slot=slot, pages=pages, last_used=self.clock)
        self._resident[name] = entry
        return entry

    def install(
        self, name: str, slot: int, pages: np.ndarray, stream: torch.cuda.Stream | None = None
    ) -> None:
        """Copies an adapter's pages into the pool at ``pages`` and fills its slot's tables. A
        tensor-parallel worker calls it with the slot and pages rank 0 chose (its own shard)."""
        info, paged = self.store.info(name), self.store.paged(name)
        self.slot_rank[slot] = info.max_rank
        self.slot_scale[slot] = info.scale
        self.layer_rank[slot], self.layer_scale[slot] = module_tables(info, self.spec)
        table = pages[: paged.head_start] if paged.head_start >= 0 else pages
        self.slot_pages[slot] = -1
        self.slot_pages[slot, : table.size] = table
        self.slot_offsets[slot] = paged.offsets.numpy()
        self.slot_vectors[slot] = paged.vectors.numpy()
        with torch.cuda.stream(stream) if stream is not None else _nullcontext():
            if stream is not None and self._evicted is not None:
                stream.wait_event(self._evicted)
            index = to_device(pages.astype(np.int64), self.device)
            if info.dora:
                data = paged.data.to(self.device, non_blocking=True)
                if data is paged.data:  # on the CPU: the host cache's copy stays as read
                    data = data.clone()
                self._dora(paged, data)
                self.pool.data.index_copy_(1, index, data)
            else:
                self._copy_in(paged.data, index)
            self._sync_slot(slot)
            if paged.head_start >= 0:
                head = to_device(pages[paged.head_start :].astype(np.int64), self.device)
                self.head_slots[slot] = SlotHeads(head, info.heads)
        self.loads += 1
        self.bytes_copied += paged.nbytes

    def _copy_in(self, data: torch.Tensor, index: torch.Tensor) -> None:
        """Copies an adapter's pages ``data`` [L, P, page_size] (host) into the pool's pages
        ``index``, ``COPY_CHUNK_BYTES`` of layers at a time: an adapter on every expert of a
        mixture of experts (1.24 GiB at rank 16 on Qwen3-30B-A3B) needs no staging buffer of
        its size on a device whose free memory the pool took."""
        per_layer = data[0].numel() * data.element_size()
        step = max(1, COPY_CHUNK_BYTES // max(1, per_layer))
        for lo in range(0, data.shape[0], step):
            chunk = data[lo : lo + step].to(self.device, non_blocking=True)  # contiguous layers
            self.pool.data[lo : lo + step].index_copy_(1, index, chunk)

    def _dora(self, paged: PagedAdapter, data: torch.Tensor) -> None:
        """Turns an adapter's DoRA rows in ``data`` (its pages, on the device) from (m, 0) into
        (g, c) per layer and target: g = m / ||W + s B A|| per output channel (the norm over the
        input, ``dora_norms``), c = (1 - g) * the base bias (0 without one), so that the expand
        kernels make PEFT's DoRA output g * (x W + s x A B) + bias of the base output x W +
        bias as g * out + c + g * s * x A B. Each module at its own rank and scale; W is the
        rank's shard under tensor parallelism (its rows: whole input rows). Queued on the
        current stream; the host waits for nothing."""
        if self.base_weight is None:
            raise RuntimeError(f"DoRA adapter {paged.info.name!r}: no base weights to norm")
        spec = self.store.page_spec
        for t_index, target in enumerate(TARGETS):
            start = int(paged.vectors[t_index, 1])
            if start < 0:
                continue
            ranks, scales = paged.info.module_ranks(target, spec.num_layers)
            layers = [i for i, r in enumerate(ranks) if r > 0]
            bases = [self.base_weight(i, target) for i in layers]
            a, b_t = dora_factors(paged, data, t_index, spec)
            scale = to_device(np.array([scales[i] for i in layers], np.float32), data.device)
            norm = dora_norms([w for w, _ in bases], a[layers], b_t[layers], scale)
            rows = page_rows(data, start, 2, spec.target_dims(target)[1])  # a view into data
            g = rows[layers, 0].float() / norm  # [layers, d_out]
            bias = [b.float() if b is not None else torch.zeros_like(g[0]) for _, b in bases]
            rows[layers, 1] = ((1 - g) * torch.stack(bias)).to(rows.dtype)
            rows[layers, 0] = g.to(rows.dtype)

    def _evict(self, name: str) -> None:
        entry = self._resident.pop(name)
        if entry.copying is not None:  # its pages go back to the pool: the copy must land first
            torch.cuda.current_stream(self.device).wait_event(entry.copying)
        self.pool.free(entry.pages)
        self.uninstall(entry.slot)
        if self.journal is not None:
            self.journal.append(("evict", entry.slot))
        if self.device.type == "cuda":
            self._evicted = torch.cuda.current_stream(self.device).record_event()
        self._free_slots.append(entry.slot)
        self.evictions += 1
        log.debug("evicted adapter %r from slot %d", name, entry.slot)

    def uninstall(self, slot: int) -> None:
        """Empties a slot's tables (its pages go back to the pool's owner)."""
        self.slot_rank[slot] = 0
        self.slot_pages[slot] = -1
        self.slot_offsets[slot] = -1
        self.slot_vectors[slot] = -1
        self.layer_rank[slot] = 0
        self.head_slots.pop(slot, None)
        self._sync_slot(slot)

    def _sync_slot(self, slot: int) -> None:
        # fill_ takes the number as a kernel argument; assigning it copies a CPU scalar and
        # waits for the device
        self.dev_rank[slot].fill_(int(self.slot_rank[slot]))
        self.dev_scale[slot].fill_(float(self.slot_scale[slot]))
        copy_in(self.dev_pages[slot], self.slot_pages[slot])
        copy_in(self.dev_offsets[slot], self.slot_offsets[slot])
        copy_in(self.dev_vectors[slot], self.slot_vectors[slot])
        copy_in(self.dev_layer_rank[slot], self.layer_rank[slot])
        copy_in(self.dev_layer_scale[slot], self.layer_scale[slot])


def module_tables(info: AdapterInfo, spec: ModelSpec) -> tuple[np.ndarray, np.ndarray]:
    """An adapter's rank and scale per layer and target ([L, len(TARGETS)] each): its modules'
    (``AdapterInfo.module_ranks``), an expert target's rank per expert in the layers with experts
    (its scale is in its B^T rows), zeros for the targets it lacks."""
    ranks = np.zeros((spec.num_layers, len(TARGETS)), dtype=np.int32)
    scales = np.zeros((spec.num_layers, len(TARGETS)), dtype=np.float32)
    experts = info.expert_ranks
    for target in info.targets:
        column = TARGETS.index(target)
        if target in experts:
            ranks[list(spec.target_layers(target)), column] = experts[target]
            continue
        ranks[:, column], scales[:, column] = info.module_ranks(target, spec.num_layers)
    return ranks, scales


def page_rows(data: torch.Tensor, start: int, count: int, width: int) -> torch.Tensor:
    """Rows ``start`` on of an adapter's pages ``data`` [L, pages, page_size]: ``count`` rows of
    ``width`` elements, each padded to whole pages, as a view [L, count, width]."""
    layers, _, page = data.shape
    per_row = -(-width // page)
    block = data[:, start : start + count * per_row]
    return block.view(layers, count, per_row * page)[:, :, :width]


def dora_factors(
    paged: PagedAdapter, data: torch.Tensor, t_index: int, spec: ModelSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """A target's A rows [L, r, d_in] and B^T rows [L, r, d_out] at its largest rank r, views of
    the adapter's pages ``data``; under tensor parallelism A's rows whole (``whole_a``), as the
    norm of a shard's output rows needs every input column."""
    target = TARGETS[t_index]
    d_in, d_out = spec.target_dims(target)
    rank = max(paged.info.module_ranks(target, spec.num_layers)[0])
    b_t = page_rows(data, int(paged.offsets[t_index, 1]), rank, d_out)
    if target in paged.whole_a:
        return paged.whole_a[target].to(data.device), b_t
    return page_rows(data, int(paged.offsets[t_index, 0]), rank, d_in), b_t


def dora_norms(
    weights: list[torch.Tensor], a: torch.Tensor, b_t: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """||W_l + s_l B_l A_l|| of each output row of n layers, fp32 [n, d_out], as ||W_i||^2 +
    2 s (W A^T)_i . B_i + s^2 B_i (A A^T) B_i^T: no [d_out, d_in] product is formed and each W
    is read twice (its row norms, and W A^T in its own dtype). weights: n of [d_out, d_in];
    a [n, r, d_in]; b_t [n, r, d_out] (B's transpose); scale [n] fp32. Rows past a layer's
    own rank are zeros in the pages, so r may be the target's largest rank."""
    a, b = a.float(), b_t.float().transpose(1, 2)  # [n, r, d_in], [n, d_out, r]
    square = torch.stack([torch.linalg.vector_norm(w, dim=1, dtype=torch.float32) for w in weights])
    wa = torch.stack([(w @ a_l.to(w.dtype).T).float() for w, a_l in zip(weights, a, strict=True)])
    s = scale[:, None]
    quad = ((b @ (a @ a.transpose(1, 2))) * b).sum(-1)  # [n, d_out]
    return (square.square() + 2 * s * (wa * b).sum(-1) + s * s * quad).clamp(min=0).sqrt()
