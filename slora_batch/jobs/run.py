"""Running a job in this process: one engine (or ``engine.data_parallel`` workers) fed the rows
left, sorted, into parts.

``run_job`` checks a job (``check_job``: model config, adapter headers, input files, output
directory, fan-out; no weights) and runs it; ``run_plan`` runs a checked one through the job's
lifecycle (``lifecycle.run_output``: lock, manifest, resume, stats, marker) with this process's
executor, ``EngineRows``: the pending rows in bounded windows sorted by adapter and prompt
(``ordering.sorted_windows``; an eval job's come adapter by adapter already:
``resume.adapter_major``), the engine built only when a row is left, and every result written by
a ``RunRecord`` into an ``OutputWriter`` as it comes.

Jobs of every kind, an eval job's lm-eval tasks included, run through ``slora_batch.runner``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from itertools import chain
from pathlib import Path
from typing import Any

from slora_batch.engine.requests.request import Request, Result
from slora_batch.jobs.check import JobError, JobPlan, check_job
from slora_batch.jobs.config import JobConfig
from slora_batch.jobs.feed import RunRecord
from slora_batch.jobs.lifecycle import Pending, run_output
from slora_batch.jobs.manifest import output_schema
from slora_batch.jobs.ordering import adapter_group, sort_key, sorted_windows
from slora_batch.jobs.progress import JobProgress, ProgressCallback
from slora_batch.jobs.resume import done_samples, pending_items
from slora_batch.jobs.samples import DoneSamples
from slora_batch.jobs.summary import JobSummary
from slora_batch.jobs.writer import OutputWriter

Items = Iterator[tuple[Request | Result, int]]  # pending items, each with the rows it owes


def run_job(
    job: JobConfig, overwrite: bool = False, progress: ProgressCallback | None = None
) -> JobSummary:
    """Check ``job`` and run it in this process; resume unless ``overwrite``. An eval job runs
    through ``slora_batch.runner.run_job``, which builds its input (lm-eval's requests) first
    and scores its rows."""
    if job.eval is not None:
        raise JobError(
            f"job {job.name!r} has an eval section: it runs through slora_batch.runner.run_job "
            "(lm-eval's requests are its input)"
        )
    return run_plan(check_job(job), overwrite=overwrite, progress=progress)


def run_plan(
    plan: JobPlan,
    overwrite: bool = False,
    progress: ProgressCallback | None = None,
    on_result: Callable[[Result], None] | None = None,
    build_engine: Callable[[JobPlan], Any] | None = None,
) -> JobSummary:
    """Run a checked job over its output directory: resume unless ``overwrite``. ``on_result``
    is handed every result of this run once it is written (an eval job's scoring);
    ``build_engine`` gives the engine when a row is left (an eval job's, built beside lm-eval's
    preparation), else ``_build_engine``; either way the run closes it."""
    rows = EngineRows(build_engine or _build_engine, on_result)
    return run_output(plan, Path(plan.job.output), rows, overwrite, progress)


def _build_engine(plan: JobPlan):
    """An ``Engine``, or a ``DataParallelEngine`` of ``engine.data_parallel`` workers."""
    from slora_batch.engine.parallel.data_parallel import (
        open_engine,  # imports torch and the model code
    )

    job = plan.job
    return open_engine(plan.model_path, plan.sources, job.engine, job.sampling)


class EngineRows:
    """A job's rows in this process (``lifecycle.Rows``): the engine ``build_engine`` gives,
    fed the pending items; ``on_result`` sees every result once it is written."""

    gpu = None  # the fingerprint's device: what this process sees

    def __init__(
        self,
        build_engine: Callable[[JobPlan], Any],
        on_result: Callable[[Result], None] | None = None,
    ) -> None:
        self.build_engine, self.on_result = build_engine, on_result

    def clear(self, out: Path) -> None:
        """Nothing of this executor's own: the job's files are all there is."""

    def open(self, out: Path) -> DoneSamples:
        return done_samples(out)

    def run(self, pending: Pending) -> RunRecord:
        """Write the pending rows' results as parts (of the columns the manifest records);
        the engine is built only when a row is left, and closed after (the device is free
        for the next job)."""
        plan, name = pending.plan, pending.plan.job.name
        run = RunRecord(name, len(pending.done), plan.total, pending.notify, self.on_result)
        job = plan.job
        with OutputWriter(
            pending.out,
            job.part_rows,
            lock=pending.lock,
            schema=output_schema(pending.manifest),
            part_seconds=job.part_seconds,
        ) as writer:
            pulled = time.perf_counter()
            items = _ordered(plan, pending)
            first = next(items, None)
            run.read_s = time.perf_counter() - pulled
            if first is not None:
                self._feed(pending, run, chain([first], items), writer)
        run.write_s = writer.write_s
        return run

    def _feed(self, pending: Pending, run: RunRecord, items: Items, writer: OutputWriter) -> None:
        plan = pending.plan
        pending.notify(JobProgress(run.job, "loading", run.done, run.total, 0, 0.0, 0))
        built = time.perf_counter()
        engine = self.build_engine(plan)
        run.load_s = time.perf_counter() - built
        with contextlib.closing(engine):
            recorded = pending.manifest["fingerprint"]["engine"]
            check_resolution(plan.job.name, str(pending.out), engine, recorded)
            run.feed(engine, items, writer)


def _ordered(plan: JobPlan, pending: Pending) -> Items:
    """The pending items in bounded windows sorted by adapter, then prompt (shared prefixes
    meet); an eval job's come adapter by adapter already (``resume.adapter_major``)."""
    items = pending_items(plan, pending.scan, pending.done)
    if plan.job.eval is not None:
        return items
    return sorted_windows(
        items,
        window=plan.job.window,
        key=lambda pair: sort_key(pair[0]),
        group=lambda pair: adapter_group(pair[0]),
    )


def check_resolution(name: str, output: str, engine, recorded: dict[str, str]) -> None:
    """Refuse to feed an engine that runs on another device kind or dtype than the manifest
    records (``resolution.resolve`` decided it before the engine was built): a safeguard, so
    rows of two precisions never share an output."""
    built = {
        "device": str(engine.device).split(":")[0].split()[0],  # "cuda:0", "cuda x2" -> "cuda"
        "dtype": str(engine.dtype).removeprefix("torch."),
    }
    wrong = [
        f"{key} {recorded[key]} -> {built[key]}" for key in built if built[key] != recorded[key]
    ]
    if wrong:
        raise JobError(
            f"job {name!r}: output {output!r} records rows made on {recorded['device']} "
            f"in {recorded['dtype']}, but the engine built for this run differs: "
            f"{'; '.join(wrong)}. Nothing was run"
        )
