"""The bench's lm-eval systems on the tiny preset (CPU): ``eval`` (the sweep through
``run_job``) and ``eval-score`` (the engine alone on the sweep's rows) run the same rows for the
base model and every adapter, and the acceptance line sets one against the other. The sweep
scores its adapters in the bench's process (``scoring_here``), and no throughput.png is drawn
(test_score_bench.py draws one from scoring rows alone, as these are)."""

from __future__ import annotations

import json

import pytest
from scoring_here import without_scoring_process

from slora_batch.bench.bench import BenchConfig, run_bench
from slora_batch.bench.eval_run import CHOICES, tokenizer_vocab, write_task


def test_write_task_is_seeded_and_lm_eval_shaped(tmp_path):
    one, two = write_task(tmp_path / "a", 5, 20, seed=1), write_task(tmp_path / "b", 5, 20, seed=1)
    docs = [json.loads(line) for line in (one / "mc.jsonl").read_text().splitlines()]
    assert (one / "mc.jsonl").read_text() == (two / "mc.jsonl").read_text()
    assert len(docs) == 5 and all(len(d["choices"]) == CHOICES for d in docs)
    assert [d["answer"] for d in docs] == [0, 1, 2, 3, 0]
    assert "output_type: multiple_choice" in (one / "bench_mc.yaml").read_text()


@pytest.mark.slow
def test_eval_and_eval_score_run_the_same_rows(tmp_path, sample_model_dir, monkeypatch):
    import slora_batch.bench.report as report

    without_scoring_process(monkeypatch)
    monkeypatch.setattr(report, "plot", lambda rows, path: None)
    assert tokenizer_vocab(sample_model_dir) == 49152
    config = BenchConfig(systems=["eval-score", "eval"], adapters=[2], model_preset="tiny",
                         device="cpu", tokenizer=str(sample_model_dir), eval_docs=5,
                         eval_context=20, warmup_requests=2, out=tmp_path / "out")  # fmt: skip
    rows, _ = run_bench(config)
    by = {r["system"]: r for r in rows}
    assert by["eval"]["error"] is None and by["eval-score"]["error"] is None, rows
    # 5 documents x 4 answers, for the base model and 2 adapters
    assert by["eval"]["finished"] == by["eval-score"]["finished"] == 3 * 5 * CHOICES
    assert by["eval"]["scored_tokens"] == by["eval-score"]["scored_tokens"]
    assert by["eval"]["eval_metrics"] == 3 * 2  # acc and acc_norm per adapter and the base
    assert by["eval"]["eval_engine_s"] + by["eval"]["eval_rest_s"] == pytest.approx(
        by["eval"]["wall_s"]
    )
    report = (config.out / "results.md").read_text()
    assert "- eval@2 / eval-score@2 rows/s = " in report


def test_eval_systems_need_a_tokenizer():
    from slora_batch.engine.config import ConfigError

    with pytest.raises(ConfigError, match="--tokenizer"):
        BenchConfig(systems=["eval"], model_preset="tiny")
