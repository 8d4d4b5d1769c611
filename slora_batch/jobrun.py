"""Running jobs: input rows -> sorted windows -> engine -> parts, then stats and the marker.

``run_jobs`` checks every job (``check_job``: model config, adapter headers, input files, output
directory, fan-out; no weights) before it runs any, so a bad job fails before any work. A run
takes the output directory's lock, skips the rows already in committed parts (resume) and ends
with ``stats.parquet`` and the completion marker. ``slora_batch.validate`` does the checks plus a
look at the input schema and a sample of rows, and never builds an engine.

Stats after a resume describe the whole output: row and token counts come from the committed
parts; wall time, throughput and the engine counters (adapter loads, evictions, peak pool pages)
are this run's. An adapter's ``seconds`` is this run's span from its first row entering the
engine to its last result.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.adapters import AdapterError, AdapterInfo, AdapterStore
from slora_batch.config import ConfigError
from slora_batch.io import InputError, iter_input_files, read_rows, to_request
from slora_batch.job import JobConfig, fanout_adapters
from slora_batch.ordering import fan_out, sorted_windows
from slora_batch.request import Request, Result
from slora_batch.sample_model import ModelNotFoundError, resolve_model
from slora_batch.spec import ModelError, ModelSpec, read_spec
from slora_batch.writer import (
    COUNT_KEYS,
    OutputError,
    OutputLock,
    OutputWriter,
    done_keys,
    output_counts,
    part_files,
    row_key,
    write_stats,
    write_success,
)

logger = logging.getLogger(__name__)

COUNT_JSONL_BYTES = 256 << 20  # JSONL inputs up to this size are counted for the progress total
ERROR_EXAMPLES = 3  # error messages of a run kept for the summary


class JobError(ValueError):
    """A job cannot run; the message names the job and the reason."""


# What a bad job raises; JobError wraps them with the job's name.
JOB_ERRORS = (ConfigError, InputError, AdapterError, ModelError, ModelNotFoundError, OutputError)


@dataclass
class JobPlan:
    """A checked job: what ``check_job`` learned without loading weights."""

    job: JobConfig
    model_path: Path
    spec: ModelSpec
    adapters: list[AdapterInfo]
    files: list[Path]
    rows_total: int | None  # input rows before fan-out; None when too costly to count
    sweep: list[str | None] | None  # fan-out adapters (None = base), or None without fan-out

    @property
    def total(self) -> int | None:
        """Output rows the job will have when complete."""
        return None if self.rows_total is None else self.rows_total * len(self.sweep or [None])


@dataclass
class JobProgress:
    """What a progress display shows; passed to the callback as rows finish."""

    job: str
    phase: str  # "loading" (model and adapters), "running", "done"
    rows_done: int  # rows in the output, earlier runs included
    rows_total: int | None  # None when counting the input would cost too much
    completion_tokens: int  # generated this run
    elapsed_s: float  # since this run's generation started
    adapters_resident: int


ProgressCallback = Callable[[JobProgress], None]


@dataclass
class JobSummary:
    """A finished job: the stats rows as written to ``stats.parquet`` and this run's share."""

    job: str
    output: Path
    stats: dict[str, Any]
    adapters: list[dict[str, Any]]
    rows_skipped: int  # already in the output when this run started
    rows_this_run: int
    errors: list[str] = field(default_factory=list)  # a few error messages of this run


def select_jobs(jobs: list[JobConfig], name: str | None) -> list[JobConfig]:
    """Every job, or the one called ``name``."""
    if name is None:
        return jobs
    chosen = [job for job in jobs if job.name == name]
    if not chosen:
        raise JobError(f"no job {name!r} (jobs: {', '.join(job.name for job in jobs)})")
    return chosen


def check_job(job: JobConfig) -> JobPlan:
    """Everything that can fail a job, checked without loading weights."""
    try:
        device = job.engine.device
        if device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(f"engine.device is {device!r} but no CUDA device is available")
        model_path = resolve_model(job.model)
        spec = read_spec(model_path)
        adapters = AdapterStore(spec, job.adapters).validate_all()
        files = iter_input_files(job.input)
        rows_total = count_rows(files)
        sweep = fanout_adapters(job)
        output = Path(job.output)
        if output.exists() and not output.is_dir():
            raise OutputError(f"output {str(output)!r} exists and is not a directory")
    except JOB_ERRORS as exc:
        raise _job_error(job, exc) from exc
    return JobPlan(job, model_path, spec, adapters, files, rows_total, sweep)


