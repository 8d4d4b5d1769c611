"""The job-key reference (docs/job-keys.md), generated from the settings dataclasses.

A key is described once, by the comment beside its dataclass field: the trailing ``# comment``
of the field's line (continued on the comment lines right below it, when the next field has a
trailing comment of its own), or the comment lines directly above the field. ``tests/test_docs.py``
fails when docs/job-keys.md is not what this module writes, or when a field has no comment.

    .venv/bin/python -m slora_batch.jobs.reference --write   # or: ... > docs/job-keys.md
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from slora_batch.engine.config import EngineConfig, SamplingConfig
from slora_batch.jobs.config import COLUMN_KEYS, ROW_OPTIONS, JobConfig
from slora_batch.jobs.eval_keys import EvalConfig

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "job-keys.md"
COMMAND = ".venv/bin/python -m slora_batch.jobs.reference --write"
# (section title, key prefix, dataclass, what the section is), in the order the page shows them
SECTIONS: tuple[tuple[str, str, type, str], ...] = (
    ("Job keys", "", JobConfig, "The keys of one entry of `jobs:` (or of `defaults:`)."),
    (
        "sampling",
        "sampling.",
        SamplingConfig,
        "How tokens are drawn, for every row of the job. An input row's own column of the same "
        "name (see [per-row options](#per-row-options)) overrides the job's value for that row.",
    ),
    ("engine", "engine.", EngineConfig, "The engine: device, precision, memory and parallelism."),
    (
        "eval",
        "eval.",
        EvalConfig,
        "lm-evaluation-harness tasks in place of `input:` ([scoring](scoring.md)).",
    ),
)
NESTED = {SamplingConfig: "sampling", EngineConfig: "engine", EvalConfig: "eval"}
# What each input column that ``columns:`` may rename holds. COLUMN_KEYS is a tuple in
# jobs/config.py with no room for a comment per key, so its keys are described here;
# ``column_meanings`` fails on a key missing from this mapping (or one it no longer has).
COLUMN_MEANINGS = {
    "id": "the row's id (an integer or a string); with `adapter` it names the row for resume",
    "adapter": "the adapter's name; empty or null: the base model",
    "prompt": "raw prompt text, fed as it is",
    "messages": "chat turns (`[{role, content}, ...]`); the model's chat template is applied",
    "prompt_token_ids": "the prompt as a list of token ids (pre-tokenized input)",
    "continuation": "a text to score after the prompt (the row is scored, not generated)",
    "choices": "a list of texts to score after the prompt, one log-probability each",
    "continuation_token_ids": "`continuation` as token ids",
    "choices_token_ids": "`choices` as lists of token ids",
    "answer": "the right choice (its index or its text); fills the output's `correct`",
}
PRAGMA = re.compile(r"^(fmt:|noqa|type:|pragma)")


@dataclasses.dataclass
class Key:
    """One documented key: its dotted name, type, default and meaning."""

    name: str
    type: str
    default: str
    meaning: str


def field_comments(cls: type) -> dict[str, str]:
    """Each dataclass field of ``cls`` -> the text of its comment ("" when it has none).

    Comment lines between two fields continue the first field's trailing comment when both
    fields have one (``max_num_seqs: ... = "auto"  # running requests at once; "auto": the``
    then ``# rows whose KV ...`` on the next line); otherwise the block directly above a field
    (no blank line between) is that field's. Example, in EngineConfig::

        backend: str = "auto"  # kernels: ...          -> backend
        # base weights: "auto" as the checkpoint ...    -> weights (it has no trailing comment)
        weights: str = "auto"
    """
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    statements = _statements(source, {f.name for f in dataclasses.fields(cls)})
    trailing, standalone = _comments(source, lines)
    own = {
        name: [text for row in range(first, last + 1) for text in trailing.get(row, [])]
        for name, first, last in statements
        if name is not None
    }
    above: dict[str, list[str]] = {name: [] for name in own}
    for (prev, _, prev_end), (name, first, _) in zip(statements, statements[1:], strict=False):
        gap = range(prev_end + 1, first)
        if prev in own and own[prev] and (name is None or own.get(name)):
            own[prev] += _comment_run(gap, standalone)  # right below prev
        elif name is not None:
            above[name] = _comment_run(reversed(gap), standalone)[::-1]  # right above the field
    last = statements[-1] if statements else None
    if last is not None and last[0] is not None and own[last[0]]:  # a field ends the class
        own[last[0]] += _comment_run(range(last[2] + 1, len(lines) + 1), standalone)
    return {name: _prose(above[name] + own[name]) for name in own}


def _statements(source: str, names: set[str]) -> list[tuple[str | None, int, int]]:
    """The class body's statements in source order: (the field's name, or None for any other
    statement; first line; last line), 1-based."""
    body = ast.parse(source).body[0].body
    return [
        (
            s.target.id
            if isinstance(s, ast.AnnAssign)
            and isinstance(s.target, ast.Name)
            and s.target.id in names
            else None,
            s.lineno,
            s.end_lineno,
        )
        for s in body
    ]


def _comments(source: str, lines: list[str]) -> tuple[dict[int, list[str]], dict[int, str]]:
    """(line -> the comments after code on it, line -> the comment that is the whole line),
    pragmas (``# noqa``, ``# fmt: ...``) left out."""
    trailing: dict[int, list[str]] = {}
    standalone: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        row, col = token.start
        text = token.string.lstrip("#").strip()
        if PRAGMA.match(text):
            continue
        if lines[row - 1][:col].strip():
            trailing.setdefault(row, []).append(text)
        else:
            standalone[row] = text
    return trailing, standalone


def _comment_run(rows: Iterable[int], standalone: dict[int, str]) -> list[str]:
    """The whole-line comments of ``rows``, in their order, up to the first row that is not
    one."""
    run = []
    for row in rows:
        if row not in standalone:
            break
        run.append(standalone[row])
    return run


def _prose(parts: list[str]) -> str:
    """Comment lines joined into one sentence of Markdown (``x`` -> `x`), Python's constants as
    a job file writes them (None -> null)."""
    text = " ".join(p for p in parts if p)
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    for python, yaml in (("None", "null"), ("True", "true"), ("False", "false")):
        text = re.sub(rf"\b{python}\b", yaml, text)
    # outside code spans, "<name>" would read as an HTML tag: "input_<name>" -> "input_&lt;name>"
    parts = text.split("`")
    parts[::2] = [part.replace("<", "&lt;") for part in parts[::2]]
    return "`".join(parts)


def undescribed() -> list[str]:
    """``Class.field`` of every settings field without a comment, and every ``columns`` key
    without a meaning: each must be described before the reference is written."""
    missing = [
        f"{cls.__name__}.{name}"
        for _, _, cls, _ in SECTIONS
        for name, text in field_comments(cls).items()
        if not text
    ]
    missing += [f"columns.{key}" for key in COLUMN_KEYS if key not in COLUMN_MEANINGS]
    return missing


def keys(cls: type, prefix: str) -> list[Key]:
    """The documented keys of dataclass ``cls``, in field order."""
    comments = field_comments(cls)
    return [
        Key(prefix + f.name, _type(f.type), _default(f), comments[f.name])
        for f in dataclasses.fields(cls)
    ]


def _type(annotation: Any) -> str:
    """``str | None`` -> "str or null"; a nested settings class -> "mapping"."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    for cls in NESTED:
        text = re.sub(rf"\b{cls.__name__}\b", "mapping", text)
    text = re.sub(r"\bNone\b", "null", text)
    return text.replace(" | ", " or ")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "—"
    if type(value) in NESTED:
        return f"see [{NESTED[type(value)]}](#{NESTED[type(value)]})"
    if isinstance(value, dict) and value and all(k == v for k, v in value.items()):
        return "each key: itself"
    text = f"`{_yaml(value)}`"
    if isinstance(value, int) and not isinstance(value, bool) and f.name.endswith("_bytes"):
        text += f" ({_size(value)})"
    return text


def _yaml(value: Any) -> str:
    """A default as it would be written in a job file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    return str(value)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def render() -> str:
    """docs/job-keys.md: every key of a job file with its type, default and meaning."""
    out = [
        "# Job keys",
        "",
        f"<!-- Generated by `{COMMAND}` from the comments beside the fields of JobConfig",
        "(slora_batch/jobs/config.py), SamplingConfig and EngineConfig (slora_batch/engine/config.py)",
        "and EvalConfig (slora_batch/jobs/eval_keys.py). Edit those comments, not this file. -->",
        "",
        "Every key a job file takes. A job file holds a `jobs:` list and an optional `defaults:`",
        "mapping merged under every job; `sampling`, `engine` and `columns` merge key by key, any",
        "other key is replaced. Unknown keys are an error naming the key and its job. Relative",
        "paths are relative to the job file. A default of — means the job must give the key (in",
        "the job or under `defaults:`), unless its meaning says otherwise. See [jobs.md](jobs.md)",
        "for how the keys work together.",
        "",
    ]
    for title, prefix, cls, intro in SECTIONS:
        out += [f"## {title}", "", intro, ""]
        rows = [(f"`{k.name}`", f"`{k.type}`", k.default, k.meaning) for k in keys(cls, prefix)]
        out += _table(("key", "type", "default", "meaning"), rows)
        out.append("")
        if cls is JobConfig:
            out += _columns_section()
    out += [
        "## Per-row options",
        "",
        "Input columns read under their own names, which override the job's `sampling` (and",
        "`logprobs`, which only a row sets) for that row: "
        + ", ".join(f"`{name}`" for name in ROW_OPTIONS)
        + ".",
        "`logprobs: k` (0 to 20) adds the k most likely tokens at each generated position",
        "([output.md](output.md#log-probabilities)).",
        "",
    ]
    return "\n".join(out)


def _columns_section() -> list[str]:
    out = [
        "## columns",
        "",
        "Which input column holds each field a row is read from, when your files name it",
        "otherwise: `columns: {id: question_id, messages: conversation}`. Keys not given keep",
        "their own name; two keys cannot name one column.",
        "",
    ]
    rows = [(f"`columns.{k}`", f"`{k}`", COLUMN_MEANINGS.get(k, "")) for k in COLUMN_KEYS]
    out += _table(("key", "default input column", "meaning"), rows)
    out.append("")
    return out


def column_meanings() -> dict[str, str]:
    """COLUMN_MEANINGS, checked against COLUMN_KEYS both ways."""
    stale = sorted(set(COLUMN_MEANINGS) - set(COLUMN_KEYS))
    if stale:
        raise ValueError(f"COLUMN_MEANINGS describes keys columns no longer has: {stale}")
    return COLUMN_MEANINGS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slora_batch.jobs.reference",
        description="Write the job-key reference (docs/job-keys.md) to stdout, or into the file.",
    )
    parser.add_argument("--write", action="store_true", help=f"write {DOC_PATH} instead")
    args = parser.parse_args(argv)
    column_meanings()
    missing = undescribed()
    if missing:
        parser.exit(1, f"no comment describes: {', '.join(missing)}\n")
    text = render()
    if args.write:
        DOC_PATH.parent.mkdir(exist_ok=True)
        DOC_PATH.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
