"""The ``slora-batch`` command: argument handling, progress and printing over ``slora_batch``.

Everything a job does lives in ``slora_batch.jobrun``; this file only turns options into calls,
draws progress with rich and prints summaries. Exit status: 0 done, 1 a bad job (one message on
stderr, no traceback), 130 interrupted (finished rows are kept; re-run to resume).
"""

from __future__ import annotations

import logging
from pathlib import Path

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from slora_batch.bench_cli import bench
from slora_batch.config import ConfigError
from slora_batch.job import load_jobs
from slora_batch.jobrun import (
    JOB_ERRORS,
    JobError,
    JobProgress,
    JobSummary,
    preview,
    run_jobs,
    select_jobs,
)
from slora_batch.validate import ValidationReport, validate_job

app = typer.Typer(
    help="Offline batch inference of one base LLM with many LoRA adapters (S-LoRA design).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("bench")(bench)  # DESIGN section 5; its options live with it in bench_cli.py
out = Console(highlight=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)  # a message stays one line

JOBS_FILE = typer.Argument(
    ...,
    help="Job file (YAML): a 'jobs' list and optional 'defaults'; relative paths in it are "
    "relative to the file.",
    show_default=False,
)
PREVIEW_ROWS = 5
PREVIEW_CHARS = 160
ADAPTER_ROWS = 20  # per-adapter lines in the summary; the rest are in stats.parquet


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
        "already written).",
    ),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="Print nothing but errors: no progress, no summary."
    ),
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="Also log what the engine does (model, pool, adapters)."
    ),
) -> None:
    """Run the jobs of JOBS_FILE.

    Each job streams its input, generates, and writes Parquet parts, stats.parquet and a
    _SUCCESS marker into its output directory; a re-run resumes. Every job is checked before
    any runs, and a bad job stops with one message.
    """
    _logging(quiet, verbose)
    jobs = _load(jobs_file, job)
    display = _ProgressDisplay(enabled=not quiet)
    try:
        with display:
            for summary in run_jobs(jobs, overwrite=overwrite, progress=display.update):
                display.finish()
                if not quiet:
                    _print_summary(summary, next(j for j in jobs if j.name == summary.job))
    except (JobError, *JOB_ERRORS) as exc:
        _fail(exc)
    except KeyboardInterrupt:
        err.print("interrupted: finished rows are kept; run the same command again to resume")
        raise typer.Exit(130) from None


@app.command()
def validate(
    jobs_file: Path = JOBS_FILE,
    job: str | None = typer.Option(
        None, "--job", "-j", help="Validate only the job with this name (default: every job)."
    ),
) -> None:
    """Check the jobs of JOBS_FILE without running them (loads no weights).

    Checks keys, the model config, every adapter against the model, the input files and
    schema, and a sample of rows (tokenized). Exits 1 when a job could not run; row problems
    are listed (a run writes error rows for them) but do not fail validation.
    """
    _logging(quiet=False, verbose=False)
    failed = 0
    for config in _load(jobs_file, job):
        try:
            report = validate_job(config)
        except (JobError, *JOB_ERRORS) as exc:
            err.print(f"[red]error:[/] {escape(str(exc))}")
            failed += 1
            continue
        _print_report(report)
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


def _logging(quiet: bool, verbose: bool) -> None:
    level = logging.ERROR if quiet else logging.INFO if verbose else logging.WARNING
    handler = RichHandler(console=err, show_path=False, show_time=False)
    logging.basicConfig(level=level, format="%(message)s", handlers=[handler], force=True)
    if not quiet:  # the one-time conversion of the sample model takes a while: say so
        logging.getLogger("slora_batch.sample_model").setLevel(logging.INFO)


class _ProgressDisplay:
    """A rich progress line per job while it runs: rows done of total, tokens/s, adapters
    resident, ETA. Drawn from a job's first event until ``finish``, so summaries print below."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("rows"),
            TextColumn("{task.fields[tokens_per_s]:>7.1f} tok/s"),
            TextColumn("{task.fields[resident]} adapters resident"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=err,
        )
        self.task: int | None = None

    def __enter__(self) -> _ProgressDisplay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.task is not None:
            self.progress.stop()

    def update(self, event: JobProgress) -> None:
        if not self.enabled:
            return
        if self.task is None:
            # the rows of earlier runs are the task's start, not progress to measure speed on
            self.task = self.progress.add_task(
                f"{event.job}: loading", total=event.rows_total, completed=event.rows_done,
                tokens_per_s=0.0, resident=0,
            )  # fmt: skip
            self.progress.start()
        if event.phase == "loading":
            return
        rate = event.completion_tokens / event.elapsed_s if event.elapsed_s > 0 else 0.0
        self.progress.update(
            self.task, description=event.job, completed=event.rows_done, tokens_per_s=rate,
            resident=event.adapters_resident,
        )  # fmt: skip

    def finish(self) -> None:
        """Stop drawing the job's line, leaving it on screen complete."""
        if self.task is None:
            return
        done = self.progress.tasks[0].completed
        self.progress.update(self.task, total=done, completed=done)
        self.progress.stop()
        self.progress.remove_task(self.task)
        self.task = None


