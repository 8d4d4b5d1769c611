"""The ``slora-batch`` command: argument handling, progress and printing over ``slora_batch``.

Everything a job does lives in ``slora_batch.runner`` and below; this file only turns options
into calls, draws progress (rich bars on a terminal, a plain line every ``--progress-every``
seconds otherwise) and prints summaries. Exit status: 0 every job done; 1 a job failed (one message on
stderr each, no traceback; the jobs after it still ran); 130 interrupted by SIGINT, 143 by
SIGTERM (the message says how many rows are committed and how many a re-run will do).

``run`` and ``validate`` take a job file, or a one-file job: an input file with ``--model``,
``--output`` and job keys as flags (``slora_batch.jobs.quick``). A missing optional package
(``slora_batch.extras``) is one line naming the pip command.
"""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path

import typer

from slora_batch.console import (
    ProgressDisplay,
    err,
    print_error,
    print_report,
    print_stop,
    print_summary,
    setup_logging,
    shown_path,
)
from slora_batch.engine.config import ConfigError
from slora_batch.extras import MissingPackage, require
from slora_batch.jobs.check import JOB_ERRORS, JobError, select_jobs
from slora_batch.jobs.config import JobConfig, load_jobs
from slora_batch.jobs.quick import QuickFlags, is_job_file, quick_job
from slora_batch.jobs.summary import JobFailure, JobSummary
from slora_batch.jobs.validate import VALIDATE_ROWS
from slora_batch.runner import run_jobs, validate_job

app = typer.Typer(
    help="Offline batch inference of one base LLM with many LoRA adapters (S-LoRA design).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # a docstring's lines join into paragraphs, wrapped once
)


def _version() -> str:
    """The installed package's version, else (a source tree on the path) the source's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("slora-batch")
    except PackageNotFoundError:
        from slora_batch import __version__

        return __version__


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"slora-batch {_version()}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print the version and exit.",
    ),
) -> None:
    """Options before the command (--version); the app's help is the Typer's."""


@app.command(
    "bench",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
    help="Benchmark every system on one workload (see benchmarks/README.md; options: "
    "slora-batch bench --help).",
)
def bench(ctx: typer.Context) -> None:
    # Registered lazily: the bench (torch, transformers, PEFT) loads only when it runs.
    from slora_batch.bench.cli import app as bench_app

    bench_app(args=ctx.args, prog_name="slora-batch bench")


JOBS_FILE = typer.Argument(
    ...,
    metavar="JOBS_FILE_OR_INPUT",
    help="Job file (.yaml/.yml): a 'jobs' list and optional 'defaults'; relative paths in it "
    "are relative to the file. Or a one-file job's input (a .jsonl/.parquet file, a directory "
    "of them, or a quoted glob) with --model and --output; its relative paths are relative to "
    "the current directory.",
    show_default=False,
)
LIMIT = typer.Option(
    None,
    "--limit",
    metavar="N",
    help="Only the first N input rows of each job (the job key limit).",
    show_default=False,
)
# The one-file job's flags: each sets the job key of its name (``jobs/quick.py``).
ONE_FILE = "One-file job (an input in place of the job file)"


def _flag(*names: str, text: str, metavar: str | None = None):
    return typer.Option(
        None, *names, help=text, metavar=metavar, show_default=False, rich_help_panel=ONE_FILE
    )


MODEL = _flag(
    "--model",
    "-m",
    text="The base model: a directory, a Hub name org/name[@revision], or "
    "smollm2-135m-instruct (the sample).",
)
ADAPTERS = _flag(
    "--adapters",
    metavar="DIR|NAME=PATH,...",
    text="A directory of PEFT adapter directories "
    "(each one's name is its folder's), or name=path pairs (a path or a Hub name); repeatable.",
)
OUTPUT = _flag("--output", "-o", text="The output directory.")
NAME = _flag("--name", text="The job's name (default: the output directory's name).")
FANOUT = _flag(
    "--fanout",
    metavar="all|NAMES",
    text="Run every row through each adapter: 'all' (the base "
    "model and every adapter) or comma-separated names ('null': the base model).",
)
MAX_NEW_TOKENS = _flag("--max-new-tokens", metavar="N", text="sampling.max_new_tokens.")
TEMPERATURE = _flag("--temperature", metavar="T", text="sampling.temperature.")
SAMPLING = _flag(
    "--sampling",
    metavar="KEY=VALUE",
    text="Any other sampling key (top_p=0.9, seed=1); repeatable.",
)
ENGINE = _flag(
    "--engine",
    metavar="KEY=VALUE",
    text="An engine key (max_model_len=4096, tensor_parallel=2, device=cpu); repeatable.",
)
PROMPT_TEMPLATE = _flag(
    "--prompt-template", text="Builds each prompt from input columns: 'Q: {question}'."
)
APPLY_CHAT_TEMPLATE = typer.Option(
    False,
    "--apply-chat-template",
    help="Send each text prompt as a user turn through the model's chat template.",
    rich_help_panel=ONE_FILE,
)
SYSTEM_PROMPT = _flag("--system-prompt", text="A system turn before each prompt's user turn.")
COLUMN = _flag(
    "--column",
    metavar="KEY=COLUMN",
    text="Read a key from an input column of another name: prompt=question; repeatable.",
)
KEEP_COLUMNS = _flag(
    "--keep-columns",
    metavar="all|NAMES",
    text="Input columns carried to the output: 'all' or comma-separated names.",
)
OUTPUT_FORMAT = _flag(
    "--output-format",
    metavar="parquet|openai",
    text="'openai': also _openai_output.jsonl and "
    "_openai_errors.jsonl, as the OpenAI Batch API writes them.",
)


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread as Python raises KeyboardInterrupt for SIGINT: it
    unwinds the job (the writer commits every finished row) like an interrupt does."""


