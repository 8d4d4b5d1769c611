"""jobs/sample-json.yaml as the README shows it, over the first sample prompts: every row that
finishes with "stop" is a compact JSON record that validates against the job's schema file, and
nearly every row finishes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from slora_batch.jobs.config import load_jobs
from slora_batch.jobs.outdir import part_files
from slora_batch.jobs.run import run_job

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "jobs" / "sample-json.yaml"
PROMPTS = 4


@pytest.mark.slow
def test_sample_json_job_rows_validate(sample_model_dir, tmp_path):
    import jsonschema

    (job,) = load_jobs(JOB)
    schema = json.loads((JOB.parent / "schemas" / "record.json").read_text())
    assert job.sampling.response_format["json_schema"]["schema"] == schema
    lines = (ROOT / "samples" / "prompts.jsonl").read_text().splitlines()[:PROMPTS]
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    engine = dataclasses.replace(job.engine, device="cpu", dtype="float32", num_pages=20000)
    job = dataclasses.replace(job, input=str(tmp_path / "prompts.jsonl"),
                              output=str(tmp_path / "out"), engine=engine)  # fmt: skip
    run_job(job)
    rows = pq.read_table([p for _, p in part_files(job.output)]).to_pylist()
    assert len(rows) == PROMPTS and all(r["error"] is None for r in rows)
    stopped = [r for r in rows if r["finish_reason"] == "stop"]
    assert len(stopped) >= PROMPTS - 1
    for row in stopped:
        record = json.loads(row["text"])
        jsonschema.validate(record, schema)
        assert row["text"] == json.dumps(record)  # compact, as json.dumps writes it
