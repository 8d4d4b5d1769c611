"""Structured output end to end: greedy constrained tokens equal transformers + PEFT with each
step's logits masked by an xgrammar matcher of the same grammar (``structured.py``), for JSON
schemas, regexes, choices, json_object and EBNF rows mixed with unconstrained rows and several
adapters in one batch; with and without the overlapped loop, and under preemption."""

from __future__ import annotations

import json
import random

import pytest
from structured import EOS, FORMATS, PERSON, TOKENIZER_VOCAB, constrained_reference, structured_case

from slora_batch import Engine, EngineConfig, Request

ROWS = 18


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    model_dir, adapters = structured_case(tmp_path_factory.mktemp("structured"))
    rng = random.Random(0)
    names = [None, "r4", "r8"]
    rows = [
        {
            "id": i,
            "adapter": names[i % 3],
            "prompt_token_ids": [
                rng.randrange(3, TOKENIZER_VOCAB) for _ in range(rng.choice([3, 9, 20]))
            ],
            "max_new_tokens": 48,
            "response_format": FORMATS[i % len(FORMATS)],
        }
        for i in range(ROWS)
    ]
    return model_dir, adapters, rows, constrained_reference(model_dir, adapters, rows)


def run(model_dir, adapters, rows, **knobs):
    config = EngineConfig(device="cpu", dtype="float32", **knobs)
    engine = Engine(model_dir, adapters=adapters, config=config)
    results = {r.id: r for r in engine.generate(Request(**row) for row in rows)}
    assert sorted(results) == sorted(row["id"] for row in rows)
    assert not [r.error for r in results.values() if r.error]
    return results, engine


@pytest.mark.parametrize(
    "knobs",
    [
        dict(num_pages=8000, max_num_batched_tokens=64, overlap=True),
        dict(num_pages=8000, max_num_batched_tokens=64, overlap=False),
        dict(num_pages=700, max_num_batched_tokens=32, max_num_seqs=8, overlap=True),
    ],
    ids=["overlapped", "serial", "preempting"],
)
def test_constrained_greedy_matches_masked_reference(case, knobs):
    model_dir, adapters, rows, expected = case
    results, engine = run(model_dir, adapters, rows, **knobs)
    wrong = {i: (results[i].token_ids, want) for i, want in expected.items()
             if results[i].token_ids != want}  # fmt: skip
    assert not wrong, f"{len(wrong)} rows differ from the masked reference: {wrong}"
    if knobs["num_pages"] == 700:
        assert engine.counters.preemptions > 0
    assert len(engine.grammars.compiled) == len([f for f in FORMATS if f is not None])
    stopped = 0
    for row in rows:
        got, fmt = results[row["id"]], row["response_format"]
        assert all(t < TOKENIZER_VOCAB for t in got.token_ids) or fmt is None
        if fmt is None or got.finish_reason == "length":
            continue
        assert got.finish_reason == "stop" and got.token_ids[-1] == EOS
        stopped += 1
        if fmt["type"] == "json_schema":
            import jsonschema

            jsonschema.validate(json.loads(got.text), PERSON)
            assert got.text == json.dumps(json.loads(got.text))  # compact, as json.dumps writes
        elif fmt["type"] == "choice":
            assert got.text in fmt["choice"]
    assert stopped >= ROWS // 3  # the bounded formats (regex, choice, EBNF) end
