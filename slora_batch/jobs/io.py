"""Streaming input (JSONL, Parquet) into ``Request``s, and the scan a job makes of it first; the
output side is ``writer.py``.

Rows are read one at a time (Parquet in record batches), so memory does not grow with the file.
A bad row never raises: it becomes an error ``Result`` naming the file, the row and why. Row
numbers in messages: "line N" for JSONL (1-based, as editors show), "row N" for Parquet (0-based,
as pyarrow and pandas show); files are named relative to the folder that holds them all.

Identity: a row's id is its ``id`` column, kept with its type (string or int). A row without a
usable id (none given; or its id, its adapter or the line itself cannot be read) gets a
``RowSource`` instead: where it came from, which no given id can equal (the writer stores a null
id and the source). ``row_key`` turns either into the resume key.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.engine.config import ConfigError, SamplingConfig
from slora_batch.engine.request import SAMPLING_FIELDS, Request, Result

SUFFIXES = (".jsonl", ".parquet")
PARQUET_BATCH_ROWS = 1024
INFER_ROWS = 4096  # JSONL values of a kept column typed together, then unified
DUPLICATE_EXAMPLES = 5  # duplicates named in the scan's message
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class InputError(ValueError):
    """The input spec matches nothing readable; the message names the spec or file."""


@dataclass(frozen=True, slots=True)
class RowSource:
    """The id of a row that has no usable one: where it came from, "rows.jsonl line 7"."""

    source: str

    def __str__(self) -> str:  # sampling keys a row's random stream by str(id)
        return self.source

    def __repr__(self) -> str:
        return f"<no id: {self.source}>"


def row_key(id_: Any, adapter: str | None, source: str | None = None) -> str:
    """Resume key of a row: its id (an int compares as its decimal string, so the int 7 and the
    string "7" are one id) and adapter ("" = None); a row without an id (None or a
    ``RowSource``) is keyed by its source instead, which no given id can equal.

    Running example: (7, None) -> "1:7"; ("7", "a") -> "1:7a"; (None, "a", "x line 3") ->
    "@10:x line 3a". The length prefix ends the id, so no id and adapter pair reads as another.
    """
    if isinstance(id_, RowSource):
        source, id_ = id_.source, None
    if id_ is None:
        return f"@{len(str(source))}:{source}{adapter or ''}"
    text = str(id_)
    return f"{len(text)}:{text}{adapter or ''}"


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


def input_root(files: list[Path]) -> Path:
    """The folder that holds every input file: rows name their file relative to it."""
    return Path(os.path.commonpath([os.path.abspath(f.parent) for f in files]))


@dataclass(slots=True)
class InputRow:
    """One input row: ``values`` holds the mapped columns under their logical names (id, adapter,
    prompt, messages) plus per-row sampling overrides, ``kept`` the kept columns present in the
    row; ``error`` is set when it could not be parsed."""

    position: int  # global 0-based index across files
    file: Path
    name: str  # the file relative to the input root, as messages and ``source`` show it
    number: int  # JSONL: 1-based line; Parquet: 0-based row in the file
    values: dict[str, Any]
    columns: dict[str, str]  # logical name -> input column name, shared by all rows
    kept: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def where(self) -> str:
        unit = "line" if self.file.suffix.lower() == ".jsonl" else "row"
        return f"{self.name} {unit} {self.number}"


def _pairs(columns: dict[str, str]) -> list[tuple[str, str]]:
    """(logical name, input column) of the mapped columns and the overrides (never renamed)."""
    pairs = [(key, columns.get(key, key)) for key in ("id", "adapter", "prompt", "messages")]
    return pairs + [(name, name) for name in SAMPLING_FIELDS]


def used_columns(columns: dict[str, str]) -> list[str]:
    """Input column names a job reads: the mapped columns and the per-row overrides."""
    return [column for _, column in _pairs(columns)]


def read_rows(
    files: Iterable[Path],
    columns: dict[str, str],
    keep: Iterable[str] = (),
    root: Path | None = None,
) -> Iterator[InputRow]:
    """Stream every row of ``files`` in order, with the ``keep`` columns each row has. Raises
    only when a file cannot be opened or read."""
    files = list(files)
    root = root or (input_root(files) if files else Path("."))
    logical = {column: key for key, column in reversed(_pairs(columns))}  # column -> name
    keep = list(keep)
    wanted = list(logical) + keep
    position = 0
    for file in files:
        name = relative_name(file, root)
        for number, record, error in _records(file, wanted):
            values, kept = {}, {}
            if record is not None:  # a record has a few keys: walk them, not every name
                values = {logical[c]: v for c, v in record.items() if c in logical}
                if keep:
                    kept = {c: record[c] for c in keep if c in record}
            yield InputRow(position, file, name, number, values, columns, kept, error)
            position += 1


def relative_name(file: Path, root: Path) -> str:
    try:
        return str(Path(os.path.abspath(file)).relative_to(root))
    except ValueError:
        return str(file)


def _records(
    file: Path, columns: list[str] | None
) -> Iterator[tuple[int, dict | None, str | None]]:
    """(number, record, error) of every row; Parquet reads only ``columns`` (None: all)."""
    if file.suffix.lower() == ".jsonl":
        return _jsonl_records(file)
    return _parquet_records(file, columns)


def _jsonl_records(file: Path) -> Iterator[tuple[int, dict | None, str | None]]:
    try:
        with open(file, "rb") as handle:
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
                    yield number, None, f"expected a JSON object, got {_type_name(record)}"
    except OSError as exc:
        raise InputError(f"{file}: cannot read: {exc.strerror or exc}") from exc


def _parquet_records(
    file: Path, columns: list[str] | None
) -> Iterator[tuple[int, dict | None, str | None]]:
    number = 0
    try:
        parquet = pq.ParquetFile(file)
        names = parquet.schema_arrow.names
        wanted = names if columns is None else [c for c in dict.fromkeys(columns) if c in names]
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=wanted):
            for record in batch.to_pylist():
                yield number, record, None
                number += 1
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{file}: cannot read as Parquet (at row {number}): {exc}") from exc


def identity(row: InputRow, fanout: bool = False) -> tuple[Any, str | None, str | None]:
    """(id, adapter, problem) of a row: the id as given, or a ``RowSource`` when the row has no
    usable id; ``problem`` says why the row is an error row when its line, id or adapter cannot
    be read (then the id is always a ``RowSource``: the row cannot claim an identity it may
    share). With ``fanout`` the row's adapter is not read (the sweep replaces it)."""
    if row.error is not None:
        return RowSource(row.where), None, row.error
    columns = row.columns
    id_, problem = _check_id(row.values.get("id"), columns["id"])
    adapter = None
    if not fanout and problem is None:
        adapter, problem = _check_adapter(row.values.get("adapter"), columns["adapter"])
        if problem is not None and id_ is not None:
            problem += f" (row id {id_!r})"
    if problem is not None or id_ is None:
        return RowSource(row.where), (None if problem else adapter), problem
    return id_, adapter, None


