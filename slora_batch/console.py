"""What the ``slora-batch`` command draws and prints, with rich: log handlers, progress (live bars
on a terminal, a plain line every few seconds otherwise), job summaries and validation reports.
Only ``cli.py`` imports it: library code logs, the command prints.

Logs of an unattended run (stderr not a terminal) have one format, ``LOG_FORMAT``: the library's
records, the progress lines (logger ``slora_batch.progress``), the command's own messages
(``slora_batch.cli``: a failed job, a stop) and the records of transformers, datasets and
huggingface_hub, whose own stderr handlers are taken off; third-party progress bars are off
there. A terminal gets rich: live bars, rich log lines.

Levels: by default the library's INFO records (the sample model's conversion, each job's start
with the rows to do, its engine, its end) and everything's warnings; ``--verbose`` debug too;
``--quiet`` errors only, and the line that says a signal stopped the run.
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys
import time
from pathlib import Path

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
)
from rich.table import Table

from slora_batch.engine.adapters.changes import grouped, names_text, unmatched_notes
from slora_batch.jobs.preference import ChoicePreference, choice_preference
from slora_batch.jobs.preview import preview
from slora_batch.jobs.progress import (
    COMPUTED,
    GENERATED,
    JobProgress,
    clock,
    generated_per_s,
    progress_line,
    rates_text,
    seconds_left,
    tokens_per_s,
)
from slora_batch.jobs.summary import JobSummary
from slora_batch.jobs.validate import ValidationReport

out = Console(highlight=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)  # a message stays one line
PREVIEW_ROWS = 5
PREVIEW_CHARS = 160
ADAPTER_ROWS = 20  # per-adapter lines in the summary; the rest are in _stats.parquet
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_DATE = "%Y-%m-%d %H:%M:%S"
# The summary's width when stdout is not a terminal (and COLUMNS is unset): nothing wraps a
# log's lines, so tables take the width they need; a wider one folds, never cutting a name.
LOG_WIDTH = 1000
# Libraries that put their own stderr handler on their logger when imported
LIBRARY_LOGGERS = ("transformers", "datasets", "huggingface_hub")
# Their progress bars' switches, for an unattended run (a variable the user set is kept);
# TQDM_DISABLE is tqdm's own default for every bar (lm-eval's), read when tqdm is imported.
PROGRESS_BAR_VARIABLES = (
    "HF_DATASETS_DISABLE_PROGRESS_BARS",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "TQDM_DISABLE",
)
# Loggers whose INFO records are one per file or per adapter: shown with --verbose only
CHATTY = ("slora_batch.jobs.outdir", "slora_batch.eval.lm")

progress_log = logging.getLogger("slora_batch.progress")  # the plain progress lines
cli_log = logging.getLogger("slora_batch.cli")  # the name of the command's own lines


def setup_logging(quiet: bool, verbose: bool) -> None:
    """The library's INFO records, everything's warnings (``--verbose``: debug; ``--quiet``:
    errors, and a stop's line). On a terminal through rich; otherwise one plain format with the
    time, level and logger, for the log of an unattended run, with no third-party progress
    bars."""
    level = logging.ERROR if quiet else logging.DEBUG if verbose else logging.WARNING
    if err.is_terminal:
        handler: logging.Handler = RichHandler(console=err, show_path=False, show_time=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATE))
        quiet_progress_bars()
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.captureWarnings(True)  # Python warnings: records of "py.warnings", in one format
    logging.getLogger("slora_batch").setLevel(logging.NOTSET if quiet or verbose else logging.INFO)
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)
    # The tokenizer's "sequence length is longer than the specified maximum" warning: the
    # engine checks every prompt against the model's context and says so in the row's error.
    logging.getLogger("transformers.tokenization_utils_base").setLevel(logging.ERROR)
    adopt_library_loggers()
    if not any(isinstance(finder, _AdoptOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AdoptOnImport())
    # a summary that is not on a terminal is as wide as it needs (COLUMNS, when set, rules)
    out.width = None if out.is_terminal or os.environ.get("COLUMNS") else LOG_WIDTH


def quiet_progress_bars() -> None:
    """No third-party progress bars: datasets' (lm-eval's dataset loading), huggingface_hub's
    and transformers' (downloads, weights), tqdm's own (lm-eval's). Their variables, for what
    imports them later and for child processes; their switches, for what is imported now."""
    for name in PROGRESS_BAR_VARIABLES:
        os.environ.setdefault(name, "1")
    if "datasets" in sys.modules:
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def adopt_library_loggers() -> None:
    """The records of ``LIBRARY_LOGGERS`` through the root's handler (one format): their own
    stderr handlers off, their records propagated. Their levels stay theirs."""
    for name in LIBRARY_LOGGERS:
        if name not in sys.modules:
            continue
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:
                logger.removeHandler(handler)
        logger.propagate = True


class _AdoptOnImport(importlib.abc.MetaPathFinder):
    """Adopts a library's logger (``adopt_library_loggers``) once the library is imported."""

    def find_spec(self, name, path=None, target=None):
        if name not in LIBRARY_LOGGERS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module) -> None:
            run(module)
            adopt_library_loggers()

        loader.exec_module = exec_module
        return spec


