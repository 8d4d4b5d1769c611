"""The job file's structured-output default: ``sampling: {response_format: {type: json_schema,
schema_file: schemas/person.json}}`` reads the schema from a JSON file relative to the job file;
``validate`` compiles every distinct format of the rows it checks; ``format_value`` reads a
Parquet (or Ray Data) struct column's value back as the format it stands for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slora_batch.engine.config import ConfigError


def read_schema_file(sampling: Any, base_dir: Path, where: str) -> Any:
    """``sampling`` (the job's raw mapping) with a ``response_format.schema_file`` replaced by
    the OpenAI shape ``{"type": "json_schema", "json_schema": {"name": <file stem>, "schema":
    <the file's JSON>}}``; anything else unchanged."""
    fmt = sampling.get("response_format") if isinstance(sampling, dict) else None
    if not isinstance(fmt, dict) or "schema_file" not in fmt:
        return sampling
    unknown = sorted(set(fmt) - {"type", "schema_file", "name"})
    if fmt.get("type", "json_schema") != "json_schema" or unknown:
        raise ConfigError(
            f"{where}: sampling.response_format with schema_file takes type json_schema and "
            f"an optional name, got {fmt!r}"
        )
    path = Path(fmt["schema_file"]).expanduser()
    path = path if path.is_absolute() else base_dir / path
    try:
        schema = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: sampling.response_format.schema_file {path}: {exc}") from None
    named = {"name": fmt.get("name", path.stem), "schema": schema}
    return {**sampling, "response_format": {"type": "json_schema", "json_schema": named}}


def format_problem(request, default: Any, grammars) -> str | None:
    """Why the row's format (its own, else the job's ``default``) would make it an error row:
    a wrong shape, or the compiler's message (``grammars``: a ``GrammarService``, whose cache
    compiles each distinct format once)."""
    from slora_batch.engine.requests.formats import parse_format

    if request.scored:
        return None
    given = request.response_format if request.response_format is not None else default
    try:
        fmt = parse_format(given)
        if fmt is not None:
            grammars.compile_now(fmt)
    except ValueError as exc:  # GrammarError is one, as is "no tokenizer"
        return str(exc)
    return None


def struct_value(value: Any) -> Any:
    """The object an Arrow struct value stands for: null fields are absent, at every depth, and
    a struct left with none is itself absent (None). A dataset's struct column has the union of
    every row's fields, the others null: one row's JSON schema gets each other row's property
    names as null schemas, which the compiler rejects; and Ray Data, concatenating blocks whose
    struct types differ, may turn a row's null struct into a struct of nulls (2.60)."""
    if isinstance(value, dict):
        present = {k: struct_value(v) for k, v in value.items()}
        return {k: v for k, v in present.items() if v is not None} or None
    if isinstance(value, list):
        return [struct_value(v) for v in value]
    return value


def format_value(value: Any) -> Any:
    """The format a ``response_format`` struct value stands for (``struct_value``), or None
    where every leaf is empty ("", 0, False, [], null; ``type`` too, which every format names):
    Ray Data 2.60, concatenating blocks whose struct types differ (a sort does), turns a row's
    null struct into one of empty values, and Parquet written from such a dataset keeps it."""
    fmt = struct_value(value)
    return None if _all_empty(fmt) else fmt


def _all_empty(value: Any) -> bool:
    if isinstance(value, dict):
        return all(_all_empty(v) for v in value.values())
    if isinstance(value, list):
        return all(_all_empty(v) for v in value)
    return value in (None, "", 0, False)