def _check_id(id_: Any, column: str) -> tuple[Any, str | None]:
    if id_ is None:
        return None, None
    if isinstance(id_, bool) or not isinstance(id_, str | int) or id_ == "":
        return (
            None,
            f"column {column!r} must be a non-empty string or an integer, got {_describe(id_)}",
        )
    if isinstance(id_, str) and not _encodable(id_):
        return None, f"column {column!r}: {_unencodable(id_)}"
    return id_, None


def _check_adapter(adapter: Any, column: str) -> tuple[str | None, str | None]:
    if adapter is not None and not isinstance(adapter, str):
        return None, f"column {column!r} must be a string or null, got {_describe(adapter)}"
    if adapter and not _encodable(adapter):
        return None, f"column {column!r}: {_unencodable(adapter)}"
    return adapter or None, None


def to_request(
    row: InputRow, sampling_defaults: SamplingConfig, fanout: bool = False
) -> Request | Result:
    """Validate one row into a ``Request``, or an error ``Result`` whose message names the file,
    the row and the reason. Null override values mean "use the job's sampling". ``extra``
    carries the output's extra columns: ``source`` and the kept columns."""
    values, columns = row.values, row.columns
    id_, adapter, problem = identity(row, fanout)
    extra = {"source": row.where, **row.kept}

    def failed(reason: str) -> Result:
        return Result(
            id=id_,
            adapter=adapter,
            text="",
            finish_reason="error",
            error=f"{row.where}: {reason}",
            extra=extra,
        )

    if problem is not None:
        return failed(problem)
    prompt, messages = values.get("prompt"), values.get("messages")
    if prompt is not None and messages is not None:
        return failed(
            f"give either column {columns['prompt']!r} or {columns['messages']!r}, not both"
        )
    if prompt is None and messages is None:
        return failed(f"row has neither column {columns['prompt']!r} nor {columns['messages']!r}")
    if prompt is not None and not isinstance(prompt, str):
        return failed(f"column {columns['prompt']!r} must be a string, got {_describe(prompt)}")
    if prompt == "":
        return failed(f"column {columns['prompt']!r} is empty")
    if prompt is not None and not _encodable(prompt):
        return failed(f"column {columns['prompt']!r}: {_unencodable(prompt)}")
    if messages is not None:
        messages, problem = _check_messages(messages, columns["messages"])
        if problem:
            return failed(problem)
    overrides = {name: values[name] for name in SAMPLING_FIELDS if values.get(name) is not None}
    if overrides:
        try:  # SamplingConfig is the one place these are validated (and stop normalized)
            merged = dataclasses.replace(sampling_defaults, **overrides)
        except ConfigError as exc:
            return failed(f"per-row override: {exc}")
        overrides = {name: getattr(merged, name) for name in overrides}
    return Request(
        id=id_,
        adapter=adapter,
        prompt=prompt,
        messages=messages,
        extra=extra,
        source=row.where,
        **overrides,
    )


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
        for key, text in (("role", role), ("content", content)):
            if not _encodable(text):
                return [], f"{column}[{i}].{key}: {_unencodable(text)}"
        clean.append({"role": role, "content": content})
    return clean, None


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _unencodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        return (
            f"{text[:40]!r} has a character UTF-8 cannot encode ({bad!r} at position {exc.start}, "
            "a lone surrogate from a JSON \\u escape?)"
        )
    return f"{text[:40]!r} is fine"


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _describe(value: Any) -> str:
    return f"{_type_name(value)} {value!r}"[:80]


