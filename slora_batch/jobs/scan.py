"""The input scan: one pass over every row before a job's first run, for the output's id type,
the kept columns' types, the columns neither used nor kept (with a did-you-mean), the rows
whose (id, adapter) repeat and the output rows the job will make (n samples per row).
``InputScan`` is kept in the job manifest, so a resume does not read the input twice."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.engine.config import SamplingConfig
from slora_batch.jobs.config import SCORE_KEYS
from slora_batch.jobs.openai_input import OpenAIBatch
from slora_batch.jobs.reader import (
    InputError,
    InputRow,
    converted,
    file_records,
    input_root,
    parquet_file,
    read_rows,
    relative_name,
    used_columns,
)
from slora_batch.jobs.rows import RowSource, identity, row_key
from slora_batch.jobs.samples import row_samples

INFER_ROWS = 4096  # JSONL values of a kept column typed together, then unified
DUPLICATE_EXAMPLES = 5  # duplicates named in the scan's message
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


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
    # rows whose output rows per adapter are not the job's n: those with an n column (their own
    # n, or one error row when it is bad), scored rows (one each) and those that cannot be read
    # (one error row)
    own_n_rows: int = 0
    own_n_samples: int = 0  # the output rows per adapter of those
    # the choices list every row with a ``choices`` column gives, None when none does or two
    # differ (the preference table then heads its columns by the choices' texts)
    choices: list[str] | None = None
    choices_differ: bool = False

    def samples(self, n: int) -> int:
        """Output rows per adapter of a job whose ``sampling.n`` is ``n``, when every row that
        can be read makes its samples (one that fails makes one error row instead).

        Running example: 10 rows, 2 of them with n 5 and one line unreadable, a job with n 3:
        (10 - 3) * 3 + 5 + 5 + 1 = 32."""
        return (self.rows - self.own_n_rows) * n + self.own_n_samples

    def notes(self, columns: dict[str, str]) -> list[str]:
        """What a user should hear about the input: columns neither used nor kept (with a
        did-you-mean), kept columns stored as JSON text or found nowhere, names not kept."""
        known = used_columns(columns)
        notes = []
        for name, (count, where) in self.unused.items():
            field_of, _, field_name = name.partition(".")
            if field_of in ("body", "line") and field_name:  # OpenAI Batch lines (openai_input)
                notes.append(
                    f"OpenAI batch: {field_of} field {field_name!r} in {count:,} "
                    f"{_plural(count, 'line')} (first: {where}) is not supported: ignored"
                )
                continue
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


def _same_choices(scan: InputScan, choices: Any) -> None:
    """Follows whether every row's ``choices`` is one list (rows without it do not count)."""
    if choices is None or scan.choices_differ:
        return
    if scan.choices is None:
        scan.choices = list(choices) if isinstance(choices, list) else None
        scan.choices_differ = scan.choices is None
    elif choices != scan.choices:
        scan.choices, scan.choices_differ = None, True


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
    fs=None,
    openai: OpenAIBatch | None = None,
) -> InputScan:
    """One pass over every row: the id column's type, the kept columns' types (Parquet: the
    files' schemas; JSONL: inferred from the values), columns neither used nor kept, and rows
    whose (id, adapter) repeat an earlier row's (with ``fanout``: whose id does). Memory: one
    key per row (duplicates are found by a set of them), freed when the scan ends.

    ``keep`` is a list of column names, "all" (every column not used) or None; ``reserved``
    names the output's own columns, which "all" does not take. ``fs``: the filesystem the files
    are on (None: the local disk); ``openai``: they hold OpenAI Batch lines (ids are strings)."""
    reading = openai.reading() if openai is not None else None
    used = set(used_columns(columns))
    score_columns = [columns.get(key, key) for key in SCORE_KEYS]  # a scored row makes 1 row
    keep_all = keep == "all"
    wanted = [] if keep_all or not keep else list(keep)
    scan = InputScan()
    types: dict[str, _TypeOf] = {name: _TypeOf() for name in wanted}
    reserved = set(reserved)
    all_ints = True
    seen: set[str] = set()
    repeats: list[tuple[str, str]] = []  # (key, where) of the first few repeated rows
    root = input_root(files, fs)

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
            schema = _parquet_schema(file, fs)
            rows = parquet_file(file, fs).metadata.num_rows
            for name in schema.names:
                tracker = take(name)
                if tracker is not None:
                    tracker.merge(schema.field(name).type)
                elif name not in used and not keep_all:
                    count = scan.unused.setdefault(
                        name, [0, f"{relative_name(file, root)} (every row)"]
                    )
                    count[0] += rows
            parquet_wanted = [columns["id"], columns["adapter"], "n", *score_columns]
        else:
            parquet_wanted = None
        name_ = relative_name(file, root)
        records = converted(file_records(file, parquet_wanted, fs), reading, name_)
        for number, record, error in records:
            scan.rows += 1
            if record is None:
                scan.own_n_rows += 1
                scan.own_n_samples += 1
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
            scored = any(record.get(name) is not None for name in score_columns)
            _same_choices(scan, record.get(columns.get("choices", "choices")))
            if problem is not None or record.get("n") is not None or scored:
                scan.own_n_rows += 1
                n = 1 if problem else row_samples(record.get("n"), SamplingConfig(), scored)
                scan.own_n_samples += n
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
    scan.id_type = "int64" if all_ints and openai is None else "string"
    for name, tracker in types.items():
        tracker.settle()
        if tracker.json:
            scan.json_text.append(name)
        scan.keep[name] = pa.string() if tracker.json else (tracker.type or pa.null())
    if repeats:
        firsts = _first_rows(files, columns, fanout, {key for key, _ in repeats}, fs, openai)
        scan.duplicate_examples = [
            f"{where} repeats {firsts.get(key, '?')}" for key, where in repeats
        ]
    return scan


def _first_rows(
    files: list[Path], columns: dict[str, str], fanout: bool, keys: set[str], fs=None, openai=None
) -> dict[str, str]:
    """Where each of ``keys`` first occurs (a second pass, stopping when all are found)."""
    found: dict[str, str] = {}
    for row in read_rows(files, columns, root=input_root(files, fs), fs=fs, openai=openai):
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


def _parquet_schema(file: Path, fs=None) -> pa.Schema:
    try:
        return pq.read_schema(file) if fs is None else parquet_file(file, fs).schema_arrow
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{file}: cannot read as Parquet: {exc}") from exc