def _print_summary(summary: JobSummary, job) -> None:
    s = summary.stats
    table = Table(title=f"job {escape(summary.job)}", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for name, value in (
        ("rows", f"{s['rows']:,} ({s['ok_rows']:,} ok, {s['error_rows']:,} errors)"),
        ("tokens", f"{s['prompt_tokens']:,} prompt, {s['completion_tokens']:,} generated"),
        ("this run", f"{s['wall_s']:.1f} s, {s['tokens_per_s']:.1f} tokens/s, "
                     f"{s['requests_per_s']:.2f} rows/s"),
        ("adapters", f"{s['adapters_seen']} used; {s['adapter_loads']} loads, "
                     f"{s['adapter_evictions']} evictions, {s['prefetch_hits']} prefetch hits"),
        ("pool", f"peak {s['peak_pool_pages']:,} pages"),
        ("device", f"{s['device']}, {s['dtype']}"),
    ):  # fmt: skip
        table.add_row(name, value)
    out.print(table)
    if summary.rows_skipped:
        out.print(
            f"resumed: {summary.rows_skipped:,} rows were already done, "
            f"{summary.rows_this_run:,} written this run"
        )
    adapters = Table(title="per adapter", title_justify="left")
    for name in ("adapter", "rows", "errors", "output tok", "seconds"):
        adapters.add_column(name, justify="left" if name == "adapter" else "right")
    for row in sorted(summary.adapters, key=lambda r: -r["rows"])[:ADAPTER_ROWS]:
        seconds = "-" if row["seconds"] is None else f"{row['seconds']:.1f}"
        adapters.add_row(
            escape(row["adapter"] or "(base)"), f"{row['rows']:,}", f"{row['error_rows']:,}",
            f"{row['tokens']:,}", seconds,
        )  # fmt: skip
    out.print(adapters)
    if len(summary.adapters) > ADAPTER_ROWS:
        out.print(f"... and {len(summary.adapters) - ADAPTER_ROWS} more adapters in stats.parquet")
    for message in summary.errors:
        out.print(f"[yellow]error row:[/] {escape(message)}")
    out.print(
        f"outputs: [bold]{escape(_shown(summary.output))}[/] (part-*.parquet, stats.parquet, _SUCCESS)",
        soft_wrap=True,
    )
    rows = preview(job, limit=PREVIEW_ROWS)
    if rows:
        sample = Table(title="a few outputs", title_justify="left", show_lines=True)
        for name in ("id", "adapter", "prompt", "output"):
            sample.add_column(name, overflow="fold")
        for row in rows:
            text = row.text if len(row.text) <= PREVIEW_CHARS else row.text[:PREVIEW_CHARS] + "..."
            sample.add_row(
                escape(row.id), escape(row.adapter or "(base)"), escape(row.prompt), escape(text)
            )
        out.print(sample)


def _shown(path: Path) -> str:
    """A path as the user would type it: relative when under the working directory."""
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def _print_report(report: ValidationReport) -> None:
    spec = report.spec
    rows = "?" if report.rows_total is None else f"{report.rows_total:,}"
    fanout = ""
    if report.sweep is not None:
        fanout = f", fan-out over {len(report.sweep)} (base + adapters)"
    out.print(f"[green]job {escape(report.job)}: ok[/]", soft_wrap=True)
    out.print(
        f"  model {escape(report.model)}: {spec.architecture}, {spec.num_layers} layers, "
        f"hidden {spec.hidden_size}, vocab {spec.vocab_size}, context {spec.max_context}",
        soft_wrap=True,
    )
    ranks = sorted({a.rank for a in report.adapters})
    out.print(f"  {len(report.adapters)} adapters" + (f", ranks {ranks}" if ranks else "") + fanout)
    out.print(f"  input: {len(report.files)} files, {rows} rows; {report.rows_checked} checked")
    for problem in report.problems[:10]:
        out.print(f"  [yellow]row problem:[/] {escape(problem)}", soft_wrap=True)
    if len(report.problems) > 10:
        out.print(f"  ... and {len(report.problems) - 10} more row problems")


if __name__ == "__main__":
    app()