# -- the scan: one pass over the input before a job's first run --------------------------------


@dataclass
class InputScan:
    """What a job learns from one pass over its input before its first run (kept in the output's
    manifest, so a resume does not read the input twice)."""

    rows: int = 0  # input rows, unreadable lines included
    id_type: str = "int64"  # the output's id column: "int64" when every given id is an int
    keep: dict[str, pa.DataType] = field(default_factory=dict)  # kept column -> its type
    json_text: list[str] = field(default_factory=list)  # kept columns of mixed types: JSON text
    unused: dict[str, list] = field(default_factory=dict)  # column -> [rows having it, first where]
    clashing: list[str] = field(default_factory=list)  # keep_columns all: names the output has
    duplicates: int = 0  # rows whose (id, adapter) an earlier row has
    duplicate_examples: list[str] = field(default_factory=list)

    def notes(self, columns: dict[str, str]) -> list[str]:
        """What a user should hear about the input: columns neither used nor kept (with a
        did-you-mean), kept columns stored as JSON text or found nowhere, names not kept."""
        known = used_columns(columns)
        notes = []
        for name, (count, where) in self.unused.items():
            close = difflib.get_close_matches(name, known, n=1)
            hint = (
                f" (did you mean {close[0]!r}?)"
                if close
                else " (add it to keep_columns to carry it to the output)"
            )
            notes.append(
                f"column {name!r} in {count:,} {_plural(count, 'row')} (first: {where}) is neither used nor kept{hint}"
            )
        for name in self.json_text:
            notes.append(f"kept column {name!r} mixes value types: stored as JSON text")
        for name, type_ in self.keep.items():
            if pa.types.is_null(type_):
                notes.append(f"kept column {name!r} has no value in any row")
        for name in self.clashing:
            notes.append(f"column {name!r} is not kept: the output has its own {name!r}")
        return notes

    def duplicates_message(self) -> str:
        examples = "; ".join(self.duplicate_examples)
        more = self.duplicates - len(self.duplicate_examples)
        return (
            f"{self.duplicates:,} input {_plural(self.duplicates, 'row repeats', 'rows repeat')} "
            f"the (id, adapter) of an earlier row, and each must be unique: {examples}"
            + (f"; and {more:,} more" if more > 0 else "")
            + ". Remove or renumber the duplicates"
        )

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["keep"] = {name: _type_to_text(t) for name, t in self.keep.items()}
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InputScan:
        data = dict(data)
        data["keep"] = {name: _type_from_text(t) for name, t in data["keep"].items()}
        return cls(**data)


def _type_to_text(type_: pa.DataType) -> str:
    return pa.schema([("x", type_)]).serialize().to_pybytes().hex()


def _type_from_text(text: str) -> pa.DataType:
    return pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(text))).field("x").type


def _plural(n: int, one: str, many: str | None = None) -> str:
    return one if n == 1 else (many or one + "s")


class _TypeOf:
    """A kept column's type over its values: pyarrow's inference per chunk, unified permissively
    (null -> int64 -> double ...); types that do not unify make it JSON text."""

    def __init__(self, type_: pa.DataType | None = None) -> None:
        self.type, self.json, self.values = type_, False, []

    def add(self, value: Any) -> None:
        if not self.json:
            self.values.append(value)
            if len(self.values) >= INFER_ROWS:
                self.settle()

    def merge(self, other: pa.DataType) -> None:
        if self.json or self.type == other:
            return
        if self.type is None:
            self.type = other
            return
        try:
            schemas = [pa.schema([("x", self.type)]), pa.schema([("x", other)])]
            self.type = pa.unify_schemas(schemas, promote_options="permissive").field("x").type
        except (pa.ArrowException, TypeError, ValueError):
            self.json = True

    def settle(self) -> None:
        if self.values and not self.json:
            try:
                self.merge(pa.array(self.values).type)
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                self.json = True
        self.values = []


