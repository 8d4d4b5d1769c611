"""The output directory: Parquet parts written as rows finish, resume keys, counts, stats, the
job manifest, the completion marker and the lock.

``part-NNNNN.parquet`` files of one ``part_schema`` per job: ``id`` keeps the input's type
(int64 when every given id is an integer, else string: an int 7 is stored "7"), null for a row
without a usable id, which ``source`` ("rows.jsonl line 7") identifies instead; then the kept
input columns. The resume key of a row is ``row_key(id, adapter, source)``. Every file is
written to a hidden temp name in the same directory, fsync'd and ``os.replace``d, so a committed
part is always whole, also after kill -9. One run at a time: ``OutputLock`` holds an ``flock``
on ``LOCK_FILE`` while a writer is open (the kernel drops it when the process dies).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.engine.request import Result
from slora_batch.jobs.io import RowSource, row_key

logger = logging.getLogger(__name__)

PART_RE = re.compile(r"^part-(\d+)\.parquet$")
SURROGATE = re.compile("[\ud800-\udfff]")  # what UTF-8 cannot encode in a Python str
STATS_FILE = "stats.parquet"
SUCCESS_FILE = "_SUCCESS"
MANIFEST_FILE = "_job.json"  # what the rows were produced from (``jobrun`` writes it)
LOCK_FILE = ".lock"  # flock'd by the running job, removed when it releases the lock
TMP_MARK = ".tmp-"  # temp files are ".<final name>.tmp-<pid>"
JSON_TEXT = {b"slora_batch": b"json"}  # field metadata: a kept column stored as JSON text
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
CORE_FIELDS = [
    pa.field("adapter", pa.string()),  # null = base model
    pa.field("text", pa.string(), nullable=False),
    pa.field("token_ids", pa.list_(pa.int32()), nullable=False),  # generated ids only
    pa.field("prompt_tokens", pa.int32(), nullable=False),
    pa.field("completion_tokens", pa.int32(), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),  # stop | length | error
    pa.field("error", pa.string()),  # null when fine
    pa.field("source", pa.string()),  # where the row came from: "rows.jsonl line 7"
]
OUTPUT_COLUMNS = ("id", *(f.name for f in CORE_FIELDS))  # a kept input column cannot take these
ID_TYPES = {"int64": pa.int64(), "string": pa.string()}


def part_schema(
    id_type: str = "string",
    keep: dict[str, pa.DataType] | None = None,
    json_text: tuple[str, ...] | list[str] = (),
) -> pa.Schema:
    """The parts' schema: ``id`` of ``id_type`` ("int64" or "string"), the core columns, then
    the kept input columns (``json_text`` ones are strings holding each value as JSON)."""
    if id_type not in ID_TYPES:
        raise ValueError(f"id_type must be 'int64' or 'string', got {id_type!r}")
    kept = []
    for name, type_ in (keep or {}).items():
        if name in OUTPUT_COLUMNS:
            raise ValueError(f"kept column {name!r} would replace the output's own column")
        json_column = name in json_text
        kept.append(
            pa.field(
                name,
                pa.string() if json_column else type_,
                True,
                JSON_TEXT if json_column else None,
            )
        )
    return pa.schema([pa.field("id", ID_TYPES[id_type]), *CORE_FIELDS, *kept])


PART_SCHEMA = part_schema()  # string ids, no kept columns: the writer's default

STATS_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),  # "job" or "adapter"
        ("adapter", pa.string()),  # adapter rows: name, null = base model
        ("rows", pa.int64()),
        ("ok_rows", pa.int64()),
        ("error_rows", pa.int64()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("wall_s", pa.float64()),  # this run, start to end
        ("tokens_per_s", pa.float64()),  # completion tokens of this run / engine_s
        ("requests_per_s", pa.float64()),  # rows of this run / engine_s
        ("engine_s", pa.float64()),  # generating: the loop less reading, writing and warmup
        ("load_s", pa.float64()),  # building the engine: weights, tokenizer, pool
        ("warmup_s", pa.float64()),  # compiling kernels, capturing CUDA graphs
        ("read_s", pa.float64()),  # reading input rows, skipping done ones included
        ("write_s", pa.float64()),  # buffering and committing parts
        ("adapters_seen", pa.int64()),
        ("adapters_broken", pa.int64()),  # adapters that cannot run: their rows are errors
        ("adapter_loads", pa.int64()),
        ("adapter_disk_loads", pa.int64()),  # adapter weight files read
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


def done_keys(out_dir: str | Path) -> set[str]:
    """``row_key``s of the rows in committed parts; temp files are never read."""
    keys: set[str] = set()
    for _, path in part_files(Path(out_dir)):
        try:
            names = pq.read_schema(path).names
            table = pq.read_table(
                path, columns=[c for c in ("id", "adapter", "source") if c in names]
            )
        except (OSError, pa.ArrowException) as exc:
            raise OutputError(f"{path}: committed part is unreadable: {exc}") from exc
        ids, adapters = table["id"].to_pylist(), table["adapter"].to_pylist()
        sources = table["source"].to_pylist() if "source" in names else [None] * len(ids)
        keys.update(map(row_key, ids, adapters, sources))
    return keys


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
    it. ``release`` removes the file while still holding the lock; a process that opened the old
    file meanwhile sees that the path no longer names what it locked and tries again, so two
    runs never both hold the directory. A killed process leaves the file, unlocked (the kernel
    drops an flock with its last descriptor), and the next run takes it.
    """

    ATTEMPTS = 5  # a lock file removed under us this many times in a row: give up

    def __init__(self, out_dir: str | Path) -> None:
        import fcntl  # POSIX only, like the atomic renames the writer relies on

        self.path = Path(os.path.abspath(out_dir)) / LOCK_FILE  # abspath: "a/../b" reads "b"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(self.ATTEMPTS):
            handle = open(self.path, "a+")  # noqa: SIM115 -- held until release()
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "?"
                handle.close()
                raise OutputError(
                    f"output directory {str(self.path.parent)!r} is in use by another run "
                    f"(pid {holder}, lock file {self.path.name}); wait for it or stop it"
                ) from None
            if _same_file(self.path, handle):
                break
            handle.close()  # released and removed by its holder after we opened it
        else:
            raise OutputError(
                f"{self.path}: the lock file keeps being removed; is another run starting?"
            )
        self._handle = handle
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()

    def release(self) -> None:
        if not self._handle.closed:
            if _same_file(self.path, self._handle):
                self.path.unlink()  # still locked: nobody can take the file in between
            self._handle.close()  # closing the last descriptor drops the flock

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _same_file(path: Path, handle) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
    except FileNotFoundError:
        return False


