"""Where a Ray job's files live: its input and output resolved through ``pyarrow.fs`` (a local
path, ``file://``, ``s3://``, ``gs://``, any filesystem pyarrow knows, or an explicit one), a
part committed atomically (on the local disk by the job tool's ``commit_file``: temp file,
fsync, rename; elsewhere, ``jobs.fsio.FsDir``, in one upload, which on object stores stores the
whole object or nothing), and the leftovers of actors that died mid-commit."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.engine.config import ConfigError
from slora_batch.jobs.check import JobError
from slora_batch.jobs.config import JobConfig
from slora_batch.jobs.fsio import FsDir, open_fs
from slora_batch.jobs.outdir import SUCCESS_FILE, TMP_MARK, commit


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


def remove_leftovers(out: Path | FsDir) -> None:
    """Remove the complete marker and the temp files of commits that never finished."""
    if isinstance(out, FsDir):  # committed in one upload: no temp files
        out.remove(SUCCESS_FILE)
        return
    for path in out.iterdir():
        if (path.name.startswith(".") and TMP_MARK in path.name) or path.name == SUCCESS_FILE:
            path.unlink(missing_ok=True)
