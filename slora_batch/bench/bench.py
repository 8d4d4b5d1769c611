"""``slora-batch bench``: the workload of benchmarks/README.md through every system, in one process.

One random-weight base model (a transformers ``LlamaForCausalLM`` built on the device) serves all
systems: the engine takes its state dict, PEFT wraps the model itself. Adapters: ONE PEFT
directory per distinct rank (``--adapter-targets attention``: 8, 16, 32, 64 on q, k, v, o;
``experts``: 8, 16 on q, k, v, o and every expert of a mixture-of-experts preset), and adapter
id i maps to the directory of the (i % ranks)-th rank; the engine still parses, loads, pages
and evicts each id on its own; ``slora-dora`` maps one id in four (``workload.is_dora``) to a
DoRA directory of its rank instead (the same A and B, and magnitudes). The scoring
systems (``score``, ``peft-score``) run their own rows (``workload.ScoreWorkload``), and the
prefix cache's (``prefix``, ``prefix-off``; ``samples``, ``samples-separate``) theirs
(``workload.PrefixWorkload``; a ``Workload`` of ``samples_prompts``), each made only when one of
them is asked for. Results are rewritten after every run, so a run cut short keeps
what finished (``report.write_outputs``).
"""

from __future__ import annotations

import gc
import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from slora_batch.bench.engine_run import (
    ABLATIONS,
    DORA_SYSTEMS,
    FP8_ADAPTER_SYSTEMS,
    run_engine,
    run_sources,
)
from slora_batch.bench.eval_run import (
    copy_tokenizer,
    run_eval_score,
    run_eval_system,
    tokenizer_vocab,
)
from slora_batch.bench.formatting import brief
from slora_batch.bench.model import ADAPTER_TARGETS, PRESETS, BenchModel, build_model
from slora_batch.bench.prefix_run import PREFIX_ROWS, SAMPLES, run_prefix, run_samples
from slora_batch.bench.report import write_outputs
from slora_batch.bench.roofline import Rates, measure_rates
from slora_batch.bench.run_meta import run_meta
from slora_batch.bench.workload import PrefixWorkload, ScoreWorkload, Workload
from slora_batch.engine.config import MAX_N, check

log = logging.getLogger(__name__)

# slora with one adapter id in four DoRA (bench/engine_run.py; not in the default list), the
# ablations, then the job tool's own path (bench/job_run.py: not in the default list),
# the scoring workload through the engine and through PEFT (bench/score_run.py,
# peft_score_run.py: not in the default list either), the prefix cache's systems
# (bench/prefix_run.py; slora-off: slora with the cache off; not in the default list), then
# base and slora again at --tensor-parallel x --data-parallel (the default when that is > 1),
# and job-par: the job at that layout (not in the default list)
PARALLEL = ("base-par", "slora-par", "job-par")
SCORING = ("score", "peft-score")
PREFIX = ("slora-off", *PREFIX_ROWS, *SAMPLES)
PEFT_SYSTEMS = ("peft", "peft-score")  # transformers + PEFT: --peft-max-seconds, <= 100 adapters
PEFT_MAX_ADAPTERS = 100  # PEFT holds every adapter as modules: more only measures its loading
SYSTEMS = (
    "base",
    "slora",
    *DORA_SYSTEMS,
    *FP8_ADAPTER_SYSTEMS,
    "json",
    "json-free",
    "eval-score",
    "eval",
    "peft",
    *ABLATIONS,
    "job",
    *SCORING,
    *PREFIX,
    *PARALLEL,
)
DEFAULT_SYSTEMS = ("base", "slora", "peft", *ABLATIONS)


