"""Running jobs: input rows -> sorted windows -> engine -> parts, then stats and the marker.

``run_jobs`` checks every job (``check_job``: model config, adapter headers, input files, output
directory, fan-out; no weights), then runs the good ones one after another; a job that fails
(at the check or while it runs) is reported and the next one runs. A run takes the output
directory's lock and then:

- compares the job's ``fingerprint`` (input files with sizes and mtimes, model and adapter files,
  sampling, and the job keys that decide rows) with the one in the output's manifest: a
  directory holding rows of other inputs or settings is refused, naming what changed;
- returns at once when the job is complete (``_SUCCESS``): no engine, nothing written;
- scans the input once (``io.scan_input``: id type, kept columns, duplicates, unused columns)
  unless the manifest holds the scan, and refuses a job whose (id, adapter) rows repeat;
- skips the rows already in committed parts (resume), builds the engine only when a row is left,
  writes parts (by rows and by time) and ends with ``stats.parquet`` and the marker.

Stats after a resume describe the whole output: row and token counts come from the committed
parts; times, throughput and the engine counters (adapter loads, evictions, peak pool pages)
are this run's. ``tokens_per_s`` divides this run's tokens by ``engine_s``, the generation
loop's time without reading input and writing parts; model load (``load_s``), compile and
capture (``warmup_s``), reading (``read_s``) and writing (``write_s``) are their own fields. An
adapter's ``seconds`` is this run's span from its first row entering the engine to its last
result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.engine.adapter_files import (
    AdapterError,
    AdapterInfo,
    check_adapters,
    resolve_sources,
)
from slora_batch.engine.config import ConfigError
from slora_batch.engine.request import Request, Result
from slora_batch.engine.sample_model import ModelNotFoundError, resolve_model
from slora_batch.engine.spec import ModelError, ModelSpec, read_spec
from slora_batch.jobs.config import JobConfig, fanout_adapters
from slora_batch.jobs.io import (
    InputError,
    InputScan,
    RowSource,
    identity,
    input_root,
    iter_input_files,
    read_rows,
    relative_name,
    row_key,
    scan_input,
    to_request,
)
from slora_batch.jobs.ordering import sorted_windows
from slora_batch.jobs.writer import (
    COUNT_KEYS,
    MANIFEST_FILE,
    OUTPUT_COLUMNS,
    OutputError,
    OutputLock,
    OutputWriter,
    clear_output,
    done_keys,
    output_counts,
    part_files,
    part_schema,
    read_manifest,
    read_stats,
    read_success,
    write_manifest,
    write_stats,
    write_success,
)

logger = logging.getLogger(__name__)

ERROR_EXAMPLES = 3  # error messages of a run kept for the summary
MANIFEST_VERSION = 1
CHANGES_SHOWN = 6  # fingerprint differences named in a refusal


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
    adapters: list[AdapterInfo]  # the usable ones
    broken: dict[str, str]  # adapter -> why it cannot run (its rows become error rows)
    files: list[Path]
    sweep: list[str | None] | None  # fan-out adapters (None = base), or None without fan-out
    rows_total: int | None = None  # input rows before fan-out, once the input is scanned

    @property
    def total(self) -> int | None:
        """Output rows the job will have when complete."""
        return None if self.rows_total is None else self.rows_total * len(self.sweep or [None])


@dataclass
class JobProgress:
    """What a progress display shows; passed to the callback as rows finish."""

    job: str
    phase: str  # "scanning" (the input), "loading" (model and adapters), "running", "done"
    rows_done: int  # rows in the output, earlier runs included
    rows_total: int | None  # None until the input is scanned
    completion_tokens: int  # generated this run
    elapsed_s: float  # since this run's generation started
    adapters_resident: int
    rows_this_run: int = 0


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
    notes: list[str] = field(default_factory=list)  # input columns neither used nor kept, ...
    broken: dict[str, str] = field(default_factory=dict)  # adapter -> why it cannot run
    complete_already: bool = False  # the job was complete: nothing ran, nothing was written


@dataclass
class JobFailure:
    """A job of ``run_jobs`` that failed; the message names the job and the reason."""

    job: str
    error: str


def select_jobs(jobs: list[JobConfig], name: str | None) -> list[JobConfig]:
    """Every job, or the one called ``name``."""
    if name is None:
        return jobs
    chosen = [job for job in jobs if job.name == name]
    if not chosen:
        raise JobError(f"no job {name!r} (jobs: {', '.join(job.name for job in jobs)})")
    return chosen


def check_job(job: JobConfig) -> JobPlan:
    """Everything that can fail a job, checked without loading weights or reading the input's
    rows. An adapter the engine cannot run does not fail the job (its rows become error rows)."""
    try:
        device = job.engine.device
        if device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(f"engine.device is {device!r} but no CUDA device is available")
        model_path = resolve_model(job.model)
        spec = read_spec(model_path)
        adapters, broken = check_adapters(spec, job.adapters)
        files = iter_input_files(job.input)
        for file in files:  # every Parquet footer: an unreadable file fails here
            if file.suffix.lower() == ".parquet":
                try:
                    pq.ParquetFile(file).metadata  # noqa: B018
                except (OSError, pa.ArrowException) as exc:
                    raise InputError(f"{file}: cannot read as Parquet: {exc}") from exc
        sweep = fanout_adapters(job)
        output = Path(job.output)
        if output.exists() and not output.is_dir():
            raise OutputError(f"output {str(output)!r} exists and is not a directory")
    except JOB_ERRORS as exc:
        raise _job_error(job, exc) from exc
    reasons = {name: str(exc) for name, exc in broken.items()}
    return JobPlan(job, model_path, spec, adapters, reasons, files, sweep)


def _job_error(job: JobConfig, exc: Exception) -> JobError:
    message = str(exc)
    return JobError(message if f"job {job.name!r}" in message else f"job {job.name!r}: {message}")


def run_jobs(
    jobs: list[JobConfig], overwrite: bool = False, progress: ProgressCallback | None = None
) -> Iterator[JobSummary | JobFailure]:
    """Check every job, then run the good ones one by one, yielding each one's summary or
    failure: first the jobs that failed their check, then the runs in order. A job that fails
    while it runs does not stop the jobs after it."""
    plans: list[JobPlan] = []
    for job in jobs:
        try:
            plans.append(check_job(job))
        except JobError as exc:
            yield JobFailure(job.name, str(exc))
    for plan in plans:
        try:
            yield run_plan(plan, overwrite=overwrite, progress=progress)
        except JobError as exc:
            yield JobFailure(plan.job.name, str(exc))
        except Exception as exc:  # the engine or the disk: this job is lost, the next may run
            logger.error("job %s failed", plan.job.name, exc_info=True)
            message = f"job {plan.job.name!r} failed: {type(exc).__name__}: {exc}"
            yield JobFailure(plan.job.name, message)


def run_job(
    job: JobConfig, overwrite: bool = False, progress: ProgressCallback | None = None
) -> JobSummary:
    return run_plan(check_job(job), overwrite=overwrite, progress=progress)


def _build_engine(plan: JobPlan):
    from slora_batch.engine.engine import Engine  # imports torch and the model code

    job = plan.job
    return Engine(plan.model_path, adapters=job.adapters, config=job.engine, sampling=job.sampling)


def run_plan(
    plan: JobPlan, overwrite: bool = False, progress: ProgressCallback | None = None
) -> JobSummary:
    """Run a checked job over its output directory: resume unless ``overwrite``."""
    job, started = plan.job, time.perf_counter()
    notify = progress or (lambda update: None)
    out = Path(job.output)
    try:
        lock = OutputLock(out)
    except OutputError as exc:
        raise _job_error(job, exc) from exc
    with lock:
        try:
            if overwrite:
                clear_output(out)
            current = fingerprint(plan)
            manifest = _resumable_manifest(plan, current)
            if manifest is not None and read_success(out) is not None:
                complete = _complete_summary(plan, manifest)
                if complete is not None:
                    notify(
                        JobProgress(job.name, "done", complete.stats["rows"], plan.total, 0, 0.0, 0)
                    )
                    return complete
            if manifest is None:
                notify(JobProgress(job.name, "scanning", 0, None, 0, 0.0, 0))
                scan = _scan(plan)
                manifest = {
                    "version": MANIFEST_VERSION,
                    "job": job.name,
                    "fingerprint": current,
                    "scan": scan.to_json(),
                }
                write_manifest(out, manifest)
            scan = InputScan.from_json(manifest["scan"])
            plan.rows_total = scan.rows
            done = done_keys(out)
        except JOB_ERRORS as exc:
            raise _job_error(job, exc) from exc
        total = plan.total
        if done:
            rows = _count(len(done), "row")
            logger.info("job %s: %s already in %s, skipping them", job.name, rows, out)
        schema = part_schema(scan.id_type, scan.keep, scan.json_text)
        items = sorted_windows(_pending(plan, scan, done), window=job.window)
        run = _Run(job.name, len(done), total, notify)
        with OutputWriter(
            out, job.part_rows, lock=lock, schema=schema, part_seconds=job.part_seconds
        ) as writer:
            try:
                pulled = time.perf_counter()
                first = next(items, None)  # the engine is built only when a row is left
                run.read_s = time.perf_counter() - pulled
                if first is not None:
                    notify(JobProgress(job.name, "loading", len(done), total, 0, 0.0, 0))
                    built = time.perf_counter()
                    engine = _build_engine(plan)
                    run.load_s = time.perf_counter() - built
                    with contextlib.closing(engine):  # frees the device for the next job
                        run.feed(engine, chain([first], items), writer)
            except JOB_ERRORS as exc:  # a model the engine cannot load, a file unreadable midway
                raise _job_error(job, exc) from exc
        run.write_s = writer.write_s
        wall_s = time.perf_counter() - started
        job_row, adapter_rows = _stats(out, plan, run, wall_s)
        write_stats(out, job_row, adapter_rows)
        write_success(out, job.name, rows=job_row["rows"])
        notify(
            JobProgress(
                job.name,
                "done",
                job_row["rows"],
                total,
                run.tokens,
                run.elapsed,
                run.resident,
                run.rows,
            )
        )
    logger.info("job %s: %s this run, %.1f s", job.name, _count(writer.rows_written, "row"), wall_s)
    return JobSummary(
        job=job.name,
        output=out.resolve(),
        stats=job_row,
        adapters=adapter_rows,
        rows_skipped=len(done),
        rows_this_run=writer.rows_written,
        errors=run.errors,
        notes=scan.notes(job.columns),
        broken=plan.broken,
    )


def _scan(plan: JobPlan) -> InputScan:
    job = plan.job
    logger.info("job %s: scanning %s", job.name, _count(len(plan.files), "input file"))
    scan = scan_input(
        plan.files, job.columns, job.keep_columns, plan.sweep is not None, reserved=OUTPUT_COLUMNS
    )
    if scan.duplicates:
        raise JobError(f"job {job.name!r}: {scan.duplicates_message()}; nothing was run")
    return scan


def _resumable_manifest(plan: JobPlan, current: dict[str, Any]) -> dict[str, Any] | None:
    """The output's manifest when it describes this job as it is now; None when there is none
    or it is stale but no row was committed under it. Refuses (``JobError``) an output that holds
    rows of other inputs or settings, or rows without a manifest."""
    job, out = plan.job, Path(plan.job.output)
    manifest = read_manifest(out)
    has_rows = bool(part_files(out)) or read_success(out) is not None
    if manifest is None:
        if has_rows:
            raise JobError(
                f"job {job.name!r}: output {str(out)!r} holds parts but no {MANIFEST_FILE}, so "
                "what produced them is unknown (an older slora-batch or another tool); nothing "
                "was run. Re-run with --overwrite to start over, or give the job another output"
            )
        return None
    if manifest.get("version") != MANIFEST_VERSION or "scan" not in manifest:
        changes = [f"manifest version {manifest.get('version')!r} -> {MANIFEST_VERSION}"]
    else:
        changes = fingerprint_changes(manifest.get("fingerprint") or {}, current)
    if not changes:
        return manifest
    if not has_rows:
        logger.info("job %s: starting afresh (%s)", job.name, "; ".join(changes))
        return None
    shown = "; ".join(changes[:CHANGES_SHOWN])
    more = len(changes) - CHANGES_SHOWN
    raise JobError(
        f"job {job.name!r}: output {str(out)!r} holds rows made from other inputs or settings: "
        f"{shown}{f'; and {more} more' if more > 0 else ''}. Nothing was run; re-run with "
        "--overwrite to start over, or give the job another output"
    )


def _complete_summary(plan: JobPlan, manifest: dict[str, Any]) -> JobSummary | None:
    """The summary of a complete job from its stats, or None when they cannot be read."""
    job = plan.job
    try:
        stats = read_stats(job.output)
    except (OSError, pa.ArrowException):
        stats = None
    if stats is None:
        return None
    job_row, adapter_rows = stats
    plan.rows_total = manifest["scan"]["rows"]
    logger.info(
        "job %s: complete already (%s in %s); nothing to do",
        job.name,
        _count(job_row["rows"], "row"),
        job.output,
    )
    return JobSummary(
        job=job.name,
        output=Path(job.output).resolve(),
        stats=job_row,
        adapters=adapter_rows,
        rows_skipped=job_row["rows"],
        rows_this_run=0,
        notes=InputScan.from_json(manifest["scan"]).notes(job.columns),
        broken=plan.broken,
        complete_already=True,
    )


def _pending(plan: JobPlan, scan: InputScan, done: set[str]) -> Iterator[Request | Result]:
    """The job's requests and bad-row results not yet in the output, in input order. A done
    row is skipped before it is turned into a request (only its id and adapter are read)."""
    job = plan.job
    fanout = plan.sweep is not None
    root = input_root(plan.files)
    for row in read_rows(plan.files, job.columns, keep=list(scan.keep), root=root):
        id_, adapter, _ = identity(row, fanout)
        adapters = plan.sweep if fanout else [adapter]
        todo = [a for a in adapters if row_key(id_, a) not in done] if done else adapters
        if not todo:
            continue
        item = to_request(row, job.sampling, fanout)
        if not fanout:
            yield item
            continue
        for name in todo:
            yield dataclasses.replace(item, adapter=name or None)


class _Run:
    """This run's accounting: progress, times, per-adapter spans, a few error messages."""

    def __init__(self, job: str, done: int, total: int | None, notify: ProgressCallback) -> None:
        self.job, self.done, self.total, self.notify = job, done, total, notify
        self.counters = None  # the engine's, once it runs
        self.device: str | None = None  # the engine's device and dtype, once it runs
        self.dtype: str | None = None
        self.rows = 0
        self.tokens = 0
        self.errors: list[str] = []
        self.first_in: dict[str | None, float] = {}  # adapter -> first row handed to the engine
        self.last_out: dict[str | None, float] = {}  # adapter -> its last result
        self.started = time.perf_counter()
        self.load_s = self.read_s = self.write_s = self.engine_s = 0.0

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @property
    def resident(self) -> int:
        return 0 if self.counters is None else self.counters.adapters_resident

    def feed(self, engine, items: Iterator[Request | Result], writer: OutputWriter) -> None:
        """Hand the requests to the engine and write every result as it comes: the engine's,
        and the bad rows' that never reach it (written as the engine pulls past them, so a long
        run of bad rows is never held in memory)."""
        self.counters = engine.counters
        self.device, self.dtype = str(engine.device), str(engine.dtype).removeprefix("torch.")
        self.started = time.perf_counter()
        read_s, write_s = self.read_s, writer.write_s  # before the loop

        def requests() -> Iterator[Request]:
            while True:
                pulled = time.perf_counter()
                item = next(items, None)
                self.read_s += time.perf_counter() - pulled
                if item is None:
                    return
                if isinstance(item, Result):
                    self._done(item, writer)
                else:
                    self.first_in.setdefault(item.adapter, time.perf_counter())
                    writer.tick()  # commits by time also while no row finishes
                    yield item

        for result in engine.generate(requests()):
            self.last_out[result.adapter] = time.perf_counter()
            self._done(result, writer)
        # the loop's time less what it spent reading input and writing parts
        loop_read, loop_write = self.read_s - read_s, writer.write_s - write_s
        self.engine_s = max(self.elapsed - loop_read - loop_write, 0.0)

    def _done(self, result: Result, writer: OutputWriter) -> None:
        writer.write(result)
        self.done += 1
        self.rows += 1
        self.tokens += result.completion_tokens
        if result.error is not None and len(self.errors) < ERROR_EXAMPLES:
            self.errors.append(result.error)
        self.notify(
            JobProgress(
                self.job,
                "running",
                self.done,
                self.total,
                self.tokens,
                self.elapsed,
                self.resident,
                self.rows,
            )
        )