class _StderrHandler(logging.StreamHandler):
    """A plain log handler writing to whatever ``sys.stderr`` is when a record comes."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def print_error(message: str, label: str = "error") -> None:
    """A job that failed or a job file that cannot run: red on a terminal, an ERROR line of the
    log format otherwise (the level says "error")."""
    if err.is_terminal:
        err.print(f"[red]{label}:[/] {escape(message)}")
    else:
        _log_line(logging.ERROR, message if label == "error" else f"{label}: {message}")


def print_stop(message: str) -> None:
    """A run stopped by a signal: what it committed, that a re-run resumes. One line: plain on
    a terminal, a WARNING line of the log format otherwise."""
    if err.is_terminal:
        err.print(message, markup=False)
    else:
        _log_line(logging.WARNING, message)


def _log_line(level: int, message: str) -> None:
    """``message`` as a record of ``cli_log`` in ``LOG_FORMAT``, on stderr whatever the log
    level (``--quiet`` too) and whether or not logging is set up."""
    record = cli_log.makeRecord(cli_log.name, level, __file__, 0, message, None, None)
    line = logging.Formatter(LOG_FORMAT, LOG_DATE).format(record)
    err.print(line, markup=False, highlight=False)


class ProgressDisplay:
    """Progress of the running job: rows done of total, generated and prefill+decode tokens per
    second of engine time (``progress.py``), adapters resident, ETA.

    On a terminal (``live``) a rich progress line per job, drawn from its first event until
    ``finish`` so that summaries print below. Otherwise a log record (``progress_log``) when a
    job loads its model, every ``every_s`` seconds while it runs and once at its end (its rates
    then are its summary's): no bars, no carriage returns, for logs."""

    def __init__(self, enabled: bool, live: bool, every_s: float = 30.0) -> None:
        self.enabled, self.live, self.every_s = enabled, live, every_s
        self.job: str | None = None  # the job of the latest event
        self.last: JobProgress | None = None  # the latest event
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("rows"),
            TextColumn(f"{{task.fields[generated]:>7.1f}} {GENERATED},"),
            TextColumn(f"{{task.fields[computed]:>7.1f}} {COMPUTED}"),
            TextColumn("{task.fields[resident]} adapters resident"),
            TimeElapsedColumn(),
            TextColumn("ETA {task.fields[eta]}"),
            console=err,
        )
        self.task: int | None = None
        self.phase: str | None = None
        self.last_line = 0.0  # time.monotonic() of the last plain line

    def __enter__(self) -> ProgressDisplay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.task is not None:
            self.progress.stop()

    def update(self, event: JobProgress) -> None:
        self.job, self.last = event.job, event
        if not self.enabled:
            return
        if not self.live:
            self._line(event)
            return
        if self.task is None and event.phase == "done":  # complete already: nothing to draw
            return
        if self.task is None:
            # the rows of earlier runs are the task's start, not progress to measure speed on
            self.task = self.progress.add_task(
                f"{event.job}: {event.phase}",
                total=event.rows_total,
                completed=event.rows_done,
                generated=0.0,
                computed=0.0,
                resident=0,
                eta=clock(None),
            )
            self.progress.start()
        if event.phase in ("scanning", "loading"):
            self.progress.update(
                self.task,
                description=f"{event.job}: {event.phase}",
                total=event.rows_total,
                completed=event.rows_done,
            )
            return
        self.progress.update(
            self.task,
            description=event.job,
            total=event.rows_total,
            completed=event.rows_done,
            generated=generated_per_s(event),
            computed=tokens_per_s(event),
            resident=event.adapters_resident,
            eta=clock(seconds_left(event)),
        )

    def _line(self, event: JobProgress) -> None:
        """The plain lines: the job's loading (its scan and its rows to do are the job runner's
        records), its progress every ``every_s``, its end when this run did rows."""
        now = time.monotonic()
        phase, self.phase = self.phase, event.phase
        if event.phase == "loading" and phase != event.phase:
            progress_log.info("job %s: loading the model", event.job)
            self.last_line = now
        elif event.phase == "running" and now - self.last_line >= self.every_s:
            progress_log.info("%s", progress_line(event))
            self.last_line = now
        elif event.phase == "done" and event.rows_this_run:
            progress_log.info("%s", progress_line(event))

    def finish(self) -> None:
        """Stop drawing the job's line, leaving it on screen complete."""
        self.phase = None
        if self.task is None:
            return
        done = self.progress.tasks[0].completed
        self.progress.update(self.task, total=done, completed=done)
        self.progress.stop()
        self.progress.remove_task(self.task)
        self.task = None


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _fold(table: Table) -> Table:
    """Every column folds what does not fit its width onto more lines: a name is never cut."""
    for column in table.columns:
        column.overflow = "fold"
    return table


