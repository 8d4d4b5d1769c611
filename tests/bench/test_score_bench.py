"""The bench's scoring systems on the CPU: ``score`` (the engine on scoring rows) and ``peft-score``
(transformers + PEFT in right-padded batches per adapter): their workload, plan, batches, rows,
and that both compute the same choice log-probabilities."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

from slora_batch.bench import cli as cli_module
from slora_batch.bench.bench import DEFAULT_SYSTEMS, BenchConfig, run_bench
from slora_batch.bench.model import build_model
from slora_batch.bench.peft_run import load_peft
from slora_batch.bench.peft_score_run import choice_sums, score_batches
from slora_batch.bench.warmup import WARMUP_PROMPT, _warmup
from slora_batch.bench.workload import ScoreWorkload, adapter_sources, group_by_adapter
from slora_batch.engine.config import ConfigError, EngineConfig
from slora_batch.engine.engine import assemble
from slora_batch.engine.execution.parts import EngineParts

TINY = dict(
    model_preset="tiny",
    device="cpu",
    warmup_requests=2,
    score_rows=12,
    score_min_context=3,
    score_max_context=20,
    score_min_choice=1,
    score_max_choice=5,
    peft_score_rows=8,
    peft_score_batch=3,
)


def test_score_workload_is_seeded_in_range_and_draws_adapters_like_the_workload():
    config = BenchConfig(**{**TINY, "score_rows": 300})
    a, b = ScoreWorkload.generate(config, 300), ScoreWorkload.generate(config, 300)
    assert a.contexts == b.contexts and a.choices == b.choices
    assert all(3 <= len(c) <= 20 and min(c) >= 3 and max(c) < 300 for c in a.contexts)
    assert all(len(choices) == 4 for choices in a.choices)
    assert all(1 <= len(c) <= 5 and min(c) >= 3 and max(c) < 300 for cs in a.choices for c in cs)
    assert [int(name[1:]) for name in a.adapters(10)] == [int(d * 10) for d in a.draws]
    assert a.adapters(0) == [None] * 300
    skewed = ScoreWorkload.generate(BenchConfig(**{**TINY, "score_rows": 300, "skewed": True}), 300)
    assert np.mean([int(n[1:]) for n in skewed.adapters(100)]) < 20  # power(0.1): mostly low ids
    requests = a.requests(3, count=5)
    assert [r.id for r in requests] == list(range(5)) and all(r.scored for r in requests)
    assert [r.choices_token_ids for r in requests] == a.choices[:5]
    assert a.tokens(0) == 4 * (len(a.contexts[0]) - 1) + sum(map(len, a.choices[0]))  # last: unfed


def test_scoring_systems_are_planned_on_request_and_validated():
    assert not {"score", "peft-score"} & set(DEFAULT_SYSTEMS)
    plan = BenchConfig(systems=["score", "peft-score"], adapters=[1, 1000, 10]).plan()
    assert plan == [("score", 1), ("score", 10), ("score", 1000), ("peft-score", 1),
                    ("peft-score", 10)]  # fmt: skip
    d = BenchConfig()
    assert (d.score_rows, d.score_min_context, d.score_max_context, d.score_choices) == (
        8000, 64, 1024, 4)  # fmt: skip
    assert (d.score_min_choice, d.score_max_choice) == (1, 32)
    for bad in (
        dict(score_min_context=0),
        dict(score_min_context=50, score_max_context=40),
        dict(score_min_choice=6, score_max_choice=5),
        dict(score_choices=0),
        dict(peft_score_batch=0),
        dict(peft_score_rows=0),
    ):
        with pytest.raises(ConfigError):
            BenchConfig(**bad)


def test_cli_fills_the_scoring_settings(monkeypatch):
    seen = []

    def fake_run(config):
        seen.append(config)
        return [], {}

    monkeypatch.setattr(cli_module, "run_bench", fake_run)
    monkeypatch.setattr(cli_module, "markdown", lambda rows, meta: "")
    app = typer.Typer()
    app.command()(cli_module.bench)
    args = ["--systems", "score,peft-score", "--score-rows", "50", "--score-min-context", "5",
            "--score-max-context", "9", "--score-choices", "2", "--score-min-choice", "3",
            "--score-max-choice", "7", "--peft-score-rows", "11", "--peft-score-batch", "2"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (config,) = seen
    assert config.systems == ["score", "peft-score"]
    got = [getattr(config, k) for k in ("score_rows", "score_min_context", "score_max_context",
           "score_choices", "score_min_choice", "score_max_choice", "peft_score_rows",
           "peft_score_batch")]  # fmt: skip
    assert got == [50, 5, 9, 2, 3, 7, 11, 2]


def test_peft_batches_never_mix_adapters_and_hold_each_row_once():
    workload = ScoreWorkload.generate(BenchConfig(**{**TINY, "score_rows": 60}), 300)
    batches = score_batches(workload, 5, 40, 3, seed=0)
    assert sorted(i for _, ids in batches for i in ids) == list(range(40))
    names = workload.adapters(5)
    for adapter, ids in batches:
        assert 1 <= len(ids) <= 3 and {names[i] for i in ids} == {adapter}
        lens = [len(workload.contexts[i]) for i in ids]
        assert lens == sorted(lens, reverse=True)  # longest first: the least padding
    assert batches == score_batches(workload, 5, 40, 3, seed=0)


def test_warmup_keeps_scoring_rows_scored_with_cut_contexts():
    workload = ScoreWorkload.generate(BenchConfig(**{**TINY, "score_max_context": 200}), 300)
    rows = workload.requests(2)
    cut, whole = _warmup(rows, False), _warmup(rows, True)
    assert all(r.scored and r.max_new_tokens is None for r in cut + whole)
    assert [r.prompt_token_ids for r in cut] == [c[:WARMUP_PROMPT] for c in workload.contexts]
    assert [r.choices_token_ids for r in whole] == workload.choices
    assert [r.prompt_token_ids for r in whole] == workload.contexts


def test_score_and_peft_score_run_and_report_rows_per_second(tmp_path):
    config = BenchConfig(systems=["score", "peft-score"], adapters=[3], out=tmp_path / "out",
                         **TINY)  # fmt: skip
    rows, _ = run_bench(config)
    assert [(r["system"], r["adapters"]) for r in rows] == [("score", 3), ("peft-score", 3)]
    workload = ScoreWorkload.generate(config, 300)
    for row in rows:
        count = 12 if row["system"] == "score" else 8
        assert row["error"] is None and row["error_rows"] == 0 and not row["truncated"]
        assert row["requests"] == row["finished"] == count
        assert row["rows_per_s"] == row["requests_per_s"] > 0 and row["wall_s"] > 0
        assert row["scored_tokens"] == sum(workload.tokens(i) for i in range(count))
        assert row["scored_tokens_per_s"] > 0 and math.isnan(row["output_tokens_per_s"])
        assert 0 < row["roofline_fraction"] < math.inf
    score, peft = rows  # the floor counts what was computed: no context the cache gave
    computed = score["scored_tokens"] - score["prefix_hit_tokens"]
    assert score["flops"] / computed == pytest.approx(peft["flops"] / peft["scored_tokens"])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert set(summary["score"]["3"]) == {"requests_per_s", "roofline_fraction", "rows_per_s",
                                          "scored_tokens_per_s"}  # fmt: skip
    text = (tmp_path / "out" / "results.md").read_text()
    assert "| score | 3 | 12/12 |" in text and "| peft-score | 3 | 8/8 |" in text
    assert "score@3 / peft-score best = " in text and "nan" not in text
    assert (tmp_path / "out" / "throughput.png").is_file()


def test_engine_and_peft_score_the_same_choices(tmp_path):
    """peft-score's padded batch gives each choice the sum a plain unpadded forward gives; the
    engine's choice_logprobs and best_choice on the same rows and weights agree with it."""
    device = torch.device("cpu")
    model = build_model("tiny", device, torch.float32, tmp_path, seed=0)
    sources = adapter_sources(3, model.write_adapters(tmp_path / "adapters", 0))
    workload = ScoreWorkload.generate(BenchConfig(**TINY), 300)
    requests = group_by_adapter(workload.requests(3, count=6))
    config = EngineConfig(device="cpu", dtype="float32", num_pages=16384)
    engine = assemble(model.model_dir, sources, config, parts=EngineParts(model.weights))
    results = {r.id: r for r in engine.generate(requests)}
    peft = load_peft(model.hf_model, sources)
    try:
        for adapter in dict.fromkeys(r.adapter for r in requests):
            rows = [r for r in requests if r.adapter == adapter]
            peft.set_adapter(adapter)
            batch = [(r.prompt_token_ids, r.choices_token_ids) for r in rows]
            sums = choice_sums(peft, batch, device)
            for row, row_sums in zip(rows, sums, strict=True):
                want = []
                for choice in row.choices_token_ids:
                    with torch.no_grad():
                        ids = torch.tensor([row.prompt_token_ids + choice])
                        logp = torch.log_softmax(peft(input_ids=ids).logits[0].float(), -1)
                    n = len(row.prompt_token_ids)
                    want.append(sum(logp[n - 1 + j, t].item() for j, t in enumerate(choice)))
                assert row_sums == pytest.approx(want, abs=1e-4)
                got = results[row.id]
                assert got.finish_reason == "score"
                assert got.choice_logprobs == pytest.approx(row_sums, abs=1e-3)
                assert got.best_choice == int(np.argmax(row_sums))
    finally:
        peft.unload()
