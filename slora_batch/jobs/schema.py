"""The output parts' schema: ``id`` keeps the input's type (int64 when every given id is an
integer, else string: an int 7 is stored "7"), null for a row without a usable id, which
``source`` ("rows.jsonl line 7") identifies instead; then the core columns, the scoring and
logprobs columns (null where they do not apply), then the kept input columns (``JSON_TEXT`` ones
hold each value as JSON text).

An output row is one sample of one input row for one adapter: ``(id, adapter, sample_index)``
is unique (``samples.py``). Parts written before the scoring columns or ``sample_index``
existed lack them (such a part's rows are sample 0); readers of an output directory (resume,
stats, preview, ``preference``) read each part by its own schema."""

from __future__ import annotations

import pyarrow as pa

JSON_TEXT = {b"slora_batch": b"json"}  # field metadata: a kept column stored as JSON text
CORE_FIELDS = [
    pa.field("adapter", pa.string()),  # null = base model
    pa.field("sample_index", pa.int64(), nullable=False),  # which of the row's n samples
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
# the next five (one list entry per choice), a row with an answer ``correct``, and a generated
# row asked for ``logprobs`` the last (one entry per generated token).
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
    pa.field("logprobs", pa.list_(TOKEN_LOGPROBS)),
]
# the output's own columns: a kept input column cannot take these
OUTPUT_COLUMNS = ("id", *(f.name for f in CORE_FIELDS), *(f.name for f in SCORE_FIELDS))
ID_TYPES = {"int64": pa.int64(), "string": pa.string()}


def part_schema(
    id_type: str = "string",
    keep: dict[str, pa.DataType] | None = None,
    json_text: tuple[str, ...] | list[str] = (),
) -> pa.Schema:
    """The parts' schema: ``id`` of ``id_type`` ("int64" or "string"), the core and scoring
    columns, then the kept input columns (``json_text`` ones are strings holding each value as
    JSON)."""
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
    return pa.schema([pa.field("id", ID_TYPES[id_type]), *CORE_FIELDS, *SCORE_FIELDS, *kept])


PART_SCHEMA = part_schema()  # string ids, no kept columns: the writer's default
