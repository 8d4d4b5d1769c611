"""The ``slora-batch`` command: argument handling, progress and printing over ``slora_batch``.

Everything a job does lives in ``slora_batch.jobs.run``; this file only turns options into calls,
draws progress (rich bars on a terminal, a plain line every ``--progress-every`` seconds
otherwise) and prints summaries. Exit status: 0 every job done; 1 a job failed (one message on
stderr each, no traceback; the jobs after it still ran); 130 interrupted by SIGINT, 143 by
SIGTERM (the message says how many rows are committed and how many a re-run will do).
"""

from __future__ import annotations

import signal
from pathlib import Path

import typer
from rich.markup import escape

from slora_batch.console import (
    ProgressDisplay,
    err,
    print_report,
    print_summary,
    setup_logging,
    shown_path,
)
from slora_batch.engine.config import ConfigError
from slora_batch.jobs.check import JOB_ERRORS, JobError, select_jobs
from slora_batch.jobs.config import load_jobs
from slora_batch.jobs.run import JobFailure, run_jobs
from slora_batch.jobs.validate import VALIDATE_ROWS, validate_job

app = typer.Typer(
    help="Offline batch inference of one base LLM with many LoRA adapters (S-LoRA design).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # a docstring's lines join into paragraphs, wrapped once
)


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
    help="Job file (YAML): a 'jobs' list and optional 'defaults'; relative paths in it are "
    "relative to the file.",
    show_default=False,
)


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread as Python raises KeyboardInterrupt for SIGINT: it
    unwinds the job (the writer commits every finished row) like an interrupt does."""


def _on_sigterm(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise _Terminated


@app.command()
def run(
    jobs_file: Path = JOBS_FILE,
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
) -> None:
    """Run the jobs of JOBS_FILE.

    Each job streams its input, generates, and writes Parquet parts, _stats.parquet and a
    _SUCCESS marker into its output directory; a re-run resumes, and does nothing for a
    complete job. A job that fails is reported and the next one runs (exit status 1 at the
    end). SIGINT and SIGTERM commit every finished row and exit 130 and 143.
    """
    setup_logging(quiet, verbose)
    jobs = _load(jobs_file, job)
    display = ProgressDisplay(enabled=not quiet, live=err.is_terminal, every_s=progress_every)
    failures: list[JobFailure] = []
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with display:
            if ray_address is not None:  # ray and the cluster code load only here
                from slora_batch.ray.job import RaySettings, run_ray_jobs

                settings = RaySettings(ray_address, replicas, gpus_per_replica)
                outcomes = run_ray_jobs(
                    jobs, settings, overwrite=overwrite, progress=display.update
                )
            else:
                outcomes = run_jobs(jobs, overwrite=overwrite, progress=display.update)
            for outcome in outcomes:
                display.finish()
                if isinstance(outcome, JobFailure):
                    failures.append(outcome)
                    err.print(f"[red]error:[/] {escape(outcome.error)}")
                elif not quiet:
                    print_summary(outcome, next(j for j in jobs if j.name == outcome.job))
                    if outcome.eval_results:  # an eval job: lm-eval's metrics per adapter
                        from slora_batch.console import out
                        from slora_batch.eval.report import eval_table

                        out.print(eval_table(outcome.eval_results))
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
            err.print(f"[red]failed:[/] {len(failures)} of {len(jobs)} jobs ({names})")
        raise typer.Exit(1)


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
    err.print(f"interrupted by {name}: {text}; run the same command again to resume", markup=False)
    raise typer.Exit(code)


@app.command()
def validate(
    jobs_file: Path = JOBS_FILE,
    job: str | None = typer.Option(
        None, "--job", "-j", help="Validate only the job with this name (default: every job)."
    ),
    every: bool = typer.Option(
        False,
        "--all",
        help="Check every input row, not the first 200, and list every row problem, not the "
        "first 10.",
    ),
) -> None:
    """Check the jobs of JOBS_FILE without running them (no engine, no weights; the sample
    model is converted once on its first use, as by run).

    Checks keys, the model config, every adapter against the model (adapters the engine
    cannot run are listed), the input files and schema, every row's id (repeated (id, adapter)
    rows fail the job) and columns (those neither used nor kept are listed), and a sample of
    rows (tokenized). Exits 1 when a job could not run; row problems are listed (a run writes
    error rows for them) but do not fail validation.
    """
    setup_logging(quiet=False, verbose=False)
    failed = 0
    for config in _load(jobs_file, job):
        try:
            report = validate_job(config, limit=None if every else VALIDATE_ROWS)
        except (JobError, *JOB_ERRORS) as exc:
            err.print(f"[red]error:[/] {escape(str(exc))}")
            failed += 1
            continue
        print_report(report, every=every)
    if failed:
        raise typer.Exit(1)


def _load(jobs_file: Path, name: str | None):
    try:
        return select_jobs(load_jobs(jobs_file), name)
    except (ConfigError, JobError) as exc:
        _fail(exc)


def _fail(exc: Exception) -> None:
    err.print(f"[red]error:[/] {escape(str(exc))}")
    raise typer.Exit(1)


if __name__ == "__main__":
    app()
