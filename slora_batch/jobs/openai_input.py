"""OpenAI Batch API lines in: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}}`` turned into the job's input records (the logical columns
under the job's column names), so scan, resume, validate and rows read them like any row.

``custom_id`` is the id and ``body.model`` the adapter: the base model's name as the job names
it (or its directory's name), "" and null mean the base. A bad line (wrong method or url, no
custom_id, unknown model, malformed body, a custom_id an earlier line has) yields its record
(when the custom_id is usable and new) and an error naming the line and the custom_id; it
becomes one error row, never costing another. A body field the engine does not read is kept in
the record as ``body.<field>`` (a line field as ``line.<field>``): the scan counts and reports
those (``scan.InputScan.notes``), nothing is dropped silently.

Running example: line 3 ``{"custom_id": "q1", "method": "POST", "url": "/v1/completions",
"body": {"model": "a", "prompt": "Hi", "max_tokens": 5, "logit_bias": {}}}`` ->
``{"id": "q1", "adapter": "a", "prompt": "Hi", "max_new_tokens": 5, "body.logit_bias": {},
"openai_request": '{"url": "/v1/completions"}'}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from slora_batch.jobs.reader import InputError
from slora_batch.jobs.text import describe

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
LINE_KEYS = ("custom_id", "method", "url", "body")
REQUEST_COLUMN = "openai_request"  # a kept column: the line's url, for the output's shapes
# body fields read under the same row option name
SAME_NAME = ("temperature", "top_p", "n", "seed", "response_format")
BODY_KEYS = {
    CHAT: {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "logprobs",
        "top_logprobs",
        *SAME_NAME,
    },
    COMPLETIONS: {"model", "prompt", "max_tokens", "stop", "logprobs", *SAME_NAME},
}


def is_openai_line(record: Any) -> bool:
    """Whether a JSONL record looks like an OpenAI Batch line (detection from the first line)."""
    return (
        isinstance(record, dict) and "custom_id" in record and isinstance(record.get("body"), dict)
    )


def holds_openai_lines(input_format: str, files: list[Path], first: dict | None) -> bool:
    """Whether the input holds OpenAI Batch lines: ``input_format: openai``, or ``auto`` when
    every file is JSONL and the input's ``first`` record (``reader.first_record``) is an OpenAI
    Batch line. Raises ``InputError`` for an openai input with a file that is not JSONL."""
    jsonl = all(str(f).lower().endswith(".jsonl") for f in files)
    if input_format == "rows" or (input_format == "auto" and not jsonl):
        return False
    if not jsonl:
        parquet = next(f for f in files if not str(f).lower().endswith(".jsonl"))
        raise InputError(f"input_format openai reads .jsonl files only, got {str(parquet)!r}")
    return input_format == "openai" or is_openai_line(first)


def openai_batch(
    input_format: str,
    files: list[Path],
    first: dict | None,
    *,
    model: str,
    model_dir: Path,
    adapters: Iterable[str],
    columns: dict[str, str],
) -> OpenAIBatch | None:
    """The input's OpenAI Batch reading (``holds_openai_lines``), or None for plain rows.
    ``model``: the base model as the job names it, ``model_dir`` its directory (either names it
    in a body); ``adapters``: the job's adapter names; ``columns``: the job's column names."""
    if not holds_openai_lines(input_format, files, first):
        return None
    name = base_model_name(model)
    return OpenAIBatch({name, name.rsplit("/", 1)[-1], model, model_dir.name}, adapters, columns)


class OpenAIBatch:
    """The job's reading of OpenAI Batch lines: which ``body.model`` names mean the base model,
    which adapters exist (None: not checked) and the job's column names."""

    def __init__(
        self, base_names: Iterable[str], adapters: Iterable[str] | None, columns: dict[str, str]
    ) -> None:
        self.base_names = {name for name in base_names if name}
        self.adapters = None if adapters is None else set(adapters)
        self.columns = columns

    def reading(self) -> OpenAIReading:
        """The state of one pass over the input: custom_ids seen so far (duplicates)."""
        return OpenAIReading(self)

    def adapter(self, model: Any) -> tuple[str | None, str | None]:
        """(adapter, problem) of a ``body.model``: None for the base model."""
        if model is None or model == "":
            return None, None
        if not isinstance(model, str):
            return None, f"body.model must be a string, got {describe(model)}"
        if self.adapters is not None and model in self.adapters:
            return model, None
        if model in self.base_names:
            return None, None
        if self.adapters is None:
            return model, None
        known = ", ".join(sorted(self.adapters)) or "none"
        base = ", ".join(repr(n) for n in sorted(self.base_names))
        return None, f'unknown model {model!r} (adapters: {known}; the base model: {base} or "")'