def _on_sigterm(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise _Terminated


@app.command()
def run(
    jobs_file: str = JOBS_FILE,
    job: str | None = typer.Option(
        None, "--job", "-j", help="Run only the job with this name (default: every job)."
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Delete the job's previous outputs and start over (default: resume, skipping rows "
        "already written; a complete job is left as it is).",
    ),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="Print nothing but errors: no progress, no summary."
    ),
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="Also log debug messages (engine, pool, adapters, parts)."
    ),
    progress_every: float = typer.Option(
        30.0,
        "--progress-every",
        min=0.0,
        help="Seconds between progress lines when stderr is not a terminal (logs of unattended "
        "runs); a terminal shows live bars instead.",
    ),
    ray_address: str | None = typer.Option(
        None,
        "--ray",
        metavar="ADDRESS",
        help="Run on a Ray cluster (needs the 'ray' extra): 'local' starts one on this machine, "
        "'auto' joins the cluster this machine is in, else the cluster's address.",
    ),
    replicas: int = typer.Option(2, "--replicas", min=1, help="With --ray: engine actors."),
    gpus_per_replica: float = typer.Option(
        0.0, "--gpus-per-replica", min=0.0, help="With --ray: GPUs per engine actor (0: CPU)."
    ),
    limit: int | None = LIMIT,
    model: str | None = MODEL,
    adapters: list[str] | None = ADAPTERS,
    output: str | None = OUTPUT,
    name: str | None = NAME,
    fanout: str | None = FANOUT,
    max_new_tokens: int | None = MAX_NEW_TOKENS,
    temperature: float | None = TEMPERATURE,
    sampling: list[str] | None = SAMPLING,
    engine: list[str] | None = ENGINE,
    prompt_template: str | None = PROMPT_TEMPLATE,
    apply_chat_template: bool = APPLY_CHAT_TEMPLATE,
    system_prompt: str | None = SYSTEM_PROMPT,
    column: list[str] | None = COLUMN,
    keep_columns: str | None = KEEP_COLUMNS,
    output_format: str | None = OUTPUT_FORMAT,
) -> None:
    """Run the jobs of JOBS_FILE, or one job: slora-batch run data.jsonl --model M --output OUT.

    Each job streams its input, generates, and writes Parquet parts, _stats.parquet and a
    _SUCCESS marker into its output directory; a re-run resumes, and does nothing for a
    complete job. A job that fails is reported and the next one runs (exit status 1 at the
    end). SIGINT and SIGTERM commit every finished row and exit 130 and 143.
    """
    flags = QuickFlags(
        model=model,
        adapters=adapters or [],
        output=output,
        name=name,
        fanout=fanout,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        sampling=sampling or [],
        engine=engine or [],
        prompt_template=prompt_template,
        apply_chat_template=apply_chat_template,
        system_prompt=system_prompt,
        columns=column or [],
        keep_columns=keep_columns,
        output_format=output_format,
    )
    setup_logging(quiet, verbose)
    jobs = _load(jobs_file, job, flags, limit)
    if ray_address is not None:
        _require("ray", "slora-batch run --ray")
    display = ProgressDisplay(enabled=not quiet, live=err.is_terminal, every_s=progress_every)
    failures: list[JobFailure] = []
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with display:
            outcomes = _outcomes(jobs, overwrite, display, ray_address, replicas, gpus_per_replica)
            for outcome in outcomes:
                display.finish()
                if isinstance(outcome, JobFailure):
                    failures.append(outcome)
                    print_error(outcome.error)
                elif not quiet:
                    _print_outcome(outcome, jobs)
    except (JobError, *JOB_ERRORS) as exc:
        _fail(exc)
    except KeyboardInterrupt:
        _interrupted("SIGINT", display, jobs, 130)
    except _Terminated:
        _interrupted("SIGTERM", display, jobs, 143)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if failures:
        if len(jobs) > 1:
            names = ", ".join(f.job for f in failures)
            print_error(f"{len(failures)} of {len(jobs)} jobs ({names})", "failed")
        raise typer.Exit(1)


