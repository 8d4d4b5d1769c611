"""Input files and their rows, streamed: the files an input spec names (JSONL, Parquet) and
every row one at a time (Parquet in record batches), so memory does not grow with the file.

A line that cannot be parsed is a row with ``error`` set, never an exception; only a file that
cannot be opened or read raises ``InputError``. Row numbers in messages: "line N" for JSONL
(1-based, as editors show), "row N" for Parquet (0-based, as pyarrow and pandas show); files are
named relative to the folder that holds them all (``input_root``). Rows into requests:
``rows.py``; the scan a job makes first: ``scan.py``.
"""

from __future__ import annotations

import glob
import io
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.jobs import fsio
from slora_batch.jobs.config import COLUMN_KEYS, ROW_OPTIONS
from slora_batch.jobs.response_format import format_value
from slora_batch.jobs.text import type_name

Records = Iterator[tuple[int, dict | None, str | None]]  # (number, record, parse error)


class LineReading(Protocol):
    """One pass's conversion of a file's records (``openai_input.OpenAIReading``)."""

    def records(self, records: Records, name: str) -> Records: ...


class LineConverter(Protocol):
    """What the reader asks of a converter of input lines (``openai_input.OpenAIBatch``, which
    itself reads through this module): a reading per pass over the input."""

    def reading(self) -> LineReading: ...


SUFFIXES = (".jsonl", ".parquet")
PARQUET_BATCH_ROWS = 1024


class InputError(ValueError):
    """The input spec matches nothing readable; the message names the spec or file."""


def input_files(spec: str, fs=None) -> list[Path]:
    """The job's input files (``iter_input_files``), each Parquet file's footer read: a file
    that cannot be read as Parquet fails the job here, before any work."""
    files = iter_input_files(spec, fs)
    for file in files:
        if file.suffix.lower() == ".parquet":
            parquet_file(file, fs)
    return files


def first_record(files: list[Path], fs=None) -> dict | None:
    """The input's first record when every file is JSONL (what tells OpenAI Batch lines from
    rows: ``openai_input.holds_openai_lines``), else None; None too when that line is not an
    object or the first file has none."""
    if not files or any(f.suffix.lower() != ".jsonl" for f in files):
        return None
    records = _jsonl_records(files[0], fs)
    try:
        first = next(records, None)
    finally:
        records.close()
    return None if first is None else first[1]


def iter_input_files(spec: str, fs=None) -> list[Path]:
    """A .jsonl/.parquet file, a directory (its .jsonl/.parquet files, sorted by name, hidden
    and "_" files skipped, not recursive) or a glob (``**`` recurses), sorted. ``fs``: a
    ``pyarrow.fs`` filesystem ``spec`` is a path on (None: the local disk)."""
    if fs is not None:
        return _fs_input_files(spec, fs)
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


def _fs_input_files(spec: str, fs) -> list[Path]:
    kind, found = fsio.list_files(fs, spec)
    files = [Path(p) for p in found]
    if kind == "file" and files[0].suffix.lower() not in SUFFIXES:
        raise InputError(
            f"input {spec!r}: unsupported file type {files[0].suffix!r} (use .jsonl or .parquet)"
        )
    if kind == "missing":
        raise InputError(f"input {spec!r} does not exist")
    files = files if kind == "file" else [p for p in files if _is_input(p)]
    if not files:
        if kind == "dir":
            raise InputError(f"input {spec!r}: directory holds no .jsonl or .parquet files")
        raise InputError(f"input {spec!r}: no .jsonl or .parquet files match")
    return files


def _is_input(path: Path) -> bool:
    return path.suffix.lower() in SUFFIXES and not path.name.startswith((".", "_"))


def input_root(files: list[Path], fs=None) -> Path:
    """The folder that holds every input file: rows name their file relative to it. On another
    filesystem (``fs``) paths are compared as written: "bucket/key" has no working directory."""
    if fs is not None:
        return Path(fsio.common_folder([str(f) for f in files]))
    return Path(os.path.commonpath([os.path.abspath(f.parent) for f in files]))


@dataclass(slots=True)
class InputRow:
    """One input row: ``values`` holds the mapped columns under their logical names (id, adapter,
    prompt, messages, the scoring columns, ...) plus the per-row options, ``kept`` the kept
    columns present in the row; ``error`` is set when it could not be parsed."""

    position: int  # global 0-based index across files
    file: Path
    name: str  # the file relative to the input root, as messages and ``source`` show it
    number: int  # JSONL: 1-based line; Parquet: 0-based row in the file
    values: dict[str, Any]
    columns: dict[str, str]  # logical name -> input column name, shared by all rows
    kept: dict[str, Any] = field(default_factory=dict)  # by output name (``scan.kept_name``)
    error: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)  # the columns prompt_template reads

    @property
    def where(self) -> str:
        unit = "line" if self.file.suffix.lower() == ".jsonl" else "row"
        return f"{self.name} {unit} {self.number}"


def _pairs(columns: dict[str, str]) -> list[tuple[str, str]]:
    """(logical name, input column) of the mapped columns and the per-row options (sampling
    overrides and ``logprobs``, never renamed)."""
    pairs = [(key, columns.get(key, key)) for key in COLUMN_KEYS]
    return pairs + [(name, name) for name in ROW_OPTIONS]


def used_columns(columns: dict[str, str]) -> list[str]:
    """Input column names a job reads: the mapped columns and the per-row options."""
    return [column for _, column in _pairs(columns)]


