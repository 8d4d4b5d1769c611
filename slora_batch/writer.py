"""The output directory: Parquet parts written as rows finish, resume keys, counts, stats, the
completion marker and the lock.

``part-NNNNN.parquet`` files of ``PART_SCHEMA``. Every file is written to a hidden temp name in
the same directory, fsync'd and ``os.replace``d, so a committed part is always whole, also after
kill -9. Ids are stored as strings (an int id 7 becomes "7"); the resume key of a row is
``row_key(id, adapter)``. One run at a time: ``OutputLock`` holds an ``flock`` on ``LOCK_FILE``
in the directory while a writer is open (the kernel drops it when the process dies).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.request import Result

logger = logging.getLogger(__name__)

PART_RE = re.compile(r"^part-(\d+)\.parquet$")
STATS_FILE = "stats.parquet"
SUCCESS_FILE = "_SUCCESS"
LOCK_FILE = ".lock"  # flock'd by the running job; left in place (removing it would race)
TMP_MARK = ".tmp-"  # temp files are ".<final name>.tmp-<pid>"
PART_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("adapter", pa.string()),  # null = base model
        pa.field("text", pa.string(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),  # generated ids only
        pa.field("prompt_tokens", pa.int32(), nullable=False),
        pa.field("completion_tokens", pa.int32(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),  # stop | length | error
        pa.field("error", pa.string()),  # null when fine
    ]
)
STATS_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),  # "job" or "adapter"
        ("adapter", pa.string()),  # adapter rows: name, null = base model
        ("rows", pa.int64()),
        ("ok_rows", pa.int64()),
        ("error_rows", pa.int64()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("wall_s", pa.float64()),
        ("tokens_per_s", pa.float64()),  # completion tokens / wall_s
        ("requests_per_s", pa.float64()),
        ("adapters_seen", pa.int64()),
        ("adapter_loads", pa.int64()),
        ("adapter_evictions", pa.int64()),
        ("prefetch_hits", pa.int64()),
        ("peak_pool_pages", pa.int64()),
        ("device", pa.string()),
        ("dtype", pa.string()),
        ("tokens", pa.int64()),  # adapter rows: completion tokens of the adapter's rows
        ("seconds", pa.float64()),  # adapter rows: time the adapter's rows were running
    ]
)


class OutputError(ValueError):
    """The output directory cannot be used; the message names the path and why."""


def row_key(id_: Any, adapter: str | None) -> tuple[str, str | None]:
    """Resume key of an output row: (id as stored, adapter with "" as None)."""
    return str(id_), adapter or None


def done_keys(out_dir: str | Path, key: Callable[[Any, str | None], Hashable] = row_key) -> set:
    """Keys of the rows in committed parts; temp files are never read."""
    keys: set = set()
    for _, path in part_files(Path(out_dir)):
        try:
            table = pq.read_table(path, columns=["id", "adapter"])
        except (OSError, pa.ArrowException) as exc:
            raise OutputError(f"{path}: committed part is unreadable: {exc}") from exc
        keys.update(
            key(i, a)
            for i, a in zip(table["id"].to_pylist(), table["adapter"].to_pylist(), strict=True)
        )
    return keys


def done_ids(out_dir: str | Path) -> set[str]:
    """Ids (as strings) of the rows in committed parts."""
    return done_keys(out_dir, key=lambda id_, adapter: id_)


def part_files(out_dir: str | Path) -> list[tuple[int, Path]]:
    """(number, path) of the committed parts, by number; [] when the directory does not exist."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = ((PART_RE.match(p.name), p) for p in out_dir.iterdir())
    return sorted((int(m.group(1)), p) for m, p in found if m)


COUNT_KEYS = ("rows", "ok_rows", "error_rows", "prompt_tokens", "completion_tokens")


def output_counts(out_dir: str | Path) -> dict[str | None, dict[str, int]]:
    """Rows, ok and error rows, prompt and completion tokens per adapter over every committed
    part (None = base model)."""
    counts: dict[str | None, dict[str, int]] = {}
    for _, path in part_files(out_dir):
        table = pq.read_table(
            path, columns=["adapter", "finish_reason", "prompt_tokens", "completion_tokens"]
        )
        grouped = table.group_by(["adapter", "finish_reason"]).aggregate(
            [([], "count_all"), ("prompt_tokens", "sum"), ("completion_tokens", "sum")]
        )
        for row in grouped.to_pylist():
            c = counts.setdefault(row["adapter"], dict.fromkeys(COUNT_KEYS, 0))
            c["rows"] += row["count_all"]
            c["error_rows" if row["finish_reason"] == "error" else "ok_rows"] += row["count_all"]
            c["prompt_tokens"] += row["prompt_tokens_sum"]
            c["completion_tokens"] += row["completion_tokens_sum"]
    return counts


