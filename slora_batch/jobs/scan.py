"""The input scan: one pass over every row before a job's first run, for the output's id type,
the kept columns' types, the columns neither used nor kept (with a did-you-mean), the rows
whose (id, adapter) repeat and the output rows the job will make (n samples per row).
``InputScan`` is kept in the job manifest, so a resume does not read the input twice."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.engine.config import SamplingConfig
from slora_batch.jobs.column_types import (
    TypeOf,
    arrow_kind,
    type_from_text,
    type_to_text,
    value_kind,
)
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
from slora_batch.jobs.text import plural

DUPLICATE_EXAMPLES = 5  # duplicates named in the scan's message
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
KEPT_PREFIX = "input_"  # a kept column named as an output column is kept as "input_<name>"


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

    def samples(self, n: int) -> int:
        """Output rows per adapter of a job whose ``sampling.n`` is ``n``, when every row that
        can be read makes its samples (one that fails makes one error row instead).

        Running example: 10 rows, 2 of them with n 5 and one line unreadable, a job with n 3:
        (10 - 3) * 3 + 5 + 5 + 1 = 32."""
        return (self.rows - self.own_n_rows) * n + self.own_n_samples

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


def _same_choices(scan: InputScan, choices: Any) -> None:
    """Follows whether every row's ``choices`` is one list (rows without it do not count)."""
    if choices is None or scan.choices_differ:
        return
    if scan.choices is None:
        scan.choices = list(choices) if isinstance(choices, list) else None
        scan.choices_differ = scan.choices is None
    elif choices != scan.choices:
        scan.choices, scan.choices_differ = None, True


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
    reading = openai.reading() if openai is not None else None
    used = set(used_columns(columns)) | set(fields)
    score_columns = [columns.get(key, key) for key in SCORE_KEYS]  # a scored row makes 1 row
    keep_all = keep == "all"
    wanted = [] if keep_all or not keep else list(keep)
    # "all" leaves out the id and adapter (the output's own), and an OpenAI line's fields
    not_all = {columns["id"], columns["adapter"]} | (used if openai is not None else set())
    scan = InputScan(limit=limit)
    types: dict[str, TypeOf] = {name: TypeOf() for name in wanted}
    taken = set(reserved) | {name for name in wanted if name not in reserved}
    out_names = {name: name for name in wanted if name not in reserved}
    for name in wanted:
        if name in reserved:
            out_names[name] = kept_name(name, taken)
    all_ints = True
    seen: set[str] = set()
    found: set[str] = set()
    repeats: list[tuple[str, str]] = []  # (key, where) of the first few repeated rows
    root = input_root(files, fs)

    def take(name: str) -> TypeOf | None:
        """The type tracker of a column the row has, or None when it is not kept."""
        if name in used:
            found.add(name)
        if name in types:
            return types[name]
        if keep_all and name not in not_all:
            out_names[name] = kept_name(name, taken)
            types[name] = TypeOf()
            return types[name]
        return None

    def full() -> bool:
        return limit is not None and scan.rows >= limit

    for file in files:
        if full():
            break
        rows_before = scan.rows
        if file.suffix.lower() == ".parquet":
            schema = _parquet_schema(file, fs)
            rows = parquet_file(file, fs).metadata.num_rows
            if limit is not None:
                rows = min(rows, limit - scan.rows)
            for name in schema.names:
                if scan.column_kinds.get(name, "null") == "null":
                    scan.column_kinds[name] = arrow_kind(schema.field(name).type)
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
            if full():
                break
            scan.rows += 1
            if record is None:
                scan.own_n_rows += 1
                scan.own_n_samples += 1
                continue
            row = InputRow(0, file, name_, number, {}, columns, {}, error)
            if parquet_wanted is None:
                kinds = scan.column_kinds
                for name, value in record.items():
                    if kinds.get(name, "null") == "null":
                        kinds[name] = value_kind(value)
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
        scan.file_rows.append(scan.rows - rows_before)
    del seen
    scan.columns_found = sorted(found)
    scan.position_ids = openai is None and columns["id"] not in scan.column_kinds
    scan.id_type = "int64" if all_ints and openai is None else "string"
    for name, tracker in types.items():
        out = out_names[name]
        if out != name:
            scan.kept_as[name] = out
        tracker.settle()
        if tracker.json:
            scan.json_text.append(out)
        scan.keep[out] = pa.string() if tracker.json else (tracker.type or pa.null())
    if repeats:
        firsts = _first_rows(files, columns, fanout, {key for key, _ in repeats}, fs, openai)
        scan.duplicate_examples = [
            f"{where} repeats {firsts.get(key, '?')}" for key, where in repeats
        ]
    return scan


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