def print_summary(summary: JobSummary, job) -> None:
    shown = escape(shown_path(summary.output))
    if summary.complete_already:
        out.print(
            f"job {escape(summary.job)}: complete already "
            f"({_plural(summary.stats['rows'], 'row')} in {shown}); nothing to do "
            "(--overwrite starts over)",
            soft_wrap=True,
        )
        _print_notes(summary)
        return
    out.print(_fold(_totals_table(summary)))
    if summary.rows_skipped:
        done = "row was" if summary.rows_skipped == 1 else "rows were"
        out.print(
            f"resumed: {summary.rows_skipped:,} {done} already done, "
            f"{summary.rows_this_run:,} written this run"
        )
    out.print(_adapter_table(summary))
    if len(summary.adapters) > ADAPTER_ROWS:
        out.print(f"... and {len(summary.adapters) - ADAPTER_ROWS} more adapters in _stats.parquet")
    _print_scored(summary)
    _print_problems(summary)
    _print_notes(summary)
    out.print(
        f"outputs: [bold]{shown}[/] (part-*.parquet, _stats.parquet, _SUCCESS)", soft_wrap=True
    )
    rows = preview(job, limit=PREVIEW_ROWS)
    if rows:
        out.print(_fold(_preview_table(rows)))


def _totals_table(summary: JobSummary) -> Table:
    """The job's totals, one line each: rows, tokens, this run's time, speed, adapters, pool,
    device."""
    s = summary.stats
    table = Table(title=f"job {escape(summary.job)}", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for name, value in (
        (
            "rows",
            f"{_plural(s['rows'], 'row')} ({s['ok_rows']:,} ok, {_plural(s['error_rows'], 'error')})",
        ),
        ("tokens", _tokens(summary)),
        (
            "this run",
            f"{s['wall_s']:.1f} s: load {s['load_s'] or 0:.1f}, warmup "
            f"{s['warmup_s'] or 0:.1f}, engine {s['engine_s']:.1f}, read "
            f"{s['read_s']:.1f}, write {s['write_s']:.1f} s",
        ),
        ("speed", _speed(s)),
        (
            "adapters",
            f"{s['adapters_seen']} used, {s['adapters_broken']} unusable; "
            f"{_plural(s['adapter_loads'], 'load')} ({s['adapter_disk_loads']} from disk), "
            f"{_plural(s['adapter_evictions'], 'eviction')}, "
            f"{_plural(s['prefetch_hits'], 'prefetch hit')}",
        ),
        (
            "pool",
            f"peak {_plural(s['peak_pool_pages'], 'page')}; prefix cache: "
            f"{s.get('prefix_hit_tokens') or 0:,} prompt tokens found, "
            f"{_plural(s.get('block_evictions') or 0, 'block eviction')}",
        ),
        ("device", f"{s['device']}, {s['dtype']}"),
    ):
        table.add_row(name, value)
    return table


def _print_scored(summary: JobSummary) -> None:
    """The scored rows' count and accuracy, and which choice label the model prefers; nothing
    when no row was scored."""
    s = summary.stats
    if not s.get("scored_rows"):
        return
    accuracy = "" if s.get("accuracy") is None else f", accuracy {s['accuracy']:.1%}"
    out.print(f"scored: {_plural(s['scored_rows'], 'row')}{accuracy}")
    preference = choice_preference(summary.output, summary.choice_labels)
    if preference is not None:
        _print_preference(preference)


def _print_problems(summary: JobSummary) -> None:
    """This run's error rows (the first few, then how many more) and the empty-text warning."""
    for message in summary.errors:
        out.print(f"[yellow]error row:[/] {escape(message)}", soft_wrap=True)
    more = summary.error_rows_this_run - len(summary.errors)
    if more > 0:
        out.print(f"... and {_plural(more, 'more error row')} (the error column of the parts)")
    empty = summary.empty_text_note()
    if empty is not None:
        out.print(f"[yellow]warning:[/] {escape(empty)}", soft_wrap=True)


def _preview_table(rows) -> Table:
    """A few output rows: id, adapter, prompt and output, the last two cut short."""
    sample = Table(title="a few outputs", title_justify="left", show_lines=True)
    for name in ("id", "adapter", "prompt", "output"):
        sample.add_column(name)
    for row in rows:
        sample.add_row(
            escape(row.id),
            escape(row.adapter or "(base)"),
            escape(_cut(row.prompt)),
            escape(_cut(row.text)),
        )
    return sample


def _cut(text: str) -> str:
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS] + "..."