def _job_error(job: JobConfig, exc: Exception) -> JobError:
    message = str(exc)
    return JobError(message if f"job {job.name!r}" in message else f"job {job.name!r}: {message}")


def run_jobs(
    jobs: list[JobConfig], overwrite: bool = False, progress: ProgressCallback | None = None
) -> Iterator[JobSummary]:
    """Check every job, then run them one by one, yielding each one's summary."""
    plans = [check_job(job) for job in jobs]
    for plan in plans:
        yield run_plan(plan, overwrite=overwrite, progress=progress)


def run_job(
    job: JobConfig, overwrite: bool = False, progress: ProgressCallback | None = None
) -> JobSummary:
    return run_plan(check_job(job), overwrite=overwrite, progress=progress)


def run_plan(
    plan: JobPlan, overwrite: bool = False, progress: ProgressCallback | None = None
) -> JobSummary:
    """Run a checked job over its output directory: resume unless ``overwrite``."""
    from slora_batch.engine import Engine  # imports torch and the model code

    job, started = plan.job, time.perf_counter()
    notify = progress or (lambda update: None)
    try:
        lock = OutputLock(job.output)
    except OutputError as exc:
        raise _job_error(job, exc) from exc
    with lock:
        done = set() if overwrite else done_keys(job.output)
        total = plan.total
        if done:
            logger.info(
                "job %s: %d rows already in %s, skipping them", job.name, len(done), job.output
            )
        notify(JobProgress(job.name, "loading", len(done), total, 0, 0.0, 0))
        try:
            engine = Engine(
                plan.model_path, adapters=job.adapters, config=job.engine, sampling=job.sampling
            )
        except JOB_ERRORS as exc:
            raise _job_error(job, exc) from exc
        run = _Run(job.name, len(done), total, engine, notify)
        with OutputWriter(job.output, job.part_rows, overwrite=overwrite, lock=lock) as writer:
            run.feed(_items(plan, done), writer.write)
        wall_s = time.perf_counter() - started
        job_row, adapter_rows = _stats(job.output, engine, run, wall_s)
        write_stats(job.output, job_row, adapter_rows)
        write_success(job.output, job.name, rows=job_row["rows"])
        resident = engine.counters.adapters_resident
        notify(
            JobProgress(job.name, "done", job_row["rows"], total, run.tokens, run.elapsed, resident)
        )
    logger.info("job %s: %d rows this run, %.1f s", job.name, writer.rows_written, wall_s)
    return JobSummary(
        job=job.name,
        output=Path(job.output).resolve(),
        stats=job_row,
        adapters=adapter_rows,
        rows_skipped=len(done),
        rows_this_run=writer.rows_written,
        errors=run.errors,
    )


def _items(plan: JobPlan, done: set) -> Iterator[Request | Result]:
    """The job's requests and bad-row results not yet in the output, in sorted windows."""
    job = plan.job
    items: Iterable[Request | Result] = (
        to_request(row, job.sampling) for row in read_rows(plan.files, job.columns)
    )
    if plan.sweep is not None:
        items = fan_out(items, plan.sweep)
    if done:
        items = (i for i in items if row_key(i.id, i.adapter) not in done)
    return sorted_windows(items, window=job.window)


class _Run:
    """This run's accounting: progress, per-adapter spans, a few error messages."""

    def __init__(self, job: str, done: int, total: int | None, engine, notify) -> None:
        self.job, self.done, self.total = job, done, total
        self.engine, self.notify = engine, notify
        self.rows = 0
        self.tokens = 0
        self.errors: list[str] = []
        self.first_in: dict[str | None, float] = {}  # adapter -> first row handed to the engine
        self.last_out: dict[str | None, float] = {}  # adapter -> its last result
        self.started = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def feed(self, items: Iterable[Request | Result], write: Callable[[Result], None]) -> None:
        """Hand the requests to the engine and ``write`` every result as it comes: the engine's,
        and the bad rows' that never reach it (written as the engine pulls past them, so a long
        run of bad rows is never held in memory)."""

        def requests() -> Iterator[Request]:
            for item in items:
                if isinstance(item, Result):
                    self._done(item, write)
                else:
                    self.first_in.setdefault(item.adapter, time.perf_counter())
                    yield item

        for result in self.engine.generate(requests()):
            self.last_out[result.adapter] = time.perf_counter()
            self._done(result, write)

    def _done(self, result: Result, write: Callable[[Result], None]) -> None:
        write(result)
        self.done += 1
        self.rows += 1
        self.tokens += result.completion_tokens
        if result.error is not None and len(self.errors) < ERROR_EXAMPLES:
            self.errors.append(result.error)
        resident = self.engine.counters.adapters_resident
        self.notify(
            JobProgress(
                self.job, "running", self.done, self.total, self.tokens, self.elapsed, resident
            )
        )


