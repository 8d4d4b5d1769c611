"""A row's scoring columns and its ``logprobs`` option, checked into ``Request`` fields.

A row is scored when it gives one of ``continuation``, ``choices`` (a list of strings),
``continuation_token_ids`` or ``choices_token_ids`` (a list of token id lists); its prompt is
the context. ``answer`` (a choice's index, or its text) is read only on a scored row: a
generated row's ``answer`` column (a reference solution, say) is left alone. ``logprobs``
(0-20) is for generated rows only. Sampling overrides on a scored row are checked as on any
row and have no effect. Each problem is one sentence naming the input column (as the job's
``columns`` maps it); ``rows.to_request`` prefixes the file and the row.
"""

from __future__ import annotations

from typing import Any

from slora_batch.engine.requests.scoring import MAX_LOGPROBS
from slora_batch.jobs.config import SCORE_KEYS
from slora_batch.jobs.text import describe, encodable, unencodable


def scored(values: dict[str, Any]) -> bool:
    """Whether a row (its values by canonical column name) is scored: it gives a scoring
    column."""
    return any(values.get(key) is not None for key in SCORE_KEYS)


def scoring_fields(
    values: dict[str, Any], columns: dict[str, str]
) -> tuple[dict[str, Any], str | None]:
    """The ``Request`` fields a row's scoring columns and ``logprobs`` give ({} for a generated
    row without logprobs), or the reason the row is an error row."""
    names = {key: columns.get(key, key) for key in (*SCORE_KEYS, "answer")}
    given = [key for key in SCORE_KEYS if values.get(key) is not None]
    logprobs = values.get("logprobs")
    if len(given) > 1:
        listed = " and ".join(repr(names[key]) for key in given)
        return {}, f"give one of the scoring columns, not {listed}"
    if logprobs is not None:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int):
            return {}, (
                f"column 'logprobs' must be an integer from 0 to {MAX_LOGPROBS}, "
                f"got {describe(logprobs)}"
            )
        if not 0 <= logprobs <= MAX_LOGPROBS:
            return {}, f"column 'logprobs' must be from 0 to {MAX_LOGPROBS}, got {logprobs}"
        if given:
            return {}, (
                f"column 'logprobs' is for generated rows; this row is scored (column "
                f"{names[given[0]]!r}) and gets its token log-probabilities anyway"
            )
        return {"logprobs": logprobs}, None
    if not given:
        return {}, None
    key = given[0]
    value = values[key]
    problem = _CHECKS[key](value, names[key])
    if problem is not None:
        return {}, problem
    fields = {key: value}
    answer = values.get("answer")
    if answer is not None:
        problem = _check_answer(answer, key, value, names["answer"])
        if problem is not None:
            return {}, problem
        fields["answer"] = answer
    return fields, None


def _check_text(text: Any, column: str) -> str | None:
    if not isinstance(text, str):
        return f"column {column!r} must be a string, got {describe(text)}"
    if text == "":
        return f"column {column!r} is empty"
    if not encodable(text):
        return f"column {column!r}: {unencodable(text)}"
    return None


def _check_texts(texts: Any, column: str) -> str | None:
    if not isinstance(texts, list) or not texts:
        return f"column {column!r} must be a non-empty list of strings, got {describe(texts)}"
    for i, text in enumerate(texts):
        if not isinstance(text, str) or text == "":
            return f"{column}[{i}] must be a non-empty string, got {describe(text)}"
        if not encodable(text):
            return f"{column}[{i}]: {unencodable(text)}"
    return None


def _is_ids(ids: Any) -> bool:
    return (
        isinstance(ids, list)
        and bool(ids)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    )


def token_ids_problem(ids: Any, column: str) -> str | None:
    """Why column ``column``'s value is not a non-empty list of token ids, or None (a row's
    prompt_token_ids are checked by this too)."""
    if _is_ids(ids):
        return None
    return (
        f"column {column!r} must be a non-empty list of token ids (integers >= 0), "
        f"got {describe(ids)}"
    )


def _check_id_lists(lists: Any, column: str) -> str | None:
    if not isinstance(lists, list) or not lists:
        return (
            f"column {column!r} must be a non-empty list of token id lists, got {describe(lists)}"
        )
    for i, ids in enumerate(lists):
        if not _is_ids(ids):
            return (
                f"{column}[{i}] must be a non-empty list of token ids (integers >= 0), "
                f"got {describe(ids)}"
            )
    return None


_CHECKS = {
    "continuation": _check_text,
    "choices": _check_texts,
    "continuation_token_ids": token_ids_problem,
    "choices_token_ids": _check_id_lists,
}


def _check_answer(answer: Any, key: str, scored: Any, column: str) -> str | None:
    """A choice's index, or its text (rows of text only). A continuation row is one choice:
    its answer is 0 or its text, and ``correct`` says whether it was the greedy one."""
    if key.startswith("continuation"):
        zero = isinstance(answer, int) and not isinstance(answer, bool) and answer == 0
        if zero or (key == "continuation" and answer == scored):
            return None
        allowed = "0 or the continuation's text" if key == "continuation" else "0"
        return (
            f"column {column!r} on a continuation row must be {allowed} (its one choice: "
            f"correct then says whether the continuation is the model's greedy one), got "
            f"{describe(answer)}"
        )
    if isinstance(answer, bool) or not isinstance(answer, int | str):
        return (
            f"column {column!r} must be a choice's index (an integer) or its text, "
            f"got {describe(answer)}"
        )
    count = len(scored) if key.startswith("choices") else 1
    if isinstance(answer, int):
        if not 0 <= answer < count:
            return f"column {column!r}: {answer} is not a choice index (0 to {count - 1})"
        return None
    if key.endswith("token_ids"):
        return f"column {column!r}: a row of token ids takes its answer as an index, got {describe(answer)}"
    texts = scored if key == "choices" else [scored]
    if answer not in texts:
        return f"column {column!r}: {answer[:80]!r} is not among the choices"
    return None