def clear_output(out_dir: str | Path) -> None:
    """Remove what a job wrote (parts, stats, manifest, marker, temp files); other files stay."""
    for path in Path(out_dir).iterdir():
        if _ours(path.name) or (path.name.startswith(".") and TMP_MARK in path.name):
            logger.info("removing %s", path)
            path.unlink()


def _ours(name: str) -> bool:
    return bool(PART_RE.match(name)) or name in (STATS_FILE, SUCCESS_FILE, MANIFEST_FILE)


class OutputWriter:
    """Buffers results and commits a part every ``part_rows`` rows, when the oldest buffered row
    has waited ``part_seconds`` (checked as rows arrive and on ``tick``), and on ``close``.

    Opening takes the directory's ``OutputLock`` (unless the caller passes one it holds), removes
    stale temp files and the completion marker (the job is incomplete until ``write_success``);
    ``overwrite`` also removes parts, stats and the manifest. Part numbers continue after the
    highest committed part. ``close`` commits the buffer and releases a lock the writer took.

    A row is checked before it enters the buffer, so one bad row never spoils a part: text that
    cannot be encoded (a lone surrogate) is stored with U+FFFD in its place; an id or adapter
    that cannot be stored as given (unencodable, an int beyond int64, a string in an int64 id
    column) turns the row into an error row without an id, known by its ``source``.
    """

    def __init__(
        self,
        out_dir: str | Path,
        part_rows: int,
        overwrite: bool = False,
        lock: OutputLock | None = None,
        schema: pa.Schema = PART_SCHEMA,
        part_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(part_rows, int) or part_rows < 1:
            raise ValueError(f"part_rows must be an integer >= 1, got {part_rows!r}")
        if part_seconds is not None and not part_seconds > 0:
            raise ValueError(f"part_seconds must be > 0, got {part_seconds!r}")
        self.out_dir = Path(out_dir)
        self.part_rows = part_rows
        self.part_seconds = part_seconds
        self.schema = schema
        self.clock = clock
        self._int_ids = schema.field("id").type == pa.int64()
        self._kept = [f.name for f in schema][len(OUTPUT_COLUMNS) :]
        self._json = {f.name for f in schema if f.metadata == JSON_TEXT}
        self._own_lock = lock is None
        self._lock = OutputLock(self.out_dir) if lock is None else lock
        if overwrite:
            clear_output(self.out_dir)
        for path in self.out_dir.iterdir():
            if (path.name.startswith(".") and TMP_MARK in path.name) or path.name == SUCCESS_FILE:
                logger.info("removing %s", path)
                path.unlink()
        parts = part_files(self.out_dir)
        self.next_part = parts[-1][0] + 1 if parts else 0
        self.rows_written = 0
        self.write_s = 0.0  # time spent in write, tick and flush
        # Rows, each a list of values in schema order: one append adds a whole row, so an
        # exception (a signal) in write() never leaves the buffer half a row longer.
        self._rows: list[list[Any]] = []
        self._oldest: float | None = None  # clock() when the oldest buffered row arrived

    @property
    def buffered(self) -> int:
        return len(self._rows)

    def write(self, result: Result) -> None:
        started = time.perf_counter()
        if result.finish_reason not in ("stop", "length", "error"):
            raise ValueError(
                f"row {result.id!r}: finish_reason {result.finish_reason!r} is not stop, length or error"
            )
        self._rows.append(self._row(result))
        if self._oldest is None:
            self._oldest = self.clock()
        self.write_s += time.perf_counter() - started
        if self.buffered >= self.part_rows:
            self.flush()
        else:
            self.tick()

    def tick(self) -> None:
        """Commit the buffer when its oldest row has waited ``part_seconds``."""
        due = self._oldest is not None and self.part_seconds is not None
        if due and self.clock() - self._oldest >= self.part_seconds:
            self.flush()

    def _row(self, result: Result) -> list[Any]:
        """The output row's values in schema order; see the class docstring for what is fixed."""
        extra = result.extra or {}
        source = extra.get("source")
        id_, problem = result.id, None
        if isinstance(id_, RowSource):
            id_, source = None, id_.source
        elif isinstance(id_, int) and not isinstance(id_, bool):
            if not self._int_ids:
                id_ = str(id_)
            elif not INT64_MIN <= id_ <= INT64_MAX:
                problem = f"id {id_} does not fit the int64 id column"
        elif isinstance(id_, str):
            if self._int_ids:
                problem = f"id {id_!r} is a string but this output's ids are integers"
            elif not _encodable(id_):
                problem = f"id {id_!r} has characters that cannot be encoded as UTF-8"
        elif id_ is not None:
            problem = f"id {_short(id_)} is neither a string nor an integer"
        adapter = result.adapter or None
        if adapter is not None and not (isinstance(adapter, str) and _encodable(adapter)):
            problem = problem or f"adapter {adapter!r} cannot be stored (not a UTF-8 string)"
        tokens = result.token_ids
        if tokens and not (min(tokens) >= -(2**31) and max(tokens) < 2**31):
            problem = problem or f"token ids out of the int32 range ({min(tokens)}..{max(tokens)})"
        source = _clean(source) if isinstance(source, str) else None
        kept = [self._kept_value(name, extra.get(name)) for name in self._kept]
        if problem is not None:
            logger.warning("%s: %s; written as an error row without an id", source, problem)
            where = f"{source}: " if source else ""
            message = f"{where}row cannot be stored: {problem}"
            return [None, None, "", [], result.prompt_tokens, 0, "error", message, source, *kept]
        return [
            id_,
            adapter,
            _clean(result.text),
            list(tokens),
            result.prompt_tokens,
            result.completion_tokens,
            result.finish_reason,
            _clean(result.error),
            source,
            *kept,
        ]

    def _kept_value(self, name: str, value: Any) -> Any:
        if value is None:
            return None
        if name in self._json:
            return _clean(value if isinstance(value, str) else _json_text(value))
        if isinstance(value, str):
            return _clean(value)
        return value

    def flush(self) -> None:
        """Commit the buffered rows as the next part (nothing when the buffer is empty)."""
        rows = self.buffered
        if rows == 0:
            return
        started = time.perf_counter()
        table = self._table()
        path = self.out_dir / f"part-{self.next_part:05d}.parquet"
        _commit(path, lambda handle: pq.write_table(table, handle))
        # The buffer empties before the part number moves on: an exception (a signal) between
        # the two leaves nothing to commit twice; one before both (during _commit, after the
        # rename) makes close() write the same rows to the same part name again.
        self._rows = []
        self.next_part += 1
        self._oldest = None
        self.rows_written += rows
        logger.debug("committed %s (%d rows)", path, rows)
        self.write_s += time.perf_counter() - started

    def _table(self) -> pa.Table:
        """The buffer as a table. A kept value that does not fit its column's type (the input
        changed its mind about a column's type) is stored as null and logged, rather than
        failing the part and every finished row in it."""
        columns = [list(values) for values in zip(*self._rows, strict=True)]
        try:
            return pa.Table.from_arrays(
                [pa.array(v, type=f.type) for v, f in zip(columns, self.schema, strict=True)],
                schema=self.schema,
            )
        except (pa.ArrowException, UnicodeError, OverflowError, TypeError, ValueError):
            pass
        sources = columns[self.schema.names.index("source")]
        arrays = []
        for field, values in zip(self.schema, columns, strict=True):
            try:
                arrays.append(pa.array(values, type=field.type))
                continue
            except (pa.ArrowException, UnicodeError, OverflowError, TypeError, ValueError):
                if field.name not in self._kept:
                    raise
            fixed = []
            for value, source in zip(values, sources, strict=True):
                try:
                    pa.array([value], type=field.type)
                    fixed.append(value)
                except (pa.ArrowException, UnicodeError, OverflowError, TypeError, ValueError):
                    logger.warning(
                        "%s: kept column %r: %s does not fit type %s; stored as null",
                        source,
                        field.name,
                        _short(value),
                        field.type,
                    )
                    fixed.append(None)
            arrays.append(pa.array(fixed, type=field.type))
        return pa.Table.from_arrays(arrays, schema=self.schema)

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


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _clean(text: str | None) -> str | None:
    """``text`` with every character UTF-8 cannot encode (lone surrogates) replaced by U+FFFD."""
    if text is None or _encodable(text):
        return text
    return SURROGATE.sub("\ufffd", text)


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def _short(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:80]


def iter_output_rows(out_dir: str | Path, columns: list[str]) -> Iterator[dict[str, Any]]:
    """Rows of the committed parts, part by part, with the given columns."""
    for _, path in part_files(out_dir):
        yield from pq.read_table(path, columns=columns).to_pylist()


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


def read_stats(out_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """The job row and the adapter rows of ``stats.parquet``, or None when there is none."""
    path = Path(out_dir) / STATS_FILE
    if not path.is_file():
        return None
    rows = pq.read_table(path).to_pylist()
    job = [r for r in rows if r["kind"] == "job"]
    if not job:
        return None
    strip = lambda row: {k: v for k, v in row.items() if k != "kind"}
    return strip(job[0]), [strip(r) for r in rows if r["kind"] == "adapter"]


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


def write_manifest(out_dir: str | Path, manifest: dict[str, Any]) -> Path:
    """Write ``MANIFEST_FILE`` (JSON) atomically."""
    path = Path(out_dir) / MANIFEST_FILE
    text = json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False)
    _commit(path, lambda handle: handle.write(text.encode() + b"\n"))
    return path


def read_manifest(out_dir: str | Path) -> dict[str, Any] | None:
    """The manifest, or None when there is none; ``OutputError`` when it is not one."""
    path = Path(out_dir) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise OutputError(f"{path}: unreadable job manifest: {exc}") from exc
    if not isinstance(manifest, dict):
        raise OutputError(f"{path}: unreadable job manifest: not a JSON object")
    return manifest


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
