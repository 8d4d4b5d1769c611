"""The lm-eval sweep in the bench: ``eval`` and ``eval-score``, the same rows.

The task is a local multiple-choice task in lm-eval's YAML over a JSONL the bench writes
(``write_task``): ``eval_docs`` documents, each a passage of random words and a question with
four answers of 3-12 words; lm-eval asks one loglikelihood request per (document, answer).

- ``eval``: the real sweep, ``slora-batch run`` of a job with ``eval:`` (``eval/sweep.py``):
  lm-eval builds the requests, the job writes them, one engine runs them fanned out over the
  base model and ``n`` adapters (the model and the adapters as directories on disk, as
  ``job`` writes them), Parquet parts, then lm-eval's ``evaluate`` per adapter. Its rows/s
  count the engine rows over the sweep's wall time less the engine's start-up (loading the
  model from disk, capturing CUDA graphs), which ``eval-score`` does not pay either.
- ``eval-score``: the engine alone on the same rows (the sweep's own requests file, built by
  the same ``prepare``), every row for the base model and each adapter, grouped by adapter, as
  ``score`` times its rows: a fresh engine, the untimed warm-up, then the clock.

So ``eval`` / ``eval-score`` rows/s is what the integration costs: lm-eval's request building
and scoring, the job's files, its one engine pass. It runs first so that the Triton kernels it
builds in its warm-up are not counted against ``eval`` (the job has no warm-up groups).

The random model has no tokenizer: ``--tokenizer DIR`` names one (its files are copied beside
the model's config; the model's vocabulary becomes the tokenizer's size, rounded up to 64).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from pathlib import Path

from slora_batch.bench.job_run import write_adapters, write_model
from slora_batch.bench.roofline import Work
from slora_batch.bench.row_fields import figures
from slora_batch.bench.workload import adapter_name
from slora_batch.engine.config import EngineConfig, SamplingConfig
from slora_batch.engine.requests.request import Request
from slora_kernels.builds import BuildLog

TASK = "bench_mc"
CHOICES = 4
TOKENIZER_SKIP = {"config.json", "generation_config.json"}  # the model's, not the tokenizer's
WORDS = (
    "river",
    "stone",
    "light",
    "market",
    "garden",
    "window",
    "letter",
    "winter",
    "morning",
    "signal",
    "harbor",
    "forest",
    "engine",
    "valley",
    "silver",
    "mirror",
    "candle",
    "bridge",
    "orbit",
    "meadow",
    "copper",
    "thunder",
    "lantern",
    "castle",
    "pepper",
    "rocket",
    "island",
    "canvas",
    "velvet",
    "marble",
    "anchor",
    "compass",
    "feather",
    "glacier",
    "hammer",
    "jungle",
    "ladder",
    "magnet",
    "needle",
    "oyster",
    "pillow",
    "quartz",
    "saddle",
    "tunnel",
    "violin",
    "wagon",
    "yarn",
    "zebra",
)
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{passage}}}}\\nQuestion: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
"""


