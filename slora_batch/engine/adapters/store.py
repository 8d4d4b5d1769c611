"""Adapter weights in host memory: read from PEFT safetensors, laid out in pool pages, and the
store that holds them (an LRU bounded by bytes, fed by a loader thread).

The store knows every adapter by name from the start (a directory listing or a mapping) but
reads a config only when asked and weights only when the adapter is first needed; weights stay
in host memory (pinned when a GPU is used), so thousands fit.
"""

from __future__ import annotations

import difflib
import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from slora_batch.engine.adapters.adapter_files import (
    _MODULE_TO_TARGET,
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    AdapterInfo,
    check_adapters,
    fp8_refusals,
    lora_key,
    parse_adapter,
    resolve_sources,
)
from slora_batch.engine.adapters.expert_weights import ExpertRows
from slora_batch.engine.adapters.head_files import (
    BASE_COPY_KEY,
    head_factor,
    head_pages,
    is_head_key,
)
from slora_batch.engine.adapters.head_weights import head_block
from slora_batch.engine.models.spec import EXPERT_TARGETS, TARGETS, ModelSpec
from slora_kernels import lora_fp8

__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "AdapterError",
    "AdapterInfo",
    "AdapterStore",
    "AdapterWeights",
    "PagedAdapter",
    "adapter_pages",
    "load_weights",
    "parse_adapter",
    "resolve_sources",
    "to_pages",
    "vector_rows",
]

log = logging.getLogger(__name__)

# Loader threads when weights are pinned (a GPU engine): its own thread mostly waits on the
# device, so two reads at a time keep up with adapter-major jobs (a sweep reads a new adapter
# every few hundred rows). A CPU engine's cores are its compute: one read at a time there.
LOADER_THREADS_PINNED = 2
ROW_PARALLEL = ("o", "down")  # targets cut along d_in under tensor parallelism (``execution.tp``)


@dataclass
class AdapterWeights:
    """Host copies of the factors, per target: A rows [L, r, d_in] and B^T rows [L, r, d_out],
    r the target's largest rank over layers; a layer of a smaller rank fills its first rows and
    one the adapter leaves out none (``load_weights`` with ``stack=False``: a list of each
    layer's rows; stacked, the rows past a layer's own rank are zeros). ``vectors``: the
    targets with one vector per output channel, their rows [L, k, d_out]: lora_B's bias
    (lora_bias, k = 1), or DoRA's magnitude m and a row of zeros (k = 2), which the residency
    turns into g and c on the device. ``heads``: the flat block of LoRA on embed_tokens and
    lm_head (``head_weights.head_block``), None without."""

    a: dict[str, torch.Tensor]
    b_t: dict[str, torch.Tensor]
    vectors: dict[str, torch.Tensor] = field(default_factory=dict)
    heads: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        tensors = (*self.a.values(), *self.b_t.values(), *self.vectors.values())
        tensors += (self.heads,) if self.heads is not None else ()
        return sum(t.numel() * t.element_size() for t in tensors)


def shard_adapter(weights, rank: int, size: int, spec: ModelSpec | None = None):
    """The rank's slice of an adapter's factors: A rows [L, r, d_in] cut along d_in and B^T rows
    [L, r, d_out] cut along d_out, for every target (``execution.tp``'s docstring says why both),
    its vector rows like B^T. A fused target's B^T (Phi-3's qkv, gate_up; ``spec`` gives the
    sizes) is cut part by part, the rank's q | k | v columns side by side as in its shard of
    the fused projection."""
    parts = {}
    if spec is not None:
        kv, inter = spec.kv_dim, spec.intermediate_size
        parts = {"qkv": (spec.q_dim, kv, kv), "gate_up": (inter, inter)}

    def cut(rows: torch.Tensor, target: str | None = None) -> torch.Tensor:
        pieces = rows.split(parts[target], dim=2) if target in parts else (rows,)
        return torch.cat([p.chunk(size, dim=2)[rank] for p in pieces], dim=2).contiguous()

    return AdapterWeights(
        a={t: cut(a) for t, a in weights.a.items()},
        b_t={t: cut(b, t) for t, b in weights.b_t.items()},
        vectors={t: cut(v, t) for t, v in weights.vectors.items()},
    )