class OpenAIReading:
    """One pass over OpenAI Batch lines, in input order (the first line of a custom_id wins)."""

    def __init__(self, batch: OpenAIBatch) -> None:
        self.batch = batch
        self.seen: dict[str, str] = {}  # custom_id -> where its first line is

    def records(
        self, records: Iterator[tuple[int, dict | None, str | None]], name: str
    ) -> Iterator[tuple[int, dict | None, str | None]]:
        """(number, record, error) of the lines of file ``name`` (``reader.input_records``), each
        line converted to the job's columns; a bad line keeps its record when it has a usable
        custom_id."""
        for number, record, error in records:
            if record is not None:
                record, error = self.convert(record, f"{name} line {number}")
            yield number, record, error

    def convert(self, record: dict, where: str) -> tuple[dict | None, str | None]:
        """(record of the job's columns, error) of one line; the record is None when the line
        has no usable custom_id (the row then has no id: its ``source`` names it)."""
        columns = self.batch.columns
        custom_id = record.get("custom_id")
        if not isinstance(custom_id, str) or custom_id == "":
            return None, f"custom_id must be a non-empty string, got {describe(custom_id)}"
        label = f"custom_id {json.dumps(custom_id, ensure_ascii=False)}"
        first = self.seen.get(custom_id)
        if first is not None:
            return None, f"{label}: duplicate custom_id (first on {first})"
        self.seen[custom_id] = where
        out: dict[str, Any] = {columns["id"]: custom_id}
        out.update({f"line.{k}": v for k, v in record.items() if k not in LINE_KEYS})
        problem = _request_problem(record)
        if problem is None:
            url, body = record["url"], record["body"]
            out[REQUEST_COLUMN] = json.dumps({"url": url})
            out.update({f"body.{k}": v for k, v in body.items() if k not in BODY_KEYS[url]})
            adapter, problem = self.batch.adapter(body.get("model"))
            out[columns["adapter"]] = adapter
            problem = problem or _body_fields(url, body, out, columns)
        return out, None if problem is None else f"{label}: {problem}"


def _request_problem(record: dict) -> str | None:
    method, url, body = record.get("method"), record.get("url"), record.get("body")
    if method != "POST":
        return f'method must be "POST", got {describe(method)}'
    if url not in BODY_KEYS:
        return f"url must be {CHAT!r} or {COMPLETIONS!r}, got {describe(url)}"
    if not isinstance(body, dict):
        return f"body must be an object, got {describe(body)}"
    return None


def _body_fields(url: str, body: dict, out: dict, columns: dict[str, str]) -> str | None:
    """Fill ``out`` with the body's row fields; the first problem, or None. Value checks beyond
    the OpenAI shapes (ranges, types of sampling options) are the rows' own (``rows.py``)."""
    given = {k: v for k, v in body.items() if v is not None}
    if url == CHAT:
        if "messages" not in given:
            return "body.messages is missing (a chat completion needs messages)"
        messages, problem = _messages(given["messages"])
        if problem:
            return problem
        out[columns["messages"]] = messages
    else:
        if "prompt" not in given:
            return "body.prompt is missing (a completion needs a prompt)"
        problem = _prompt(given["prompt"], out, columns)
        if problem:
            return problem
    limits = [given[k] for k in ("max_completion_tokens", "max_tokens") if k in given]
    if len(limits) == 2 and limits[0] != limits[1]:
        return f"max_completion_tokens {limits[0]!r} and max_tokens {limits[1]!r} differ"
    if limits:
        out["max_new_tokens"] = limits[0]
    for key in SAME_NAME:
        if key in given:
            out[key] = given[key]
    stop = given.get("stop")
    if stop is not None:
        out["stop"] = [stop] if isinstance(stop, str) else stop
    return _logprobs(url, given, out)


def _messages(messages: Any) -> tuple[Any, str | None]:
    """Chat messages with a content given as text parts joined into one string (the rows check
    the rest); a part other than text is refused by name."""
    if not isinstance(messages, list):
        return None, f"body.messages must be a list of messages, got {describe(messages)}"
    clean = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    return (
                        None,
                        f"body.messages[{i}].content: only text parts, got {describe(part)}",
                    )
                texts.append(part["text"])
            message = {**message, "content": "".join(texts)}
        clean.append(message)
    return clean, None


def _prompt(prompt: Any, out: dict, columns: dict[str, str]) -> str | None:
    """A completion's prompt: a string, one string in a list, or token ids (one list of ints)."""
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        out[columns["prompt_token_ids"]] = prompt
        return None
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            out[columns["prompt_token_ids"]] = prompt
            return None
    if isinstance(prompt, list):
        return f"body.prompt: a list of {len(prompt)} prompts; give one prompt per line"
    out[columns["prompt"]] = prompt  # a non-string is the rows' error, named there
    return None


def _logprobs(url: str, given: dict, out: dict) -> str | None:
    """Chat: ``logprobs: true`` with ``top_logprobs`` alternatives (0 when not given);
    completions: ``logprobs`` is the number of alternatives. Row option ``logprobs``: that
    number (None: no logprobs)."""
    logprobs = given.get("logprobs")
    if url == COMPLETIONS:
        if logprobs is not None:
            out["logprobs"] = logprobs
        return None
    top = given.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        return f"body.logprobs must be true or false, got {describe(logprobs)}"
    if top is not None and not logprobs:
        return "body.top_logprobs needs body.logprobs: true"
    if logprobs:
        out["logprobs"] = 0 if top is None else top
    return None


def base_model_name(model: str) -> str:
    """The base model's name in OpenAI bodies: a path's last part (the job resolves paths to
    absolute ones), a Hub name without its revision, the sample alias as is."""
    if model.startswith(("/", ".", "~")):
        return model.rstrip("/").rsplit("/", 1)[-1]
    return model.split("@")[0]


def kept_columns(
    keep: str | list[str] | None, openai: OpenAIBatch | None
) -> str | list[str] | None:
    """The job's ``keep_columns`` and, for OpenAI Batch lines, the request column the output's
    shapes need (chat or completion)."""
    if openai is None or keep == "all":
        return keep
    return [*(keep or ()), REQUEST_COLUMN]
