"""Counters of an engine run: what tests assert on and what the stats file reports."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

# A loop turn of the engine, in order: pull rows (prepare and queue them), load_ahead and
# schedule, build the step's inputs (plan_step), launch (forward, sampling, read-back copy),
# wait (for the previous step's tokens, and take them), commit (postprocess: finish and free).
TURN_PHASES = ("pull", "schedule", "build", "launch", "wait", "commit")


@dataclass
class EngineCounters:
    steps: int = 0
    max_num_seqs: int = 0  # rows at once (``auto`` resolved; summed over data-parallel workers)
    decode_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    adapter_loads: int = 0
    adapter_evictions: int = 0
    adapters_resident: int = 0
    peak_pages: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    adapter_bytes_copied: int = 0
    graph_steps: int = 0  # decode steps replayed from a CUDA graph
    host_s: float = 0.0  # scheduling and batch preparation, all steps
    step_s: float = 0.0  # wall time of all steps
    decode_host_s: float = 0.0  # the same two for decode-only steps
    decode_step_s: float = 0.0
    # Loop turns that launched a decode-only step, and their host seconds per phase (TURN_PHASES)
    decode_turns: int = 0
    turn_pull_s: float = 0.0
    turn_schedule_s: float = 0.0
    turn_build_s: float = 0.0
    turn_launch_s: float = 0.0
    turn_wait_s: float = 0.0
    turn_commit_s: float = 0.0
    load_s: float = 0.0  # building the engine: weights, tokenizer, adapter headers, pool
    warmup_s: float = 0.0  # kernel compilation and CUDA-graph capture at start
    prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    cached_blocks: int = 0  # prefix blocks in the pool now (in use or idle)
    block_evictions: int = 0  # idle prefix blocks evicted for room
    disk_loads: int = 0  # adapter weight files read into the host cache
    loader_waits: int = 0  # admissions that waited for the loader thread's read
    grammar_steps: int = 0  # steps with a constrained row
    grammar_rows: int = 0  # constrained draws
    grammar_mask_s: float = 0.0  # filling their masks on the host (while the forward runs)
    rows: int = 0
    ok_rows: int = 0
    error_rows: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    _last: float = field(default_factory=time.perf_counter, repr=False)
    _turn: dict = field(default_factory=lambda: dict.fromkeys(TURN_PHASES, 0.0), repr=False)

    def count_step(
        self, step, pool, scheduler, residency, host_s: float, step_s: float, graph: int
    ) -> None:
        self.steps += 1
        self.host_s += host_s
        self.step_s += step_s
        self.graph_steps = graph
        if max(step.num_new) == 1:
            self.decode_steps += 1
            self.decode_host_s += host_s
            self.decode_step_s += step_s
        ones = step.num_new.count(1)
        self.decode_tokens += ones
        self.prefill_tokens += sum(step.num_new) - ones
        self.preemptions = scheduler.preemptions
        self.adapter_loads = residency.loads
        self.adapter_evictions = residency.evictions
        self.adapters_resident = residency.num_resident
        self.peak_pages = pool.peak_used
        self.prefetch_hits = residency.prefetch_hits
        self.prefetch_misses = residency.prefetch_misses
        self.adapter_bytes_copied = residency.bytes_copied
        self.disk_loads = residency.store.disk_loads
        self.loader_waits = residency.store.loader_waits
        cache = scheduler.cache
        if cache is not None:
            self.prefix_hit_tokens = cache.hit_tokens
            self.cached_blocks = len(cache.blocks)
            self.block_evictions = cache.evictions

    def mark(self, phase: str) -> None:
        """The seconds since the last mark are the current loop turn's ``phase``."""
        now = time.perf_counter()
        self._turn[phase] += now - self._last
        self._last = now

    def skip(self) -> None:
        """The seconds since the last mark belong to no phase (the caller's, between results)."""
        self._last = time.perf_counter()

    def end_turn(self, decode: bool) -> None:
        """The turn is over; its phases count when the step it launched is decode-only."""
        if decode:
            self.decode_turns += 1
            for phase, seconds in self._turn.items():
                setattr(self, f"turn_{phase}_s", getattr(self, f"turn_{phase}_s") + seconds)
        self._turn = dict.fromkeys(TURN_PHASES, 0.0)

    def count_masks(self, masks) -> None:
        """A step's grammar masks (``execution.masks.GrammarMasks``, None without any)."""
        if masks is not None:
            self.grammar_steps += 1
            self.grammar_rows += len(masks.rows)
            self.grammar_mask_s += masks.host_s

    def count_result(self, result) -> None:
        self.rows += 1
        if result.finish_reason == "error":
            self.error_rows += 1
        else:
            self.ok_rows += 1
        self.prompt_tokens += result.prompt_tokens
        self.completion_tokens += result.completion_tokens

    def as_dict(self) -> dict:
        out = asdict(self)
        for name in ("started", "_last", "_turn"):
            out.pop(name)
        out["wall_s"] = time.perf_counter() - self.started
        return out
