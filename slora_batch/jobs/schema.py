"""The output parts' schema: ``id`` keeps the input's type (int64 when every given id is an
integer, else string: an int 7 is stored "7"), null for a row without a usable id, which
``source`` ("rows.jsonl line 7") identifies instead; then the core columns, the scoring columns
when the job's input has a scoring column, ``logprobs`` when its rows may ask for them, then the
kept input columns (``JSON_TEXT`` ones hold each value as JSON text).

Which of its own columns a job's parts hold (``job_columns``) is decided on the job's first run
and recorded in its manifest, so a resume writes parts of the same schema; a manifest without
the record was written by a version whose parts held every column of that time
(``LEGACY_COLUMNS``). ``adapter`` is "" for the base model (a null adapter, as parts of earlier
versions hold, means the same: ``adapter_name`` reads either).

An output row is one sample of one input row for one adapter: ``(id, adapter, sample_index)``
is unique (``samples.py``). Parts written before the scoring columns, ``sample_index`` or
``row_index`` existed lack them (such a part's rows are sample 0); readers of an output
directory (resume, stats, preview, ``preference``, the eval scoring) read each part by its own
schema."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

JSON_TEXT = {b"slora_batch": b"json"}  # field metadata: a kept column stored as JSON text
BASE_ADAPTER = ""  # the output's adapter of base-model rows (the input's convention too)
CORE_FIELDS = [
    pa.field("adapter", pa.string()),  # "" = base model (null in parts of earlier versions)
    pa.field("row_index", pa.int64()),  # the input row's 0-based position in the job's input
    pa.field("sample_index", pa.int64(), nullable=False),  # which of the row's n samples
    pa.field("prompt", pa.string()),  # the text prompt; a messages row's messages as JSON text
    pa.field("text", pa.string(), nullable=False),
    pa.field("token_ids", pa.list_(pa.int32()), nullable=False),  # generated ids only
    pa.field("prompt_tokens", pa.int32(), nullable=False),
    pa.field("completion_tokens", pa.int32(), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),  # stop | length | score | error
    pa.field("error", pa.string()),  # null when fine
    pa.field("source", pa.string()),  # where the row came from: "rows.jsonl line 7"
]
TOP_LOGPROB = pa.struct(
    [("token_id", pa.int64()), ("text", pa.string()), ("logprob", pa.float64())]
)
TOKEN_LOGPROBS = pa.struct([*TOP_LOGPROB, ("top", pa.list_(TOP_LOGPROB))])
# ``Result``'s fields of the same names: a continuation row sets the first four, a choices row
# the next five (one list entry per choice), a row with an answer ``correct``.
SCORE_FIELDS = [
    pa.field("logprob", pa.float64()),  # sum over the continuation's tokens
    pa.field("token_logprobs", pa.list_(pa.float64())),
    pa.field("is_greedy", pa.bool_()),  # every continuation token was the most likely one
    pa.field("continuation_tokens", pa.int64()),
    pa.field("choice_logprobs", pa.list_(pa.float64())),  # per choice: sum over its tokens
    pa.field("choice_tokens", pa.list_(pa.int64())),
    pa.field("choice_greedy", pa.list_(pa.bool_())),
    pa.field("best_choice", pa.int64()),  # highest sum
    pa.field("best_choice_norm", pa.int64()),  # highest mean per token
    pa.field("correct", pa.bool_()),
]
# a generated row asked for ``logprobs``: one entry per generated token
LOGPROBS_FIELD = pa.field("logprobs", pa.list_(TOKEN_LOGPROBS))
SCORE_NAMES = tuple(f.name for f in SCORE_FIELDS)
FIELDS = {f.name: f for f in (*CORE_FIELDS, *SCORE_FIELDS, LOGPROBS_FIELD)}
# every column of the output's own (a kept column cannot take these), in the parts' order
OUTPUT_COLUMNS = ("id", *FIELDS)
# the columns every part held before a job recorded its own (``job_columns``), in their order
LEGACY_COLUMNS = (
    "id",
    "adapter",
    "sample_index",
    "text",
    "token_ids",
    "prompt_tokens",
    "completion_tokens",
    "finish_reason",
    "error",
    "source",
    *SCORE_NAMES,
    "logprobs",
)
ID_TYPES = {"int64": pa.int64(), "string": pa.string()}


def job_columns(scoring: bool, logprobs: bool) -> list[str]:
    """The output's own columns of a job: the core ones, the scoring ones when ``scoring`` (its
    input has a scoring column), ``logprobs`` when ``logprobs`` (its rows may ask for them)."""
    return [
        "id",
        *(f.name for f in CORE_FIELDS),
        *(SCORE_NAMES if scoring else ()),
        *(["logprobs"] if logprobs else []),
    ]


def part_schema(
    id_type: str = "string",
    keep: dict[str, pa.DataType] | None = None,
    json_text: tuple[str, ...] | list[str] = (),
    columns: Sequence[str] = OUTPUT_COLUMNS,
) -> pa.Schema:
    """The parts' schema: the output's own ``columns`` in that order (``id`` of ``id_type``,
    "int64" or "string"), then the kept input columns (``json_text`` ones are strings holding
    each value as JSON)."""
    if id_type not in ID_TYPES:
        raise ValueError(f"id_type must be 'int64' or 'string', got {id_type!r}")
    unknown = [name for name in columns if name != "id" and name not in FIELDS]
    if unknown or "id" not in columns:
        raise ValueError(f"output columns must include 'id' and be output columns: {unknown!r}")
    own = [pa.field("id", ID_TYPES[id_type]) if n == "id" else FIELDS[n] for n in columns]
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
    return pa.schema([*own, *kept])


def kept_names(schema: pa.Schema) -> list[str]:
    """The kept input columns of a part schema (every column not the output's own)."""
    return [name for name in schema.names if name not in OUTPUT_COLUMNS]


def adapter_name(value: Any) -> str | None:
    """An ``adapter`` value of a part as the job tool names adapters: None for the base model,
    whether the part stores "" (this version) or null (earlier ones)."""
    return value or None


PART_SCHEMA = part_schema()  # string ids, every output column, no kept columns