@dataclass
class BenchConfig:
    """Every bench setting and its default; the CLI fills this and nothing else."""

    systems: list[str] = field(default_factory=lambda: list(DEFAULT_SYSTEMS))
    adapters: list[int] = field(default_factory=lambda: [1, 10, 100, 1000, 2000])  # slora
    peft_adapters: list[int] | None = None  # None: the `adapters` counts up to 100
    ablation_adapters: list[int] | None = None  # the ABLATIONS' counts; None: `adapters`
    requests: int = 2000
    peft_requests: int = 128  # the first ones of the same workload
    peft_batch: int = 64  # rows of one padded static batch
    min_input: int = 8
    max_input: int = 512
    min_output: int = 8
    max_output: int = 512
    skewed: bool = False  # adapter popularity power(0.1) instead of power(1)
    seed: int = 0
    model_preset: str = "llama2-7b"
    device: str = "auto"  # auto: cuda when available
    backend: str = "auto"  # the engine's kernels (EngineConfig.backend)
    max_num_seqs: int | str = "auto"  # the engines' rows at once (EngineConfig.max_num_seqs)
    kv_cache_dtype: str = "auto"  # the engines' KV pages: auto (the model dtype) or fp8
    weights: str = "auto"  # the engines' base projections: auto or fp8 (W8A8)
    max_adapters_per_batch: int = 256  # the engines' adapter cap (EngineConfig's)
    adapter_targets: str = "attention"  # or "experts" (bench/adapters.py; an MoE preset)
    max_seconds: float = 0.0  # per engine run: stop there, count the work done; 0 = no limit
    peft_max_seconds: float = 0.0  # per peft run, the same; 0 = no limit
    total_seconds: float = 0.0  # skip runs that would start past this; 0 = no limit
    warmup_requests: int = 32  # short requests through each engine before its timed run
    # the scoring workload (score, peft-score): rows of a context and choices, random ids
    score_rows: int = 8000
    score_min_context: int = 64
    score_max_context: int = 1024
    score_choices: int = 4
    score_min_choice: int = 1
    score_max_choice: int = 32
    peft_score_rows: int = 256  # the first rows of the same workload
    peft_score_batch: int = 8  # rows of one padded batch (x score_choices sequences)
    # the shared-prefix workload (prefix, prefix-off): one prefix per adapter, suffixes apart
    prefix_rows: int = 4000
    prefix_tokens: int = 1024
    prefix_min_suffix: int = 32
    prefix_max_suffix: int = 128
    prefix_output: int = 64
    samples_prompts: int = 500  # samples, samples-separate: prompts of the standard shapes,
    samples_n: int = 8  # ... and samples of each
    # the lm-eval sweep (eval, eval-score): a tokenizer directory (the model's vocabulary
    # becomes its size), documents of a local multiple-choice task, words per passage
    tokenizer: str | None = None
    eval_docs: int = 64
    eval_context: int = 120
    out: Path = Path("benchmarks/results")
    tensor_parallel: int = 1  # the layout of the -par systems: devices per engine
    data_parallel: int = 1  # ... and engines (workers)
    systems_given: bool = False  # the CLI's --systems was set (else -par joins when parallel)

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        for name in ("tensor_parallel", "data_parallel"):
            check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        if isinstance(self.max_num_seqs, str) and self.max_num_seqs.isdigit():
            self.max_num_seqs = int(self.max_num_seqs)
        check(
            self.max_num_seqs == "auto"
            or isinstance(self.max_num_seqs, int)
            and self.max_num_seqs >= 1,
            f"max_num_seqs must be auto or an integer >= 1, got {self.max_num_seqs!r}",
        )
        parallel = self.tensor_parallel * self.data_parallel > 1
        if parallel and not self.systems_given:
            self.systems = ["base", "slora", "base-par", "slora-par"]
        check(
            parallel or not set(PARALLEL) & set(self.systems),
            f"systems {', '.join(PARALLEL)} need --tensor-parallel or --data-parallel above 1",
        )
        unknown = sorted(set(self.systems) - set(SYSTEMS))
        check(
            not unknown and bool(self.systems),
            f"systems must be among {', '.join(SYSTEMS)}, got {self.systems!r}",
        )
        for name in ("adapters", "peft_adapters", "ablation_adapters"):
            value = getattr(self, name)
            check(
                value is None
                or (bool(value) and all(isinstance(n, int) and n >= 1 for n in value)),
                f"{name} must be a non-empty list of integers >= 1, got {value!r}",
            )
        check(
            not self.peft_adapters or max(self.peft_adapters) <= PEFT_MAX_ADAPTERS,
            f"peft_adapters must be <= {PEFT_MAX_ADAPTERS}, got {self.peft_adapters}",
        )
        check(
            1 <= self.min_input <= self.max_input,
            f"need 1 <= min_input <= max_input, got {self.min_input}, {self.max_input}",
        )
        check(
            1 <= self.min_output <= self.max_output,
            f"need 1 <= min_output <= max_output, got {self.min_output}, {self.max_output}",
        )
        check(
            1 <= self.score_min_context <= self.score_max_context,
            "need 1 <= score_min_context <= score_max_context, got "
            f"{self.score_min_context}, {self.score_max_context}",
        )
        check(
            1 <= self.score_min_choice <= self.score_max_choice,
            "need 1 <= score_min_choice <= score_max_choice, got "
            f"{self.score_min_choice}, {self.score_max_choice}",
        )
        check(
            1 <= self.prefix_min_suffix <= self.prefix_max_suffix,
            "need 1 <= prefix_min_suffix <= prefix_max_suffix, got "
            f"{self.prefix_min_suffix}, {self.prefix_max_suffix}",
        )
        check(
            1 <= self.samples_n <= MAX_N,
            f"samples_n must be from 1 to {MAX_N}, got {self.samples_n}",
        )
        for name in (
            "requests",
            "peft_requests",
            "peft_batch",
            "score_rows",
            "score_choices",
            "peft_score_rows",
            "peft_score_batch",
            "prefix_rows",
            "prefix_tokens",
            "prefix_output",
            "samples_prompts",
            "eval_docs",
            "eval_context",
        ):
            check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        check(
            self.warmup_requests >= 0, f"warmup_requests must be >= 0, got {self.warmup_requests}"
        )
        for name in ("max_seconds", "peft_max_seconds", "total_seconds"):
            check(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        check(
            self.model_preset in PRESETS,
            f"model_preset must be one of {', '.join(PRESETS)}, got {self.model_preset!r}",
        )
        self._check_adapter_targets()
        check(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            f"device must be auto, cpu or cuda[:N], got {self.device!r}",
        )
        check(
            not {"eval", "eval-score"} & set(self.systems) or self.tokenizer is not None,
            "systems eval and eval-score need --tokenizer (a directory with a tokenizer)",
        )
        check(
            self.tokenizer is None or Path(self.tokenizer).is_dir(),
            f"tokenizer must be a directory, got {self.tokenizer!r}",
        )

    def _check_adapter_targets(self) -> None:
        """Expert adapters need a mixture-of-experts preset, and run on the engine alone:
        transformers + PEFT batches adapters on the fused expert parameters one at a time. The
        DoRA adapters (slora-dora) are written on q, k, v, o only, beside the attention ones."""
        check(
            self.adapter_targets in ADAPTER_TARGETS,
            f"adapter_targets must be one of {', '.join(ADAPTER_TARGETS)}, "
            f"got {self.adapter_targets!r}",
        )
        check(
            self.adapter_targets == "attention" or not set(DORA_SYSTEMS) & set(self.systems),
            f"{', '.join(DORA_SYSTEMS)} runs DoRA adapters on q, k, v, o: leave it out of systems "
            f"with adapter_targets {self.adapter_targets}",
        )
        if self.adapter_targets != "experts":
            return
        check(
            "num_experts" in PRESETS[self.model_preset],
            "adapter_targets experts needs a mixture-of-experts model_preset "
            f"({', '.join(p for p, f in PRESETS.items() if 'num_experts' in f)}), "
            f"got {self.model_preset!r}",
        )
        peft = sorted(set(PEFT_SYSTEMS) & set(self.systems))
        check(
            not peft,
            f"adapter_targets experts runs the engine's systems; leave {', '.join(peft)} out "
            "of systems (PEFT mixes no adapters on the experts in one batch)",
        )

    def plan(self) -> list[tuple[str, int]]:
        """(system, adapter count) of every run, in run order; base runs once, at 0 adapters."""
        counts = {
            "base": [0],
            "slora": self.adapters,
            "slora-dora": self.adapters,  # slora's requests, one adapter id in four DoRA
            "slora-fp8a": self.adapters,  # slora's requests and adapters, A and B in e4m3
            "json": self.adapters,  # bench/json_run.py: slora's requests under a JSON schema
            "json-free": self.adapters,  # json's requests at json's lengths, unconstrained
            "eval-score": self.adapters,  # bench/eval_run.py: the lm-eval sweep's rows alone
            "eval": self.adapters,  # ... and the sweep itself
            "peft": self.peft_adapters
            or [n for n in self.adapters if n <= PEFT_MAX_ADAPTERS]
            or [min(min(self.adapters), PEFT_MAX_ADAPTERS)],
        }
        counts.update(dict.fromkeys(ABLATIONS, self.ablation_adapters or self.adapters))
        counts.update({"base-par": [0], "slora-par": self.adapters})
        counts["job"] = counts["job-par"] = self.ablation_adapters or self.adapters
        counts.update({"score": self.adapters, "peft-score": counts["peft"]})
        counts.update(dict.fromkeys(PREFIX, self.adapters))
        return [(s, n) for s in SYSTEMS if s in self.systems for n in sorted(set(counts[s]))]


@dataclass
class BenchContext:
    """What every run shares: the model, its directory, the adapters, the workload, the rates."""

    config: BenchConfig
    model: BenchModel
    rank_dirs: dict[int, Path]
    workload: Workload
    rates: Rates
    score_workload: ScoreWorkload | None = None  # only when a scoring system runs
    prefix_workload: PrefixWorkload | None = None  # only when prefix or prefix-off runs
    samples_workload: Workload | None = None  # only when samples or samples-separate runs
    json_lengths: dict[int, dict[int, int]] = field(default_factory=dict)  # json's, per count
    dora_dirs: dict[int, Path] = field(default_factory=dict)  # rank -> DoRA directory (slora-dora)


def run_bench(config: BenchConfig) -> tuple[list[dict], dict]:
    """Runs the plan and writes its outputs to ``config.out`` after every run.

    Returns one row per (system, adapters) and the header (date, card, commit, rates, settings).
    """
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    started = time.perf_counter()
    runs = config.plan()
    log.info("bench: %d runs on %s: %s", len(runs), device, ", ".join(f"{s}@{n}" for s, n in runs))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="slora-bench-") as tmp:
        # transformers' model only where PEFT runs: the engines make RandomWeights themselves
        # (the same values on one device, per tensor-parallel rank and per worker)
        hf = bool(set(PEFT_SYSTEMS) & set(config.systems))
        vocab = tokenizer_vocab(config.tokenizer) if config.tokenizer else None
        model = build_model(config.model_preset, device, dtype, Path(tmp), config.seed, hf, vocab)
        if config.tokenizer:  # beside the config: the eval systems' requests need it
            copy_tokenizer(Path(config.tokenizer), model.model_dir)
        rank_dirs = model.write_adapters(
            Path(tmp) / "adapters", config.seed, config.adapter_targets
        )
        dora_dirs = {}
        if set(DORA_SYSTEMS) & set(config.systems):  # beside the plain ones, their A and B
            dora_dirs = model.write_dora_adapters(Path(tmp) / "adapters", config.seed, rank_dirs)
        rates = measure_rates(device, dtype)
        log.info(
            "measured: matmul %.1f TFLOP/s, copy %.2f TB/s",
            rates.matmul_flops_per_s / 1e12,
            rates.copy_bytes_per_s / 1e12,
        )
        workload = Workload.generate(config, model.spec.vocab_size)
        scoring = None
        if set(SCORING) & set(config.systems):
            scoring = ScoreWorkload.generate(config, model.spec.vocab_size)
        prefix = samples = None
        if set(PREFIX_ROWS) & set(config.systems):
            prefix = PrefixWorkload.generate(config, model.spec.vocab_size)
        if set(SAMPLES) & set(config.systems):
            samples = Workload.generate(config, model.spec.vocab_size, config.samples_prompts)
        meta = run_meta(device, dtype, rates, config, model, list(rank_dirs))
        log.info("setup took %.1f s", time.perf_counter() - started)
        ctx = BenchContext(
            config, model, rank_dirs, workload, rates, scoring, prefix, samples, dora_dirs=dora_dirs
        )
        for system, n in runs:
            if _over_budget(config, system, started):
                log.warning(
                    "skipping %s@%d: --total-seconds %.0f would be exceeded",
                    system,
                    n,
                    config.total_seconds,
                )
                meta["skipped"].append(f"{system}@{n}")
                write_outputs(config.out, rows, meta)
                continue
            rows.append(_run_one(ctx, system, n))
            write_outputs(config.out, rows, meta)
    return rows, meta


