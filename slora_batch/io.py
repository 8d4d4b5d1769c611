"""Streaming input (JSONL, Parquet) into ``Request``s, and the Parquet part writer with resume.

Input: rows are read one at a time (Parquet in record batches), so memory does not grow with the
file. A bad row never raises: it becomes an error ``Result`` naming the file, the row and why.
Row numbers in messages: "line N" for JSONL (1-based, as editors show), "row N" for Parquet
(0-based, as pyarrow and pandas show).

Output: ``part-NNNNN.parquet`` files of ``PART_SCHEMA``. Every file is written to a hidden temp
name in the same directory, fsync'd and ``os.replace``d, so a committed part is always whole,
also after kill -9. Ids are stored as strings (an int id 7 becomes "7"); the resume key of a row
is ``row_key(id, adapter)``.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import re
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.config import ConfigError, SamplingConfig
from slora_batch.request import SAMPLING_FIELDS, Request, Result

logger = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".parquet")
PARQUET_BATCH_ROWS = 1024
PART_RE = re.compile(r"^part-(\d+)\.parquet$")
STATS_FILE = "stats.parquet"
SUCCESS_FILE = "_SUCCESS"
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


class InputError(ValueError):
    """The input spec matches nothing readable; the message names the spec or file."""


def iter_input_files(spec: str) -> list[Path]:
    """A .jsonl/.parquet file, a directory (its .jsonl/.parquet files, sorted by name, hidden
    and "_" files skipped, not recursive) or a glob (``**`` recurses), sorted."""
    path = Path(spec)
    if path.is_file():
        if path.suffix.lower() not in SUFFIXES:
            raise InputError(
                f"input {spec!r}: unsupported file type {path.suffix!r} (use .jsonl or .parquet)"
            )
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and _is_input(p))
        if not files:
            raise InputError(f"input {spec!r}: directory holds no .jsonl or .parquet files")
        return files
    if glob.has_magic(spec):
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True))
        files = [p for p in files if p.is_file() and _is_input(p)]
        if not files:
            raise InputError(f"input {spec!r}: no .jsonl or .parquet files match")
        return files
    raise InputError(f"input {spec!r} does not exist")


def _is_input(path: Path) -> bool:
    return path.suffix.lower() in SUFFIXES and not path.name.startswith((".", "_"))


@dataclass(slots=True)
class InputRow:
    """One input row: ``values`` holds the mapped columns under their logical names (id, adapter,
    prompt, messages) plus per-row sampling overrides; ``error`` is set when it could not be parsed."""

    position: int  # global 0-based index across files: the default id
    file: Path
    number: int  # JSONL: 1-based line; Parquet: 0-based row in the file
    values: dict[str, Any]
    columns: dict[str, str]  # logical name -> input column name, shared by all rows
    error: str | None = None

    @property
    def where(self) -> str:
        unit = "line" if self.file.suffix.lower() == ".jsonl" else "row"
        return f"{self.file} {unit} {self.number}"


def read_rows(files: Iterable[Path], columns: dict[str, str]) -> Iterator[InputRow]:
    """Stream every row of ``files`` in order. Raises only when a file cannot be opened or read."""
    # (logical name, input column) for the mapped columns and the overrides, which are never renamed
    pairs = [(key, columns.get(key, key)) for key in ("id", "adapter", "prompt", "messages")]
    pairs += [(name, name) for name in SAMPLING_FIELDS]
    position = 0
    for file in files:
        reader = _jsonl_rows if file.suffix.lower() == ".jsonl" else _parquet_rows
        for number, record, error in reader(file, pairs):
            values = {} if record is None else {k: record[c] for k, c in pairs if c in record}
            yield InputRow(position, file, number, values, columns, error)
            position += 1


def _jsonl_rows(
    file: Path, pairs: list[tuple[str, str]]
) -> Iterator[tuple[int, dict | None, str | None]]:
    try:
        with open(file, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError) as exc:  # also UnicodeDecodeError
                    yield number, None, f"malformed JSON: {exc}"
                    continue
                if isinstance(record, dict):
                    yield number, record, None
                else:
                    yield number, None, f"expected a JSON object, got {_type_name(record)}"
    except OSError as exc:
        raise InputError(f"{file}: cannot read: {exc.strerror or exc}") from exc


def _parquet_rows(
    file: Path, pairs: list[tuple[str, str]]
) -> Iterator[tuple[int, dict | None, str | None]]:
    number = 0
    try:
        parquet = pq.ParquetFile(file)
        wanted = [c for _, c in pairs if c in parquet.schema_arrow.names]
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=wanted):
            for record in batch.to_pylist():
                yield number, record, None
                number += 1
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{file}: cannot read as Parquet (at row {number}): {exc}") from exc


def to_request(row: InputRow, sampling_defaults: SamplingConfig) -> Request | Result:
    """Validate one row into a ``Request``, or an error ``Result`` whose message names the file,
    the row and the reason. Null override values mean "use the job's sampling"."""
    values, columns = row.values, row.columns

    def failed(reason: str, id_: Any = row.position, adapter: str | None = None) -> Result:
        return Result(
            id=id_, adapter=adapter, text="", finish_reason="error", error=f"{row.where}: {reason}"
        )

    if row.error is not None:
        return failed(row.error)
    id_ = values.get("id")
    if id_ is None:
        id_ = row.position
    elif isinstance(id_, bool) or not isinstance(id_, str | int) or id_ == "":
        return failed(
            f"column {columns['id']!r} must be a non-empty string or an integer, got {_describe(id_)}"
        )
    adapter = values.get("adapter")
    if adapter is not None and not isinstance(adapter, str):
        return failed(
            f"column {columns['adapter']!r} must be a string or null, got {_describe(adapter)}", id_
        )
    adapter = adapter or None
    prompt, messages = values.get("prompt"), values.get("messages")
    if prompt is not None and messages is not None:
        return failed(
            f"give either column {columns['prompt']!r} or {columns['messages']!r}, not both",
            id_,
            adapter,
        )
    if prompt is None and messages is None:
        return failed(
            f"row has neither column {columns['prompt']!r} nor {columns['messages']!r}",
            id_,
            adapter,
        )
    if prompt is not None and not isinstance(prompt, str):
        return failed(
            f"column {columns['prompt']!r} must be a string, got {_describe(prompt)}", id_, adapter
        )
    if prompt == "":
        return failed(f"column {columns['prompt']!r} is empty", id_, adapter)
    if messages is not None:
        messages, problem = _check_messages(messages, columns["messages"])
        if problem:
            return failed(problem, id_, adapter)
    overrides = {name: values[name] for name in SAMPLING_FIELDS if values.get(name) is not None}
    if overrides:
        try:  # SamplingConfig is the one place these are validated (and stop normalized)
            merged = dataclasses.replace(sampling_defaults, **overrides)
        except ConfigError as exc:
            return failed(f"per-row override: {exc}", id_, adapter)
        overrides = {name: getattr(merged, name) for name in overrides}
    return Request(id=id_, adapter=adapter, prompt=prompt, messages=messages, **overrides)


def _check_messages(messages: Any, column: str) -> tuple[list[dict[str, str]], str | None]:
    if not isinstance(messages, list) or not messages:
        return (
            [],
            f"column {column!r} must be a non-empty list of {{role, content}} objects, got {_describe(messages)}",
        )
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return (
                [],
                f"{column}[{i}] must be an object with 'role' and 'content', got {_describe(message)}",
            )
        # Parquet structs carry every field of the column's type; null fields are absent ones
        extra = sorted(
            k for k, v in message.items() if k not in ("role", "content") and v is not None
        )
        if extra:
            return [], f"{column}[{i}] has unsupported key {extra[0]!r} (only 'role' and 'content')"
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role == "":
            return [], f"{column}[{i}].role must be a non-empty string, got {_describe(role)}"
        if not isinstance(content, str):
            return [], f"{column}[{i}].content must be a string, got {_describe(content)}"
        clean.append({"role": role, "content": content})
    return clean, None


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _describe(value: Any) -> str:
    return f"{_type_name(value)} {value!r}"[:80]


def row_key(id_: Any, adapter: str | None) -> tuple[str, str | None]:
    """Resume key of an output row: (id as stored, adapter with "" as None)."""
    return str(id_), adapter or None


def done_keys(out_dir: str | Path, key: Callable[[Any, str | None], Hashable] = row_key) -> set:
    """Keys of the rows in committed parts; temp files are never read."""
    keys: set = set()
    for _, path in _parts(Path(out_dir)):
        try:
            table = pq.read_table(path, columns=["id", "adapter"])
        except (OSError, pa.ArrowException) as exc:
            raise InputError(f"{path}: committed part is unreadable: {exc}") from exc
        keys.update(
            key(i, a)
            for i, a in zip(table["id"].to_pylist(), table["adapter"].to_pylist(), strict=True)
        )
    return keys


def done_ids(out_dir: str | Path) -> set[str]:
    """Ids (as strings) of the rows in committed parts."""
    return done_keys(out_dir, key=lambda id_, adapter: id_)


def _parts(out_dir: Path) -> list[tuple[int, Path]]:
    if not out_dir.is_dir():
        return []
    found = ((PART_RE.match(p.name), p) for p in out_dir.iterdir())
    return sorted((int(m.group(1)), p) for m, p in found if m)


class OutputWriter:
    """Buffers results and commits a part every ``part_rows`` rows (and on ``close``).

    Opening removes stale temp files and the completion marker (the job is incomplete until
    ``write_success``); ``overwrite`` also removes parts and stats. Part numbers continue after
    the highest committed part.
    """

    def __init__(self, out_dir: str | Path, part_rows: int, overwrite: bool = False) -> None:
        if not isinstance(part_rows, int) or part_rows < 1:
            raise ValueError(f"part_rows must be an integer >= 1, got {part_rows!r}")
        self.out_dir = Path(out_dir)
        self.part_rows = part_rows
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for path in self.out_dir.iterdir():
            stale_temp = path.name.startswith(".") and TMP_MARK in path.name
            ours = PART_RE.match(path.name) or path.name == STATS_FILE
            if stale_temp or path.name == SUCCESS_FILE or (overwrite and ours):
                logger.info("removing %s", path)
                path.unlink()
        parts = _parts(self.out_dir)
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
        self.flush()

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