def _stats(
    out_dir: Path, plan: JobPlan, run: _Run, wall_s: float
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The job row and the per-adapter rows of ``stats.parquet`` (see the module docstring)."""
    per_adapter = output_counts(out_dir)
    totals = {key: sum(c[key] for c in per_adapter.values()) for key in COUNT_KEYS}
    counters = run.counters
    engine_s = run.engine_s
    rate = 1.0 / engine_s if engine_s > 0 else 0.0
    previous = _previous_stats(out_dir)
    job_row = {
        **totals,
        "wall_s": wall_s,
        "tokens_per_s": run.tokens * rate,
        "requests_per_s": run.rows * rate,
        "engine_s": engine_s,
        "load_s": getattr(counters, "load_s", None) or run.load_s,
        "warmup_s": getattr(counters, "warmup_s", 0.0),
        "read_s": run.read_s,
        "write_s": run.write_s,
        "adapters_seen": sum(1 for a, c in per_adapter.items() if a is not None and c["ok_rows"]),
        "adapters_broken": len(plan.broken),
        "adapter_loads": getattr(counters, "adapter_loads", 0),
        "adapter_disk_loads": getattr(counters, "disk_loads", 0),
        "adapter_evictions": getattr(counters, "adapter_evictions", 0),
        "prefetch_hits": getattr(counters, "prefetch_hits", 0),
        "peak_pool_pages": getattr(counters, "peak_pages", 0),
        # no engine this run (every row was done): the device of the run that made them
        "device": previous.get("device") or plan.job.engine.device,
        "dtype": previous.get("dtype") or plan.job.engine.dtype,
    }
    if run.device is not None:
        job_row["device"], job_row["dtype"] = run.device, run.dtype
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


def _previous_stats(out_dir: Path) -> dict[str, Any]:
    try:
        stats = read_stats(out_dir)
    except (OSError, pa.ArrowException):
        return {}
    return stats[0] if stats else {}


# -- fingerprint: what decides the rows of an output -------------------------------------------


def fingerprint(plan: JobPlan) -> dict[str, Any]:
    """What decides a job's rows, cheap to take (file sizes and mtimes, no reading): the input
    files, the model's and every adapter's files, the sampling and the job keys that change
    outputs (columns, fanout, keep_columns, max_model_len, dtype). JSON-ready."""
    job = plan.job
    root = input_root(plan.files)
    sources = resolve_sources(job.adapters)
    taken = {
        "input": {relative_name(f, root): _stat(f) for f in plan.files},
        "model": {"model": job.model, "files": _dir_stats(plan.model_path)},
        "adapters": {name: _dir_stats(path) for name, path in sorted(sources.items())},
        "sampling": dataclasses.asdict(job.sampling),
        "job": {
            "columns": job.columns,
            "fanout": job.fanout,
            "keep_columns": job.keep_columns,
            "max_model_len": job.engine.max_model_len,
            "dtype": job.engine.dtype,
        },
    }
    return json.loads(json.dumps(taken))  # tuples -> lists, as read back from the manifest


def _stat(path: Path) -> list[int]:
    stat = Path(path).stat()
    return [stat.st_size, stat.st_mtime_ns]


def _dir_stats(path: Path) -> dict[str, list[int]]:
    """Size and mtime of a file, or of every visible file directly in a directory."""
    path = Path(path)
    if path.is_file():
        return {path.name: _stat(path)}
    if not path.is_dir():
        return {}
    return {
        p.name: _stat(p)
        for p in sorted(path.iterdir())
        if p.is_file() and not p.name.startswith(".")
    }


def fingerprint_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints, in words: "input rows.jsonl changed (size 10 ->
    12)", "sampling.max_new_tokens 8 -> 16", "adapter 'c' added", ..."""
    changes = []
    changes += _files_changes("input", old.get("input", {}), new["input"])
    old_model, new_model = old.get("model", {}), new["model"]
    if old_model.get("model") != new_model["model"]:
        changes.append(f"model {old_model.get('model')!r} -> {new_model['model']!r}")
    else:
        changes += _files_changes("model file", old_model.get("files", {}), new_model["files"])
    old_adapters, new_adapters = old.get("adapters", {}), new["adapters"]
    for name in sorted(set(old_adapters) | set(new_adapters)):
        if name not in new_adapters:
            changes.append(f"adapter {name!r} removed")
        elif name not in old_adapters:
            changes.append(f"adapter {name!r} added")
        else:
            changes += _files_changes(
                f"adapter {name!r} file", old_adapters[name], new_adapters[name]
            )
    for section in ("sampling", "job"):
        before, after = old.get(section, {}), new[section]
        prefix = "sampling." if section == "sampling" else ""
        for key in sorted(set(before) | set(after)):
            if before.get(key) != after.get(key):
                changes.append(f"{prefix}{key} {before.get(key)!r} -> {after.get(key)!r}")
    return changes


def _files_changes(what: str, old: dict[str, list], new: dict[str, list]) -> list[str]:
    changes = []
    for name in sorted(set(old) | set(new)):
        if name not in new:
            changes.append(f"{what} {name} removed")
        elif name not in old:
            changes.append(f"{what} {name} added")
        elif old[name][0] != new[name][0]:
            changes.append(
                f"{what} {name} changed (size {old[name][0]:,} -> {new[name][0]:,} bytes)"
            )
        elif old[name][1] != new[name][1]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(new[name][1] / 1e9))
            changes.append(f"{what} {name} changed (modified {when})")
    return changes


