"""Where a Ray job's files live: its input and output resolved through ``pyarrow.fs`` (a local
path, ``file://``, ``s3://``, ``gs://``, any filesystem pyarrow knows, or an explicit one), the
output's lock (local disk only), and a part committed atomically: on the local disk by the job
tool's ``commit_file`` (temp file, fsync, rename), elsewhere (``jobs.fsio.FsDir``) in one upload,
which on object stores stores the whole object or nothing."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.engine.config import ConfigError
from slora_batch.jobs.check import JobError
from slora_batch.jobs.config import JobConfig
from slora_batch.jobs.fsio import FsDir, open_fs
from slora_batch.jobs.lock import OutputLock
from slora_batch.jobs.outdir import SUCCESS_FILE, TMP_MARK, commit

logger = logging.getLogger(__name__)


def commit_table(output: str | FsDir, name: str, table: pa.Table) -> None:
    """Write ``table`` as Parquet file ``name`` in directory ``output`` (a local path or a
    ``FsDir``); readers see the whole file or the previous one, never part of one."""
    out = output if isinstance(output, FsDir) else Path(output)
    commit(out, name, lambda handle: pq.write_table(table, handle))


def resolved(job: JobConfig, filesystem) -> tuple[JobConfig, Any, FsDir | None]:
    """The job with its input and output as paths on their filesystems, the input's filesystem
    (None: the local disk) and the output directory when it is not on the local disk."""
    (input_fs, input_path), (output_fs, output_path) = (
        open_fs(job.input, filesystem),
        open_fs(job.output, filesystem),
    )
    try:
        job = replace(job, input=input_path, output=output_path)
    except ConfigError as exc:
        raise JobError(f"job {job.name!r}: {exc}") from exc
    return job, input_fs, None if output_fs is None else FsDir(output_fs, output_path)


_warned_unlocked: set[str] = set()


def output_lock(out: Path | FsDir):
    """The output's ``OutputLock`` on the local disk. Other filesystems have no ``flock`` and
    object stores no atomic create-if-absent, so nothing is locked there: a second run on the
    same output would write the same part names beside the first (logged once per output)."""
    if isinstance(out, Path):
        return OutputLock(out)
    if str(out) not in _warned_unlocked:
        _warned_unlocked.add(str(out))
        logger.warning(
            "output %s is not on the local disk and is not locked: run one job at a time on it",
            out,
        )
    return contextlib.nullcontext()


def shown(out: Path | FsDir) -> Path:
    return out.resolve() if isinstance(out, Path) else Path(out.path)


def remove_leftovers(out: Path | FsDir) -> None:
    if isinstance(out, FsDir):  # committed in one upload: no temp files
        out.remove(SUCCESS_FILE)
        return
    for path in out.iterdir():
        if (path.name.startswith(".") and TMP_MARK in path.name) or path.name == SUCCESS_FILE:
            path.unlink(missing_ok=True)


def remove_name(out: Path | FsDir, name: str) -> None:
    if isinstance(out, FsDir):
        if out.exists(name):
            out.remove(name)
    else:
        (out / name).unlink(missing_ok=True)
