"""benchmarks/fp8_accuracy.py on the tiny model: the sample eval's first questions fanned out
over its adapters, scored in every setting, the comparisons and targets it reports."""

import math

import pytest
import yaml
from test_jobrun import PAGES, build_tiny

from benchmarks.fp8_accuracy import COMPARED, JOB, REFERENCES, eval_requests, markdown, measure

QUESTIONS = 2


@pytest.fixture(scope="module")
def figures(tmp_path_factory, sample_model_dir):
    tiny = build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)
    job = yaml.safe_load(JOB.read_text())
    job["jobs"][0].update(model=str(tiny.model), adapters=str(tiny.adapters),
                          input=str(JOB.parent.parent / "samples" / "eval.jsonl"))  # fmt: skip
    path = tmp_path_factory.mktemp("fp8acc") / "eval.yaml"
    path.write_text(yaml.safe_dump(job))
    requests = eval_requests(path, limit=QUESTIONS)
    assert len(requests) == QUESTIONS * 3 * 5  # base, "a", "b"; five choices each
    return measure(tiny.model, tiny.adapters, requests, "cpu", num_pages=PAGES)


def test_every_setting_is_compared_against_bf16_and_fp32(figures):
    pairs = [(c["setting"], c["reference"]) for c in figures["comparisons"]]
    assert pairs == [(s, r) for r in REFERENCES for s in COMPARED]
    tokens = {c["tokens"] for c in figures["comparisons"]}
    assert len(tokens) == 1 and tokens.pop() > QUESTIONS * 3 * 5
    assert all(c["rows"] == QUESTIONS * 3 for c in figures["comparisons"])
    assert list(figures["settings"]) == ["fp32", "bf16", "bf16 + fp8 KV", "bf16 + fp8 W+KV"]


def test_deltas_measure_each_settings_rounding(figures):
    by = {(c["setting"], c["reference"]): c for c in figures["comparisons"]}
    same = by[("bf16", "bf16")]
    assert same["mean_abs_delta"] == same["max_abs_delta"] == 0
    assert same["same_best"] == same["same_best_norm"] == 1 and same["changed"] == []
    kv, wkv = by[("bf16 + fp8 KV", "bf16")], by[("bf16 + fp8 W+KV", "bf16")]
    for c in (kv, wkv, by[("bf16", "fp32")]):
        assert 0 < c["mean_abs_delta"] <= c["max_abs_delta"] and math.isfinite(c["max_abs_delta"])
    assert wkv["mean_abs_delta"] != kv["mean_abs_delta"]  # the weights were quantized too


def test_targets_are_checked_against_bf16_and_printed(figures):
    checks = figures["targets"]
    assert len(checks) == 6 and all(isinstance(t["pass"], bool) for t in checks)
    by = {(c["setting"], c["reference"]): c for c in figures["comparisons"]}
    kv = by[("bf16 + fp8 KV", "bf16")]
    assert checks[0]["value"] == kv["mean_abs_delta"]
    assert checks[0]["pass"] == (kv["mean_abs_delta"] <= 0.02)
    assert checks[1]["pass"] == (kv["same_best"] >= 0.95)
    table = markdown(figures)
    assert "| bf16 + fp8 KV | bf16 |" in table and "| bf16 | fp32 |" in table
    for check in checks:
        assert f"{check['check']}: " in table
    assert table.count(" pass\n") + table.count(" FAIL\n") == len(checks)