def _over_budget(config: BenchConfig, system: str, started: float) -> bool:
    if not config.total_seconds:
        return False
    limit = config.peft_max_seconds if system in PEFT_SYSTEMS else config.max_seconds
    return time.perf_counter() - started + limit > config.total_seconds


def _run_one(ctx: BenchContext, system: str, n: int) -> dict:
    """One run; a failure becomes a row with its error so the other runs still happen."""
    log.info("run %s with %d adapters", system, n)
    try:
        if system == "peft":
            from slora_batch.bench.peft_run import run_peft

            row = run_peft(ctx, n)
        elif system in ("job", "job-par"):
            from slora_batch.bench.job_run import run_job_system

            row = run_job_system(ctx, n, system)
        elif system == "eval-score":
            row = run_eval_score(ctx, n)
        elif system == "eval":
            row = run_eval_system(ctx, n)
        elif system == "score":
            from slora_batch.bench.score_run import run_score

            row = run_score(ctx, n)
        elif system == "peft-score":
            from slora_batch.bench.peft_score_run import run_peft_score

            row = run_peft_score(ctx, n)
        elif system in PREFIX_ROWS:
            row = run_prefix(ctx, system, n)
        elif system in SAMPLES:
            row = run_samples(ctx, system, n)
        else:
            row = run_engine(ctx, system, n)
    except Exception as exc:  # one broken system must not cost the others their run
        log.exception("run %s@%d failed", system, n)
        row = {"system": system, "adapters": n, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        gc.collect()
        if ctx.model.device.type == "cuda":
            torch.cuda.empty_cache()
            log.info(
                "after %s@%d: %.1f GiB allocated on %s (the base model is %.1f GiB)",
                system,
                n,
                torch.cuda.memory_allocated(ctx.model.device) / 2**30,
                ctx.model.device,
                ctx.model.num_params * ctx.model.dtype.itemsize / 2**30,
            )
    row.setdefault("error", None)
    row["weight_sets"] = len(set(run_sources(ctx, system, n).values()))
    row["adapter_targets"] = ctx.config.adapter_targets if n else None
    log.info("%s@%d: %s", system, n, brief(row))
    return row
