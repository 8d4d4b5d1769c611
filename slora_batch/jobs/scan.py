"""The input scan: one pass over every row before a job's first run, for the output's id type,
the kept columns' types, the columns neither used nor kept (with a did-you-mean), the rows
whose (id, adapter) repeat and the output rows the job will make (n samples per row).
``InputScan`` is kept in the job manifest, so a resume does not read the input twice; a kept
column's Arrow type is kept there as text (``type_to_text``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from slora_batch.engine.config import SamplingConfig
from slora_batch.jobs.config import SCORE_KEYS
from slora_batch.jobs.openai_input import OpenAIBatch
from slora_batch.jobs.reader import InputFile, InputRow, input_records, used_columns
from slora_batch.jobs.rows import RowSource, identity, row_key
from slora_batch.jobs.samples import row_samples
from slora_batch.jobs.text import plural

DUPLICATE_EXAMPLES = 5  # duplicates named in the scan's message
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
KEPT_PREFIX = "input_"  # a kept column named as an output column is kept as "input_<name>"
INFER_ROWS = 4096  # JSONL values of a kept column typed together, then unified


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
    # the used columns some row has (a JSONL record's key, a Parquet file's column), the output
    # columns a job can produce are decided from (``schema.job_columns``)
    columns_found: list[str] = field(default_factory=list)
    file_rows: list[int] = field(default_factory=list)  # input rows of each file, in order
    # every input column some row has -> the kind of its first value: "text", "number", "bool",
    # "list", "object" or "null" (validate's hints and the chat-template warning read it)
    column_kinds: dict[str, str] = field(default_factory=dict)
    # the input has no id column: each row's id is its 0-based position in the job's input
    position_ids: bool = False
    kept_as: dict[str, str] = field(default_factory=dict)  # kept column -> its output name
    limit: int | None = None  # the job's ``limit`` the scan was taken with (None: every row)

    def kept_columns(self) -> dict[str, str]:
        """The kept input columns and the output name each is kept under."""
        names = {out: inp for inp, out in self.kept_as.items()}
        return {names.get(out, out): out for out in self.keep}

    def duplicates_message(self) -> str:
        examples = "; ".join(self.duplicate_examples)
        more = self.duplicates - len(self.duplicate_examples)
        return (
            f"{self.duplicates:,} input {plural(self.duplicates, 'row repeats', 'rows repeat')} "
            f"the (id, adapter) of an earlier row, and each must be unique: {examples}"
            + (f"; and {more:,} more" if more > 0 else "")
            + ". Remove or renumber the duplicates"
        )

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["keep"] = {name: type_to_text(t) for name, t in self.keep.items()}
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InputScan:
        data = dict(data)
        data["keep"] = {name: type_from_text(t) for name, t in data["keep"].items()}
        return cls(**data)


def scan_input(
    files: list[Path],
    columns: dict[str, str],
    keep: list[str] | str | None,
    fanout: bool,
    reserved: Iterable[str] = (),
    fs=None,
    openai: OpenAIBatch | None = None,
    fields: Iterable[str] = (),
    limit: int | None = None,
) -> InputScan:
    """One pass over every row: the id column's type, the kept columns' types (Parquet: the
    files' schemas; JSONL: inferred from the values), the input's columns, columns neither used
    nor kept, and rows whose (id, adapter) repeat an earlier row's (with ``fanout``: whose id
    does). Memory: one key per row (duplicates are found by a set of them), freed when the scan
    ends. An input with no id column at all gets ids from positions (``position_ids``).

    ``keep`` is a list of column names, "all" (every column but the id and adapter ones) or
    None; a kept column named as one of ``reserved`` (the output's own columns) is kept as
    "input_<name>" (``kept_as``). ``fs``: the filesystem the files are on (None: the local
    disk); ``openai``: they hold OpenAI Batch lines (ids are strings; "all" keeps no column
    the job reads). ``fields``: the columns the job's prompt_template reads; ``limit``: scan
    only the first rows of the input."""
    used = {*used_columns(columns), *fields}
    kept = _KeptColumns(keep, reserved, used, {columns["id"], columns["adapter"]}, openai)
    scanner = _Scanner(InputScan(limit=limit), kept, columns, fanout)
    for file in input_records(files, fs, openai, scanner.parquet_wanted):
        if scanner.full:
            break
        scanner.read(file)
    scan = scanner.finish(openai is None)
    if scanner.repeats:
        keys = {key for key, _ in scanner.repeats}
        firsts = _first_rows(files, columns, fanout, keys, fs, openai)
        scan.duplicate_examples = [
            f"{where} repeats {firsts.get(key, '?')}" for key, where in scanner.repeats
        ]
    return scan


class _Scanner:
    """One pass over the input's files, filling ``scan``: per file its columns (a Parquet
    file's from its schema), per row its columns (a JSONL record's), its identity (the id
    type, the duplicates) and the output rows it makes per adapter."""

    def __init__(
        self, scan: InputScan, kept: _KeptColumns, columns: dict[str, str], fanout: bool
    ) -> None:
        self.scan, self.kept, self.columns, self.fanout = scan, kept, columns, fanout
        self.score_columns = [columns.get(key, key) for key in SCORE_KEYS]  # a scored row: 1
        self.choices_column = columns.get("choices", "choices")
        # what a Parquet file's rows are read for: their kinds and kept types are the schema's
        self.parquet_wanted = [columns["id"], columns["adapter"], "n", *self.score_columns]
        self.sampling = SamplingConfig()  # a row's own n is checked against the defaults
        self.all_ints = True  # every usable id is an int64
        self.keys: set[str] = set()  # (id, adapter) of every usable row, freed at the end
        self.repeats: list[tuple[str, str]] = []  # (key, where) of the first few repeated rows

    @property
    def full(self) -> bool:
        """Whether the scan has read the ``limit`` rows it was asked for."""
        limit = self.scan.limit
        return limit is not None and self.scan.rows >= limit

    def read(self, file: InputFile) -> None:
        """Every row of one file: a Parquet file's columns are its schema's, for every row."""
        before, parquet = self.scan.rows, file.parquet
        if parquet is not None:
            rows = parquet.metadata.num_rows
            if self.scan.limit is not None:
                rows = min(rows, self.scan.limit - self.scan.rows)
            self.kept.schema(self.scan, parquet.schema_arrow, rows, f"{file.name} (every row)")
        for number, record, error in file.records:
            if self.full:
                break
            row = InputRow(0, file.path, file.name, number, {}, self.columns, {}, error)
            self._read_row(row, record, parquet is None)
        self.scan.file_rows.append(self.scan.rows - before)

    def _read_row(self, row: InputRow, record: dict | None, own_columns: bool) -> None:
        """One row: its columns (``own_columns``: a JSONL record's, each row its own), its
        choices, its identity and the output rows it makes per adapter. A line that cannot
        be read (no ``record``) is one error row."""
        self.scan.rows += 1
        if record is None:
            self._owes(1)
            return
        if own_columns:
            self.kept.record(self.scan, record, row.where)
        self._same_choices(record.get(self.choices_column))
        columns = self.columns
        row.values = {"id": record.get(columns["id"]), "adapter": record.get(columns["adapter"])}
        id_, adapter, problem = identity(row, self.fanout)
        usable = problem is None and not isinstance(id_, RowSource)
        key = row_key(id_, adapter) if usable else None
        scored = any(record.get(name) is not None for name in self.score_columns)
        n = 1 if problem else row_samples(record.get("n"), self.sampling, scored)
        if problem is not None or record.get("n") is not None or scored:
            self._owes(n)
        if key is not None:
            self._identity(id_, key, row.where)

    def _owes(self, n: int) -> None:
        """A row whose output rows per adapter are not the job's n: its own n, 1 for a scored
        row, 1 error row for one that fails."""
        self.scan.own_n_rows += 1
        self.scan.own_n_samples += n

    def _identity(self, id_: Any, key: str, where: str) -> None:
        """A usable id: whether it fits int64, and whether an earlier row has its key."""
        if isinstance(id_, str) or not INT64_MIN <= id_ <= INT64_MAX:
            self.all_ints = False
        if key not in self.keys:
            self.keys.add(key)
            return
        self.scan.duplicates += 1
        if len(self.repeats) < DUPLICATE_EXAMPLES:
            self.repeats.append((key, where))

    def _same_choices(self, choices: Any) -> None:
        """Follows whether every row's ``choices`` is one list (rows without it do not count)."""
        scan = self.scan
        if choices is None or scan.choices_differ:
            return
        if scan.choices is None:
            scan.choices = list(choices) if isinstance(choices, list) else None
            scan.choices_differ = scan.choices is None
        elif choices != scan.choices:
            scan.choices, scan.choices_differ = None, True

    def finish(self, ids_given: bool) -> InputScan:
        """The scan, with what is settled once every row is read. ``ids_given``: the rows'
        ids are their id column's (not OpenAI Batch custom_ids, always strings)."""
        scan = self.scan
        self.keys.clear()
        scan.position_ids = ids_given and self.columns["id"] not in scan.column_kinds
        scan.id_type = "int64" if self.all_ints and ids_given else "string"
        self.kept.finish(scan)
        return scan


class _KeptColumns:
    """The input's columns as the scan meets them: the kind of each (of its first value that is
    not null), the kept ones' output names and types, the used ones some row has, and the
    columns neither used nor kept, with the rows that have them.

    ``keep``: a list of columns, "all" (every column but ``own``, the id and adapter ones, and
    for OpenAI Batch lines the ones the job reads) or None; a kept column named as one of
    ``reserved`` is kept as "input_<name>" (``kept_name``). ``used``: the columns the job
    reads."""

    def __init__(
        self,
        keep: list[str] | str | None,
        reserved: Iterable[str],
        used: set[str],
        own: set[str],
        openai: OpenAIBatch | None,
    ) -> None:
        self.used = used
        self.keep_all = keep == "all"
        self.not_all = own | (used if openai is not None else set())
        wanted = [] if self.keep_all or not keep else list(keep)
        reserved = set(reserved)
        self.taken = reserved | {name for name in wanted if name not in reserved}
        self.out_names = {
            name: kept_name(name, self.taken) if name in reserved else name for name in wanted
        }
        self.types = {name: TypeOf() for name in wanted}
        self.found: set[str] = set()

    def schema(self, scan: InputScan, schema: pa.Schema, rows: int, where: str) -> None:
        """A Parquet file's columns: each of its ``rows`` rows has each, of the schema's type."""
        for name in schema.names:
            type_ = schema.field(name).type
            if scan.column_kinds.get(name, "null") == "null":
                scan.column_kinds[name] = arrow_kind(type_)
            tracker = self._take(name)
            if tracker is not None:
                tracker.merge(type_)
            elif name not in self.used and not self.keep_all:
                _count_unused(scan, name, rows, where)

    def record(self, scan: InputScan, record: dict[str, Any], where: str) -> None:
        """A JSONL record's columns: a record has a few keys, walked rather than every name."""
        kinds = scan.column_kinds
        for name, value in record.items():
            if kinds.get(name, "null") == "null":
                kinds[name] = value_kind(value)
            tracker = self._take(name)
            if tracker is not None:
                tracker.add(value)
            elif name not in self.used and not self.keep_all:
                _count_unused(scan, name, 1, where)

    def _take(self, name: str) -> TypeOf | None:
        """The type tracker of a column a row has, or None when it is not kept."""
        if name in self.used:
            self.found.add(name)
        if name in self.types:
            return self.types[name]
        if self.keep_all and name not in self.not_all:
            self.out_names[name] = kept_name(name, self.taken)
            self.types[name] = TypeOf()
            return self.types[name]
        return None

    def finish(self, scan: InputScan) -> None:
        """The used columns found, and each kept column's output name and settled type."""
        scan.columns_found = sorted(self.found)
        for name, tracker in self.types.items():
            out = self.out_names[name]
            if out != name:
                scan.kept_as[name] = out
            tracker.settle()
            if tracker.json:
                scan.json_text.append(out)
            scan.keep[out] = pa.string() if tracker.json else (tracker.type or pa.null())


def _count_unused(scan: InputScan, name: str, rows: int, where: str) -> None:
    """``rows`` more rows have the column neither used nor kept (``where``: its first)."""
    count = scan.unused.setdefault(name, [0, where])
    count[0] += rows


def _first_rows(
    files: list[Path], columns: dict[str, str], fanout: bool, keys: set[str], fs=None, openai=None
) -> dict[str, str]:
    """Where each of ``keys`` first occurs (a second pass, stopping when all are found)."""
    found: dict[str, str] = {}
    for file in input_records(files, fs, openai, [columns["id"], columns["adapter"]]):
        for number, record, error in file.records:
            if record is None:  # a line that cannot be read has no id to repeat
                continue
            values = {"id": record.get(columns["id"]), "adapter": record.get(columns["adapter"])}
            row = InputRow(0, file.path, file.name, number, values, columns, {}, error)
            id_, adapter, problem = identity(row, fanout)
            if problem is not None or isinstance(id_, RowSource):
                continue
            key = row_key(id_, adapter)
            if key in keys and key not in found:
                shown = "" if fanout else f", adapter {adapter!r}"
                found[key] = f"{row.where} (id {id_!r}{shown})"
                if len(found) == len(keys):
                    return found
    return found


def limit_changed(manifest: dict[str, Any], limit: int | None) -> bool:
    """Whether an output's manifest holds a scan taken with another ``limit`` than the job's
    now: its row counts and its completion are of other rows, so the input is scanned again and
    the output is not complete (the rows it holds stay: a larger limit adds the new ones)."""
    return manifest["scan"].get("limit") != limit


def kept_name(name: str, taken: set[str]) -> str:
    """The output name of a kept column: its own, or "input_<name>" (prefixed again while
    that is taken too) when the output has a column of that name; added to ``taken``.

    Running example: an input column "text" beside the output's "text" -> "input_text"."""
    out = name
    while out in taken:
        out = KEPT_PREFIX + out
    taken.add(out)
    return out


class TypeOf:
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


def type_to_text(type_: pa.DataType) -> str:
    return pa.schema([("x", type_)]).serialize().to_pybytes().hex()


def type_from_text(text: str) -> pa.DataType:
    return pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(text))).field("x").type


def value_kind(value: Any) -> str:
    """The kind of a JSON value, for hints: "text", "number", "bool", "list", "object", "null"."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return "text"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return "list" if isinstance(value, list) else "object"


def arrow_kind(type_: pa.DataType) -> str:
    """``value_kind`` of a Parquet column's type."""
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        return "text"
    if pa.types.is_integer(type_) or pa.types.is_floating(type_):
        return "number"
    if pa.types.is_boolean(type_):
        return "bool"
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        return "list"
    return "null" if pa.types.is_null(type_) else "object"