class OutputLock:
    """An exclusive, non-blocking ``flock`` on ``out_dir/LOCK_FILE`` (the directory is created).

    A second holder, in this process or another, gets ``OutputError`` naming the pid that holds
    it. Released by ``release`` or when the process exits, however it exits.
    """

    def __init__(self, out_dir: str | Path) -> None:
        import fcntl  # POSIX only, like the atomic renames the writer relies on

        self.path = Path(os.path.abspath(out_dir)) / LOCK_FILE  # abspath: "a/../b" reads "b"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.path, "a+")  # noqa: SIM115 -- held until release()
        try:
            fcntl.flock(self._handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._handle.seek(0)
            holder = self._handle.read().strip() or "?"
            self._handle.close()
            raise OutputError(
                f"output directory {str(self.path.parent)!r} is in use by another run "
                f"(pid {holder}, lock file {self.path.name}); wait for it or stop it"
            ) from None
        self._handle.seek(0)
        self._handle.truncate()
        self._handle.write(f"{os.getpid()}\n")
        self._handle.flush()

    def release(self) -> None:
        if not self._handle.closed:
            self._handle.close()  # closing the last descriptor drops the flock

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class OutputWriter:
    """Buffers results and commits a part every ``part_rows`` rows (and on ``close``).

    Opening takes the directory's ``OutputLock`` (unless the caller passes one it holds), removes
    stale temp files and the completion marker (the job is incomplete until ``write_success``);
    ``overwrite`` also removes parts and stats. Part numbers continue after the highest committed
    part. ``close`` commits the buffer and releases a lock the writer took itself.
    """

    def __init__(
        self,
        out_dir: str | Path,
        part_rows: int,
        overwrite: bool = False,
        lock: OutputLock | None = None,
    ) -> None:
        if not isinstance(part_rows, int) or part_rows < 1:
            raise ValueError(f"part_rows must be an integer >= 1, got {part_rows!r}")
        self.out_dir = Path(out_dir)
        self.part_rows = part_rows
        self._own_lock = lock is None
        self._lock = OutputLock(self.out_dir) if lock is None else lock
        for path in self.out_dir.iterdir():
            stale_temp = path.name.startswith(".") and TMP_MARK in path.name
            ours = PART_RE.match(path.name) or path.name == STATS_FILE
            if stale_temp or path.name == SUCCESS_FILE or (overwrite and ours):
                logger.info("removing %s", path)
                path.unlink()
        parts = part_files(self.out_dir)
        self.next_part = parts[-1][0] + 1 if parts else 0
        self.rows_written = 0
        self._buffer: dict[str, list] = {name: [] for name in PART_SCHEMA.names}

    def write(self, result: Result) -> None:
        if result.finish_reason not in ("stop", "length", "error"):
            raise ValueError(
                f"row {result.id!r}: finish_reason {result.finish_reason!r} is not stop, length or error"
            )
        buffer = self._buffer
        buffer["id"].append(str(result.id))
        buffer["adapter"].append(result.adapter or None)
        buffer["text"].append(result.text)
        buffer["token_ids"].append(result.token_ids)
        buffer["prompt_tokens"].append(result.prompt_tokens)
        buffer["completion_tokens"].append(result.completion_tokens)
        buffer["finish_reason"].append(result.finish_reason)
        buffer["error"].append(result.error)
        if len(buffer["id"]) >= self.part_rows:
            self.flush()

    def flush(self) -> None:
        """Commit the buffered rows as the next part (nothing when the buffer is empty)."""
        rows = len(self._buffer["id"])
        if rows == 0:
            return
        table = pa.table(self._buffer, schema=PART_SCHEMA)
        path = self.out_dir / f"part-{self.next_part:05d}.parquet"
        _commit(path, lambda handle: pq.write_table(table, handle))
        logger.debug("committed %s (%d rows)", path, rows)
        self.next_part += 1
        self.rows_written += rows
        self._buffer = {name: [] for name in PART_SCHEMA.names}

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self._own_lock:
                self._lock.release()

    def __enter__(self) -> OutputWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()  # buffered rows are finished results: keep them even when the job failed


def write_stats(
    out_dir: str | Path, job_row: dict[str, Any], adapter_rows: list[dict[str, Any]]
) -> Path:
    """Write ``stats.parquet``: one row kind="job", then one kind="adapter" per adapter.
    Keys must be ``STATS_SCHEMA`` names; missing ones are null."""
    rows = [{**job_row, "kind": "job"}] + [{**row, "kind": "adapter"} for row in adapter_rows]
    for row in rows:
        unknown = sorted(set(row) - set(STATS_SCHEMA.names))
        if unknown:
            raise ValueError(f"stats {row['kind']} row: unknown column {unknown[0]!r}")
    table = pa.Table.from_pylist(rows, schema=STATS_SCHEMA)
    path = Path(out_dir) / STATS_FILE
    _commit(path, lambda handle: pq.write_table(table, handle))
    return path


def write_success(out_dir: str | Path, job: str, rows: int) -> Path:
    """Write the completion marker (last, after parts and stats): JSON with job, rows, time."""
    marker = {"job": job, "rows": rows, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path = Path(out_dir) / SUCCESS_FILE
    _commit(path, lambda handle: handle.write(json.dumps(marker).encode() + b"\n"))
    return path


def read_success(out_dir: str | Path) -> dict[str, Any] | None:
    """The completion marker's contents, or None when the job has not completed."""
    path = Path(out_dir) / SUCCESS_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _commit(path: Path, write: Callable[[Any], Any]) -> None:
    """Write ``path`` atomically: temp file in the same directory, fsync, rename, fsync the dir."""
    temp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")
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
