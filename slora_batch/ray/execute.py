"""The Ray Data pipeline of a job run: read tasks cut the pending rows into units, a shuffle
groups each unit, engine actors commit one part a unit; the driver consumes their summaries.

Sizing: the engine actors never take every CPU of the cluster. Ray Data's own tasks (the reads,
the shuffle's map and reduce) need a CPU to run, and actors holding all of them left the first
read task ``backpressured`` for good on a 2-core machine. Each actor asks for
``min(1, (cpus - 1) / replicas)`` CPUs (at least ``MIN_ACTOR_CPUS``); GPU replicas beyond the
cluster's GPUs are cut (said in one line). An engine uses the threads it wants either way: the
reservation only decides what Ray schedules beside it.

Stall watch: when no unit has finished for ``stall_s`` seconds the run fails with a message that
names the first stage that has not finished (the starved one) and the cluster's free resources.
"""

from __future__ import annotations

import logging
import pickle
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from slora_batch.jobs.check import JobError, JobPlan
from slora_batch.jobs.fsio import FsDir
from slora_batch.jobs.manifest import output_schema
from slora_batch.jobs.outdir import read_manifest
from slora_batch.jobs.reader import input_root
from slora_batch.jobs.resume import pending_rows
from slora_batch.jobs.samples import DoneSamples
from slora_batch.jobs.scan import InputScan
from slora_batch.ray.fence import unit_key
from slora_batch.ray.stage import ITEM, UNIT, EngineActor, adapter_bucket

logger = logging.getLogger(__name__)

MIN_ACTOR_CPUS = 0.25
PIPELINE_CPUS = 1.0  # kept free for Ray Data's read and shuffle tasks
STOP_S = 30.0  # an interrupted run waits this long for the stopped execution's thread


class RayStalled(JobError):
    """No unit finished for the set time; the message names the stage that starves."""


def actor_resources(replicas: int, gpus_per_replica: float) -> tuple[int, float]:
    """(replicas, CPUs per actor) that leave the pipeline's tasks room on this cluster."""
    import ray

    total = ray.cluster_resources()
    cpus, gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
    if gpus_per_replica and replicas * gpus_per_replica > gpus:
        fit = int(gpus // gpus_per_replica)
        if fit < 1:
            raise JobError(
                f"--gpus-per-replica {gpus_per_replica}: the Ray cluster has {gpus:g} GPUs"
            )
        logger.warning(
            "Ray: %d replicas of %g GPUs each do not fit the cluster's %g GPUs; running %d",
            replicas,
            gpus_per_replica,
            gpus,
            fit,
        )
        replicas = fit
    per_actor = max(MIN_ACTOR_CPUS, min(1.0, (cpus - PIPELINE_CPUS) / replicas))
    logger.info(
        "Ray: %d engine actors of %g CPU each (the cluster has %g CPUs, %g GPUs)",
        replicas,
        per_actor,
        cpus,
        gpus,
    )
    return replicas, per_actor


def execute(
    plan: JobPlan,
    scan: InputScan,
    done: DoneSamples,
    settings,
    out: Path | FsDir,
    run: int,
    on_part: Callable[[dict[str, Any]], None],
) -> list[dict[str, Any]]:
    """Read, group into units and generate on Ray; one summary per committed part, each also
    handed to ``on_part`` as it comes."""
    import ray.data

    job = plan.job
    files = [{"file": str(f), "index": i} for i, f in enumerate(plan.files)]
    reads = {
        "plan": plan,
        "scan": scan,
        "done": done,
        "root": input_root(plan.files, plan.input_fs),
        "block_rows": settings.block_rows or job.part_rows,
        "buckets": settings.buckets,
    }
    units = ray.data.from_items(files, override_num_blocks=len(files)).map_batches(
        read_units, batch_size=1, batch_format="pyarrow", fn_kwargs=reads
    )
    actor = {
        "model": str(plan.model_path),
        "adapters": plan.sources,  # Hub names resolved to local snapshots by check_job
        "engine": job.engine,
        "sampling": job.sampling,
        "schema": output_schema(read_manifest(out)),  # the columns the job's manifest records
        "output": out if isinstance(out, FsDir) else str(out),
        "run": run,
    }
    replicas, cpus = actor_resources(settings.replicas, settings.gpus_per_replica)
    parts = units.groupby(UNIT, num_partitions=max(replicas * 2, 2)).map_groups(
        EngineActor,
        fn_constructor_kwargs=actor,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=replicas),
        num_cpus=cpus,
        num_gpus=settings.gpus_per_replica or None,
    )
    return _consume(parts, settings.stall_s, on_part, job.name)