def _outcomes(
    jobs: list[JobConfig],
    overwrite: bool,
    display: ProgressDisplay,
    ray_address: str | None,
    replicas: int,
    gpus_per_replica: float,
):
    """Each job's summary or failure as it ends: in this process, or on Ray with --ray."""
    if ray_address is None:
        return run_jobs(jobs, overwrite=overwrite, progress=display.update)
    from slora_batch.ray.job import RaySettings, run_ray_jobs  # ray and the cluster code

    settings = RaySettings(ray_address, replicas, gpus_per_replica)
    return run_ray_jobs(jobs, settings, overwrite=overwrite, progress=display.update)


def _print_outcome(summary: JobSummary, jobs: list[JobConfig]) -> None:
    """A job's summary, and an eval job's lm-eval metrics per adapter."""
    print_summary(summary, next(j for j in jobs if j.name == summary.job))
    if summary.eval_results:
        from slora_batch.console import out
        from slora_batch.eval.report import eval_table

        out.print(eval_table(summary.eval_results))


def _interrupted(name: str, display: ProgressDisplay, jobs, code: int) -> None:
    """Say what the interrupted job holds now: the rows committed (this run's share) and the
    rows a re-run does (those that were in progress among them)."""
    from slora_batch.jobs.stats import committed_rows

    event, text = display.last, "no job had started; nothing was written"
    output = next((j.output for j in jobs if event and j.name == event.job), None)
    if event is not None and output is not None:
        committed = committed_rows(output) if Path(output).is_dir() else 0
        earlier = event.rows_done - event.rows_this_run
        text = (
            f"job {event.job!r} has {committed:,} rows committed in {shown_path(Path(output))} "
            f"({max(committed - earlier, 0):,} of them this run)"
        )
        if event.rows_total is not None:
            text += f"; {max(event.rows_total - committed, 0):,} of {event.rows_total:,} are left"
    print_stop(f"interrupted by {name}: {text}; run the same command again to resume")
    raise typer.Exit(code)