def _adapter_table(summary: JobSummary) -> Table:
    """Per adapter: the whole output's rows, errors and generated tokens, and this run's time
    (its first row in to its last result out); after a resume, this run's rows too."""
    resumed = bool(summary.rows_skipped)
    heads = ["adapter", "rows", "errors", "generated tok"]
    heads += ["rows this run", "s this run"] if resumed else ["s this run"]
    adapters = Table(title="per adapter", title_justify="left")
    for name in heads:
        adapters.add_column(name, justify="left" if name == "adapter" else "right")
    for row in sorted(summary.adapters, key=lambda r: -r["rows"])[:ADAPTER_ROWS]:
        cells = [
            escape(row["adapter"] or "(base)"),
            f"{row['rows']:,}",
            f"{row['error_rows']:,}",
            f"{row['tokens']:,}",
        ]
        if resumed:
            this_run = row.get("rows_this_run")
            cells.append("-" if this_run is None else f"{this_run:,}")
        cells.append("-" if row["seconds"] is None else f"{row['seconds']:.1f}")
        adapters.add_row(*cells)
    return _fold(adapters)


def _tokens(summary: JobSummary) -> str:
    """The whole output's tokens (error rows compute none); this run's too after a resume, as
    the speed is this run's."""
    s = summary.stats
    if s["completion_tokens"] == 0 and s.get("scored_rows"):
        text = f"{s['prompt_tokens']:,} prompt tokens scored ({_plural(s['scored_rows'], 'row')})"
    else:
        text = f"{s['prompt_tokens']:,} prompt, {s['completion_tokens']:,} generated"
    if summary.rows_skipped:
        text += (
            f" in the whole output; this run {summary.prompt_tokens_this_run:,} prompt, "
            f"{summary.completion_tokens_this_run:,} generated"
        )
    return text


def _speed(s: dict) -> str:
    """This run's rates over its engine time, worded as the progress lines word them: the last
    progress event of the run has these numbers (``progress.rates_text``)."""
    rates = rates_text(s["tokens_per_s"], s.get("computed_tokens_per_s"))
    return f"this run: {rates}, {s['requests_per_s']:.2f} rows/s"


