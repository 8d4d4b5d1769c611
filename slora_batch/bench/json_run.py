"""The ``json`` system: the standard workload's requests, each under one JSON schema (a nested
object, an enum, an array of up to 8 strings of up to 32 characters), through the full engine.
Outputs end at the grammar's end, so they are shorter than slora's and prefill weighs more in
them: the ``json-free`` system runs the same requests unconstrained, each asked for exactly the
tokens its ``json`` run produced, on a fresh engine. ``json`` / ``json-free`` output tokens/s is
then the price of the constraint alone (same prompts, same output lengths, same batches); the
``json`` row adds the host seconds spent filling masks.

The bench's models have random weights and no tokenizer: the grammar's vocabulary is a
synthetic one over the model's ids (``synthetic_vocab``): special ids 0-2, every printable ASCII
character, then JSON pieces and letter pairs until the logits' width."""

from __future__ import annotations

import dataclasses
import itertools
import string

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 32},
        "kind": {"enum": ["person", "place", "thing", "event"]},
        "meta": {
            "type": "object",
            "properties": {
                "score": {"type": "integer", "minimum": 0, "maximum": 100},
                "ok": {"type": "boolean"},
            },
            "required": ["score", "ok"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 32}, "maxItems": 8},
    },
    "required": ["title", "kind", "meta", "tags"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
PIECES = ['{"', '": ', '", "', '"}', ", ", '["', '"]', "true", "false", "title", "kind", "meta"]


def synthetic_vocab(vocab_size: int, eos: int = 2) -> list[str]:
    """``vocab_size`` distinct token strings: "<s0>" "<s1>" "<s2>", the printable ASCII
    characters, JSON pieces, then two-letter pieces, three-letter ones past those and four-letter
    ones past those (531,441 of them: every preset's vocabulary fits)."""
    vocab = ["<s0>", "<s1>", "<s2>", *string.printable[:95], *PIECES]
    letters = string.ascii_lowercase + " "
    seen = set(vocab)
    for size in (2, 3, 4):
        for combo in itertools.product(letters, repeat=size):
            if len(vocab) >= vocab_size:
                return vocab[:vocab_size]
            piece = "".join(combo)
            if piece not in seen:  # "true", "kind" and "meta" are pieces already
                seen.add(piece)
                vocab.append(piece)
    raise ValueError(f"synthetic vocabulary tops out below {vocab_size} tokens")


def grammar_tokens(vocab_size: int, eos: int = 2):
    """An ``xgrammar.TokenizerInfo`` over ``synthetic_vocab`` (the engine's ``grammar_tokens``)."""
    import xgrammar as xgr

    vocab = synthetic_vocab(vocab_size)
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[eos])


def free_requests(requests: list, lengths: dict) -> list:
    """``json-free``: the requests without their format, each asked for the ``lengths[id]``
    tokens the json run produced (at least 1)."""
    return [
        dataclasses.replace(r, response_format=None, max_new_tokens=max(1, lengths[r.id]))
        for r in requests
    ]


def json_requests(requests: list) -> list:
    """The workload's requests under the schema; EOS stays ignored outside the grammar, so a row
    ends at the grammar's end or at its output length."""
    return [dataclasses.replace(r, response_format=FORMAT) for r in requests]
