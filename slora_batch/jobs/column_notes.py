"""What a user hears about the input's columns (``validate`` and ``run`` show it): columns
neither used nor kept, with a did-you-mean that suggests a scoring column only for data that
looks like scoring data; kept columns stored as JSON text, found nowhere or kept under another
name; and an input without a prompt column, with the keys that would make one of its columns
(``prompt_source_problem``: validate fails the job with it)."""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable

import pyarrow as pa

from slora_batch.jobs.config import PROMPT_KEYS, SCORE_KEYS
from slora_batch.jobs.reader import used_columns
from slora_batch.jobs.scan import InputScan
from slora_batch.jobs.text import plural

# the kinds of values (``scan.value_kind``) of a column a scoring column is suggested for
SCORING_KINDS = {
    "continuation": ("text",),
    "choices": ("list",),
    "continuation_token_ids": ("list",),
    "choices_token_ids": ("list",),
    "answer": ("text", "number"),
}
NO_PROMPT = "the input has none of the prompt columns"  # how prompt_source_problem starts
SCORING_CUTOFF = 0.8  # a scoring column is suggested for a near-exact name only ("choice")


def column_notes(scan: InputScan, columns: dict[str, str], fields: Iterable[str] = ()) -> list[str]:
    """The notes on the input's columns. ``columns``: the job's mapping; ``fields``: the
    columns the job's prompt_template reads."""
    fields = list(fields)
    likely = _likely(scan, [*used_columns(columns), *fields], columns, fields)
    notes = []
    for name, (count, where) in scan.unused.items():
        field_of, _, field_name = name.partition(".")
        if field_of in ("body", "line") and field_name:  # OpenAI Batch lines (openai_input)
            notes.append(
                f"OpenAI batch: {field_of} field {field_name!r} in {count:,} "
                f"{plural(count, 'line')} (first: {where}) is not supported: ignored"
            )
            continue
        close = likely(name)
        hint = (
            f" (did you mean {close!r}?)"
            if close
            else " (add it to keep_columns to carry it to the output)"
        )
        notes.append(
            f"column {name!r} in {count:,} {plural(count, 'row')} (first: {where}) is neither "
            f"used nor kept{hint}"
        )
    for name in scan.json_text:
        notes.append(f"kept column {name!r} mixes value types: stored as JSON text")
    for name, type_ in scan.keep.items():
        if pa.types.is_null(type_):
            notes.append(f"kept column {name!r} has no value in any row")
    for name in scan.clashing:  # an earlier version's scan: such columns were not kept
        notes.append(f"column {name!r} is not kept: the output has its own {name!r}")
    for name, kept in scan.kept_as.items():
        notes.append(f"column {name!r} is kept as {kept!r}: the output has its own {name!r}")
    return notes


def _likely(scan: InputScan, known: list[str], columns: dict[str, str], fields: list[str]):
    """``likely(name)``: the column an unused column's name may be a misspelling of, or None:
    any column the job reads (difflib's closeness), but a scoring one (continuation, choices,
    answer and their token ids) only for a near-exact name, when the input has a prompt to
    score after and the column's values look like that column's: "instruction" is no
    "continuation" (a 0.61 match), and no column of an input without prompts is one."""
    scoring = {columns.get(key, key): key for key in (*SCORE_KEYS, "answer")}
    plain = [k for k in known if k not in scoring]
    prompts = [columns.get(key, key) for key in PROMPT_KEYS]
    has_prompt = bool(fields) or any(p in scan.column_kinds for p in prompts)

    def likely(name: str) -> str | None:
        kind = scan.column_kinds.get(name)
        fit = [k for k, key in scoring.items() if has_prompt and kind in SCORING_KINDS[key]]
        close = difflib.get_close_matches(name, plain, n=1)
        close += difflib.get_close_matches(name, fit, n=1, cutoff=SCORING_CUTOFF)
        return max(
            close, key=lambda k: difflib.SequenceMatcher(None, name, k).ratio(), default=None
        )

    return likely


def prompt_source_problem(job, scan: InputScan, chat_template: bool | None) -> str | None:
    """Why no row of the input can have a prompt, with the keys that would give one, or None:
    the input has rows but none of the prompt, messages and prompt_token_ids columns, and the
    job (a ``JobConfig``) has no prompt_template. The hint is built from the input's own
    columns (``_prompt_like``); ``chat_template``: whether the model has one.

    Running example, Alpaca (instruction, input, output): ``prompt_template:
    ["{instruction}\\n\\n{input}", "{instruction}"]``, or ``columns: {prompt: instruction}``."""
    names = [job.columns.get(key, key) for key in PROMPT_KEYS]
    present = scan.column_kinds
    if job.prompt_template is not None or not scan.rows or any(n in present for n in names):
        return None
    listed = ", ".join(present) or "none"
    message = (
        f"{NO_PROMPT} {', '.join(map(repr, names))} (its columns: {listed}), so every row "
        "would be an error row"
    )
    chosen = _prompt_like(present, job.columns)
    if not chosen:
        return message + ". Give each row a prompt, or build one with prompt_template"
    joined = "\n\n".join("{" + name + "}" for name in chosen)
    if len(chosen) > 1:
        template = f"[{json.dumps(joined)}, {json.dumps('{' + chosen[0] + '}')}]"
        how = " (a row takes the first template whose columns are all non-empty)"
    else:
        template, how = json.dumps(joined), ""
    chat = ", with apply_chat_template: true for this chat model" if chat_template else ""
    return (
        f"{message}. Build each row's prompt from its columns with prompt_template: {template}"
        f"{how}, or read one column as the prompt with columns: {{prompt: {chosen[0]}}}{chat}"
    )


# column names that hold a task's input (a prompt is made of them) or its reference output
PROMPT_NAMES = {
    "system",
    "instruction",
    "instructions",
    "question",
    "query",
    "problem",
    "input",
    "context",
    "text",
    "content",
    "request",
    "task",
    "passage",
    "document",
    "article",
    "premise",
    "hypothesis",
    "sentence",
    "title",
    "body",
    "user",
    "human",
}
ANSWER_NAMES = {
    "output",
    "outputs",
    "answer",
    "answers",
    "response",
    "responses",
    "completion",
    "target",
    "targets",
    "label",
    "labels",
    "chosen",
    "rejected",
    "solution",
    "reference",
    "ground_truth",
    "gold",
    "expected",
    "canonical_solution",
    "assistant",
    "gpt",
}


def _prompt_like(kinds: dict[str, str], columns: dict[str, str]) -> list[str]:
    """The input's columns a prompt is likely made of, in the input's order: those named as
    task inputs (at most 3), else the first text column that is no answer and no id."""
    usable = [
        name
        for name, kind in kinds.items()
        if kind in ("text", "null")
        and "." not in name
        and name.lower() not in ANSWER_NAMES
        and name not in (columns["id"], columns["adapter"])
        and name.lower() not in ("idx", "index", "uid", "uuid", "key")
        and not name.lower().endswith(("_id", "_idx", "_index"))
    ]
    named = [name for name in usable if name.lower() in PROMPT_NAMES]
    return named[:3] or usable[:1]