@app.command()
def validate(
    jobs_file: str = JOBS_FILE,
    job: str | None = typer.Option(
        None, "--job", "-j", help="Validate only the job with this name (default: every job)."
    ),
    every: bool = typer.Option(
        False,
        "--all",
        help="Check every input row, not the first 200, and list every row problem, not the "
        "first 10.",
    ),
    per_adapter: bool = typer.Option(
        False,
        "--per-adapter",
        help="List what each adapter changes in the model, a line each (default: a line per "
        "distinct change, with how many adapters have it).",
    ),
    limit: int | None = LIMIT,
    model: str | None = MODEL,
    adapters: list[str] | None = ADAPTERS,
    output: str | None = OUTPUT,
    name: str | None = NAME,
    fanout: str | None = FANOUT,
    max_new_tokens: int | None = MAX_NEW_TOKENS,
    temperature: float | None = TEMPERATURE,
    sampling: list[str] | None = SAMPLING,
    engine: list[str] | None = ENGINE,
    prompt_template: str | None = PROMPT_TEMPLATE,
    apply_chat_template: bool = APPLY_CHAT_TEMPLATE,
    system_prompt: str | None = SYSTEM_PROMPT,
    column: list[str] | None = COLUMN,
    keep_columns: str | None = KEEP_COLUMNS,
    output_format: str | None = OUTPUT_FORMAT,
) -> None:
    """Check the jobs of JOBS_FILE without running them (no engine, no weights; the sample
    model is converted once on its first use, as by run).

    Checks keys, the model config, every adapter against the model (what each changes: which
    modules, on which layers, with LoRA, DoRA, lora_bias, the heads; adapters the engine cannot
    run are listed), the input files and schema, every row's id (repeated (id, adapter)
    rows fail the job) and columns (those neither used nor kept are listed), and a sample of
    rows (tokenized). Exits 1 when a job could not run; row problems are listed (a run writes
    error rows for them) but do not fail validation.
    """
    flags = QuickFlags(
        model=model,
        adapters=adapters or [],
        output=output,
        name=name,
        fanout=fanout,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        sampling=sampling or [],
        engine=engine or [],
        prompt_template=prompt_template,
        apply_chat_template=apply_chat_template,
        system_prompt=system_prompt,
        columns=column or [],
        keep_columns=keep_columns,
        output_format=output_format,
    )
    setup_logging(quiet=False, verbose=False)
    failed = 0
    for config in _load(jobs_file, job, flags, limit):
        try:
            report = validate_job(config, limit=None if every else VALIDATE_ROWS)
        except (JobError, *JOB_ERRORS) as exc:
            print_error(str(exc))
            failed += 1
            continue
        print_report(report, every=every, per_adapter=per_adapter)
    if failed:
        raise typer.Exit(1)


def _load(target: str, name: str | None, flags: QuickFlags, limit: int | None):
    """The jobs of a job file, or the one job of an input file and flags; then (an eval job)
    lm-eval is there."""
    try:
        if is_job_file(target):
            if flags.given():
                raise ConfigError(
                    f"{', '.join(flags.given())}: for a one-file job (an input file in place of "
                    f"the job file); in {target} they are job keys"
                )
            jobs = [_with_limit(job, limit) for job in load_jobs(target)]
        else:
            flags.limit = limit
            jobs = [quick_job(target, flags)]
        jobs = select_jobs(jobs, name)
    except (ConfigError, JobError) as exc:
        _fail(exc)
    for job in jobs:
        if job.eval is not None:
            _require("lm_eval", f"job {job.name!r} (eval)")
    return jobs


def _with_limit(job: JobConfig, limit: int | None) -> JobConfig:
    """``--limit`` over a job file's jobs: their ``limit`` key, checked as the file's is."""
    if limit is None:
        return job
    try:
        return dataclasses.replace(job, limit=limit)
    except ConfigError as exc:
        raise ConfigError(f"--limit {limit}: job {job.name!r}: {exc}") from exc


def _require(module: str, needed_by: str) -> None:
    try:
        require(module, needed_by)
    except MissingPackage as exc:
        _fail(exc)


def _fail(exc: Exception) -> None:
    print_error(str(exc))
    raise typer.Exit(1)


if __name__ == "__main__":
    app()
