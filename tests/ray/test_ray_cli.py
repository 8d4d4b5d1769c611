"""The README's ``slora-batch run JOBS --ray local`` on this machine (default replicas, Ray sized
by the machine's own CPUs: CI has 2): SIGTERM mid-run exits 143 with one line, the same command
again completes with every row once, and a third run of the complete job does not start Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from test_jobrun import build_tiny, outputs, write_job  # noqa: E402

from slora_batch.jobs.config import load_jobs  # noqa: E402
from slora_batch.jobs.outdir import read_success  # noqa: E402
from slora_batch.ray import RaySettings, run_ray_jobs  # noqa: E402
from slora_batch.ray import job as ray_job  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ROWS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, sample_model_dir):
    return build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)


# The README's command that sends itself SIGTERM as its first part comes in: a signal from the
# test once a part was on disk came after the last part when the run outpaced it.
TERMINATED = """
import os, signal, sys
from slora_batch.ray import job as ray_job
real_execute = ray_job.execute
def execute(plan, scan, done, settings, out, run, on_part):
    def first(summary):
        on_part(summary)
        os.kill(os.getpid(), signal.SIGTERM)
    return real_execute(plan, scan, done, settings, out, run, first)
ray_job.execute = execute
from cli import app
app(sys.argv[1:])
"""


def cli(job_file: Path, *, terminated: bool = False, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    program = ["-c", TERMINATED] if terminated else [str(ROOT / "cli.py")]
    command = [sys.executable, *program, "run", str(job_file), "--ray", "local"]
    return subprocess.Popen(command, cwd=ROOT, env=env, text=True, **popen)


def test_readme_ray_local_survives_sigterm_and_completes_on_this_machine(
    tmp_path, tiny, monkeypatch
):
    lines = [
        json.dumps({"id": i, "adapter": "ab"[i % 2], "prompt": "the fox"}) for i in range(ROWS)
    ]
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    job_file = write_job(tmp_path, tiny, part_rows=2, sampling={"max_new_tokens": 2})
    out = tmp_path / "out"
    first = cli(job_file, terminated=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _, stderr = first.communicate(timeout=400)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 143, stderr
    last = stderr.strip().splitlines()[-1]  # the one line the CLI documents, naming job and output
    assert " WARNING slora_batch.cli: interrupted by SIGTERM" in last and "'tiny'" in last, stderr
    assert str(out.resolve()) in last and "resume" in last, stderr
    for dump in ("SIGTERM received", "Traceback", "execution failed", "Aborted"):
        assert dump not in stderr, stderr
    assert read_success(out) is None

    second = cli(job_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = second.communicate(timeout=400)
    assert second.returncode == 0, stderr
    rows = outputs(out)
    assert sorted(r["id"] for r in rows) == list(range(ROWS))  # every row once
    assert all(r["finish_reason"] == "length" for r in rows)
    assert read_success(out)["rows"] == ROWS
    ray_lines = [line for line in stderr.splitlines() if "slora_batch.jobs" not in line]
    assert not any("WARNING" in line or "concurrency" in line for line in ray_lines), stderr
    # Ray kept quiet; the job's own notes on its input are warned as a run in one process does

    (job,) = load_jobs(job_file)

    def connect(address):  # any Ray instance: this process may hold the shared one
        raise AssertionError("a complete job started or joined Ray")

    monkeypatch.setattr(ray_job, "connect", connect)
    (summary,) = run_ray_jobs([job], RaySettings(address="local"))
    assert summary.complete_already and summary.rows_this_run == 0