def tokenizer_vocab(source: str | Path) -> int:
    """The model vocabulary that holds the tokenizer's ids: its size rounded up to 64."""
    from transformers import AutoTokenizer

    return -(-len(AutoTokenizer.from_pretrained(str(source))) // 64) * 64


def copy_tokenizer(source: Path, model_dir: Path) -> None:
    """The tokenizer's files (everything but a model's config and weights) into ``model_dir``."""
    for path in Path(source).iterdir():
        if path.is_file() and path.name not in TOKENIZER_SKIP and path.suffix != ".safetensors":
            shutil.copy(path, model_dir / path.name)


def write_task(root: Path, docs: int, context_words: int, seed: int) -> Path:
    """The task directory: ``bench_mc.yaml`` over ``mc.jsonl`` of ``docs`` documents."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    lines = []
    for i in range(docs):
        passage = words(rng.randint(context_words // 2, context_words))
        answers = [words(rng.randint(3, 12)) for _ in range(CHOICES)]
        doc = {
            "passage": passage,
            "question": words(6) + "?",
            "choices": answers,
            "answer": i % CHOICES,
        }
        lines.append(json.dumps(doc) + "\n")
    data = root / "mc.jsonl"
    data.write_text("".join(lines))
    (root / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
    return root


def eval_job(ctx, n: int, model_dir: Path, adapters: Path | None, out: Path):
    """The sweep's job: the bench task, every adapter and the base model, no limit."""
    from slora_batch.jobs.config import JobConfig
    from slora_batch.jobs.eval_keys import REQUESTS_FILE, EvalConfig

    cfg, model = ctx.config, ctx.model
    root = Path(model.model_dir).parent
    task_dir = write_task(root / "eval-task", cfg.eval_docs, cfg.eval_context, cfg.seed)
    return JobConfig(
        name=f"bench-eval-{n}",
        model=str(model_dir),
        adapters=str(adapters) if adapters else None,
        input=str(out / REQUESTS_FILE),  # as an eval job's YAML makes it (eval_job_raw)
        output=str(out),
        fanout="all",
        eval=EvalConfig(tasks=[TASK], include_path=str(task_dir), num_fewshot=0),
        sampling=SamplingConfig(),
        engine=EngineConfig(
            device=str(model.device),
            dtype=str(model.dtype).removeprefix("torch."),
            backend=cfg.backend,
            max_num_seqs=cfg.max_num_seqs,
        ),
    )


def sweep_rows(ctx, n: int) -> list[Request]:
    """The sweep's engine rows (``eval/sweep.prepare`` on the bench's model directory, which
    holds the config and the tokenizer) for the base model and each of ``n`` adapters."""
    from slora_batch.eval.sweep import prepare
    from slora_batch.jobs.eval_keys import REQUESTS_FILE

    root = Path(ctx.model.model_dir).parent
    out = root / f"eval-rows-{n}"
    prepare(eval_job(ctx, n, ctx.model.model_dir, None, out), out)
    rows = [json.loads(line) for line in (out / REQUESTS_FILE).read_text().splitlines()]
    requests = []
    for adapter in [None, *(adapter_name(i) for i in range(n))]:
        for row in rows:
            requests.append(
                Request(
                    id=len(requests),
                    adapter=adapter,
                    prompt_token_ids=row["prompt_token_ids"],
                    continuation_token_ids=row["continuation_token_ids"],
                )
            )
    return requests


def scored_tokens(out: Path) -> int:
    """The fed tokens of one adapter's rows in a sweep's requests file: context and
    continuation less its last token, never fed (``score_run.computed_tokens``)."""
    from slora_batch.jobs.eval_keys import REQUESTS_FILE

    rows = map(json.loads, (out / REQUESTS_FILE).read_text().splitlines())
    return sum(len(r["prompt_token_ids"]) + len(r["continuation_token_ids"]) - 1 for r in rows)


def run_eval_score(ctx, n: int) -> dict:
    """``eval-score``: the sweep's rows straight into a fresh engine, timed like ``score``."""
    from slora_batch.bench.score_run import run_score

    return run_score(ctx, n, sweep_rows(ctx, n), "eval-score")


def run_eval_system(ctx, n: int) -> dict:
    """``eval``: the sweep as a user runs it (``run_job`` of an ``eval:`` job), timed whole."""
    import torch

    from slora_batch.runner import run_job

    cfg, model = ctx.config, ctx.model
    root = Path(model.model_dir).parent
    started = time.perf_counter()
    model_dir = write_model(ctx, root)
    copy_tokenizer(Path(cfg.tokenizer), model_dir)
    adapters = write_adapters(ctx, root, n) if n else None
    out = root / f"eval-{n}"
    shutil.rmtree(out, ignore_errors=True)
    files_s = time.perf_counter() - started
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(model.device)
    began = time.perf_counter()
    with BuildLog() as builds:  # the job has no warm-up: builds past start-up slow its rows
        summary = run_job(eval_job(ctx, n, model_dir, adapters, out))
    wall_s = time.perf_counter() - began
    stats = summary.stats
    startup_s = (stats["load_s"] or 0.0) + (stats["warmup_s"] or 0.0)
    # the engine's start-up begins with the job (eval/early.py): builds ending later are the run's
    run_builds, run_build_s = builds.since(began + startup_s)
    timed_s = wall_s - startup_s  # what eval-score's clock covers, and the integration's work
    rows, errors = summary.rows_this_run, summary.error_rows_this_run
    work = Work()  # every row's context and continuation, as eval-score counts them
    work.add(scored_tokens(out) * (n + 1), 0)
    work.cached_tokens = stats.get("prefix_hit_tokens") or 0  # answers after the first
    metrics = {(r["adapter"], r["metric"]): r["value"] for r in summary.eval_results or []}
    result = dict(
        system="eval",
        adapters=n,
        requests=rows,
        fed=rows,
        finished=rows - errors,
        error_rows=errors,
        length_mismatches=0,
        truncated=False,
        setup_s=startup_s,
        peak_mem_gib=torch.cuda.max_memory_allocated(model.device) / 2**30 if cuda else math.nan,
        tensor_parallel=1,
        data_parallel=1,
        wall_s=timed_s,
        rows_per_s=(rows - errors) / timed_s,
        requests_per_s=(rows - errors) / timed_s,
        output_tokens_per_s=math.nan,
        scored_tokens=work.prompt_tokens,
        scored_tokens_per_s=work.prompt_tokens / timed_s,
        eval_wall_s=wall_s,
        eval_engine_s=stats["engine_s"],
        eval_rest_s=timed_s - stats["engine_s"],  # lm-eval, the job's files, the passes over them
        eval_files_s=files_s,
        eval_metrics=len(metrics),
        prefix_hit_tokens=stats.get("prefix_hit_tokens") or 0,  # beside eval-score's
        disk_loads=stats.get("adapter_disk_loads") or 0,  # one per adapter directory
        kernel_builds=run_builds if builds.available else math.nan,
        kernel_build_s=run_build_s if builds.available else math.nan,
        eval_acc_base=metrics.get((None, "acc"), math.nan),
        decode_batch=math.nan,
        host_share=math.nan,
        decode_host_share=math.nan,
    )
    result.update(
        {
            k: v
            for k, v in figures(ctx, work, rows - errors, timed_s).items()
            if k not in ("output_tokens_per_s", "requests_per_s")
        }
    )
    shutil.rmtree(out, ignore_errors=True)
    return result