def count_rows(files: list[Path]) -> int | None:
    """Input rows: Parquet from file metadata, JSONL by counting non-blank lines when the JSONL
    files are small enough (``COUNT_JSONL_BYTES``), else None. Every Parquet footer is read, so
    an unreadable file fails here, before any work."""
    jsonl = [f for f in files if f.suffix.lower() == ".jsonl"]
    count_jsonl = sum(f.stat().st_size for f in jsonl) <= COUNT_JSONL_BYTES
    total = 0
    for file in files:
        try:
            if file not in jsonl:
                total += pq.ParquetFile(file).metadata.num_rows
            elif count_jsonl:
                with open(file, "rb") as handle:
                    total += sum(1 for line in handle if line.strip())
        except (OSError, pa.ArrowException) as exc:
            raise InputError(f"{file}: cannot read: {exc}") from exc
    return total if count_jsonl else None


def _stats(
    out_dir: str, engine, run: _Run, wall_s: float
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The job row and the per-adapter rows of ``stats.parquet`` (see the module docstring)."""
    per_adapter = output_counts(out_dir)
    totals = {key: sum(c[key] for c in per_adapter.values()) for key in COUNT_KEYS}
    counters = engine.counters
    rate = 1.0 / wall_s if wall_s > 0 else 0.0
    job_row = {
        **totals,
        "wall_s": wall_s,
        "tokens_per_s": run.tokens * rate,
        "requests_per_s": run.rows * rate,
        "adapters_seen": sum(1 for a, c in per_adapter.items() if a is not None and c["ok_rows"]),
        "adapter_loads": counters.adapter_loads,
        "adapter_evictions": counters.adapter_evictions,
        "prefetch_hits": counters.prefetch_hits,
        "peak_pool_pages": counters.peak_pages,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
    }
    adapter_rows = []
    for adapter in sorted(per_adapter, key=lambda a: (a is not None, a or "")):
        counts = per_adapter[adapter]
        span = None
        if adapter in run.first_in and adapter in run.last_out:
            span = run.last_out[adapter] - run.first_in[adapter]
        adapter_rows.append(
            {"adapter": adapter, **counts, "tokens": counts["completion_tokens"], "seconds": span}
        )
    return job_row, adapter_rows


@dataclass
class PreviewRow:
    id: str
    adapter: str | None
    prompt: str
    text: str
    finish_reason: str


def preview(job: JobConfig, limit: int = 5, scan: int = 50) -> list[PreviewRow]:
    """A few finished outputs with their prompts, taken from the first ``scan`` input rows: with
    fan-out one prompt across its adapters (base first), else the first outputs in input order."""
    prompts: dict[str, str] = {}
    try:
        for row in read_rows(iter_input_files(job.input), job.columns):
            if len(prompts) == scan:
                break
            item = to_request(row, job.sampling)
            if isinstance(item, Request):
                prompts.setdefault(str(item.id), _prompt_text(item))
    except InputError:
        return []
    found: dict[str, list[dict[str, Any]]] = {}
    for _, path in part_files(job.output):
        table = pq.read_table(
            path,
            columns=["id", "adapter", "text", "finish_reason"],
            filters=[("id", "in", list(prompts)), ("finish_reason", "!=", "error")],
        )
        for row in table.to_pylist():
            found.setdefault(row["id"], []).append(row)
    ids = [i for i in prompts if i in found]
    if job.fanout is not None:
        ids = ids[:1]
    rows = [
        PreviewRow(i, r["adapter"], prompts[i], r["text"], r["finish_reason"])
        for i in ids
        for r in sorted(found[i], key=lambda r: (r["adapter"] is not None, r["adapter"] or ""))
    ]
    return rows[:limit]


def _prompt_text(request: Request) -> str:
    if request.prompt is not None:
        return request.prompt
    users = [m["content"] for m in request.messages or [] if m["role"] == "user"]
    return users[-1] if users else (request.messages or [{"content": ""}])[-1]["content"]
