"""formats.py and grammar.py: the shapes a response_format may take, error rows for formats the
compiler rejects (the others unharmed), and constrained rows under sampling (n samples, seeds,
top-p/top-k), logprobs of the masked distribution and stop strings."""

from __future__ import annotations

import json
import re

import pytest
from structured import EOS, PERSON, structured_case

from slora_batch import Engine, EngineConfig, Request
from slora_batch.engine.requests.formats import parse_format

REGEX = "[a-z]{2,4}-[0-9]{3}"
CHOICE = ["yes", "no", "maybe"]


@pytest.fixture(scope="module")
def engine_case(tmp_path_factory):
    model_dir, adapters = structured_case(tmp_path_factory.mktemp("grammar"))
    config = EngineConfig(device="cpu", dtype="float32", num_pages=6000, max_num_batched_tokens=64)
    return Engine(model_dir, adapters=adapters, config=config)


def prompt(i: int) -> list[int]:
    return [3 + (7 * i + j * 13) % 270 for j in range(5 + i % 7)]


def test_parse_format_shapes_and_errors():
    assert parse_format(None) is None and parse_format({"type": "text"}) is None
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    fmt = parse_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    as_text = parse_format(json.dumps({"type": "json_schema", "json_schema": {"schema": schema}}))
    assert fmt == as_text and fmt.kind == "json_schema"  # the name and JSON text do not count
    assert fmt.source.index('"b"') < fmt.source.index('"a"')  # property order kept
    assert (
        parse_format({"type": "choice", "choice": ["a", 'b"c']}).source == 'root ::= "a" | "b\\"c"'
    )
    for bad, says in [
        ({"type": "xml"}, "type 'xml' is not one of"),
        ({"type": "json_schema"}, "needs json_schema.schema"),
        ({"type": "choice", "choice": []}, "non-empty list"),
        ({"type": "regex"}, "non-empty string 'regex'"),
        ("{not json", "not JSON"),
        (["json"], "must be an object"),
    ]:
        with pytest.raises(ValueError, match=re.escape(says)):
            parse_format(bad)


def test_bad_formats_are_error_rows_others_unharmed(engine_case):
    good = [
        dict(id=f"g{i}", adapter=[None, "r4", "r8"][i % 3], prompt_token_ids=prompt(i),
             max_new_tokens=24, response_format=f)
        for i, f in enumerate([{"type": "regex", "regex": REGEX}, None,
                               {"type": "choice", "choice": CHOICE}])
    ]  # fmt: skip
    bad = {
        "b-schema": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
        "b-regex": {"type": "regex", "regex": "[a-"},
        "b-ebnf": {"type": "grammar", "grammar": "root ::= undefined_rule"},
        "b-type": {"type": "yaml"},
    }
    rows = [dict(good[0], id=name, response_format=f) for name, f in bad.items()]
    alone = {r.id: r for r in engine_case.generate(Request(**row) for row in good)}
    mixed = {r.id: r for r in engine_case.generate(Request(**row) for row in rows + good)}
    for row in good:
        assert mixed[row["id"]].token_ids == alone[row["id"]].token_ids
        assert mixed[row["id"]].error is None
    for name, says in [("b-schema", 'Unsupported type "nope"'), ("b-regex", "Unclosed '['"),
                       ("b-ebnf", "undefined_rule"), ("b-type", "type 'yaml' is not one of")]:  # fmt: skip
        got = mixed[name]
        assert got.finish_reason == "error" and f"row {name!r}" in got.error and says in got.error
        assert "/project/" not in got.error  # xgrammar's source location is cut


def test_sampled_samples_follow_their_grammar_and_seed(engine_case):
    fmts = [{"type": "regex", "regex": REGEX}, {"type": "choice", "choice": CHOICE},
            {"type": "json_schema", "json_schema": {"schema": PERSON}}]  # fmt: skip
    rows = [
        dict(id=i, adapter=[None, "r4", "r8"][i % 3], prompt_token_ids=prompt(i), n=3,
             temperature=1.3, top_p=0.95, top_k=40, seed=9, max_new_tokens=64,
             response_format=fmts[i % 3])
        for i in range(6)
    ]  # fmt: skip
    crowd = {(r.id, r.sample_index): r for r in engine_case.generate(Request(**r) for r in rows)}
    alone = {(r.id, r.sample_index): r for r in engine_case.generate([Request(**rows[2])])}
    assert len(crowd) == 18
    for key, got in alone.items():
        assert crowd[key].token_ids == got.token_ids  # seeded: the batch does not matter
    for (i, _), got in crowd.items():
        assert got.error is None
        if got.finish_reason != "stop":
            continue
        assert got.token_ids[-1] == EOS
        if i % 3 == 0:
            assert re.fullmatch(REGEX, got.text)
        elif i % 3 == 1:
            assert got.text in CHOICE
        else:
            import jsonschema

            jsonschema.validate(json.loads(got.text), PERSON)
    assert sum(g.finish_reason == "stop" for g in crowd.values()) >= 8
    texts = {crowd[1, s].text for s in range(3)} | {crowd[3, s].text for s in range(3)}
    assert len(texts) > 1  # the samples draw on their own