def read_rows(
    files: Iterable[Path],
    columns: dict[str, str],
    keep: Iterable[str] | Mapping[str, str] = (),
    root: Path | None = None,
    fs=None,
    openai: LineConverter | None = None,
    *,
    fields: Iterable[str] = (),
    start: int = 0,
    limit: int | None = None,
    position_ids: bool = False,
) -> Iterator[InputRow]:
    """Stream every row of ``files`` (on ``fs``; None: the local disk) in order, with the
    ``keep`` columns each row has (a mapping: input column -> the name it is kept under) and
    the ``fields`` prompt_template reads; ``openai``: the files hold OpenAI Batch lines,
    converted (``openai_input.py``). Raises only when a file cannot be opened or read.

    ``start`` is the position of the first row of ``files`` in the job's input (a later file
    read alone); rows stop before position ``limit``. ``position_ids``: the input has no id
    column (``scan.InputScan.position_ids``), each row's id is its position."""
    logical = {column: key for key, column in reversed(_pairs(columns))}  # column -> name
    keep = dict(keep) if isinstance(keep, Mapping) else {name: name for name in keep}
    fields = list(fields)
    wanted = list(logical) + list(keep) + fields
    position = start
    for file in input_records(files, fs, openai, wanted, root):
        for number, record, error in file.records:
            if limit is not None and position >= limit:
                return
            values, kept, found = {}, {}, {}
            if record is not None:  # a record has a few keys: walk them, not every name
                values = {logical[c]: v for c, v in record.items() if c in logical}
                if keep:
                    kept = {out: record[c] for c, out in keep.items() if c in record}
                if fields:
                    found = {c: record[c] for c in fields if c in record}
            if position_ids:
                values["id"] = position
            yield InputRow(
                position, file.path, file.name, number, values, columns, kept, error, found
            )
            position += 1


@dataclass(slots=True)
class InputFile:
    """One file of a pass over the input (``input_records``)."""

    path: Path
    name: str  # relative to the input root, as messages and ``source`` show it
    parquet: pq.ParquetFile | None  # a Parquet file, its footer read; None for JSONL
    records: Iterator[tuple[int, dict | None, str | None]]  # (number, record, error) per row


def input_records(
    files: Iterable[Path],
    fs=None,
    openai: LineConverter | None = None,
    columns: list[str] | None = None,
    root: Path | None = None,
) -> Iterator[InputFile]:
    """One pass over the input: each of ``files`` (on ``fs``; None: the local disk) in order,
    named relative to ``root`` (default: the folder that holds them all), with its records; a
    Parquet file's are read for ``columns`` only (None: all). ``openai``: the files hold OpenAI
    Batch lines, converted (``openai_input.py``) by one reading per pass, so that a custom_id's
    first line wins. Raises only when a file cannot be opened or read."""
    files = list(files)
    root = root or (input_root(files, fs) if files else Path("."))
    reading = None  # the pass's, made at its first file
    for file in files:
        name = relative_name(file, root)
        if file.suffix.lower() == ".jsonl":
            parquet, records = None, _jsonl_records(file, fs)
        else:
            parquet = parquet_file(file, fs)
            records = _parquet_records(file, parquet, columns)
        if openai is not None:
            reading = reading or openai.reading()
            records = reading.records(records, name)
        yield InputFile(file, name, parquet, records)


def relative_name(file: Path, root: Path) -> str:
    if not Path(root).is_absolute():  # "bucket/key" paths: as written (input_root with fs)
        try:
            return str(Path(file).relative_to(root))
        except ValueError:
            return str(file)
    try:
        return str(Path(os.path.abspath(file)).relative_to(root))
    except ValueError:
        return str(file)


def parquet_file(file: Path, fs=None) -> pq.ParquetFile:
    """A Parquet file on the local disk (``fs`` None) or on ``fs``, its footer read (schema,
    row count); ``InputError`` naming the file when it cannot be read as Parquet."""
    try:
        return pq.ParquetFile(file if fs is None else fs.open_input_file(str(file)))
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{file}: cannot read as Parquet: {exc}") from exc


def _jsonl_records(file: Path, fs=None) -> Iterator[tuple[int, dict | None, str | None]]:
    try:
        if fs is None:
            opened = open(file, "rb")  # noqa: SIM115
        else:  # a pyarrow stream reads but has no readline: buffered, it iterates lines
            opened = io.BufferedReader(fs.open_input_stream(str(file)))
        with opened as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:  # decoding first spares json.loads guessing the encoding of every line
                    record = json.loads(line.decode("utf-8"))
                except (ValueError, RecursionError) as exc:  # also UnicodeDecodeError
                    yield number, None, f"malformed JSON: {exc}"
                    continue
                if isinstance(record, dict):
                    yield number, record, None
                else:
                    yield number, None, f"expected a JSON object, got {type_name(record)}"
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{file}: cannot read: {getattr(exc, 'strerror', None) or exc}") from exc


def _parquet_records(
    file: Path, parquet: pq.ParquetFile, columns: list[str] | None
) -> Iterator[tuple[int, dict | None, str | None]]:
    """(number, record, None) of every row of ``parquet`` (``file``), of ``columns`` only (None:
    all)."""
    number = 0
    try:
        names = parquet.schema_arrow.names
        wanted = names if columns is None else [c for c in dict.fromkeys(columns) if c in names]
        # a response_format struct column holds every row's fields, the others null: each row
        # reads back as its own object (kept columns stay as Arrow gives them)
        structs = [
            c
            for c in wanted
            if c == "response_format" and pa.types.is_struct(parquet.schema_arrow.field(c).type)
        ]
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=wanted):
            for record in batch.to_pylist():
                for name in structs:
                    record[name] = format_value(record[name])
                yield number, record, None
                number += 1
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{file}: cannot read as Parquet (at row {number}): {exc}") from exc
