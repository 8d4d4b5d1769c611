"""The sample job as the README runs it (``slora-batch run jobs/sample.yaml`` from the repository
root): every prompt through the base model and every sample adapter, and each adapter's behaviour
(``samples/behaviours.py``) in at least 80% of its rows and at most 10% of the base rows.

The run resumes over ``out/sample``, so after the README's command (CI runs it first) this test
only reads the outputs; outputs older than the sample adapters, prompts or job file, or written
without a job manifest (by an older slora-batch), are redone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from slora_batch.jobs.outdir import MANIFEST_FILE, part_files, read_success

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "jobs" / "sample.yaml"
OUT = ROOT / "out" / "sample"
SAMPLES = ROOT / "samples"
MIN_ADAPTER_SHARE = 45 / 48  # issue 15: each behaviour in at least 45 of the 48 rows
MAX_BASE_SHARE = 0.1


def load_checks() -> dict:
    spec = importlib.util.spec_from_file_location("behaviours", SAMPLES / "behaviours.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CHECKS


def stale() -> bool:
    """Whether out/sample holds rows older than what they were generated from (the job manifest
    is written when a run starts), or rows without a manifest: a run refuses both."""
    if not part_files(OUT):
        return False  # absent or nothing committed: a plain run is right
    marker = OUT / MANIFEST_FILE
    if not marker.exists():
        return True
    sources = [JOB, SAMPLES / "prompts.jsonl", *(SAMPLES / "adapters").rglob("*")]
    return max(p.stat().st_mtime for p in sources) > marker.stat().st_mtime


@pytest.mark.slow
def test_sample_job_shows_every_adapter_at_work():
    assert (SAMPLES / "adapters").is_dir(), "samples/adapters/ is missing: train the adapters"
    checks = load_checks()
    command = [sys.executable, "-m", "cli", "run", str(JOB.relative_to(ROOT))]
    if stale():
        command.append("--overwrite")
    # one torch thread: a little slower than two on an idle 2-core machine, many times faster
    # on a busy one
    env = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    if "complete already" not in done.stdout + done.stderr:  # CI's set-up command ran it first
        assert "outputs: out/sample " in done.stdout and "a few outputs" in done.stdout

    prompts = [json.loads(line) for line in (SAMPLES / "prompts.jsonl").read_text().splitlines()]
    adapters = sorted(p.name for p in (SAMPLES / "adapters").iterdir() if p.is_dir())
    assert set(checks) <= set(adapters)
    rows = pq.read_table([p for _, p in part_files(OUT)]).to_pylist()
    keys = {(r["id"], r["adapter"]) for r in rows}
    assert len(keys) == len(rows) == len(prompts) * (1 + len(adapters)) == read_success(OUT)["rows"]
    assert [r["error"] for r in rows if r["finish_reason"] == "error"] == []

    by_adapter: dict[str | None, list[str]] = {}
    for row in rows:
        by_adapter.setdefault(row["adapter"] or None, []).append(row["text"])  # base: "" or null
    for name, check in checks.items():
        own = sum(map(check, by_adapter[name])) / len(by_adapter[name])
        base = sum(map(check, by_adapter[None])) / len(by_adapter[None])
        assert own >= MIN_ADAPTER_SHARE, f"{name}: behaviour in {own:.0%} of its rows"
        assert base <= MAX_BASE_SHARE, f"{name}: behaviour in {base:.0%} of the base rows"
