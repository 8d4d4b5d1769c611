"""The ``bench`` command. ``cli.py`` registers a lazy ``slora-batch bench`` that hands its
arguments to ``app`` here (so that ``run`` and ``validate`` never import the bench); it also runs
on its own: ``python -m slora_batch.bench.cli --help``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import typer

from slora_batch.bench.bench import PEFT_SYSTEMS, SYSTEMS, BenchConfig, run_bench
from slora_batch.bench.report import markdown
from slora_batch.engine.config import ConfigError
from slora_batch.extras import MissingPackage, require

D = BenchConfig()  # the defaults, written once in BenchConfig


def _ints(text: str | None) -> list[int] | None:
    if text is None or not text.strip():
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None


def bench(
    systems: str = typer.Option(
        ",".join(D.systems),
        help=f"Comma-separated, among {', '.join(SYSTEMS)} (default: all but slora-dora (one "
        "adapter id in four DoRA), job, score, peft-score, the prefix cache's (slora-off, "
        "prefix, prefix-off, samples, samples-separate) and the -par ones; with "
        "--tensor-parallel or --data-parallel above 1: base, slora, base-par and slora-par).",
        show_default=False,
    ),
    adapters: str = typer.Option(
        ",".join(map(str, D.adapters)),
        help="Adapter counts for slora, slora-dora, score, job and the prefix cache's systems.",
    ),
    peft_adapters: str = typer.Option(
        None,
        help="Adapter counts for peft and peft-score, each <= 100 (none: the --adapters counts "
        "up to 100).",
    ),
    ablation_adapters: str = typer.Option(
        None,
        help="Adapter counts for bmm, no-unified and arrival (none: --adapters).",
    ),
    requests: int = typer.Option(D.requests, help="Requests in the workload."),
    peft_requests: int = typer.Option(
        D.peft_requests, help="First requests of the workload that peft runs."
    ),
    peft_batch: int = typer.Option(D.peft_batch, help="Rows per padded static batch of peft."),
    skewed: bool = typer.Option(
        D.skewed, "--skewed", help="Adapter popularity power(0.1) instead of power(1)."
    ),
    min_input: int = typer.Option(D.min_input, help="Shortest prompt, tokens."),
    max_input: int = typer.Option(D.max_input, help="Longest prompt, tokens."),
    min_output: int = typer.Option(D.min_output, help="Shortest output, tokens."),
    max_output: int = typer.Option(D.max_output, help="Longest output, tokens."),
    seed: int = typer.Option(D.seed, help="Seed of the workload and the random weights."),
    model_preset: str = typer.Option(
        D.model_preset,
        help="Model shapes: llama2-7b, llama2-70b (GQA), llama3-8b, qwen3-8b, gemma2-9b, "
        "qwen3-30b-a3b (mixture of experts), tiny or tiny-moe.",
    ),
    adapter_targets: str = typer.Option(
        D.adapter_targets,
        help="What the adapters adapt: attention (q, k, v, o; ranks 8, 16, 32, 64) or experts "
        "(q, k, v, o and every expert's gate_up and down; ranks 8, 16; a mixture-of-experts "
        "--model-preset, engine systems only).",
    ),
    device: str = typer.Option(D.device, help="auto, cpu or cuda[:N]."),
    backend: str = typer.Option(D.backend, help="Engine kernels: auto, torch or triton."),
    max_num_seqs: str = typer.Option(
        str(D.max_num_seqs), help="Rows at once per engine: auto (sized from the pool) or a number."
    ),
    kv_cache_dtype: str = typer.Option(
        D.kv_cache_dtype, help="Engines' KV cache: auto (the model dtype) or fp8 (e4m3)."
    ),
    weights: str = typer.Option(
        D.weights, help="Engines' base weights: auto or fp8 (per channel, W8A8; LoRA stays bf16)."
    ),
    max_adapters_per_batch: int = typer.Option(
        D.max_adapters_per_batch, help="Engines' adapter cap: distinct adapters running at once."
    ),
    max_seconds: float = typer.Option(
        D.max_seconds, help="Per engine run: stop there and count the work done (0: no limit)."
    ),
    peft_max_seconds: float = typer.Option(
        D.peft_max_seconds, help="Per peft run, the same (0: no limit)."
    ),
    total_seconds: float = typer.Option(
        D.total_seconds,
        help="Skip runs that could end past this many seconds from the start (0: no limit).",
    ),
    warmup_requests: int = typer.Option(
        D.warmup_requests, help="Short warm-up requests per engine run."
    ),
    score_rows: int = typer.Option(D.score_rows, help="Rows of the scoring workload."),
    score_min_context: int = typer.Option(
        D.score_min_context, help="Shortest scoring context, tokens."
    ),
    score_max_context: int = typer.Option(
        D.score_max_context, help="Longest scoring context, tokens."
    ),
    score_choices: int = typer.Option(D.score_choices, help="Choices per scoring row."),
    score_min_choice: int = typer.Option(D.score_min_choice, help="Shortest choice, tokens."),
    score_max_choice: int = typer.Option(D.score_max_choice, help="Longest choice, tokens."),
    peft_score_rows: int = typer.Option(
        D.peft_score_rows, help="First scoring rows that peft-score runs."
    ),
    peft_score_batch: int = typer.Option(
        D.peft_score_batch,
        help="Rows per padded batch of peft-score (each row one sequence per choice).",
    ),
    prefix_rows: int = typer.Option(D.prefix_rows, help="Rows of the shared-prefix workload."),
    prefix_tokens: int = typer.Option(
        D.prefix_tokens, help="Tokens of each adapter's shared prefix."
    ),
    prefix_min_suffix: int = typer.Option(
        D.prefix_min_suffix, help="Shortest suffix after the shared prefix, tokens."
    ),
    prefix_max_suffix: int = typer.Option(
        D.prefix_max_suffix, help="Longest suffix after the shared prefix, tokens."
    ),
    prefix_output: int = typer.Option(
        D.prefix_output, help="Output tokens of every shared-prefix row."
    ),
    samples_prompts: int = typer.Option(
        D.samples_prompts, help="Prompts of samples and samples-separate (standard shapes)."
    ),
    samples_n: int = typer.Option(
        D.samples_n, help="Samples per prompt: n of one request (samples) or separate requests."
    ),
    tokenizer: str = typer.Option(
        None,
        help="A tokenizer directory for eval and eval-score (the model's vocabulary becomes "
        "its size).",
        show_default=False,
    ),
    eval_docs: int = typer.Option(D.eval_docs, help="Documents of the eval systems' task."),
    eval_context: int = typer.Option(
        D.eval_context, help="Most words of an eval document's passage."
    ),
    out: str = typer.Option(str(D.out), help="Output directory (rewritten after every run)."),
    tensor_parallel: int = typer.Option(
        D.tensor_parallel, help="Devices per engine of the -par systems (base, slora, job)."
    ),
    data_parallel: int = typer.Option(
        D.data_parallel, help="Engines (workers) of the -par systems."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
) -> None:
    """Benchmark slora against the base model, transformers + PEFT and the ablations; scoring
    through the engine and through PEFT; the prefix cache on and off (benchmarks/README.md)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.DEBUG if verbose else logging.INFO,
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    try:
        config = BenchConfig(
            systems=[s.strip() for s in systems.split(",") if s.strip()],
            adapters=_ints(adapters) or [],
            peft_adapters=_ints(peft_adapters),
            ablation_adapters=_ints(ablation_adapters),
            requests=requests,
            peft_requests=peft_requests,
            peft_batch=peft_batch,
            skewed=skewed,
            min_input=min_input,
            max_input=max_input,
            min_output=min_output,
            max_output=max_output,
            seed=seed,
            model_preset=model_preset,
            adapter_targets=adapter_targets,
            device=device,
            backend=backend,
            max_num_seqs=max_num_seqs,
            kv_cache_dtype=kv_cache_dtype,
            weights=weights,
            max_adapters_per_batch=max_adapters_per_batch,
            max_seconds=max_seconds,
            peft_max_seconds=peft_max_seconds,
            total_seconds=total_seconds,
            warmup_requests=warmup_requests,
            score_rows=score_rows,
            score_min_context=score_min_context,
            score_max_context=score_max_context,
            score_choices=score_choices,
            score_min_choice=score_min_choice,
            score_max_choice=score_max_choice,
            peft_score_rows=peft_score_rows,
            peft_score_batch=peft_score_batch,
            prefix_rows=prefix_rows,
            prefix_tokens=prefix_tokens,
            prefix_min_suffix=prefix_min_suffix,
            prefix_max_suffix=prefix_max_suffix,
            prefix_output=prefix_output,
            samples_prompts=samples_prompts,
            samples_n=samples_n,
            tokenizer=tokenizer,
            eval_docs=eval_docs,
            eval_context=eval_context,
            out=Path(out),
            tensor_parallel=tensor_parallel,
            data_parallel=data_parallel,
            systems_given=systems != ",".join(D.systems),
        )
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    peft_systems = [s for s in config.systems if s in PEFT_SYSTEMS]
    if peft_systems:  # the transformers + PEFT baseline
        try:
            require("peft", f"slora-batch bench --systems {','.join(peft_systems)}")
        except MissingPackage as exc:
            typer.echo(f"error: {exc} (or leave them out of --systems)", err=True)
            raise typer.Exit(1) from None
    rows, meta = run_bench(config)
    typer.echo(markdown(rows, meta))
    typer.echo(
        f"results in {config.out}/ (results.parquet, results.md, summary.json, run.json, throughput.png)"
    )
    failed = [f"{r['system']}@{r['adapters']}" for r in rows if r.get("error")]
    if failed:
        typer.echo(f"failed runs: {', '.join(failed)}", err=True)
        raise typer.Exit(1)


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode="markdown")
app.command(
    help="Run the benchmark workload of benchmarks/README.md through every system (engine "
    "runs, PEFT, ablations) on the same weights and requests; write results.parquet, "
    "results.md, summary.json, run.json and throughput.png."
)(bench)

if __name__ == "__main__":
    app()
