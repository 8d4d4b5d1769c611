"""One input row into a ``Request``, or an error ``Result`` whose message names the file, the
row and why (a bad row never raises); and a row's identity.

Identity: a row's id is its ``id`` column, kept with its type (string or int). A row without a
usable id (none given; or its id, its adapter or the line itself cannot be read) gets a
``RowSource`` instead: where it came from, which no given id can equal (the writer stores a null
id and the source). ``row_key`` turns either into the resume key.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from slora_batch.engine.config import ConfigError, SamplingConfig
from slora_batch.engine.requests.request import SAMPLING_FIELDS, Request, Result
from slora_batch.jobs.prompts import Prompts
from slora_batch.jobs.reader import InputRow
from slora_batch.jobs.scoring import scoring_fields
from slora_batch.jobs.text import describe, encodable, unencodable

NO_PROMPTS = Prompts()  # a job without prompt settings: rows as they are


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


def identity(row: InputRow, fanout: bool = False) -> tuple[Any, str | None, str | None]:
    """(id, adapter, problem) of a row: the id as given, or a ``RowSource`` when the row has no
    usable id; ``problem`` says why the row is an error row when its line, id or adapter cannot
    be read (then the id is a ``RowSource``: the row cannot claim an identity it may share;
    only an OpenAI Batch line, whose custom_id the reader found usable and new, keeps it). With ``fanout`` the row's adapter is not read (the sweep replaces it)."""
    if row.error is not None:  # an OpenAI Batch line keeps a usable, unique custom_id
        id_, problem = _check_id(row.values.get("id"), row.columns["id"])
        usable = id_ is not None and problem is None
        return id_ if usable else RowSource(row.where), None, row.error
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
            f"column {column!r} must be a non-empty string or an integer, got {describe(id_)}",
        )
    if isinstance(id_, str) and not encodable(id_):
        return None, f"column {column!r}: {unencodable(id_)}"
    return id_, None


def _check_adapter(adapter: Any, column: str) -> tuple[str | None, str | None]:
    if adapter is not None and not isinstance(adapter, str):
        return None, f"column {column!r} must be a string or null, got {describe(adapter)}"
    if adapter and not encodable(adapter):
        return None, f"column {column!r}: {unencodable(adapter)}"
    return adapter or None, None


def to_request(
    row: InputRow,
    sampling_defaults: SamplingConfig,
    fanout: bool = False,
    prompts: Prompts | None = None,
) -> Request | Result:
    """Validate one row into a ``Request``, or an error ``Result`` whose message names the file,
    the row and the reason. Null override values mean "use the job's sampling". A row with a
    scoring column is scored (``scoring.py`` checks those and ``logprobs``). ``extra`` carries
    the output's extra columns: ``source``, ``row_index`` (``row.position``), ``prompt`` and the
    kept columns.

    ``prompts``: the job's prompt settings (``prompts.Prompts``). With a prompt_template the row's
    prompt is the template filled from its columns (the prompt column is not read); with
    apply_chat_template a text prompt becomes a user turn (after the system prompt), so it is a
    messages row from here on; a messages row without a system turn gets the system prompt."""
    values, columns = row.values, row.columns
    prompts = prompts or NO_PROMPTS
    id_, adapter, problem = identity(row, fanout)
    if prompts.templates:
        values = {**values, "prompt": None}  # the template makes the prompt
    # the output's row_index and prompt: the text prompt, a messages row's messages (checked
    # below) as JSON text, None for token ids
    prompt = values.get("prompt")
    text = prompt if isinstance(prompt, str) else None
    extra = {"source": row.where, **row.kept, "row_index": row.position, "prompt": text}

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
    messages = values.get("messages")
    token_ids = values.get("prompt_token_ids")
    given = [
        key for key in ("prompt", "messages", "prompt_token_ids") if values.get(key) is not None
    ]
    if prompts.templates and given:
        return failed(
            f"prompt_template makes the prompt, and the row gives column {columns[given[0]]!r} "
            "too: give one of them"
        )
    if prompts.templates:
        prompt, problem = prompts.render(row.fields)
        if problem is not None:
            return failed(problem)
        extra["prompt"], given = prompt, ["prompt"]
    if len(given) > 1:
        names = " and ".join(repr(columns[key]) for key in given)
        return failed(f"give one of the prompt columns, not {names}")
    if not given:
        return failed(
            f"row has none of the columns {columns['prompt']!r}, {columns['messages']!r}, "
            f"{columns.get('prompt_token_ids', 'prompt_token_ids')!r}"
        )
    if prompt is not None and not isinstance(prompt, str):
        return failed(f"column {columns['prompt']!r} must be a string, got {describe(prompt)}")
    if prompt == "":
        return failed(f"column {columns['prompt']!r} is empty")
    if prompt is not None and not encodable(prompt):
        made = "prompt_template's prompt" if prompts.templates else f"column {columns['prompt']!r}"
        return failed(f"{made}: {unencodable(prompt)}")
    if messages is not None:
        messages, problem = _check_messages(messages, columns["messages"])
        if problem:
            return failed(problem)
        messages = prompts.with_system(messages)
        extra["prompt"] = json.dumps(messages, ensure_ascii=False)
    if token_ids is not None and not (
        isinstance(token_ids, list)
        and token_ids
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids)
    ):
        return failed(
            f"column {columns.get('prompt_token_ids', 'prompt_token_ids')!r} must be a non-empty list of token ids "
            f"(integers >= 0), got {describe(token_ids)}"
        )
    scoring, problem = scoring_fields(values, columns)
    if problem is not None:
        return failed(problem)
    overrides = {name: values[name] for name in SAMPLING_FIELDS if values.get(name) is not None}
    if overrides:
        try:  # SamplingConfig is the one place these are validated (and stop normalized)
            merged = dataclasses.replace(sampling_defaults, **overrides)
        except ConfigError as exc:
            return failed(f"per-row override: {exc}")
        overrides = {name: getattr(merged, name) for name in overrides}
    if prompt is not None and prompts.chat:  # through the chat template, as a messages row
        prompt, messages = None, prompts.turns(prompt)
    return Request(
        id=id_,
        adapter=adapter,
        prompt=prompt,
        messages=messages,
        prompt_token_ids=token_ids,
        extra=extra,
        source=row.where,
        **overrides,
        **scoring,
    )


def _check_messages(messages: Any, column: str) -> tuple[list[dict[str, str]], str | None]:
    if not isinstance(messages, list) or not messages:
        return (
            [],
            f"column {column!r} must be a non-empty list of {{role, content}} objects, got {describe(messages)}",
        )
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return (
                [],
                f"{column}[{i}] must be an object with 'role' and 'content', got {describe(message)}",
            )
        # Parquet structs carry every field of the column's type; null fields are absent ones
        extra = sorted(
            k for k, v in message.items() if k not in ("role", "content") and v is not None
        )
        if extra:
            return [], f"{column}[{i}] has unsupported key {extra[0]!r} (only 'role' and 'content')"
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role == "":
            return [], f"{column}[{i}].role must be a non-empty string, got {describe(role)}"
        if not isinstance(content, str):
            return [], f"{column}[{i}].content must be a string, got {describe(content)}"
        for key, text in (("role", role), ("content", content)):
            if not encodable(text):
                return [], f"{column}[{i}].{key}: {unencodable(text)}"
        clean.append({"role": role, "content": content})
    return clean, None
