"""PEFT LoRA adapters: parsing, validation against the model, and the CPU store.

The store knows every adapter by name from the start (a directory listing or a mapping) but
reads a config only when asked and weights only when the adapter is first needed; weights stay
in host memory (pinned when a GPU is used) in an LRU bounded by bytes, so thousands fit.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from slora_batch.spec import MODULE_OF, TARGETS, ModelSpec

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.\w+)?\.weight$")
_MODULE_TO_TARGET = {module.split(".")[1]: target for target, module in MODULE_OF.items()}
_EMBEDDING_NAMES = ("embed_tokens", "lm_head", "wte", "embed_out")


class AdapterError(ValueError):
    """An adapter cannot be used; the message names the adapter, its path and the reason."""

    def __init__(self, name: str, path: str | Path, reason: str) -> None:
        self.name, self.path, self.reason = name, str(path), reason
        super().__init__(f"adapter {name!r} ({path}): {reason}")


@dataclass(frozen=True)
class AdapterInfo:
    """What the engine needs of an adapter before loading its weights."""

    name: str
    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...]  # in TARGETS order

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass
class AdapterWeights:
    """Host copies of the factors, per target: A rows [L, r, d_in] and B^T rows [L, r, d_out]."""

    a: dict[str, torch.Tensor]
    b_t: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b_t.values()))


def parse_adapter(name: str, path: str | Path, spec: ModelSpec) -> AdapterInfo:
    """Read and check one PEFT adapter directory (config and safetensors header only)."""
    path = Path(path)
    cfg_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not path.is_dir():
        raise AdapterError(name, path, "no such adapter directory")
    if not cfg_path.is_file():
        raise AdapterError(name, path, f"missing {CONFIG_FILE}")
    if not weights_path.is_file():
        raise AdapterError(name, path, f"missing {WEIGHTS_FILE}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(name, path, f"unreadable {CONFIG_FILE}: {exc}") from exc
    refuse = _refusal(cfg)
    if refuse:
        raise AdapterError(name, path, refuse)
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises several types for a corrupt file
        raise AdapterError(name, path, f"unreadable {WEIGHTS_FILE}: {exc}") from exc
    rank = int(cfg.get("r", 0))
    targets = _check_shapes(name, path, shapes, spec, rank)
    return AdapterInfo(
        name=name,
        path=path,
        rank=rank,
        alpha=float(cfg.get("lora_alpha", rank)),
        use_rslora=bool(cfg.get("use_rslora", False)),
        targets=targets,
    )


def _refusal(cfg: dict) -> str | None:
    """Why PEFT could write this adapter but the engine cannot run it, or None."""
    if cfg.get("peft_type", "LORA") != "LORA":
        return f"peft_type {cfg.get('peft_type')!r} is not LORA"
    if cfg.get("use_dora"):
        return "DoRA adapters (use_dora: true) are not supported"
    if cfg.get("modules_to_save"):
        return (
            f"modules_to_save {cfg['modules_to_save']} is not supported (it replaces base weights)"
        )
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    hit = [t for t in targets if any(e in t for e in _EMBEDDING_NAMES)]
    if hit:
        return f"embedding or lm_head targets {hit} are not supported"
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        return f"LoRA bias ({cfg.get('bias')!r}) is not supported"
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        return "rank_pattern / alpha_pattern (per-module ranks) are not supported"
    if cfg.get("layers_to_transform") is not None:
        return "layers_to_transform (adapters on a subset of layers) is not supported"
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        return f"rank r must be an integer >= 1, got {cfg.get('r')!r}"
    return None


def _check_shapes(
    name: str, path: Path, shapes: dict[str, tuple], spec: ModelSpec, rank: int
) -> tuple[str, ...]:
    seen: dict[str, set[int]] = {}
    for key, shape in shapes.items():
        if any(e in key for e in _EMBEDDING_NAMES):
            raise AdapterError(
                name, path, f"embedding or lm_head weights ({key}) are not supported"
            )
        m = _KEY.search(key)
        if m is None or m.group(3) not in _MODULE_TO_TARGET:
            raise AdapterError(name, path, f"unexpected tensor {key!r} {list(shape)}")
        layer, target, factor = int(m.group(1)), _MODULE_TO_TARGET[m.group(3)], m.group(4)
        d_in, d_out = spec.target_dims(target)
        want = (rank, d_in) if factor == "A" else (d_out, rank)
        if layer >= spec.num_layers or tuple(shape) != want:
            raise AdapterError(
                name,
                path,
                f"tensor {key!r} has shape {list(shape)}, the model "
                f"({spec.num_layers} layers) needs {list(want)} at layers < {spec.num_layers}",
            )
        seen.setdefault(target, set()).add(layer * 2 + (factor == "B"))
    if not seen:
        raise AdapterError(name, path, f"no LoRA tensors in {WEIGHTS_FILE}")
    for target, got in seen.items():
        if len(got) != 2 * spec.num_layers:
            raise AdapterError(
                name,
                path,
                f"target {target} has {len(got)} of "
                f"{2 * spec.num_layers} factors (every layer needs A and B)",
            )
    return tuple(t for t in TARGETS if t in seen)


def load_weights(info: AdapterInfo, spec: ModelSpec) -> AdapterWeights:
    """Read an adapter's factors into host memory, stacked over layers."""
    a: dict[str, list[torch.Tensor | None]] = {t: [None] * spec.num_layers for t in info.targets}
    b: dict[str, list[torch.Tensor | None]] = {t: [None] * spec.num_layers for t in info.targets}
    try:
        with safe_open(str(info.path / WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                m = _KEY.search(key)
                layer, target = int(m.group(1)), _MODULE_TO_TARGET[m.group(3)]
                tensor = f.get_tensor(key)
                if m.group(4) == "A":
                    a[target][layer] = tensor  # [r, d_in]
                else:
                    b[target][layer] = tensor.t()  # [d_out, r] -> [r, d_out]
    except Exception as exc:
        raise AdapterError(info.name, info.path, f"cannot read weights: {exc}") from exc

    return AdapterWeights(
        a={t: torch.stack(v) for t, v in a.items()}, b_t={t: torch.stack(v) for t, v in b.items()}
    )


@dataclass
class PagedAdapter:
    """An adapter laid out the way it sits in the pool: ``data[layer, i]`` goes to the adapter's
    i-th page. Per target (canonical order) the A rows, then the B^T rows, each row padded to
    whole pages. ``offsets[target, 0 or 1]`` is the first page index of A or B^T (-1: absent)."""

    info: AdapterInfo
    data: torch.Tensor  # [L, num_pages, page_size], pinned when a GPU is used
    offsets: torch.Tensor  # [len(TARGETS), 2] int32

    @property
    def num_pages(self) -> int:
        return self.data.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def to_pages(
    info: AdapterInfo,
    weights: AdapterWeights,
    page_size: int,
    dtype: torch.dtype,
    pin: bool = False,
) -> PagedAdapter:
    """Pads each factor's rows to whole pages and concatenates them in page order."""
    offsets = torch.full((len(TARGETS), 2), -1, dtype=torch.int32)
    chunks, cursor = [], 0
    for t_index, target in enumerate(TARGETS):
        if target not in info.targets:
            continue
        for which, rows in enumerate((weights.a[target], weights.b_t[target])):
            num_layers, rank, width = rows.shape
            per_row = -(-width // page_size)
            padded = torch.zeros(num_layers, rank, per_row * page_size, dtype=dtype)
            padded[:, :, :width] = rows
            offsets[t_index, which] = cursor
            chunks.append(padded.view(num_layers, rank * per_row, page_size))
            cursor += rank * per_row
    data = torch.cat(chunks, dim=1)
    return PagedAdapter(info=info, data=data.pin_memory() if pin else data, offsets=offsets)


class AdapterStore:
    """All adapters by name: configs parsed on demand, weights kept in host memory in their page
    layout (an LRU bounded by bytes; adapters that share a directory share one copy).

    Disk reads happen on one loader thread: ``load_ahead`` queues the read of an adapter the
    next rows will need, ``ready`` says whether it is in host memory, and ``paged`` returns it,
    waiting for the loader if its read is under way (counted in ``loader_waits``). Only the
    engine's thread touches the cache; the loader thread only reads files into new tensors.
    """

    def __init__(
        self,
        spec: ModelSpec,
        sources: dict[str, str | Path] | str | Path | None = None,
        cache_bytes: int = 8 << 30,
        pin: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.spec = spec
        self.sources = resolve_sources(sources)
        self.cache_bytes = cache_bytes
        self.pin = pin
        self.dtype = dtype
        self._infos: dict[str, AdapterInfo] = {}
        self._paged: OrderedDict[Path, PagedAdapter] = OrderedDict()
        self._paged_bytes = 0
        self._reading: dict[Path, Future[PagedAdapter]] = {}  # queued or running on the loader
        self._ahead_bytes = 0  # bytes of the reads in _reading
        self._loader: ThreadPoolExecutor | None = None
        self._keys: dict[str, Path] = {}
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

    def validate_all(self) -> list[AdapterInfo]:
        """Parse every adapter; the first incompatible one raises ``AdapterError``."""
        return [self.info(name) for name in self.names]

    def check_all(self) -> tuple[list[AdapterInfo], dict[str, AdapterError]]:
        """Parse every adapter: the usable ones, and why each broken one cannot be used. The
        broken ones leave the store (their rows become error rows; the others run)."""
        infos, broken = [], {}
        for name in self.names:
            try:
                infos.append(self.info(name))
            except AdapterError as exc:
                broken[name] = exc
                del self.sources[name]
        return infos, broken

    def nearest(self, name: str, n: int = 3) -> list[str]:
        """Known adapter names closest to ``name`` (for "unknown adapter" messages)."""
        return difflib.get_close_matches(name, self.names, n=n, cutoff=0.5)

    def pages(self, name: str) -> int:
        info = self.info(name)
        return self.spec.adapter_pages(info.rank, info.targets)

    def nbytes(self, name: str) -> int:
        """Host bytes of an adapter in page layout (known before reading it)."""
        elt = torch.finfo(self.dtype).bits // 8
        return self.pages(name) * self.spec.num_layers * self.spec.page_size * elt

    def ready(self, name: str) -> bool:
        """Whether ``paged(name)`` returns without reading the disk or waiting for the loader."""
        key = self._key(name)
        future = self._reading.get(key)
        return key in self._paged or (future is not None and future.done())

    def load_ahead(self, name: str) -> bool:
        """Queue the read of an adapter on the loader thread, unless it is in host memory or
        queued already. Reads run in the order queued. Adapters read ahead and not yet taken by
        ``paged`` may hold at most half the cache's bytes: returns False (nothing queued) when
        this one would pass that, so the caller stops asking for later ones."""
        key = self._key(name)
        if key in self._paged or key in self._reading:
            return True
        size = self.nbytes(name)
        if self._ahead_bytes + size > self.cache_bytes // 2 and self._reading:
            return False
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="slora-adapter-loader")
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

    def _key(self, name: str) -> Path:
        """The cache key: the adapter's resolved directory (names sharing one share weights)."""
        key = self._keys.get(name)
        if key is None:
            key = self._keys[name] = self.info(name).path.resolve()
        return key

    def _read(self, info: AdapterInfo) -> PagedAdapter:
        weights = load_weights(info, self.spec)
        return to_pages(info, weights, self.spec.page_size, self.dtype, self.pin)


def resolve_sources(sources: dict[str, str | Path] | str | Path | None) -> dict[str, Path]:
    """A directory of adapter directories (name = folder name) or a mapping name -> path."""
    if sources is None:
        return {}
    if isinstance(sources, dict):
        return {str(k): Path(v) for k, v in sources.items()}
    root = Path(sources)
    if not root.is_dir():
        raise AdapterError("*", root, "adapters directory does not exist")
    # Hidden folders (.ipynb_checkpoints, .git, ...) are not adapters.
    return {p.name: p for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith(".")}
