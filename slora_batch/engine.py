"""The engine: requests in, results out, as a lazy iterator over a continuous-batching loop."""

from __future__ import annotations

import gc
import itertools
import logging
import os
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch

from slora_batch.adapters import AdapterStore
from slora_batch.batch import plan_step
from slora_batch.config import ConfigError, EngineConfig, SamplingConfig
from slora_batch.loader import load_model
from slora_batch.pool import PagePool
from slora_batch.request import SAMPLING_FIELDS, Request, Result
from slora_batch.residency import AdapterResidency
from slora_batch.runner import ModelRunner, graph_buckets
from slora_batch.sample_model import resolve_model
from slora_batch.sampling import SamplingBatch, row_key, sample
from slora_batch.scheduler import PAGES_PER_TOKEN, ScheduledStep, Scheduler
from slora_batch.sequence import Sequence
from slora_batch.spec import read_spec
from slora_batch.stats import EngineCounters
from slora_batch.tokens import Detokenizer, load_tokenizer, tokenize

log = logging.getLogger(__name__)


@dataclass
class _Inflight:
    """A launched step whose drawn tokens have not been read back."""

    number: int
    step: ScheduledStep
    drawn: list[Sequence]  # the sequences that draw a token, in the order of ``tokens``
    tokens: torch.Tensor | None  # [len(drawn)] int64 on the device
    started: float
    host_s: float
    # On cuda: the tokens copied to pinned host memory, and the event after that copy. Reading
    # them waits for this step alone, not for the step queued after it.
    host_tokens: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None

    def read(self) -> list[int]:
        if self.tokens is None:
            return []
        if self.ready is None:
            return self.tokens.tolist()
        self.ready.synchronize()
        return self.host_tokens.tolist()


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Engine:
    """One base model, many adapters, one page pool.

    ``Engine(model, adapters=dir_or_mapping, config=EngineConfig(...), sampling=SamplingConfig())``
    then ``for result in engine.generate(requests): ...``. ``weights`` (Hugging Face tensor names)
    replaces reading the model directory's safetensors, for benchmarks on random weights.
    """

    def __init__(
        self,
        model: str | Path,
        adapters: dict[str, str | Path] | str | Path | None = None,
        config: EngineConfig | None = None,
        sampling: SamplingConfig | None = None,
        weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        began = time.perf_counter()
        self.config = config or EngineConfig()
        self.sampling = sampling or SamplingConfig()
        self.model_path = resolve_model(model)
        self.spec = read_spec(self.model_path)
        self.device = _pick_device(self.config.device)
        self.dtype = _pick_dtype(self.config.dtype, self.device)
        if self.device.type == "cpu":
            _set_cpu_threads(self.config.cpu_threads)
        self.ops = _pick_backend(self.config.backend, self.device, self.config.lora_layout)
        self.store = AdapterStore(
            self.spec,
            adapters,
            cache_bytes=self.config.host_cache_bytes,
            pin=self.device.type == "cuda",
            dtype=self.dtype,
        )
        # A broken adapter among many costs only its own rows (error rows that say why).
        _, self.broken = self.store.check_all()
        for exc in self.broken.values():
            log.warning("%s; its rows become error rows", exc)
        limit = self.config.max_model_len or self.spec.max_context
        self.max_model_len = min(limit, self.spec.max_context)
        self.model = load_model(self.spec, self.dtype, self.device, self.max_model_len, weights)
        self.tokenizer = load_tokenizer(self.model_path)
        self.pool, self.lora_pool = self._make_pools()
        self.residency = AdapterResidency(
            self.lora_pool, self.store, self.config.max_resident_adapters, self.device
        )
        self.scheduler = Scheduler(
            self.config, self.pool, self.residency, self.spec.eos_token_ids
        )
        use_graphs = (
            self.config.cuda_graphs
            and self.ops.__name__.endswith("triton_ops")
            and self.config.lora_layout == "paged"
        )
        warmup = time.perf_counter()
        self.runner = ModelRunner(
            self.model,
            self.pool,
            self.lora_pool,
            self.residency,
            self.ops,
            self.device,
            self.config.max_num_seqs,
            self.max_model_len,
            use_graphs,
        )
        warmup_s = time.perf_counter() - warmup
        self.prefetch_stream = (
            torch.cuda.Stream(self.device)
            if self.config.prefetch and self.device.type == "cuda"
            else None
        )
        self._prefetched = None  # event the next step waits on after a prefetch
        self._steps = 0  # steps launched
        self._active: weakref.ref | None = None  # the generate() iterator in use
        self._inflight: _Inflight | None = None  # the launched step not read back yet
        self.counters = EngineCounters()
        self.counters.load_s = time.perf_counter() - began - warmup_s
        self.counters.warmup_s = warmup_s
        self._arrivals = 0
        page_bytes = self.spec.num_layers * self.spec.page_size * self.pool.data.element_size()
        log.info(
            "engine: %s on %s/%s, pool %d pages of %d B (%.2f GiB, %d tokens of KV), "
            "%d adapters (%d unusable)",
            self.spec.architecture,
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.pool.num_pages,
            page_bytes,
            self.pool.num_pages * page_bytes / 2**30,
            self.pool.num_pages // PAGES_PER_TOKEN,
            len(self.store.names),
            len(self.broken),
        )

    def close(self) -> None:
        """Frees the engine's device memory (pool, CUDA graphs, weights), so that a next engine
        in this process gets the whole card. The engine cannot run afterwards."""
        for name in ("runner", "scheduler", "residency", "pool", "lora_pool", "model"):
            self.__dict__.pop(name, None)
        self.store.close()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def adapter_names(self) -> list[str]:
        return self.store.names

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Pulls requests lazily (a window of ``lookahead`` ahead) and yields results as they
        finish. Abandoning the iterator (``break``, an exception, ``close()``, or a new
        ``generate`` call, which closes the previous iterator) drops the rows still in the
        engine and releases their pages and adapters; the engine stays usable."""
        previous = self._active() if self._active is not None else None
        if previous is not None:
            previous.close()
        generator = self._generate(iter(requests))
        self._active = weakref.ref(generator)
        return generator

    def _generate(self, source: Iterator[Request]) -> Iterator[Result]:
        try:
            yield from self._loop(source)
        finally:
            if self._inflight is not None:
                self._inflight.read()  # its pages must not be reused while the device reads them
                self._inflight = None
            dropped = self.scheduler.abort()
            if dropped:
                log.info("generate() abandoned: %d rows dropped, their pages freed", len(dropped))
            self._prefetched = None

    def _loop(self, source: Iterator[Request]) -> Iterator[Result]:
        exhausted = False
        sched = self.scheduler
        while True:
            while not exhausted and len(sched.waiting) + len(sched.running) < self.config.lookahead:
                request = next(source, None)
                if request is None:
                    exhausted = True
                    break
                prepared = self._prepare(request)
                if isinstance(prepared, Result):
                    self.counters.count_result(prepared)
                    yield prepared
                else:
                    sched.add(prepared)
            if not sched.has_work() and self._inflight is None:
                if exhausted:
                    return
                continue
            # Step N+1 is scheduled, prepared and launched while step N (in flight) runs; then
            # step N's tokens are read back. Without overlap each step completes at once.
            started = time.perf_counter()
            self._load_ahead()
            step = sched.schedule() if sched.has_work() else ScheduledStep([], [])
            done = self._inflight
            self._inflight = self._launch(step, started, done) if step else None
            if done is not None:
                yield from self._complete(done, started)
            elif self._inflight is None:
                raise RuntimeError(
                    f"no sequence could be scheduled: {len(sched.waiting)} waiting, "
                    f"{self.pool.num_free} of {self.pool.num_pages} pages free"
                )
            if self._inflight is not None and not self.config.overlap:
                done, self._inflight = self._inflight, None
                yield from self._complete(done, None)

    def _launch(self, step: ScheduledStep, started: float, prev: _Inflight | None) -> _Inflight:
        """Plans a step and queues its forward and sampling on the device; returns at once."""
        host = plan_step(step)
        self._wait_prefetched(step)
        self._steps += 1
        with torch.inference_mode():
            prepared = time.perf_counter()
            logits = self.runner.forward(host, prev.tokens if prev is not None else None)
            drawn = [s for s, row in zip(step.seqs, host.logit_rows, strict=True) if row >= 0]
            tokens = None
            if drawn and any(s.temperature > 0 for s in drawn):
                params = SamplingBatch.build(
                    [(s.temperature, s.top_k, s.top_p, s.key, s.num_drawn) for s in drawn],
                    logits.device,
                )
                tokens = sample(logits, params)
            elif drawn:  # all greedy: sample()'s argmax, without building its parameters
                tokens = logits.argmax(dim=-1)
            if self.prefetch_stream is not None and not self.config.overlap:
                self._prefetch()  # overlaps the step running on the GPU
        self.scheduler.launched(step, drawn, self._steps)
        launched = _Inflight(self._steps, step, drawn, tokens, started, prepared - started)
        if tokens is not None and tokens.device.type == "cuda":
            launched.host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            launched.host_tokens.copy_(tokens, non_blocking=True)
            launched.ready = torch.cuda.Event()
            launched.ready.record()
        return launched

    def _complete(self, done: _Inflight, next_started: float | None) -> Iterator[Result]:
        """Reads a step's tokens back (waiting for the device) and yields the rows it finished."""
        tokens = done.read()
        now = time.perf_counter()
        self.counters.count_step(
            done.step,
            self.pool,
            self.scheduler,
            self.residency,
            host_s=done.host_s,
            step_s=(next_started or now) - done.started,
            graph=self.runner.graph_steps,
        )
        for seq in self.scheduler.postprocess(done.number, done.drawn, tokens):
            result = self._result(seq)
            self.counters.count_result(result)
            yield result
        if self.prefetch_stream is not None and self.config.overlap:
            # Pages free now are used by no step in flight (held ones are not free yet).
            self._prefetch()

    def prompt_logits(self, request: Request) -> torch.Tensor:
        """Next-token logits after the request's prompt, fp32 [vocab]: for checking the engine
        against another implementation. Runs alone: the engine must have no other work."""
        if self.scheduler.has_work():
            raise RuntimeError("prompt_logits needs an idle engine")
        seq = self._prepare(request)
        if isinstance(seq, Result):
            raise ValueError(seq.error)
        self.scheduler.add(seq)
        with torch.inference_mode():
            while seq.remaining:
                step = self.scheduler.schedule()
                self._wait_prefetched(step)
                logits = self.runner.forward(plan_step(step))
                seq.num_computed += step.num_new[0]
        self.scheduler.finish(seq)
        return logits[0].float()

    def _wait_prefetched(self, step: ScheduledStep) -> None:
        """Orders the step after the prefetch copies it may read: every copy issued so far
        (prefetch_wait "step"), or only those of the adapters its rows use ("adapter")."""
        if self.prefetch_stream is None:
            return
        stream = torch.cuda.current_stream(self.device)
        if self.config.prefetch_wait == "adapter":
            self.residency.wait_copied({s.adapter for s in step.seqs if s.adapter}, stream)
        elif self._prefetched is not None:
            stream.wait_event(self._prefetched)
            self._prefetched = None

    def _load_ahead(self, adapters: int = 32) -> None:
        """Asks the store's loader thread to read the adapters of the next waiting rows into
        host memory (up to ``adapters`` distinct ones, and the store's byte budget), so that
        neither admission nor the device prefetch reads a file in this loop."""
        seen: set[str] = set()
        for seq in itertools.islice(self.scheduler.waiting, 512):
            if seq.adapter and seq.adapter not in seen:
                if len(seen) == adapters or not self.store.load_ahead(seq.adapter):
                    return
                seen.add(seq.adapter)

    def _prefetch(self) -> None:
        """Copies the adapters of the next waiting requests into free pages on the side stream:
        the distinct adapters of two admission groups (at least 8), so a group that joins the
        batch finds its adapters resident."""
        lookahead = max(8, 2 * self.config.admit_seats)
        loaded: list[str] = []
        seen: set[str] = set()
        for seq in self.scheduler.waiting:
            if len(seen) >= lookahead:
                break
            if seq.adapter and seq.adapter not in seen:
                seen.add(seq.adapter)
                if self.residency.prefetch(seq.adapter, self.prefetch_stream):
                    loaded.append(seq.adapter)
        if loaded:
            event = self.prefetch_stream.record_event()
            self.residency.mark_copying(loaded, event)  # an eviction waits for it, either way
            if self.config.prefetch_wait == "step":
                self._prefetched = event

    def _result(self, seq: Sequence) -> Result:
        if seq.detok is not None and seq.stop:  # fed token by token: its text is cut at the stop
            text = seq.detok.text
        elif self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        else:
            text = ""
        return Result(
            id=seq.request.id,
            adapter=seq.adapter,
            text=text,
            token_ids=list(seq.output_ids),
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            finish_reason=seq.finish_reason,
            extra=seq.request.extra,
        )

    def _prepare(self, request: Request) -> Sequence | Result:
        """Checks and tokenizes one request; a bad one becomes an error result, never an exception."""
        adapter = request.adapter or None
        if adapter is not None and adapter in self.broken:
            return Result.failed(request, f"adapter cannot be used: {self.broken[adapter]}")
        if adapter is not None and adapter not in self.store:
            near = self.store.nearest(adapter)
            hint = f"; nearest: {', '.join(near)}" if near else ""
            return Result.failed(
                request,
                f"unknown adapter {adapter!r} ({len(self.store.names)} adapters known{hint})",
            )
        try:
            params = self._sampling_for(request)
            prompt_ids = self._tokenize(request)
        except (ConfigError, ValueError, TypeError) as exc:
            return Result.failed(request, str(exc))
        n = len(prompt_ids)
        if n == 0:
            return Result.failed(request, "empty prompt")
        if n >= self.max_model_len:
            return Result.failed(
                request,
                f"prompt of {n} tokens does not fit the context of {self.max_model_len} tokens",
                prompt_tokens=n,
            )
        max_new = min(params.max_new_tokens, self.max_model_len - n)
        self._arrivals += 1
        seq = Sequence(
            request=request,
            order=self._arrivals,
            adapter=adapter,
            prompt_ids=prompt_ids,
            max_new_tokens=max_new,
            temperature=float(params.temperature),
            top_k=params.top_k,
            top_p=float(params.top_p),
            key=row_key(params.seed, request.id),
            stop=list(params.stop),
            ignore_eos=params.ignore_eos,
            detok=(
                Detokenizer(self.tokenizer, list(params.stop))
                if self.tokenizer is not None and params.stop
                else None
            ),
        )
        if adapter and self.lora_pool is not self.pool:
            own = self.store.pages(adapter)
            if own > self.lora_pool.num_pages:
                return Result.failed(
                    request,
                    f"adapter needs {own} pages, the adapter pool has {self.lora_pool.num_pages}",
                    prompt_tokens=n,
                )
        need = self.scheduler.pages_for(seq)
        if need > self.pool.num_pages:
            return Result.failed(
                request,
                f"needs {need} pages (prompt {n} + {max_new} new tokens"
                f"{' + adapter' if adapter else ''}), the pool has {self.pool.num_pages}",
                prompt_tokens=n,
            )
        return seq

    def _sampling_for(self, request: Request) -> SamplingConfig:
        merged = asdict(self.sampling)
        merged.update(
            {k: getattr(request, k) for k in SAMPLING_FIELDS if getattr(request, k) is not None}
        )
        return SamplingConfig(**merged)

    def _tokenize(self, request: Request) -> list[int]:
        return tokenize(request, self.tokenizer, self.spec.vocab_size, self.model_path)

    def _make_pools(self) -> tuple[PagePool, PagePool]:
        """One pool for KV and adapters; two (KV, adapters) in the no-unified ablation."""
        total = self._num_pages()
        spec = self.spec
        if self.config.unified_pool:
            pool = PagePool(total, spec.page_size, spec.num_layers, self.dtype, self.device)
            return pool, pool
        adapter_pages = max(1, int(total * self.config.adapter_pool_fraction))
        kv = PagePool(
            total - adapter_pages, spec.page_size, spec.num_layers, self.dtype, self.device
        )
        return kv, PagePool(adapter_pages, spec.page_size, spec.num_layers, self.dtype, self.device)

    def _num_pages(self) -> int:
        if self.config.num_pages is not None:
            return self.config.num_pages
        spec = self.spec
        page_bytes = spec.num_layers * spec.page_size * torch.finfo(self.dtype).bits // 8
        if self.device.type != "cuda":
            return max(1, self.config.cpu_pool_bytes // page_bytes)
        # Memory the caching allocator holds but no tensor uses (an earlier engine's pool, say)
        # is free for this one: the allocator hands it out before asking CUDA for more.
        free, _ = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        reserve = self._reserve_bytes()
        usable = int(free * self.config.memory_fraction) - reserve
        if usable < page_bytes * 64:
            raise RuntimeError(
                f"only {free >> 20} MiB free on {self.device} after the weights, "
                f"{reserve >> 20} MiB of it reserved for activations, sampling and CUDA graphs; "
                f"the pool needs at least {page_bytes * 64 >> 20} MiB "
                f"(lower max_num_batched_tokens, max_num_seqs or max_model_len)"
            )
        log.info(
            "pool: %d MiB free on %s, %d MiB reserved for activations, sampling and CUDA "
            "graphs, %.0f%% of the rest for pages",
            free >> 20,
            self.device,
            reserve >> 20,
            100 * self.config.memory_fraction,
        )
        return usable // page_bytes

    def _reserve_bytes(self) -> int:
        """Device memory the pool leaves for a step's temporaries at the configured limits.

        - Activations of a prefill step of ``max_num_batched_tokens``: q/k/v, the MLP's
          gate/up/act, residuals and norms, each in the model dtype (the widths below, with
          head room for LoRA's shrink outputs and the attention's scratch).
        - Logits and the sampler's temporaries for ``max_num_seqs`` rows: fp32 logits, the
          scaled copy, the sorted copy and its int64 order, the softmax, the cumulative sum and
          masks: about 12 fp32 copies of [rows, vocab].
        - CUDA graphs: one static page table [max_num_seqs, max_model_len, 2] int32 shared by
          every bucket, and each bucket's logits [bucket, vocab] fp32.
        """
        spec, config = self.spec, self.config
        elt = torch.finfo(self.dtype).bits // 8
        width = (
            3 * (spec.q_dim + 2 * spec.kv_dim) + 6 * spec.intermediate_size + 8 * spec.hidden_size
        )
        activations = config.max_num_batched_tokens * width * elt
        sampler = config.max_num_seqs * spec.vocab_size * 4 * 12
        graphs = 0
        if config.cuda_graphs:
            graphs = config.max_num_seqs * self.max_model_len * 2 * 4
            graphs += sum(graph_buckets(config.max_num_seqs)) * spec.vocab_size * 4
        return activations + sampler + graphs


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def _set_cpu_threads(threads: int | None) -> None:
    """torch's intra-op threads for a CPU engine. By default one core is left to the engine's
    own Python thread and the adapter loader: OpenMP workers spin while they wait, so with as
    many workers as cores, any other busy process (or our own threads) stalls every op. On a
    busy 2-core machine a 6-row job took 197 s with 2 workers and 9 s with 1."""
    if threads is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, (cores or 1) - 1)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
        log.info("cpu: %d torch threads", threads)


def _pick_backend(name: str, device: torch.device, lora_layout: str) -> ModuleType:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from kernels import triton_ops as ops
    else:
        from kernels import ref as ops
    if lora_layout == "bmm":  # the ablation: the backend's ops with padded-bmm LoRA
        from kernels import bmm

        mixed = ModuleType(f"{ops.__name__}+bmm")
        mixed.__dict__.update({k: v for k, v in vars(ops).items() if not k.startswith("__")})
        mixed.lora_shrink, mixed.lora_expand = bmm.lora_shrink, bmm.lora_expand
        return mixed
    return ops