def scan_input(
    files: list[Path],
    columns: dict[str, str],
    keep: list[str] | str | None,
    fanout: bool,
    reserved: Iterable[str] = (),
) -> InputScan:
    """One pass over every row: the id column's type, the kept columns' types (Parquet: the
    files' schemas; JSONL: inferred from the values), columns neither used nor kept, and rows
    whose (id, adapter) repeat an earlier row's (with ``fanout``: whose id does). Memory: one
    key per row (duplicates are found by a set of them), freed when the scan ends.

    ``keep`` is a list of column names, "all" (every column not used) or None; ``reserved``
    names the output's own columns, which "all" does not take."""
    used = set(used_columns(columns))
    keep_all = keep == "all"
    wanted = [] if keep_all or not keep else list(keep)
    scan = InputScan()
    types: dict[str, _TypeOf] = {name: _TypeOf() for name in wanted}
    reserved = set(reserved)
    all_ints = True
    seen: set[str] = set()
    repeats: list[tuple[str, str]] = []  # (key, where) of the first few repeated rows
    root = input_root(files)

    def take(name: str) -> _TypeOf | None:
        """The type tracker of a column the row has, or None when it is neither kept nor used."""
        if name in types:
            return types[name]
        if name in used:
            return None
        if keep_all and name not in reserved:
            types[name] = _TypeOf()
            return types[name]
        if keep_all and name not in scan.clashing:
            scan.clashing.append(name)
        return None

    for file in files:
        if file.suffix.lower() == ".parquet":
            schema = _parquet_schema(file)
            rows = pq.ParquetFile(file).metadata.num_rows
            for name in schema.names:
                tracker = take(name)
                if tracker is not None:
                    tracker.merge(schema.field(name).type)
                elif name not in used and not keep_all:
                    count = scan.unused.setdefault(
                        name, [0, f"{relative_name(file, root)} (every row)"]
                    )
                    count[0] += rows
            parquet_wanted = [columns["id"], columns["adapter"]]
        else:
            parquet_wanted = None
        name_ = relative_name(file, root)
        for number, record, error in _records(file, parquet_wanted):
            scan.rows += 1
            if record is None:
                continue
            row = InputRow(0, file, name_, number, {}, columns, {}, error)
            if parquet_wanted is None:
                for name, value in record.items():
                    tracker = take(name)
                    if tracker is not None:
                        tracker.add(value)
                    elif name not in used and not keep_all:
                        count = scan.unused.setdefault(name, [0, row.where])
                        count[0] += 1
            row.values = {
                "id": record.get(columns["id"]),
                "adapter": record.get(columns["adapter"]),
            }
            id_, adapter, problem = identity(row, fanout)
            if problem is not None or isinstance(id_, RowSource):
                continue
            if isinstance(id_, str) or not INT64_MIN <= id_ <= INT64_MAX:
                all_ints = False
            key = row_key(id_, adapter)
            if key in seen:
                scan.duplicates += 1
                if len(repeats) < DUPLICATE_EXAMPLES:
                    repeats.append((key, row.where))
            else:
                seen.add(key)
    del seen
    scan.id_type = "int64" if all_ints else "string"
    for name, tracker in types.items():
        tracker.settle()
        if tracker.json:
            scan.json_text.append(name)
        scan.keep[name] = pa.string() if tracker.json else (tracker.type or pa.null())
    if repeats:
        firsts = _first_rows(files, columns, fanout, {key for key, _ in repeats})
        scan.duplicate_examples = [
            f"{where} repeats {firsts.get(key, '?')}" for key, where in repeats
        ]
    return scan


def _first_rows(
    files: list[Path], columns: dict[str, str], fanout: bool, keys: set[str]
) -> dict[str, str]:
    """Where each of ``keys`` first occurs (a second pass, stopping when all are found)."""
    found: dict[str, str] = {}
    for row in read_rows(files, columns, root=input_root(files)):
        id_, adapter, problem = identity(row, fanout)
        if problem is None and not isinstance(id_, RowSource):
            key = row_key(id_, adapter)
            if key in keys and key not in found:
                found[key] = (
                    f"{row.where} (id {id_!r}" + ("" if fanout else f", adapter {adapter!r}") + ")"
                )
                if len(found) == len(keys):
                    break
    return found


def _parquet_schema(file: Path) -> pa.Schema:
    try:
        return pq.read_schema(file)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{file}: cannot read as Parquet: {exc}") from exc
