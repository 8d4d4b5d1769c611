"""The engine: requests in, results out, as a lazy iterator over a continuous-batching loop.

Each turn of the loop: pull requests up to ``lookahead`` (``RequestPreparer`` checks and
tokenizes them), queue the next rows' adapter reads, schedule a step, launch it on the device,
then read the previous step's tokens back (``Scheduler.postprocess`` finishes rows and frees
pages) and yield its finished rows. With ``overlap`` the host plans step N+1 while the device
runs step N; N+1 takes N's drawn tokens on the device.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Generator, Iterable, Iterator
from functools import partial
from pathlib import Path

import torch

from slora_batch.engine.adapters.prefetch import AdapterPrefetcher
from slora_batch.engine.config import EngineConfig, SamplingConfig
from slora_batch.engine.counters import EngineCounters
from slora_batch.engine.device import check_fp8_settings, pick_device, pick_dtype, set_cpu_threads
from slora_batch.engine.execution import live_engines
from slora_batch.engine.execution.batch import plan_step
from slora_batch.engine.execution.masks import grammar_masks
from slora_batch.engine.execution.memory import page_bytes
from slora_batch.engine.execution.outputs import Inflight, step_outputs, take_outputs
from slora_batch.engine.execution.parts import EngineParts, build_parts, make_runner
from slora_batch.engine.hub import locate
from slora_batch.engine.models.sample_model import resolve_model
from slora_batch.engine.models.spec import read_spec
from slora_batch.engine.prepare import RequestPreparer
from slora_batch.engine.requests.grammar import GrammarService, tokenizer_info
from slora_batch.engine.requests.request import Request, Result
from slora_batch.engine.requests.results import sequence_result
from slora_batch.engine.requests.tokens import load_tokenizer
from slora_batch.engine.scheduling.scheduler import ScheduledStep, Scheduler

log = logging.getLogger(__name__)


class Engine:
    """One base model, many adapters, one page pool.

    ``Engine(model, adapters=dir_or_mapping, config=EngineConfig(...), sampling=SamplingConfig())``
    then ``for result in engine.generate(requests): ...``. ``model`` and the mapping's paths may
    be Hub names (``org/name[@revision]``, ``hub.locate``).
    It holds device memory until ``close()`` (``with Engine(...) as engine:``) or dropped.
    """

    def __init__(
        self,
        model: str | Path,
        adapters: dict[str, str | Path] | str | Path | None = None,
        config: EngineConfig | None = None,
        sampling: SamplingConfig | None = None,
    ) -> None:
        self._build(model, adapters, config, sampling, EngineParts())

    def _build(
        self,
        model: str | Path,
        adapters: dict[str, str | Path] | str | Path | None,
        config: EngineConfig | None,
        sampling: SamplingConfig | None,
        given: EngineParts,
    ) -> None:
        """The engine from ``given`` parts: ``__init__``'s defaults, or ``assemble``'s."""
        began = time.perf_counter()
        self.config = config = config or EngineConfig()
        located = locate(model, adapters)  # Hub names -> snapshots in the Hugging Face cache
        self.model_path, adapters = resolve_model(located.model), located.adapters
        self.spec = spec = read_spec(self.model_path)
        self.device = pick_device(config.device)
        check_fp8_settings(config, self.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        if self.device.type == "cpu":
            set_cpu_threads(config.cpu_threads)
        self.ops = given.kernels(config.backend, self.device)
        self.max_model_len = min(config.max_model_len or spec.max_context, spec.max_context)
        self.tp = None  # shard(): a model that does not divide for tensor parallelism says so first
        with live_engines.Room(
            str(model),
            spec.shard(config.tensor_parallel),
            config,
            self.dtype,
            self.device,
            self.max_model_len,
            given.weights,
        ) as room:
            if config.tensor_parallel > 1:  # rank 0 of N: the others start and build alongside
                from slora_batch.engine.execution import tp

                self.tp = tp.launch(self.model_path, adapters, config, given)
                self.device = self.tp.device
                room.on_failure(self.tp.close)  # the other ranks stop
            parts = build_parts(
                spec, adapters, config, self.device, self.dtype, self.max_model_len, given, self.tp
            )
            warmup = time.perf_counter()
            self.config = config = parts.config  # max_num_seqs: auto resolved
            self.runner = make_runner(parts, self.ops, self.device, self.max_model_len)
        if self.tp is not None:
            self.runner = tp.TensorParallelRunner(self.runner, self.tp)
        self.store, self.broken, self.model = parts.store, parts.broken, parts.model
        self.pool, self.lora_pool, self.pool_spec = parts.pool, parts.lora_pool, parts.pool_spec
        self.residency = parts.residency
        # A broken adapter among many costs only its own rows (error rows that say why).
        for exc in self.broken.values():
            log.warning("%s; its rows become error rows", exc)
        self.tokenizer = load_tokenizer(self.model_path)
        make_info = partial(tokenizer_info, self.tokenizer, spec, given.grammar_tokens)
        self.grammars = GrammarService(make_info, config.grammar_threads)  # formats' compiler
        self.scheduler = Scheduler(
            config, self.pool, self.residency, spec.eos_token_ids, spec.long_rope_from
        )
        self.prepare = RequestPreparer(
            spec,
            self.store,
            self.broken,
            self.tokenizer,
            sampling or SamplingConfig(),
            self.max_model_len,
            self.scheduler,
            self.grammars,
        )
        warmup_s = time.perf_counter() - warmup
        stream = None
        if config.prefetch and self.device.type == "cuda":
            stream = torch.cuda.Stream(self.device)
        self.prefetcher = AdapterPrefetcher(
            self.scheduler, self.residency, self.store, stream, config.admit_seats
        )
        self._steps = 0  # steps launched
        self._active: weakref.ref | None = None  # the generate() iterator in use
        self._inflight: Inflight | None = None  # the launched step not read back yet
        self._in_step = False  # between scheduling a step and yielding its results
        self.failed: str | None = None  # why the engine refuses further use (a step raised)
        self.counters = EngineCounters()
        self.counters.load_s = time.perf_counter() - began - warmup_s
        self.counters.warmup_s = warmup_s
        self.counters.max_num_seqs = config.max_num_seqs
        self.held_bytes = room.hold(self, self.pool, self.lora_pool)  # until close()
        pages = self.pool.num_pages
        size = page_bytes(self.pool_spec, self.dtype, config.kv_cache_dtype)
        log.info(
            "engine: %s on %s/%s%s, pool %d pages of %d B (%.2f GiB, %d tokens of %s KV), "
            "%d adapters (%d unusable)",
            spec.architecture,
            self.device,
            str(self.dtype).removeprefix("torch."),
            f" x{self.tp.size} (tensor parallel; pool per rank)" if self.tp else "",
            pages,
            size,
            pages * size / 2**30,
            pages // self.pool.kv_pages_per_token,
            "fp8" if self.pool.scales is not None else "model dtype",
            len(self.store.names),
            len(self.broken),
        )

    @property
    def adapter_names(self) -> list[str]:
        return self.store.names

    @property
    def sampling(self) -> SamplingConfig:
        return self.prepare.sampling

    def close(self) -> None:
        """Frees the engine's device memory (pool, CUDA graphs, weights) for a next engine, and
        ends a ``generate`` in use. The engine cannot run afterwards; closing again does nothing."""
        if self.failed == "it was closed":
            return
        if self._active is not None and (active := self._active()) is not None:
            active.close()
        self.failed = "it was closed"
        live_engines.release(self)
        for name in ("runner", "scheduler", "residency", "pool", "lora_pool", "model", "prepare"):
            self.__dict__.pop(name, None)
        self.prefetcher = None
        self.grammars.close()
        self.store.close()
        if self.tp is not None:
            self.tp.close()
            self.tp = None
        live_engines.free_cached(self.device)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Pulls requests lazily (a window of ``lookahead`` ahead) and yields results as they
        finish. Abandoning the iterator (``break``, an exception, ``close()``, or a new
        ``generate`` call, which closes the previous iterator) drops the rows still in the
        engine and releases their pages and adapters; the engine stays usable."""
        if self._active is not None and (previous := self._active()) is not None:
            previous.close()
        if self.failed is not None:
            raise RuntimeError(f"this engine cannot be used again: {self.failed}; build a new one")
        generator = self._generate(iter(requests))
        self._active = weakref.ref(generator)
        return generator

    def _generate(self, source: Iterator[Request]) -> Iterator[Result]:
        self._in_step = False
        try:
            yield from self._loop(source)
        except BaseException as exc:
            if self._in_step and not isinstance(exc, GeneratorExit):
                self._fail(exc)
            raise
        finally:
            if self._inflight is not None and self.failed is None:
                self._inflight.read()  # its pages must not be reused while the device reads them
            self._inflight = None
            dropped = self.scheduler.abort()
            dropped += self.grammars.parked  # rows waiting for their grammar go too
            self.grammars.parked = []
            if dropped:
                log.debug("generate() abandoned: %d rows dropped, their pages freed", len(dropped))

    def _fail(self, exc: BaseException) -> None:
        """A step raised: the scheduler's, the pool's or (tensor parallel) the other ranks'
        state may no longer agree with this one's, so the engine refuses further use; its ranks,
        which may wait in a collective this rank never joins, are stopped now."""
        self.failed = f"its step {self._steps} raised {type(exc).__name__}: {exc}"
        if isinstance(exc, Exception):
            log.error("engine failed: %s", self.failed)
        else:  # a stop (KeyboardInterrupt, SIGTERM's exception): its caller says what it left
            log.debug("engine stopped: %s", self.failed)
        if self.tp is not None:
            self.tp.abort()

    def _loop(self, source: Iterator[Request]) -> Iterator[Result]:
        """Turns until the source is exhausted and every row answered: pull requests, let the
        rows whose grammar compiled join the queue, then run a step (or wait for a grammar)."""
        exhausted = False
        while True:
            if not exhausted:
                exhausted = yield from self._pull(source)
            yield from self._join_compiled()
            self.counters.mark("pull")  # the turn's phases (counters.TURN_PHASES)
            if not self.scheduler.has_work() and self._inflight is None:
                if exhausted and not self.grammars.parked:
                    return
                self.grammars.wait(0.1)  # nothing runs: wait for a grammar (none: returns at once)
                continue
            yield from self._step()

    def _pull(self, source: Iterator[Request]) -> Generator[Result, None, bool]:
        """Pulls requests while the rows held are under ``lookahead``; yields the rows answered
        at once (refused); returns whether ``source`` is exhausted.

        Invariant (data-parallel workers rely on it): a row is pulled only after every result
        read back is yielded, and only while the rows held unanswered (waiting, running, and
        retired: finished at launch, read back after the next step) are under ``lookahead``.
        A source that blocks (a worker's pipe) so never holds back results, and a feeder that
        allows lookahead plus a chunk of rows outstanding always has room for more rows when
        the engine waits on it."""
        sched, grammars = self.scheduler, self.grammars
        while sched.unanswered() + len(grammars.parked) < self.config.lookahead:
            request = next(source, None)
            if request is None:
                return True
            prepared = self.prepare(request)
            if isinstance(prepared, Result):
                self.counters.count_result(prepared)
                yield prepared
            elif prepared.grammar is not None:  # waits for its grammar, not the batch
                grammars.park(prepared)
            else:  # the row's first sequence; its other samples or choices follow it
                sched.add(prepared)
        return False

    def _join_compiled(self) -> Iterator[Result]:
        """Parked rows whose grammar compiled join the queue; those that did not compile are
        yielded as error rows."""
        if not self.grammars.parked:
            return
        ready, failed = self.grammars.take()
        for seq in ready:
            self.scheduler.add(seq)
        for result in failed:
            self.counters.count_result(result)
            yield result

    def _step(self) -> Iterator[Result]:
        """One step: step N+1 is scheduled, prepared and launched while step N (in flight) runs;
        then step N's tokens are read back and its finished rows yielded. Without overlap each
        step completes at once."""
        sched = self.scheduler
        self._in_step, started = True, time.perf_counter()
        self.prefetcher.load_ahead()
        step = sched.schedule() if sched.has_work() else ScheduledStep([], [])
        self.counters.mark("schedule")
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
        self._in_step = False
        self.counters.end_turn(bool(step) and max(step.num_new) == 1)

    def _launch(self, step: ScheduledStep, started: float, prev: Inflight | None) -> Inflight:
        """Plans a step and queues its forward and sampling on the device; returns at once."""
        host = plan_step(step)
        self.prefetcher.order(self.device)
        self._steps += 1
        self.counters.mark("build")
        with torch.inference_mode():
            prepared = time.perf_counter()
            logits = self.runner.forward(host, prev.tokens if prev is not None else None)
            if step.rows is not None:  # every row draws
                drawn = list(step.seqs)
            else:
                drawn = [s for s, row in zip(step.seqs, host.logit_rows, strict=True) if row >= 0]
            # Filled while the forward runs (it does not need them; the sampler does).
            masks = grammar_masks(drawn, prev, self.grammars, logits.device)
            self.counters.count_masks(masks)
            outputs = step_outputs(logits, host, drawn, masks, step.rows)
            if not self.config.overlap:
                self.prefetcher.prefetch()  # overlaps the step running on the GPU
        self.scheduler.launched(step, drawn, self._steps)
        launched = Inflight(self._steps, step, host, drawn, outputs, started, prepared - started)
        if outputs and self.device.type == "cuda":
            launched.copy_to_host()
        self.counters.mark("launch")
        return launched

    def _complete(self, done: Inflight, next_started: float | None) -> Iterator[Result]:
        """Reads a step's tokens back (waiting for the device) and yields the rows it finished."""
        outputs = done.read()
        tokens = outputs["tokens"].tolist() if "tokens" in outputs else []
        take_outputs(done.host, done.step.seqs, done.drawn, outputs, tokens)
        self.counters.mark("wait")
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
        finished = self.scheduler.postprocess(done.number, done.drawn, tokens, done.step)
        self.counters.mark("commit")
        for seq in finished:
            result = sequence_result(seq, self.tokenizer)
            if result is None:  # a choice of a row whose other choices are still running
                continue
            self.counters.count_result(result)
            yield result
        self.counters.skip()  # the caller's time between results
        if self.config.overlap:
            # Pages free now are used by no step in flight (held ones are not free yet).
            self.prefetcher.prefetch()
        self.counters.mark("commit")

    def prompt_logits(self, request: Request) -> torch.Tensor:
        """Next-token logits after the request's prompt, fp32 [vocab]: for checking the engine
        against another implementation. Runs alone: the engine must have no other work."""
        if self.scheduler.has_work():
            raise RuntimeError("prompt_logits needs an idle engine")
        seq = self.prepare(request)
        if isinstance(seq, Result):
            raise ValueError(seq.error)
        self.scheduler.add(seq)
        with torch.inference_mode():
            while seq.remaining:
                step = self.scheduler.schedule()
                self.prefetcher.order(self.device)
                logits = self.runner.forward(plan_step(step))
                seq.num_computed += step.num_new[0]
        self.scheduler.finish(seq)
        return logits[0].float()


def assemble(
    model: str | Path,
    adapters: dict[str, str | Path] | str | Path | None = None,
    config: EngineConfig | None = None,
    sampling: SamplingConfig | None = None,
    parts: EngineParts | None = None,
) -> Engine:
    """An ``Engine`` built from ``parts`` in place of the defaults: the benchmark's random
    weights and ablations, and tests that need them. Users build ``Engine(...)``."""
    engine = Engine.__new__(Engine)
    engine._build(model, adapters, config, sampling, parts or EngineParts())
    return engine