def _count(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


# -- preview --------------------------------------------------------------------------------


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
    parts = part_files(job.output)
    if not parts:
        return []
    int_ids = pq.read_schema(parts[0][1]).field("id").type == pa.int64()
    prompts: dict[Any, str] = {}
    try:
        files = iter_input_files(job.input)
        for row in read_rows(files, job.columns):
            if len(prompts) == scan:
                break
            item = to_request(row, job.sampling, job.fanout is not None)
            if isinstance(item, Request) and not isinstance(item.id, RowSource):
                # as stored: an int64 id column means every id is an int
                prompts.setdefault(item.id if int_ids else str(item.id), _prompt_text(item))
    except InputError:
        return []
    if not prompts:
        return []
    found: dict[Any, list[dict[str, Any]]] = {}
    for _, path in parts:
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
        PreviewRow(str(i), r["adapter"], prompts[i], r["text"], r["finish_reason"])
        for i in ids
        for r in sorted(found[i], key=lambda r: (r["adapter"] is not None, r["adapter"] or ""))
    ]
    return rows[:limit]


def _prompt_text(request: Request) -> str:
    if request.prompt is not None:
        return request.prompt
    users = [m["content"] for m in request.messages or [] if m["role"] == "user"]
    return users[-1] if users else (request.messages or [{"content": ""}])[-1]["content"]
