"""The output directory's files, and the atomic commit every one of them is written with.

A job writes ``part-NNNNN.parquet`` parts, ``_stats.parquet``, the manifest ``_job.json`` (read
and written here; what it holds is ``manifest.py``'s) and, last, the completion marker
``_SUCCESS``. Every file but the parts starts with "_" (or "."), so readers of a directory of
Parquet files (pyarrow datasets, pandas, Spark) read the parts alone; earlier versions named the
stats ``stats.parquet``, which is still read and is removed when the stats are next written;
``.lock`` exists while a run holds the directory (``lock.py``). ``commit_file`` writes each to a
hidden temp name in the same directory, fsyncs it and ``os.replace``s it, so a committed file is
always whole, also after kill -9. An output on another filesystem (``fsio.FsDir``, the Ray
runner's) is read and written through it, each file committed in one upload.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slora_batch.jobs.fsio import FsDir

logger = logging.getLogger(__name__)

PART_RE = re.compile(r"^part-(\d+)\.parquet$")
STATS_FILE = "_stats.parquet"
OLD_STATS_FILE = "stats.parquet"  # an earlier version's name: read as data by dataset readers
SUCCESS_FILE = "_SUCCESS"
MANIFEST_FILE = "_job.json"  # what the rows were produced from (``manifest.py`` writes it)
LOCK_FILE = ".lock"  # flock'd by the running job, removed when it releases the lock
TMP_MARK = ".tmp-"  # temp files are ".<final name>.tmp-<host>-<pid>-<random>"


class OutputError(ValueError):
    """The output directory cannot be used; the message names the path and why."""


def commit_file(path: Path, write: Callable[[Any], Any]) -> None:
    """Write ``path`` atomically: temp file in the same directory, fsync, rename, fsync the dir."""
    # unique per host and process (Ray actors on two hosts may share a pid and a directory)
    unique = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    temp = path.with_name(f".{path.name}{TMP_MARK}{unique}")
    try:
        with open(temp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def commit(out_dir: str | Path | FsDir, name: str, write: Callable[[Any], Any]) -> Path:
    """Commit file ``name`` of an output directory: ``commit_file`` on the local disk, one
    upload on a ``FsDir`` (``fsio``); the file's path (on its filesystem)."""
    if isinstance(out_dir, FsDir):
        out_dir.commit(name, write)
        return Path(out_dir.child(name))
    path = Path(out_dir) / name
    commit_file(path, write)
    return path


def part_files(out_dir: str | Path | FsDir) -> list[tuple[int, Path]]:
    """(number, path) of the committed parts, by number; [] when the directory does not exist.
    On a ``FsDir`` the paths are paths on its filesystem."""
    if isinstance(out_dir, FsDir):
        found = ((PART_RE.match(name), name) for name in out_dir.names())
        return sorted((int(m.group(1)), Path(out_dir.child(name))) for m, name in found if m)
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = ((PART_RE.match(p.name), p) for p in out_dir.iterdir())
    return sorted((int(m.group(1)), p) for m, p in found if m)


def clear_output(out_dir: str | Path | FsDir) -> None:
    """Remove what a job wrote (parts, stats, manifest, marker, temp files); other files stay."""
    if isinstance(out_dir, FsDir):
        for name in out_dir.names():
            if _ours(name):
                logger.info("removing %s", out_dir.child(name))
                out_dir.remove(name)
        return
    for path in Path(out_dir).iterdir():
        if _ours(path.name) or (path.name.startswith(".") and TMP_MARK in path.name):
            logger.info("removing %s", path)
            path.unlink()


def _ours(name: str) -> bool:
    ours = (STATS_FILE, OLD_STATS_FILE, SUCCESS_FILE, MANIFEST_FILE)
    return bool(PART_RE.match(name)) or name in ours


def write_manifest(out_dir: str | Path | FsDir, manifest: dict[str, Any]) -> Path:
    """Write ``MANIFEST_FILE`` (JSON) atomically (what it holds: ``manifest.py``)."""
    text = json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False)
    return commit(out_dir, MANIFEST_FILE, lambda handle: handle.write(text.encode() + b"\n"))


def read_manifest(out_dir: str | Path | FsDir) -> dict[str, Any] | None:
    """The manifest, or None when there is none; ``OutputError`` when it is not one."""
    if isinstance(out_dir, FsDir):
        path = out_dir.child(MANIFEST_FILE)
        read = lambda: out_dir.read(MANIFEST_FILE)  # noqa: E731
    else:
        path = Path(out_dir) / MANIFEST_FILE
        if not path.is_file():
            return None
        read = path.read_text
    try:
        text = read()
        if text is None:
            return None
        manifest = json.loads(text)
    except (OSError, ValueError) as exc:
        raise OutputError(f"{path}: unreadable job manifest: {exc}") from exc
    if not isinstance(manifest, dict):
        raise OutputError(f"{path}: unreadable job manifest: not a JSON object")
    return manifest


def remove_file(out_dir: str | Path | FsDir, name: str) -> None:
    """Remove file ``name`` of an output directory when it is there."""
    if isinstance(out_dir, FsDir):
        out_dir.remove(name)
    else:
        (Path(out_dir) / name).unlink(missing_ok=True)


def write_success(out_dir: str | Path | FsDir, job: str, rows: int) -> Path:
    """Write the completion marker (last, after parts and stats): JSON with job, rows, time."""
    marker = {"job": job, "rows": rows, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    text = json.dumps(marker).encode() + b"\n"
    return commit(out_dir, SUCCESS_FILE, lambda handle: handle.write(text))


def read_success(out_dir: str | Path | FsDir) -> dict[str, Any] | None:
    """The completion marker's contents, or None when the job has not completed."""
    if isinstance(out_dir, FsDir):
        data = out_dir.read(SUCCESS_FILE)
        return None if data is None else json.loads(data)
    path = Path(out_dir) / SUCCESS_FILE
    return json.loads(path.read_text()) if path.is_file() else None
