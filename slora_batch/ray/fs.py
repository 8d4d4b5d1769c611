"""Paths through ``pyarrow.fs``: a local path or a URI (``file://``, ``s3://``, ``gs://``, any
filesystem pyarrow knows) into a filesystem and a path on it, and a part committed atomically
there: on a local filesystem by the job tool's ``commit_file`` (temp file, fsync, rename), on an
object store by one upload, which stores the whole object or nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from slora_batch.jobs.outdir import commit_file


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path on it) of a local path or a URI."""
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(uri)


def local_path(uri: str) -> Path | None:
    """The local path a path or URI names, or None when it is on another filesystem."""
    filesystem, path = resolve(uri)
    return Path(path) if isinstance(filesystem, pafs.LocalFileSystem) else None


def commit_table(uri: str, name: str, table: pa.Table) -> None:
    """Write ``table`` as Parquet file ``name`` in directory ``uri``; readers see the whole file
    or the previous one, never part of one."""
    filesystem, base = resolve(uri)
    if isinstance(filesystem, pafs.LocalFileSystem):
        commit_file(Path(base) / name, lambda handle: pq.write_table(table, handle))
        return
    with filesystem.open_output_stream(f"{base.rstrip('/')}/{name}") as handle:
        pq.write_table(table, handle)
