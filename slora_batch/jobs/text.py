"""Text checks shared by the row checks and the writer: what UTF-8 cannot encode (a lone
surrogate from a JSON ``\\u`` escape), and short descriptions of values for messages."""

from __future__ import annotations

from typing import Any


def encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unencodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        return (
            f"{text[:40]!r} has a character UTF-8 cannot encode ({bad!r} at position {exc.start}, "
            "a lone surrogate from a JSON \\u escape?)"
        )
    return f"{text[:40]!r} is fine"


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def describe(value: Any) -> str:
    return f"{type_name(value)} {value!r}"[:80]


def plural(n: int, one: str, many: str | None = None) -> str:
    """``one`` or, when ``n`` is not 1, ``many`` (default: ``one`` + "s")."""
    return one if n == 1 else (many or one + "s")
