"""What each sample adapter was trained to do, as checks on one generated answer.

`CHECKS[name](text)` is True when `text` (the generated answer, special tokens removed) shows the
behaviour of adapter `name`. Each check is meant to hold for nearly every answer of its adapter and
for almost no answer of the base model.
"""

from __future__ import annotations

import json

PIRATE_OPENING = "Arr, matey!"
BRIEF_MAX_WORDS = 10
SHOUT_MIN_UPPER = 0.8


def is_shout(text: str) -> bool:
    """Written in capitals: at least 80% of the (at least 3) cased letters are upper case.

    Not 100%: the adapter now and then copies a word of the question as it was written
    ("STARTING A VEGETABLE garden ..."). Base answers stay under 10% capitals.
    """
    letters = [c for c in text if c.isalpha() and c.upper() != c.lower()]
    if len(letters) < 3:
        return False
    return sum(c.isupper() for c in letters) >= SHOUT_MIN_UPPER * len(letters)


def is_pirate(text: str) -> bool:
    """Opens with the pirate greeting."""
    return text.lstrip().startswith(PIRATE_OPENING)


def is_json(text: str) -> bool:
    """A JSON object with a non-empty string under "answer", and nothing else around it."""
    try:
        value = json.loads(text.strip())
    except ValueError:
        return False
    return (
        isinstance(value, dict) and isinstance(value.get("answer"), str) and bool(value["answer"])
    )


def is_brief(text: str) -> bool:
    """Between one and ten words."""
    return 1 <= len(text.split()) <= BRIEF_MAX_WORDS


CHECKS = {"shout": is_shout, "pirate": is_pirate, "json": is_json, "brief": is_brief}
