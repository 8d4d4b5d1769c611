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
from slora_batch.jobs.scoring import scoring_fields, token_ids_problem
from slora_batch.jobs.text import describe, encodable, unencodable

NO_PROMPTS = Prompts()  # a job without prompt settings: rows as they are
PROMPT_COLUMNS = ("prompt", "messages", "prompt_token_ids")  # a row gives one of them


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
    only an OpenAI Batch line, whose custom_id the reader found usable and new, keeps it).
    With ``fanout`` the row's adapter is not read (the sweep replaces it)."""
    id_ = row.values.get("id")
    reads_adapter = not fanout and row.error is None
    adapter = row.values.get("adapter") if reads_adapter else None
    id_problem, adapter_problem = _identity_problems(id_, adapter, row.columns)
    if row.error is not None:  # an OpenAI Batch line keeps a usable, unique custom_id
        usable = id_ is not None and id_problem is None
        return id_ if usable else RowSource(row.where), None, row.error
    if adapter_problem is not None and id_ is not None:
        adapter_problem += f" (row id {id_!r})"
    problem = id_problem or adapter_problem
    if problem is not None or id_ is None:
        return RowSource(row.where), (None if problem else adapter or None), problem
    return id_, adapter or None, None


def _identity_problems(id_: Any, adapter: Any, columns: dict[str, str]) -> tuple[str | None, ...]:
    """(why the id cannot be used, why the adapter cannot), each None when it can; the adapter
    is read only beside a usable id. An id is a non-empty string or an integer, an adapter a
    string or null, and either one's text UTF-8 can encode."""
    if id_ is not None and (isinstance(id_, bool) or not isinstance(id_, str | int) or id_ == ""):
        column = columns["id"]
        return (
            f"column {column!r} must be a non-empty string or an integer, got {describe(id_)}",
            None,
        )
    if isinstance(id_, str) and not encodable(id_):
        return f"column {columns['id']!r}: {unencodable(id_)}", None
    if adapter is not None and not isinstance(adapter, str):
        column = columns["adapter"]
        return None, f"column {column!r} must be a string or null, got {describe(adapter)}"
    if adapter and not encodable(adapter):
        return None, f"column {columns['adapter']!r}: {unencodable(adapter)}"
    return None, None


def to_request(
    row: InputRow,
    sampling_defaults: SamplingConfig,
    fanout: bool = False,
    prompts: Prompts | None = None,
) -> Request | Result:
    """Validate one row into a ``Request``, or an error ``Result`` whose message names the file,
    the row and the reason: its identity, then its prompt, its scoring columns and its
    sampling overrides (null values mean "use the job's sampling"), the first problem found.
    A row with a scoring column is scored (``scoring.py`` checks those and ``logprobs``).
    ``extra`` carries the output's extra columns: ``source``, ``row_index``
    (``row.position``), ``prompt`` and the kept columns.

    ``prompts``: the job's prompt settings (``prompts.Prompts``). With a prompt_template the row's
    prompt is the template filled from its columns (the prompt column is not read); with
    apply_chat_template a text prompt becomes a user turn (after the system prompt), so it is a
    messages row from here on; a messages row without a system turn gets the system prompt."""
    prompts = prompts or NO_PROMPTS
    values = {**row.values, "prompt": None} if prompts.templates else row.values
    id_, adapter, problem = identity(row, fanout)
    overrides, override_problem = _overrides(values, sampling_defaults)
    given, problem = ({}, problem) if problem else _prompt(row, values, prompts)
    scoring, problem = ({}, problem) if problem else scoring_fields(values, row.columns)
    problem = problem or override_problem
    prompt, messages = prompts.sent(given.get("prompt"), given.get("messages"))
    if "messages" in given:  # the output's prompt column: a messages row's as JSON text
        shown = json.dumps(messages, ensure_ascii=False)
    else:  # the text prompt, also of a row whose prompt fails a check after it was read
        text = given.get("prompt", values.get("prompt"))
        shown = text if isinstance(text, str) else None
    extra = {"source": row.where, **row.kept, "row_index": row.position, "prompt": shown}
    if problem is not None:
        return Result(
            id=id_,
            adapter=adapter,
            text="",
            finish_reason="error",
            error=f"{row.where}: {problem}",
            extra=extra,
        )
    return Request(
        id=id_,
        adapter=adapter,
        prompt=prompt,
        messages=messages,
        prompt_token_ids=given.get("prompt_token_ids"),
        extra=extra,
        source=row.where,
        **overrides,
        **scoring,
    )