def _consume(parts, stall_s: float, on_part, job: str) -> list[dict[str, Any]]:
    """The summaries of ``parts``, consumed on a thread while this one watches for a stall
    (and stays where a signal's exception can unwind it, never inside Ray's calls)."""
    got: queue.Queue = queue.Queue()
    executors: list = []  # Ray Data's streaming executor, once made (to read, and to stop)
    create = parts._create_executor  # Ray Data keeps it only once the first output is out

    def created():
        executors.append(create())
        return executors[-1]

    parts._create_executor = created

    def pull() -> None:
        try:
            for row in parts.iter_rows():
                got.put(("row", row))
            got.put(("end", None))
        except BaseException as exc:  # handed to the driver's thread, raised there
            got.put(("error", exc))

    puller = threading.Thread(target=pull, name="ray-parts", daemon=True)
    puller.start()
    summaries: list[dict[str, Any]] = []
    moved = time.monotonic()
    try:
        while True:
            try:
                kind, value = got.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() - moved > stall_s:
                    raise RayStalled(_stall_message(executors, job, stall_s)) from None
                continue
            if kind == "end":
                return summaries
            if kind == "error":
                raise value
            moved = time.monotonic()
            summaries.append(value)
            on_part(value)
    except BaseException:
        _stop(executors)
        puller.join(timeout=STOP_S)  # ended before Ray is shut down, or it would start Ray anew
        raise


def _stop(executors: list) -> None:
    for executor in executors:
        try:
            executor.shutdown(force=True)
        except Exception:  # already stopping: nothing more to do
            logger.debug("stopping the Ray Data execution", exc_info=True)


def _stall_message(executors: list, job: str, stall_s: float) -> str:
    import ray

    stage = "unknown (Ray Data's executor state is not readable)"
    try:  # Ray Data's executor: the first operator not completed is the one that starves
        executor = executors[-1]
        completed = executor._has_op_completed
        waiting = [op.name for op in executor._topology if not completed.get(op, False)]
        stage = next(name for name in waiting if name != "Input")
    except Exception:
        logger.debug("reading Ray Data's executor state", exc_info=True)
    free = {k: round(v, 2) for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
    total = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
    return (
        f"job {job!r}: no unit finished on Ray for {stall_s:g} s; stage {stage} is starved "
        f"(cluster resources {total}, free {free}); committed parts are kept, re-run to resume"
    )


def read_units(
    batch: pa.Table,
    plan: JobPlan,
    scan: InputScan,
    done: DoneSamples,
    root: Path,
    block_rows: int,
    buckets: int,
) -> pa.Table:
    """A Ray read task: one input file's pending items, pickled, each with its unit key
    (``fence.unit_key``: the file's index, the row's block of ``block_rows``, the adapter's
    bucket of ``buckets``)."""
    keys, items = [], []
    for file, index in zip(
        batch.column("file").to_pylist(), batch.column("index").to_pylist(), strict=True
    ):
        start = sum(scan.file_rows[:index])  # the file's first row_index
        for row, item, _ in pending_rows(plan, scan, done, [Path(file)], root, start):
            bucket = adapter_bucket(item.adapter, buckets)
            keys.append(unit_key(index, row.number // block_rows, bucket))
            items.append(pickle.dumps(item))
    return pa.table({UNIT: pa.array(keys, pa.string()), ITEM: pa.array(items, pa.binary())})
