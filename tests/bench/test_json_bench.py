"""The bench's ``json`` system on the tiny preset (CPU): slora's requests under the schema of
bench/json_run.py, rows that end at the grammar's end, host mask time reported; and the
synthetic vocabulary the random models' grammars use."""

from __future__ import annotations

import json

import jsonschema
import pytest

from slora_batch.bench.bench import BenchConfig, run_bench
from slora_batch.bench.json_run import SCHEMA, synthetic_vocab
from slora_batch.bench.model import PRESETS

TINY = dict(model_preset="tiny", device="cpu", min_input=8, max_input=16, min_output=60,
            max_output=80, warmup_requests=2)  # fmt: skip


def test_synthetic_vocab_is_distinct_and_covers_json():
    vocab = synthetic_vocab(300)
    assert len(vocab) == len(set(vocab)) == 300
    assert all(c in vocab for c in '{}[]":, 0123456789abc')
    with pytest.raises(ValueError, match="below"):
        synthetic_vocab(10**6)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_synthetic_vocab_covers_every_preset(preset):
    """The H200 run of ``now json`` at llama2-7b (32000 ids) once failed here: three-letter pieces
    topped out at 20,522."""
    size = PRESETS[preset].get("vocab_size", 32000)
    assert len(set(synthetic_vocab(size))) == size


@pytest.mark.slow
def test_json_system_runs_beside_slora(tmp_path):
    config = BenchConfig(systems=["slora", "json", "json-free"], adapters=[3], requests=6,
                         out=tmp_path, **TINY)  # fmt: skip
    rows, _ = run_bench(config)
    by = {r["system"]: r for r in rows}
    # json-free: json's requests unconstrained at json's lengths, so the same tokens come out
    free = by["json-free"]
    assert free["error"] is None and free["finished"] == 6 and free["length_mismatches"] == 0
    assert free["output_tokens"] == by["json"]["output_tokens"]
    assert free["prompt_tokens"] == by["json"]["prompt_tokens"]
    assert not free.get("grammar_rows")
    report = (config.out / "results.md").read_text()
    assert "- json@3 / json-free@3 = " in report and "constrained draws" in report
    assert by["json"]["error"] is None and by["json"]["finished"] == 6
    assert by["json"]["error_rows"] == 0
    assert by["json"]["grammar_rows"] >= by["json"]["output_tokens"] - 6  # every draw masked
    assert by["json"]["grammar_mask_s"] > 0 and by["json"]["output_tokens_per_s"] > 0
    assert by["json"]["output_tokens"] <= by["slora"]["output_tokens"]


def test_json_outputs_follow_the_schema(tmp_path):
    from factory import make_model

    from slora_batch import EngineConfig, Request
    from slora_batch.bench.json_run import FORMAT, grammar_tokens
    from slora_batch.engine.engine import assemble
    from slora_batch.engine.execution.parts import EngineParts

    model_dir = make_model(tmp_path, "mha")
    config = EngineConfig(device="cpu", dtype="float32", num_pages=6000)
    parts = EngineParts(grammar_tokens=grammar_tokens(300))  # the model has no tokenizer
    engine = assemble(model_dir, config=config, parts=parts)
    vocab = synthetic_vocab(300)
    requests = [Request(id=i, prompt_token_ids=[5 + i, 9, 40 + i], max_new_tokens=200,
                        ignore_eos=True, response_format=FORMAT) for i in range(4)]  # fmt: skip
    results = list(engine.generate(requests))
    stopped = [r for r in results if r.finish_reason == "stop"]
    assert len(stopped) >= 3
    for r in stopped:
        text = "".join(vocab[t] for t in r.token_ids[:-1])
        jsonschema.validate(json.loads(text), SCHEMA)
