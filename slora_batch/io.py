"""Streaming input (JSONL, Parquet) into ``Request``s; the output side is ``writer.py``.

Rows are read one at a time (Parquet in record batches), so memory does not grow with the file.
A bad row never raises: it becomes an error ``Result`` naming the file, the row and why. Row
numbers in messages: "line N" for JSONL (1-based, as editors show), "row N" for Parquet (0-based,
as pyarrow and pandas show).
"""

from __future__ import annotations

import dataclasses
import glob
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.config import ConfigError, SamplingConfig
from slora_batch.request import SAMPLING_FIELDS, Request, Result

SUFFIXES = (".jsonl", ".parquet")
PARQUET_BATCH_ROWS = 1024


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
