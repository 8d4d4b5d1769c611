"""The sample eval as the README runs it (``slora-batch run jobs/sample-eval.yaml``), on the first
questions of samples/eval.jsonl (the job's ``limit``): each scored through the base model and
every sample adapter, each preferring the choice written in its own style (by mean
log-probability per token), and the run's summary printing the preference table."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from cli import app
from slora_batch.jobs.outdir import part_files

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "jobs" / "sample-eval.yaml"
OUT = ROOT / "out" / "sample-eval"
STYLE = {None: 0, "shout": 1, "pirate": 2, "json": 3, "brief": 4}  # samples/make_eval.py
# The first 3 of the 10 questions: the test's time is the scoring, each row's five continuations
# through the 135M model once per adapter. On all 10 (fp32, CPU) each adapter's own style comes
# first on every question, ahead by 0.2 nats a token or more; the base model's on 9, its miss
# (question 5) by 0.01.
QUESTIONS = 3
MIN_OWN_SHARE = 1.0  # each adapter's own style first on each of them


@pytest.mark.slow
def test_each_sample_adapter_prefers_its_own_style(tmp_path):
    out = tmp_path / "out"
    job = tmp_path / "eval.yaml"
    (spec,) = yaml.safe_load(JOB.read_text())["jobs"]
    assert spec["input"] == "../samples/eval.jsonl" and "limit" not in spec
    samples = ROOT / "samples"
    spec.update(
        adapters=str(samples / "adapters"),
        input=str(samples / "eval.jsonl"),
        output=str(out),
        limit=QUESTIONS,
    )
    job.write_text(yaml.safe_dump({"jobs": [spec]}))
    done = CliRunner().invoke(app, ["run", str(job)], env={"COLUMNS": "200"})  # in this process
    assert done.exit_code == 0, done.output
    assert "choice preference per adapter" in done.stdout
    # the columns are headed by the job's choice_labels
    assert all(
        head in done.stdout for head in ("0 plain", "1 shout", "2 pirate", "3 json", "4 brief")
    )
    rows = pq.read_table([p for _, p in part_files(out)]).to_pylist()
    assert len(rows) == QUESTIONS * len(STYLE) and {r["finish_reason"] for r in rows} == {"score"}
    for adapter, style in STYLE.items():
        mine = [r for r in rows if (r["adapter"] or None) == adapter]  # base: "" in the parts
        own = sum(r["best_choice_norm"] == style for r in mine) / len(mine)
        assert own >= MIN_OWN_SHARE, f"{adapter or 'base'}: its own style first in {own:.0%}"
        assert all(len(r["choice_logprobs"]) == 5 for r in mine)