def load_weights(info: AdapterInfo, spec: ModelSpec, stack: bool = True) -> AdapterWeights:
    """Read an adapter's factors into host memory, stacked over layers (``stack=False``: a list
    of each layer's tensor per factor, B^T rows as views, for ``to_pages`` to place with no
    stacked copy in between). Expert targets come as ``expert_weights`` lays them out."""
    dense = [t for t in info.targets if t not in info.expert_ranks]
    empty = lambda: {t: [None] * spec.num_layers for t in dense}
    factors: dict[str, dict[str, list[torch.Tensor | None]]] = {"A": empty(), "B": empty()}
    for factor, wanted in (("bias", info.lora_bias), ("magnitude", info.dora)):
        if wanted:
            factors[factor] = empty()
    experts = ExpertRows(info, spec)
    on_heads: dict[str, torch.Tensor] = {}  # "embed_tokens.A" -> tensor
    try:
        with safe_open(str(info.path / WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                if BASE_COPY_KEY.search(key):  # the base model's own (``check_base_copies``)
                    continue
                tensor = f.get_tensor(key)
                if spec.num_experts and experts.add(key, tensor):
                    continue
                if is_head_key(key):
                    on_heads[".".join(head_factor(key))] = tensor
                    continue
                layer, module, factor = lora_key(key)
                factors[factor][_MODULE_TO_TARGET[module]][layer] = _rows(factor, tensor)
        expert_a, expert_b = experts.rows() if info.experts else ({}, {})
    except Exception as exc:
        raise AdapterError(info.name, info.path, f"cannot read weights: {exc}") from exc
    _fill_absent_layers(info, spec, factors)
    a, b = factors["A"], factors["B"]
    a.update(expert_a)
    b.update(expert_b)
    vectors = _vector_layers(factors)
    heads = head_block(info.heads, on_heads) if info.heads else None
    if not stack:
        return AdapterWeights(a=a, b_t=b, vectors=vectors, heads=heads)  # type: ignore[arg-type]
    return AdapterWeights(a=_stacked(a), b_t=_stacked(b), vectors=_stacked(vectors), heads=heads)


def _rows(factor: str, tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as the rows its factor takes in pages: A [r, d_in] as it is, B [d_out, r] as
    B^T [r, d_out] (a view), a bias or a magnitude [d_out] as one row; a magnitude's row is
    followed by one of zeros, where the residency writes DoRA's c beside its g."""
    if factor == "A":
        return tensor
    if factor == "B":
        return tensor.t()
    row = tensor[None, :]
    return row if factor == "bias" else torch.cat([row, torch.zeros_like(row)])


def _vector_layers(factors: dict) -> dict[str, list[torch.Tensor]]:
    """Each target's vector rows per layer: its bias row, or its two DoRA rows (an adapter has
    one or the other: ``_refusal``); none without either."""
    kinds = [factors[k] for k in ("bias", "magnitude") if k in factors]
    if not kinds:
        return {}
    rows = {}
    for target, layers in kinds[0].items():
        rows[target] = [torch.cat([kind[target][i] for kind in kinds]) for i in range(len(layers))]
    return rows


def _stacked(factors: dict[str, list[torch.Tensor] | torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each target's layers as one [L, r, width] tensor, r the largest rank of its layers, the
    rows past a layer's own rank zeros (expert targets come stacked already)."""
    out = {}
    for target, layers in factors.items():
        if isinstance(layers, torch.Tensor):
            out[target] = layers
            continue
        rank = max(t.shape[0] for t in layers)
        out[target] = torch.stack([F.pad(t, (0, 0, 0, rank - t.shape[0])) for t in layers])
    return out


def _fill_absent_layers(info: AdapterInfo, spec: ModelSpec, factors: dict) -> None:
    """Empty rows in the layers a target is not in (a router in a MoE model's dense layers, a
    layer ``layers_to_transform`` leaves out); raises naming the layers where a factor
    (``factors``: "A", "B", "bias" -> target -> its layers' rows) is missing from one it is
    in."""
    for factor, targets in factors.items():
        for target, layers in targets.items():
            ranks, _ = info.module_ranks(target, spec.num_layers)
            present = [i for i in spec.target_layers(target) if ranks[i] > 0]
            missing = [i for i in present if layers[i] is None]
            if missing:
                kind = {"A": "lora_A", "B": "lora_B", "bias": "lora_B bias"}.get(
                    factor, "lora_magnitude_vector"
                )
                raise AdapterError(
                    info.name,
                    info.path,
                    f"no {kind} weights of {target} in layers {missing[:8]} of {spec.num_layers}",
                )
            some = layers[present[0]]
            for i, tensor in enumerate(layers):
                if tensor is None:
                    layers[i] = some.new_zeros(0, some.shape[1])


def vector_rows(info: AdapterInfo) -> int:
    """Rows of one output channel's width each target of ``info`` takes beside its B^T rows:
    lora_B's bias (1), DoRA's g and c (2)."""
    return int(info.lora_bias) + 2 * int(info.dora)


def adapter_pages(info: AdapterInfo, spec: ModelSpec, fp8: int = 0) -> int:
    """Pages an adapter takes in ``spec``'s pool: each target at its largest rank over layers
    (a page spans every layer), the expert targets as ``ModelSpec.adapter_pages`` counts them.
    ``fp8``: the sub-pages a page holds when the A and B^T rows are e4m3 (``adapter_dtype:
    fp8``, ``slora_kernels.lora_fp8``: the pool's element bytes; the rows' scales besides); 0:
    the model dtype."""
    experts = tuple(t for t in info.targets if t in info.expert_ranks)
    pages = spec.adapter_pages(info.rank, experts, info.expert_ranks) if experts else 0
    for target in info.targets:
        if target not in info.expert_ranks:
            rank = max(info.module_ranks(target, spec.num_layers)[0])
            pages += _factor_pages(rank, spec.target_dims(target), spec, fp8)
            pages += vector_rows(info) * spec.pages_per_row(spec.target_dims(target)[1])
    return pages + head_pages(info.heads, spec)


def _factor_pages(rank: int, dims: tuple[int, int], spec: ModelSpec, fp8: int) -> int:
    """Pages of one target's A and B^T rows: in the model dtype, or e4m3 with their scales
    (``fp8`` sub-pages a page)."""
    if not fp8:
        return rank * (spec.pages_per_row(dims[0]) + spec.pages_per_row(dims[1]))
    return sum(lora_fp8.factor_pages(rank, width, spec.page_size, fp8) for width in dims)


@dataclass
class PagedAdapter:
    """An adapter laid out the way it sits in the pool: ``data[layer, i]`` goes to the adapter's
    i-th page. Per target (canonical order) the A rows, then the B^T rows, then its vector rows
    (lora_B's bias, or DoRA's two rows), each row padded to whole pages; an expert target's are
    E blocks of its rank, expert by expert (``expert_weights``). ``offsets[target, 0 or 1]`` is
    the first page index of A or B^T (-1: absent), ``vectors[target, 0 or 1]`` that of the bias
    row or of the DoRA rows (-1: none; ``LoraMeta.slot_vectors``). After them all, the head
    block (LoRA on embed_tokens and lm_head, ``head_weights``) from page ``head_start`` on (-1:
    none), its elements laid over the layers of those pages one layer after the other. With fp8
    rows (``AdapterStore.fp8``) each A and B^T factor of a target other than the experts' is
    e4m3 in sub-pages, its row scales in the pages just before ``offsets`` points
    (``slora_kernels.lora_fp8``)."""

    info: AdapterInfo
    data: torch.Tensor  # [L, num_pages, page_size], pinned when a GPU is used
    offsets: torch.Tensor  # [len(TARGETS), 2] int32
    vectors: torch.Tensor  # [len(TARGETS), 2] int32
    # Under tensor parallelism, a DoRA adapter's whole A rows [L, r, d_in] per target: a shard's
    # magnitudes need every input column of B A for its output rows (``residency``).
    whole_a: dict[str, torch.Tensor] = field(default_factory=dict)
    head_start: int = -1

    @property
    def num_pages(self) -> int:
        return self.data.shape[1]

    @property
    def nbytes(self) -> int:
        extra = sum(a.numel() * a.element_size() for a in self.whole_a.values())
        return self.data.numel() * self.data.element_size() + extra


def to_pages(
    info: AdapterInfo,
    weights: AdapterWeights,
    page_size: int,
    dtype: torch.dtype,
    pin: bool = False,
    num_layers: int = 0,
    fp8: bool = False,
) -> PagedAdapter:
    """Pads each factor's rows to whole pages, in page order, written straight into one
    (pinned) buffer: each factor is copied once, only the pad rows and tails are zeroed. A
    factor is a stacked [L, r, width] tensor or a list of each layer's [r_l, width]
    (``load_weights``), taking the rows of the largest r_l. The head block follows them
    (``num_layers``: the pages' layers, for an adapter on the heads alone). ``fp8``: the A and
    B^T rows of the targets other than the experts' in e4m3, each factor's row scales in the
    pages before its first row (``slora_kernels.lora_fp8``); the rest in ``dtype``."""
    offsets = torch.full((len(TARGETS), 2), -1, dtype=torch.int32)
    vectors = torch.full((len(TARGETS), 2), -1, dtype=torch.int32)
    # (rows, first row page, end page, rows taken, pages a row, width, scale pages)
    layout: list[tuple] = []
    subs = lora_fp8.sub_pages(dtype) if fp8 else 0
    for t_index, target in enumerate(TARGETS):
        if target not in info.targets:
            continue
        in_fp8 = subs if target not in info.expert_ranks else 0
        for which, rows in enumerate((weights.a[target], weights.b_t[target])):
            offsets[t_index, which] = _place(layout, rows, page_size, in_fp8)
        if target in weights.vectors:
            start = _place(layout, weights.vectors[target], page_size)
            vectors[t_index] = torch.tensor(vector_starts(info, start, layout[-1][4]))
    cursor = _end(layout)
    num_layers = len(layout[0][0]) if layout else num_layers
    head_start, heads = cursor, weights.heads
    if heads is not None:
        cursor += -(-heads.numel() // (num_layers * page_size))
    data = torch.empty(num_layers, cursor, page_size, dtype=dtype, pin_memory=pin)
    if heads is not None:  # layer-major over the block's pages, as the model gathers them
        block = torch.zeros(num_layers * (cursor - head_start) * page_size, dtype=dtype)
        block[: heads.numel()] = heads
        data[:, head_start:] = block.view(num_layers, cursor - head_start, page_size)
    for rows, start, end, rank, _, width, scales in layout:
        if scales:
            lora_fp8.write_factor(data[:, start - scales : end], scales, rows, rank, width)
        else:
            _write_rows(data[:, start:end], rows, rank, width)
    head_start = head_start if heads is not None else -1
    return PagedAdapter(info, data, offsets, vectors, head_start=head_start)


def _write_rows(pages: torch.Tensor, rows, rank: int, width: int) -> None:
    """A factor's rows into its pages [L, rank * per_row, page_size] of the buffer, each row
    padded with zeros to whole pages; ``rows`` stacked [L, r, width] or each layer's."""
    padded = pages.view(pages.shape[0], rank, -1)
    padded[:, :, width:].zero_()
    if isinstance(rows, torch.Tensor):
        padded[:, :, :width].copy_(rows)
        return
    for layer, tensor in enumerate(rows):
        padded[layer, : tensor.shape[0], :width].copy_(tensor)
        padded[layer, tensor.shape[0] :].zero_()


def _end(layout: list[tuple]) -> int:
    """The page after the last factor of ``layout``."""
    return layout[-1][2] if layout else 0


def _place(layout: list[tuple], rows, page_size: int, fp8: int = 0) -> int:
    """Appends a factor's rows to ``layout`` after the last one; returns its first row page.
    ``fp8``: e4m3 rows, that many sub-pages a page, after their scale pages; 0: the model
    dtype."""
    rank = rows.shape[1] if isinstance(rows, torch.Tensor) else max(t.shape[0] for t in rows)
    width = rows[0].shape[1]
    per_row = -(-width // page_size)
    scales = lora_fp8.scale_pages(rank, page_size, fp8) if fp8 else 0
    start = _end(layout) + scales
    end = start + (-(-rank * per_row // fp8) if fp8 else rank * per_row)
    layout.append((rows, start, end, rank, per_row, width, scales))
    return start


def vector_starts(info: AdapterInfo, start: int, per_row: int) -> tuple[int, int]:
    """(bias row, DoRA rows) of a target whose vector rows begin at page ``start``, rows of
    ``per_row`` pages (-1: none): the bias row first."""
    bias = start if info.lora_bias else -1
    dora = start + int(info.lora_bias) * per_row if info.dora else -1
    return bias, dora


class AdapterStore:
    """All adapters by name: configs parsed on demand, weights kept in host memory in their page
    layout (an LRU bounded by bytes; adapters that share a directory share one copy).

    Disk reads happen on loader threads (``LOADER_THREADS_PINNED``; one without pinning):
    ``load_ahead`` queues the read of an adapter the next rows will need, ``ready`` says
    whether it is in host memory, and ``paged`` returns it, waiting for the loader if its read
    is under way (counted in ``loader_waits``). Only the engine's thread touches the cache; the
    loader threads only read files into new tensors.
    """

    def __init__(
        self,
        spec: ModelSpec,
        sources: dict[str, str | Path] | str | Path | None = None,
        cache_bytes: int = 8 << 30,
        pin: bool = False,
        dtype: torch.dtype = torch.float32,
        shard: tuple[int, int] = (0, 1),
        fp8: bool = False,
    ) -> None:
        self.spec = spec  # the whole model's: adapter files are checked against it
        # (rank, size) under tensor parallelism: this store holds rank's shard of every adapter
        # (``shard_adapter``), laid out in the pages of the shard's spec.
        self.shard = shard
        self.page_spec = spec.shard(shard[1])
        self.ahead_log: list[str] | None = None  # names queued by load_ahead (rank 0 of TP)
        self.sources = resolve_sources(sources)
        self.cache_bytes = cache_bytes
        self.pin = pin
        self.dtype = dtype
        # ``adapter_dtype: fp8``: A and B^T rows in e4m3 with a scale per row (``to_pages``)
        self.fp8 = fp8
        self._infos: dict[str, AdapterInfo] = {}
        self._pages: dict[str, int] = {}  # pages(name), asked for every row and admission
        self._paged: OrderedDict[str, PagedAdapter] = OrderedDict()
        self._paged_bytes = 0
        self._reading: dict[str, Future[PagedAdapter]] = {}  # queued or running on the loader
        self._ahead_bytes = 0  # bytes of the reads in _reading
        self._loader: ThreadPoolExecutor | None = None
        self._keys: dict[str, str] = {}
        self.disk_loads = 0
        self.loader_waits = 0

    @property
    def names(self) -> list[str]:
        return sorted(self.sources)

    def __contains__(self, name: str) -> bool:
        return name in self.sources

    def info(self, name: str) -> AdapterInfo:
        if name not in self._infos:
            if name not in self.sources:
                raise KeyError(f"unknown adapter {name!r} ({len(self.sources)} known)")
            self._infos[name] = parse_adapter(name, self.sources[name], self.spec)
        return self._infos[name]

    def check_all(self) -> tuple[list[AdapterInfo], dict[str, AdapterError]]:
        """``check_adapters`` over the store: the usable ones stay parsed, the broken ones
        leave it (their rows become error rows; the others run)."""
        infos, broken = check_adapters(self.spec, self.sources)
        broken.update(self._unsharded(infos))
        broken.update(self._not_fp8(infos))
        infos = [info for info in infos if info.name not in broken]
        self._infos.update((info.name, info) for info in infos)
        self._pages.clear()
        for name in broken:
            del self.sources[name]
        return infos, broken

    def _unsharded(self, infos: list[AdapterInfo]) -> dict[str, AdapterError]:
        """Why each adapter that has no tensor-parallel cut cannot run on a shard: LoRA on the
        router or the experts (the MoE block's LoRA has none), DoRA on a row-parallel module
        (o, down: a shard holds some input columns of each output row, and the whole row's norm
        rescales the output before the all-reduce that completes it)."""
        if self.shard[1] == 1:
            return {}
        broken = {}
        for info in infos:
            moe = [t for t in info.targets if t == "router" or t in EXPERT_TARGETS]
            rows = [t for t in info.targets if t in ROW_PARALLEL] if info.dora else []
            heads = [h.module for h in info.heads]  # vocab-parallel embedding and lm_head
            reason = (
                f"LoRA on the router or the experts ({', '.join(moe)}) is not supported"
                if moe
                else f"DoRA on the row-parallel {' and '.join(rows)} is not supported"
                if rows
                else f"LoRA on {' and '.join(heads)} is not supported"
            )
            if moe or rows or heads:
                broken[info.name] = AdapterError(
                    info.name, info.path, f"{reason} under tensor_parallel {self.shard[1]}"
                )
        return broken

    def _not_fp8(self, infos: list[AdapterInfo]) -> dict[str, AdapterError]:
        """Why each DoRA adapter cannot run with fp8 rows: its magnitudes' norms are computed
        from the factors in the pool's pages, read in the model dtype (``residency``)."""
        return fp8_refusals(infos) if self.fp8 else {}

    def nearest(self, name: str, n: int = 3) -> list[str]:
        """Known adapter names closest to ``name`` (for "unknown adapter" messages)."""
        return difflib.get_close_matches(name, self.names, n=n, cutoff=0.5)

    def pages(self, name: str) -> int:
        pages = self._pages.get(name)
        if pages is None:
            info = self.info(name)
            subs = lora_fp8.sub_pages(self.dtype) if self.fp8 else 0
            pages = self._pages[name] = adapter_pages(info, self.page_spec, subs)
        return pages

    def nbytes(self, name: str) -> int:
        """Host bytes of an adapter in page layout (known before reading it)."""
        elt = torch.finfo(self.dtype).bits // 8
        return self.pages(name) * self.spec.num_layers * self.page_spec.page_size * elt

    def ready(self, name: str) -> bool:
        """Whether ``paged(name)`` returns without reading the disk or waiting for the loader."""
        key = self._key(name)
        future = self._reading.get(key)
        return key in self._paged or (future is not None and future.done())

    def load_ahead(self, name: str) -> bool:
        """Queue the read of an adapter on the loader thread, unless it is in host memory or
        queued already. Reads start in the order queued. Adapters read ahead and not yet taken by
        ``paged`` may hold at most half the cache's bytes: returns False (nothing queued) when
        this one would pass that, so the caller stops asking for later ones."""
        key = self._key(name)
        if self.ahead_log is not None:
            self.ahead_log.append(name)
        if key in self._paged or key in self._reading:
            return True
        size = self.nbytes(name)
        if self._ahead_bytes + size > self.cache_bytes // 2 and self._reading:
            return False
        if self._loader is None:
            threads = LOADER_THREADS_PINNED if self.pin else 1
            self._loader = ThreadPoolExecutor(threads, thread_name_prefix="slora-adapter-loader")
        self._reading[key] = self._loader.submit(self._read, self.info(name))
        self._ahead_bytes += size
        return True

    def paged(self, name: str) -> PagedAdapter:
        """Host weights in page layout: from the cache, from the loader (waiting for its read if
        it is under way), or read here when nobody asked ahead."""
        key = self._key(name)
        cached = self._paged.get(key)
        if cached is not None:
            self._paged.move_to_end(key)
            return cached
        future = self._reading.pop(key, None)
        if future is not None:
            self._ahead_bytes -= self.nbytes(name)
            if not future.done():
                self.loader_waits += 1
            paged = future.result()  # the loader's AdapterError, if any, raises here
        else:
            paged = self._read(self.info(name))
        self.disk_loads += 1
        self._paged[key] = paged
        self._paged_bytes += paged.nbytes
        while self._paged_bytes > self.cache_bytes and len(self._paged) > 1:
            _, old = self._paged.popitem(last=False)
            self._paged_bytes -= old.nbytes
        return paged

    def close(self) -> None:
        """Stops the loader thread (queued reads are dropped) and empties the cache."""
        if self._loader is not None:
            self._loader.shutdown(wait=True, cancel_futures=True)
            self._loader = None
        self._reading.clear()
        self._ahead_bytes = 0
        self._paged.clear()
        self._paged_bytes = 0

    def _key(self, name: str) -> str:
        """The cache key: the adapter's resolved directory (names sharing one share weights), as
        text (a Path key compares in Python: ~1 us a lookup, a few hundred a step)."""
        key = self._keys.get(name)
        if key is None:
            key = self._keys[name] = str(self.info(name).path.resolve())
        return key

    def _read(self, info: AdapterInfo) -> PagedAdapter:
        sharded = self.shard[1] > 1
        weights = load_weights(info, self.spec, stack=sharded)  # unsharded: no stacked copy
        whole_a = {}
        if sharded:
            if info.dora:
                whole_a = {t: a.to(self.dtype) for t, a in weights.a.items()}
            weights = shard_adapter(weights, *self.shard, spec=self.spec)
        page_size, layers = self.page_spec.page_size, self.spec.num_layers
        paged = to_pages(info, weights, page_size, self.dtype, self.pin, layers, self.fp8)
        paged.whole_a = whole_a
        return paged