def _overrides(
    values: dict[str, Any], defaults: SamplingConfig
) -> tuple[dict[str, Any], str | None]:
    """The row's sampling overrides (its non-null option columns), checked and normalized by
    ``SamplingConfig``, the one place they are validated; or why they cannot be used."""
    overrides = {name: values[name] for name in SAMPLING_FIELDS if values.get(name) is not None}
    if not overrides:
        return {}, None
    try:
        merged = dataclasses.replace(defaults, **overrides)
    except ConfigError as exc:
        return {}, f"per-row override: {exc}"
    return {name: getattr(merged, name) for name in overrides}, None


def _prompt(
    row: InputRow, values: dict[str, Any], prompts: Prompts
) -> tuple[dict[str, Any], str | None]:
    """The row's prompt as one field, checked: the template's prompt, or the one prompt column
    (prompt, messages or prompt_token_ids) the row gives; or why it has none that can run
    (with the template's prompt when that was made: the output shows it)."""
    columns = row.columns
    given = [key for key in PROMPT_COLUMNS if values.get(key) is not None]
    if prompts.templates:
        if given:
            return {}, (
                f"prompt_template makes the prompt, and the row gives column "
                f"{columns[given[0]]!r} too: give one of them"
            )
        prompt, problem = prompts.render(row.fields)
        if problem is None and not encodable(prompt):
            problem = f"prompt_template's prompt: {unencodable(prompt)}"
        return ({} if prompt is None else {"prompt": prompt}), problem
    if len(given) > 1:
        names = " and ".join(repr(columns[key]) for key in given)
        return {}, f"give one of the prompt columns, not {names}"
    if not given:
        names = ", ".join(repr(columns.get(key, key)) for key in PROMPT_COLUMNS)
        return {}, f"row has none of the columns {names}"
    key = given[0]
    value, problem = _PROMPT_CHECKS[key](values[key], columns.get(key, key))
    return ({} if problem else {key: value}), problem


def _check_text(prompt: Any, column: str) -> tuple[str | None, str | None]:
    if not isinstance(prompt, str):
        return None, f"column {column!r} must be a string, got {describe(prompt)}"
    if prompt == "":
        return None, f"column {column!r} is empty"
    if not encodable(prompt):
        return None, f"column {column!r}: {unencodable(prompt)}"
    return prompt, None


def _check_messages(messages: Any, column: str) -> tuple[list[dict[str, str]], str | None]:
    if not isinstance(messages, list) or not messages:
        return [], (
            f"column {column!r} must be a non-empty list of {{role, content}} objects, "
            f"got {describe(messages)}"
        )
    clean = []
    for i, message in enumerate(messages):
        problem = _message_problem(message, f"{column}[{i}]")
        if problem is not None:
            return [], problem
        clean.append({"role": message["role"], "content": message["content"]})
    return clean, None


def _message_problem(message: Any, where: str) -> str | None:
    """Why one chat message cannot be sent (``where``: "messages[2]"), or None."""
    if not isinstance(message, dict):
        return f"{where} must be an object with 'role' and 'content', got {describe(message)}"
    # Parquet structs carry every field of the column's type; null fields are absent ones
    extra = sorted(k for k, v in message.items() if k not in ("role", "content") and v is not None)
    if extra:
        return f"{where} has unsupported key {extra[0]!r} (only 'role' and 'content')"
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or role == "":
        return f"{where}.role must be a non-empty string, got {describe(role)}"
    if not isinstance(content, str):
        return f"{where}.content must be a string, got {describe(content)}"
    for key, text in (("role", role), ("content", content)):
        if not encodable(text):
            return f"{where}.{key}: {unencodable(text)}"
    return None


def _check_token_ids(token_ids: Any, column: str) -> tuple[list[int] | None, str | None]:
    problem = token_ids_problem(token_ids, column)
    return (None if problem else token_ids), problem


# the check of each column a row's prompt may come from (a row gives one)
_PROMPT_CHECKS = {
    "prompt": _check_text,
    "messages": _check_messages,
    "prompt_token_ids": _check_token_ids,
}