def test_logprobs_are_of_the_masked_distribution(engine_case):
    import xgrammar as xgr

    row = dict(id="lp", prompt_token_ids=prompt(4), max_new_tokens=16, logprobs=5,
               response_format={"type": "regex", "regex": REGEX})  # fmt: skip
    (got,) = engine_case.generate([Request(**row)])
    matcher = xgr.GrammarMatcher(
        engine_case.grammars.compile_now(parse_format(row["response_format"]))
    )
    bitmask = xgr.allocate_token_bitmask(1, engine_case.grammars.vocab_size)
    for token, entry in zip(got.token_ids, got.logprobs, strict=True):
        matcher.fill_next_token_bitmask(bitmask)
        bits = bitmask[0].tolist()
        allowed = {t for t in range(len(bits) * 32) if (bits[t // 32] >> (t % 32)) & 1}
        assert entry["token_id"] == token == entry["top"][0]["token_id"]  # greedy: the top one
        finite = [alt for alt in entry["top"] if alt["logprob"] > float("-inf")]
        assert finite and all(alt["token_id"] in allowed for alt in finite)
        # Renormalized over the allowed tokens: their mass is 1, so the top ones sum to <= 1.
        assert sum(2.718281828 ** alt["logprob"] for alt in finite) <= 1 + 1e-5
        assert matcher.accept_token(token)
    assert got.finish_reason in ("stop", "length")


def test_stop_string_ends_a_constrained_row(engine_case):
    row = dict(id="s", prompt_token_ids=prompt(2), max_new_tokens=32,
               response_format={"type": "json_schema", "json_schema": {"schema": PERSON}})  # fmt: skip
    (full,) = engine_case.generate([Request(**row)])
    assert full.text.startswith('{"name": ')
    (cut,) = engine_case.generate([Request(**row, stop=['"age"'])])
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index('"age"')]


def test_no_tokenizer_is_an_error_row(tmp_path):
    from factory import make_model

    model_dir = make_model(tmp_path, "mha")
    engine = Engine(model_dir, config=EngineConfig(device="cpu", dtype="float32", num_pages=2000))
    rows = [Request(id=1, prompt_token_ids=[5, 6], max_new_tokens=3,
                    response_format={"type": "json_object"}),
            Request(id=2, prompt_token_ids=[5, 6], max_new_tokens=3)]  # fmt: skip
    got = {r.id: r for r in engine.generate(rows)}
    assert got[1].finish_reason == "error" and "needs a tokenizer" in got[1].error
    assert got[2].error is None and len(got[2].token_ids) == 3


def test_json_rows_never_draw_a_raw_control_character():
    """xgrammar 0.2.9's string with maxLength accepts a raw 0x14, which no JSON parser takes:
    a JSON row's mask ANDs in the tokens without control bytes; a regex row's does not."""
    import concurrent.futures as cf

    import xgrammar as xgr

    from slora_batch.engine.requests.grammar import GrammarState, without_control_bytes

    vocab = ["<s>", "</s>", '"', "a", "\x14", "a\nb", "{", "}"]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=40, stop_token_ids=[1])
    only = without_control_bytes(info.decoded_vocab, info.vocab_size)
    assert only.shape == (2,) and only.dtype.is_signed
    assert [bool(int(only[t // 32]) >> (t % 32) & 1) for t in range(8)] == [
        True, True, True, True, False, False, True, True]  # fmt: skip
    assert int(only[1]) == 0  # ids past the tokenizer: never
    compiler = xgr.GrammarCompiler(info)
    bounded = json.dumps({"type": "string", "maxLength": 8})

    def allowed(grammar, only=None) -> set[int]:
        state = GrammarState(cf.Future(), only)
        state.future.set_result(grammar)
        state.accept([2, 3], 2, "row")  # '"a' so far
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
        state.fill(bitmask, 0)
        return {t for t in range(8) if int(bitmask[0, t // 32]) >> (t % 32) & 1}

    grammar = compiler.compile_json_schema(bounded, any_whitespace=False)
    assert 4 in allowed(grammar)  # the defect this guards against
    assert allowed(grammar, only) == allowed(grammar) - {4, 5}
    assert 4 in allowed(compiler.compile_regex('"a[\\x14]*"'))  # regex rows keep theirs
