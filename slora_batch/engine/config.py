"""Engine and sampling settings: the one place their defaults are written.

Each dataclass validates itself in ``__post_init__``; ``from_dict`` rejects unknown keys by
name, so the job loader and the CLI can fill them from YAML without repeating a default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting is unknown or out of range; the message names the key."""


def from_dict(cls: type[T], data: dict[str, Any] | None, where: str) -> T:
    """Build dataclass ``cls`` from ``data``, naming ``where`` and the key on an unknown key."""
    data = dict(data or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(names))})"
        )
    try:
        return cls(**data)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


MAX_N = 256  # samples per row at most
AUTO_MIN_SEQS = 16  # max_num_seqs: auto never runs fewer rows at once than this ...
AUTO_MAX_SEQS = 1024  # ... nor more (sampler buffers and CUDA graphs grow with it)


@dataclass
class SamplingConfig:
    """How tokens are drawn. ``Request`` fields of the same names override these per row."""

    max_new_tokens: int = 128  # tokens generated per row at most
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0  # draw from the likeliest tokens whose probabilities sum to this; 1: off
    top_k: int = 0  # 0 means no top-k filter
    seed: int = 0  # a row's draws depend on (seed, id, sample index): not on its batch
    stop: list[str] = field(default_factory=list)  # strings that end a row, cut from its text
    ignore_eos: bool = False  # go on past the end-of-sequence token, up to max_new_tokens
    n: int = 1  # samples per row: outputs sample_index 0 .. n-1, each seeded on its own
    # Structured output for every row without its own (``requests/formats.py``); None: text.
    response_format: dict | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        check(
            isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
            f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}",
        )
        check(
            isinstance(self.temperature, (int, float)) and self.temperature >= 0,
            f"temperature must be >= 0, got {self.temperature!r}",
        )
        check(
            isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
        check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            f"top_k must be an integer >= 0, got {self.top_k!r}",
        )
        check(isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        check(
            isinstance(self.n, int) and not isinstance(self.n, bool) and 1 <= self.n <= MAX_N,
            f"n must be an integer from 1 to {MAX_N}, got {self.n!r}",
        )
        check(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            f"stop must be a list of non-empty strings, got {self.stop!r}",
        )
        check(
            isinstance(self.ignore_eos, bool), f"ignore_eos must be a bool, got {self.ignore_eos!r}"
        )
        check(
            self.response_format is None or isinstance(self.response_format, dict | str),
            f"response_format must be an object, got {self.response_format!r}",
        )


@dataclass
class EngineConfig:
    """Engine knobs. Memory is one page pool shared by KV cache and adapter weights."""

    device: str = "auto"  # "auto" picks cuda when available, else cpu
    dtype: str = "auto"  # "auto": bfloat16 on cuda, float32 on cpu
    kv_cache_dtype: str = "auto"  # "auto": the model dtype; "fp8": e4m3 K/V, one page per token
    # (K and V side by side, pages in groups of 16 positions), scales per token and KV head
    # (``slora_kernels.fp8``); cuda needs sm 8.9+
    adapter_dtype: str = "auto"  # "auto": adapter rows in the model dtype; "fp8": LoRA's A and
    # B rows in e4m3 with a scale per row (``slora_kernels.lora_fp8``): about half the pages of
    # bf16, plus a page of scales per factor; lora_B biases, expert and embed/lm_head LoRA stay
    # in the model dtype, DoRA adapters are refused; cuda needs sm 8.9+
    backend: str = "auto"  # kernels: "torch" (kernels/ref.py) or "triton"; auto: triton on cuda
    # base weights: "auto" as the checkpoint holds them (an FP8 checkpoint stays fp8); "fp8":
    # e4m3 per output channel, activations per token (models/quant.py); LoRA stays in dtype
    weights: str = "auto"
    num_pages: int | None = None  # pool size in pages; None sizes it from memory_fraction
    memory_fraction: float = 0.9  # of free device memory after weights (cuda) for the pool
    cpu_pool_bytes: int = 1 << 30  # pool size on cpu when num_pages is None
    max_num_seqs: int | str = "auto"  # running requests at once; "auto": the rows whose KV
    # at auto_context_tokens fits the pool after the adapters (``execution/seats.py``)
    auto_context_tokens: int = 512  # the context a row is planned at by max_num_seqs: auto
    max_num_batched_tokens: int = 8192  # tokens per step (decode + prefill chunks): large, so
    # the fixed cost of a step (launches, LoRA metadata) is spread over many prefill tokens
    admit_batch: int | None = None  # new requests join a running batch only when this many
    # can join (seats free and room under the adapter cap, or every waiting one), so most steps
    # stay pure decode steps that replay CUDA graphs; None: max_num_seqs // 16 (at least 1); 1
    # admits on every step
    max_adapters_per_batch: int = 256  # adapter clustering cap: distinct adapters running
    max_resident_adapters: int = 1024  # adapter slots on the device
    max_model_len: int | None = None  # context cap; None takes the model's
    host_cache_bytes: int = 8 << 30  # adapter weights kept in host memory (pinned on cuda),
    # least recently used leave first; a loader thread reads the next rows' adapters into it
    cpu_threads: int | None = None  # torch threads on a cpu engine; None: cores - 1 (min 1)
    lookahead: int = 1024  # requests pulled ahead of the running set (clustering window)
    grammar_threads: int = 2  # threads compiling structured-output grammars off the step loop
    cuda_graphs: bool = True  # capture decode steps on cuda
    prefetch: bool = True  # copy the next requests' adapters on a side stream (cuda)
    overlap: bool = True  # schedule and prepare step N+1 while the device runs step N; step
    # N+1 takes step N's sampled tokens on the device (False: one step at a time)
    data_parallel: int = 1  # engine worker processes, one GPU each (cpu: processes sharing
    # the cores); the job process hands them rows and writes their results
    gpus: str | None = None  # "all": data_parallel = the number of visible CUDA devices
    # divided by tensor_parallel
    prefix_caching: bool = True  # keep full blocks of prompt KV for later rows of the adapter
    prefix_block_tokens: int = 16  # tokens per cached block (a multiple of 16 with fp8 KV)
    tensor_parallel: int = 1  # devices per engine (S-LoRA tensor parallelism, ``tp``): rank 0
    # schedules, every rank holds 1/N of the weights, of the KV cache and of each adapter
    worker_timeout_s: float = 300.0  # a data-parallel worker silent this long (or making no
    # step while it holds rows), or a tensor-parallel collective waiting this long on a rank,
    # fails the run naming it (its rows are redone by the next run)

    def __post_init__(self) -> None:
        check(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            f"device must be auto, cpu or cuda[:N], got {self.device!r}",
        )
        check(
            self.dtype in ("auto", "float32", "float16", "bfloat16"),
            f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}",
        )
        check(
            self.weights in ("auto", "fp8"),
            f"weights must be auto or fp8, got {self.weights!r}",
        )
        check(
            self.kv_cache_dtype in ("auto", "fp8"),
            f"kv_cache_dtype must be auto or fp8, got {self.kv_cache_dtype!r}",
        )
        check(
            self.adapter_dtype in ("auto", "fp8"),
            f"adapter_dtype must be auto or fp8, got {self.adapter_dtype!r}",
        )
        check(
            self.backend in ("auto", "torch", "triton"),
            f"backend must be auto, torch or triton, got {self.backend!r}",
        )
        check(
            self.num_pages is None or self.num_pages >= 1,
            f"num_pages must be >= 1, got {self.num_pages}",
        )
        check(
            0 < self.memory_fraction <= 1,
            f"memory_fraction must be in (0, 1], got {self.memory_fraction}",
        )
        for name in (
            "prefix_block_tokens",
            "auto_context_tokens",
            "max_num_batched_tokens",
            "max_adapters_per_batch",
            "max_resident_adapters",
            "lookahead",
            "grammar_threads",
            "cpu_pool_bytes",
            "host_cache_bytes",
        ):
            value = getattr(self, name)
            check(
                isinstance(value, int) and value >= 1,
                f"{name} must be an integer >= 1, got {value!r}",
            )
        check(
            self.kv_cache_dtype != "fp8" or self.prefix_block_tokens % 16 == 0,
            "with kv_cache_dtype fp8 the KV pages come in groups of 16 positions: "
            f"prefix_block_tokens must be a multiple of 16, got {self.prefix_block_tokens}",
        )
        check(
            self.max_num_seqs == "auto"
            or isinstance(self.max_num_seqs, int)
            and not isinstance(self.max_num_seqs, bool)
            and self.max_num_seqs >= 1,
            f"max_num_seqs must be auto or an integer >= 1, got {self.max_num_seqs!r}",
        )
        check(
            self.admit_batch is None
            or isinstance(self.admit_batch, int)
            and 1 <= self.admit_batch <= self.seats_bound,
            f"admit_batch must be an integer in [1, max_num_seqs], got {self.admit_batch!r}",
        )
        check(
            self.cpu_threads is None
            or isinstance(self.cpu_threads, int)
            and not isinstance(self.cpu_threads, bool)
            and self.cpu_threads >= 1,
            f"cpu_threads must be an integer >= 1 or null, got {self.cpu_threads!r}",
        )
        check(
            isinstance(self.data_parallel, int)
            and not isinstance(self.data_parallel, bool)
            and self.data_parallel >= 1,
            f"data_parallel must be an integer >= 1, got {self.data_parallel!r}",
        )
        check(
            isinstance(self.tensor_parallel, int)
            and not isinstance(self.tensor_parallel, bool)
            and self.tensor_parallel >= 1,
            f"tensor_parallel must be an integer >= 1, got {self.tensor_parallel!r}",
        )
        check(
            not (self.device.startswith("cuda:") and self.tensor_parallel > 1),
            f"device {self.device} names one GPU; tensor parallelism takes cuda:0 to "
            f"cuda:{self.tensor_parallel - 1} of the visible devices: use device auto or cuda",
        )
        check(
            isinstance(self.worker_timeout_s, (int, float))
            and not isinstance(self.worker_timeout_s, bool)
            and self.worker_timeout_s > 0,
            f"worker_timeout_s must be a number of seconds > 0, got {self.worker_timeout_s!r}",
        )
        check(self.gpus in (None, "all"), f"gpus must be all or null, got {self.gpus!r}")
        check(
            self.gpus is None or self.data_parallel == 1,
            f"gpus: all picks data_parallel from the visible CUDA devices; do not also set "
            f"data_parallel ({self.data_parallel})",
        )
        check(
            self.gpus is None or self.device != "cpu",
            "gpus: all needs CUDA devices, but device is cpu",
        )
        check(
            not (self.device.startswith("cuda:") and (self.data_parallel > 1 or self.gpus)),
            f"device {self.device} names one GPU; data parallelism gives each worker its own: "
            "use device auto or cuda",
        )
        check(
            self.max_model_len is None or self.max_model_len >= 2,
            f"max_model_len must be >= 2, got {self.max_model_len}",
        )
        check(
            self.max_adapters_per_batch <= self.max_resident_adapters,
            f"max_adapters_per_batch ({self.max_adapters_per_batch}) must not exceed "
            f"max_resident_adapters ({self.max_resident_adapters}): running adapters stay resident",
        )

    @property
    def seats_bound(self) -> int:
        """``max_num_seqs``, or the most rows ``auto`` may resolve to (memory is reserved for
        that many before the pool is sized)."""
        return AUTO_MAX_SEQS if self.max_num_seqs == "auto" else self.max_num_seqs

    @property
    def admit_seats(self) -> int:
        """Free seats that let new requests join a running batch (``admit_batch`` resolved;
        read once ``max_num_seqs`` is a number: the engine resolves ``auto`` when it builds)."""
        return self.admit_batch or max(1, self.seats_bound // 16)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
