"""A row's ``response_format``: its shapes checked, and its canonical form, the key a grammar is
compiled and cached under.

Shapes (OpenAI's, plus three): ``{"type": "text"}`` (no grammar), ``{"type": "json_object"}``,
``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``, ``{"type":
"regex", "regex": "..."}``, ``{"type": "choice", "choice": ["yes", "no"]}``, ``{"type":
"grammar", "grammar": "<EBNF>"}``. A JSON string of one of them is read as that object (Parquet
columns carry the format so).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

TYPES = ("text", "json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Format:
    """A checked, non-text format. ``kind``: json_object | json_schema | regex | grammar (a
    choice is the grammar of its alternatives); ``source``: the compiler's input (the schema as
    compact JSON, its key order kept, the regex, the EBNF; "" for json_object). ``key`` is the cache key."""

    kind: str
    source: str

    @property
    def key(self) -> str:
        return f"{self.kind}\x00{self.source}"


def parse_format(value: Any) -> Format | None:
    """The row's format, or None for none or ``{"type": "text"}``. Raises ValueError naming what
    is wrong (an unknown type, a missing or mistyped field)."""
    if value is None:
        return None
    value = _format_object(value)
    kind = value.get("type")
    if kind not in TYPES:
        raise ValueError(f"response_format type {kind!r} is not one of {', '.join(TYPES)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Format("json_object", "")
    if kind == "json_schema":
        return _schema_format(value.get("json_schema"))
    if kind == "choice":
        return _choice_format(value.get(kind))
    return _source_format(kind, value.get(kind))


def _format_object(value: Any) -> dict:
    """The format as a dict of its present fields: a JSON string decoded, null fields dropped
    (a Parquet struct has every field; null ones are absent)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"response_format is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"response_format must be an object, not {type(value).__name__}")
    return _present(value)


def _schema_format(spec: Any) -> Format:
    """A json_schema format from its ``json_schema`` field; the schema may be a JSON string."""
    spec = _present(spec) if isinstance(spec, dict) else spec
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"response_format json_schema.schema is not JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(
            "response_format json_schema needs json_schema.schema, an object "
            f"(got {type(schema).__name__})"
        )
    # Key order stays: properties come out in the schema's order.
    return Format("json_schema", json.dumps(schema, separators=(",", ":")))


def _choice_format(field: Any) -> Format:
    """A choice format as the grammar of its alternatives, each once, in their order."""
    if not isinstance(field, list) or not field or not all(isinstance(c, str) and c for c in field):
        raise ValueError(
            f"response_format choice needs a non-empty list of non-empty strings, got {field!r}"
        )
    # The EBNF of the alternatives, each a string literal (JSON's escapes are EBNF's).
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(field))
    return Format("grammar", f"root ::= {alternatives}")


def _source_format(kind: str, field: Any) -> Format:
    """A regex or grammar format: its field is the compiler's input, a non-empty string."""
    if not isinstance(field, str) or not field:
        raise ValueError(f"response_format {kind} needs a non-empty string {kind!r}, got {field!r}")
    return Format(kind, field)


def _present(mapping: dict) -> dict:
    return {k: v for k, v in mapping.items() if v is not None}
