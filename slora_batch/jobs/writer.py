"""``OutputWriter``: finished rows buffered and committed as Parquet parts of the job's
``part_schema``, by rows and by time; each part is committed atomically
(``outdir.commit_file``), so a committed part is always whole."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from slora_batch.engine.requests.request import Result
from slora_batch.jobs.lock import OutputLock
from slora_batch.jobs.outdir import SUCCESS_FILE, TMP_MARK, clear_output, commit_file, part_files
from slora_batch.jobs.rows import RowSource
from slora_batch.jobs.schema import (
    BASE_ADAPTER,
    JSON_TEXT,
    PART_SCHEMA,
    SCORE_NAMES,
    kept_names,
)
from slora_batch.jobs.text import encodable

logger = logging.getLogger(__name__)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FINISH_REASONS = ("stop", "length", "score", "error")
SCORED = (*SCORE_NAMES, "logprobs")  # ``Result`` fields stored under their own names
SURROGATE = re.compile("[\ud800-\udfff]")  # what UTF-8 cannot encode in a Python str


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
        self._parts = PartRows(schema)
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
        if result.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"row {result.id!r}: finish_reason {result.finish_reason!r} is not one of "
                f"{', '.join(FINISH_REASONS)}"
            )
        self._rows.append(self._parts.row(result))
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

    def flush(self) -> None:
        """Commit the buffered rows as the next part (nothing when the buffer is empty)."""
        rows = self.buffered
        if rows == 0:
            return
        started = time.perf_counter()
        table = self._parts.table(self._rows)
        path = self.out_dir / f"part-{self.next_part:05d}.parquet"
        commit_file(path, lambda handle: pq.write_table(table, handle))
        # The buffer empties before the part number moves on: an exception (a signal) between
        # the two leaves nothing to commit twice; one before both (during commit_file, after the
        # rename) makes close() write the same rows to the same part name again.
        self._rows = []
        self.next_part += 1
        self._oldest = None
        self.rows_written += rows
        logger.debug("committed %s (%d rows)", path, rows)
        self.write_s += time.perf_counter() - started

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


class PartRows:
    """Results into rows of a part ``schema`` (lists of values in schema order), and rows into
    a table of it: the checks ``OutputWriter`` makes on every row (its docstring says which).
    The schema's own columns are any of ``schema.OUTPUT_COLUMNS`` (``schema.job_columns``),
    followed by the kept ones."""

    def __init__(self, schema: pa.Schema = PART_SCHEMA) -> None:
        self.schema = schema
        self._int_ids = schema.field("id").type == pa.int64()
        self._kept = kept_names(schema)
        self._own = schema.names[: len(schema.names) - len(self._kept)]
        self._scores = [name for name in self._own if name in SCORED]
        self._json = {f.name for f in schema if f.metadata == JSON_TEXT}

    def row(self, result: Result) -> list[Any]:
        """The output row's values in schema order; ``OutputWriter``'s docstring says what is
        fixed: texts are cleaned, and a row whose id, adapter or token ids cannot be stored
        becomes an error row without an id."""
        extra = result.extra or {}
        id_, source = result.id, extra.get("source")
        if isinstance(id_, RowSource):
            id_, source = None, id_.source
        elif isinstance(id_, int) and not isinstance(id_, bool) and not self._int_ids:
            id_ = str(id_)  # a string id column holds an int id as its decimal text
        values = self._values(result, extra, id_, source)
        kept = [self._kept_value(name, extra.get(name)) for name in self._kept]
        problem = self._problem(id_, values["adapter"], result.token_ids)
        if problem is not None:
            source = values["source"]
            logger.warning("%s: %s; written as an error row without an id", source, problem)
            where = f"{source}: " if source else ""
            values.update(
                {name: None for name in self._scores},
                id=None,
                adapter=None,
                text="",
                token_ids=[],
                completion_tokens=0,
                finish_reason="error",
                error=f"{where}row cannot be stored: {problem}",
            )
        return [*(values.get(name) for name in self._own), *kept]

    def _values(
        self, result: Result, extra: dict[str, Any], id_: Any, source: Any
    ) -> dict[str, Any]:
        """The own columns' values of ``result`` as given, their texts cleaned."""
        index = extra.get("row_index")
        values = {
            "id": id_,
            "adapter": result.adapter or BASE_ADAPTER,
            "row_index": index if isinstance(index, int) and not isinstance(index, bool) else None,
            "prompt": _prompt_text(extra.get("prompt")),
            "sample_index": result.sample_index,
            "text": _clean(result.text),
            "token_ids": list(result.token_ids),
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "finish_reason": result.finish_reason,
            "error": _clean(result.error),
            "source": _clean(source) if isinstance(source, str) else None,
        }
        for name in self._scores:
            values[name] = getattr(result, name)
        if values.get("logprobs") is not None:  # token texts are decoded pieces: lone surrogates
            values["logprobs"] = [_clean_entry(entry) for entry in values["logprobs"]]
        return values

    def _problem(self, id_: Any, adapter: Any, tokens: list[int]) -> str | None:
        """Why the row cannot be stored as given: an id that is not a string or an int64 of
        this output's id column, or that UTF-8 cannot encode; such an adapter; token ids beyond
        int32. None when it can."""
        if isinstance(id_, int) and not isinstance(id_, bool):
            if not INT64_MIN <= id_ <= INT64_MAX:
                return f"id {id_} does not fit the int64 id column"
        elif isinstance(id_, str):
            if self._int_ids:
                return f"id {id_!r} is a string but this output's ids are integers"
            if not encodable(id_):
                return f"id {id_!r} has characters that cannot be encoded as UTF-8"
        elif id_ is not None:
            return f"id {_short(id_)} is neither a string nor an integer"
        if not (isinstance(adapter, str) and encodable(adapter)):
            return f"adapter {adapter!r} cannot be stored (not a UTF-8 string)"
        if tokens and not (min(tokens) >= -(2**31) and max(tokens) < 2**31):
            return f"token ids out of the int32 range ({min(tokens)}..{max(tokens)})"
        return None

    def _kept_value(self, name: str, value: Any) -> Any:
        if value is None:
            return None
        if name in self._json:
            return _clean(value if isinstance(value, str) else _json_text(value))
        if isinstance(value, str):
            return _clean(value)
        return value

    def table(self, rows: list[list[Any]]) -> pa.Table:
        """The buffer as a table. A kept value that does not fit its column's type (the input
        changed its mind about a column's type) is stored as null and logged, rather than
        failing the part and every finished row in it."""
        columns = [list(values) for values in zip(*rows, strict=True)]
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


def _clean(text: str | None) -> str | None:
    """``text`` with every character UTF-8 cannot encode (lone surrogates) replaced by U+FFFD."""
    if text is None or text.isascii():
        return text
    return SURROGATE.sub("\ufffd", text)


def _clean_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """A ``logprobs`` entry with its texts (the token's and each alternative's) cleaned."""
    top = [{**t, "text": _clean(t.get("text"))} for t in entry.get("top") or ()]
    return {**entry, "text": _clean(entry.get("text")), "top": top}


def _prompt_text(prompt: Any) -> str | None:
    """The ``prompt`` column's value of a row's built prompt (``Result.extra["prompt"]``): its
    text, a messages list as JSON text, None (token id rows) as null."""
    if prompt is None:
        return None
    return _clean(prompt if isinstance(prompt, str) else _json_text(prompt))


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def _short(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:80]