def _print_preference(preference: ChoicePreference) -> None:
    """Per adapter, the share of its choices rows whose best choice is each index: by total
    log-probability, then by mean per token."""
    table = Table(
        title="choice preference per adapter (by total log-probability / by mean per token)",
        title_justify="left",
    )
    table.add_column("adapter")
    table.add_column("rows", justify="right")
    for head in preference.heads:
        table.add_column(escape(head), justify="right")
    beyond = any(a.beyond or a.beyond_norm for a in preference.adapters)
    if beyond:
        table.add_column(f"{preference.columns}+", justify="right")
    if preference.answers:
        table.add_column("accuracy", justify="right")
    shown = preference.adapters[:ADAPTER_ROWS]
    for row in shown:
        cells = [f"{s:.0%} / {n:.0%}" for s, n in zip(row.shares, row.shares_norm, strict=True)]
        if beyond:
            cells.append(f"{row.beyond:.0%} / {row.beyond_norm:.0%}")
        if preference.answers:
            cells.append("-" if row.accuracy is None else f"{row.accuracy:.1%}")
        table.add_row(escape(row.adapter or "(base)"), f"{row.rows:,}", *cells)
    out.print(_fold(table))
    if len(preference.adapters) > len(shown):
        out.print(f"... and {len(preference.adapters) - len(shown)} more adapters")


def _print_notes(summary: JobSummary) -> None:
    """Unusable adapters and input columns neither used nor kept."""
    for name, reason in summary.broken.items():
        out.print(
            f"[yellow]unusable adapter:[/] {escape(name)}: {escape(reason)}; its rows are error rows",
            soft_wrap=True,
        )
    for note in summary.notes:
        out.print(f"[yellow]note:[/] {escape(note)}", soft_wrap=True)


def shown_path(path: Path) -> str:
    """A path as the user would type it: relative when under the working directory."""
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def _kinds(adapters) -> str:
    """How many adapters of each kind (``AdapterInfo.kind``), when some are not plain LoRA, as
    "; 2 LoRA, 1 DoRA, 1 LoRA + bias"; else nothing."""
    kinds: dict[str, int] = {}
    for adapter in adapters:
        kinds[adapter.kind] = kinds.get(adapter.kind, 0) + 1
    if set(kinds) <= {"LoRA"}:
        return ""
    return "; " + ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))


def print_report(report: ValidationReport, every: bool = False, per_adapter: bool = False) -> None:
    """The validation report; ``every``: all row problems, not the first ten; ``per_adapter``:
    what each adapter changes, a line each, not one line per distinct change."""
    spec = report.spec
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
    out.print(
        f"  {_plural(len(report.adapters), 'adapter')}"
        + (f", ranks {ranks}" if ranks else "")
        + _kinds(report.adapters)
        + fanout
    )
    _print_changes(report, per_adapter)
    for name, reason in report.broken.items():
        out.print(
            f"  [yellow]unusable adapter:[/] {escape(name)}: {escape(reason)} (its rows will be "
            "error rows)",
            soft_wrap=True,
        )
    out.print(
        f"  input: {_plural(len(report.files), 'file')}, {_plural(report.rows_total, 'row')}; "
        f"{report.rows_checked} checked; ids: {report.id_type}"
    )
    for note in report.notes:
        out.print(f"  [yellow]note:[/] {escape(note)}", soft_wrap=True)
    shown = report.problems if every else report.problems[:10]
    for problem in shown:
        out.print(f"  [yellow]row problem:[/] {escape(problem)}", soft_wrap=True)
    if len(report.problems) > len(shown):
        more = len(report.problems) - len(shown)
        out.print(f"  ... and {_plural(more, 'more row problem')} (--all lists every one)")


def _print_changes(report: ValidationReport, per_adapter: bool) -> None:
    """What the adapters change in the model: a line per distinct change with how many adapters
    have it and a few of their names (the first ``ADAPTER_ROWS``), or a line per adapter; then
    a note per set of ``target_modules`` entries that match no module."""
    if per_adapter:
        lines = [f"{a.name}: {a.summary}" for a in report.changes]
    else:
        lines = [
            f"{_plural(len(names), 'adapter')} ({names_text(names)}): {summary}"
            for summary, names in grouped(report.changes)
        ]
    if lines:
        out.print("  what the adapters change:")
    shown = lines if per_adapter else lines[:ADAPTER_ROWS]
    for line in shown:
        out.print(f"    {escape(line)}", soft_wrap=True)
    if len(lines) > len(shown):
        more = len(lines) - len(shown)
        out.print(f"    ... and {_plural(more, 'more change')} (--per-adapter lists each adapter)")
    for note in unmatched_notes(report.changes, report.spec):
        out.print(f"  [yellow]note:[/] {escape(note)}", soft_wrap=True)
