"""The README's ``slora-batch run JOBS --ray local`` on this machine (default replicas, Ray sized
by the machine's own CPUs: CI has 2): SIGTERM mid-run exits 143 with one line and nothing of
Ray's on stderr; the single-process tool then resumes the interrupted output with every row once
(in this process: a resumed Ray run is test_ray_job.py's killed-driver test, and each engine
actor costs seconds of CPU to import torch and build its engine); and a Ray run of the complete
job does not start Ray."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from test_jobrun import build_tiny, outputs, write_job  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from cli import app  # noqa: E402
from slora_batch.jobs.config import load_jobs  # noqa: E402
from slora_batch.jobs.outdir import part_files, read_success  # noqa: E402
from slora_batch.ray import RaySettings, run_ray_jobs  # noqa: E402
from slora_batch.ray import job as ray_job  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ROWS = 12
ENV = {"COLUMNS": "200", "NO_COLOR": "1"}  # the in-process run's summary: no wrapping, no colour


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, sample_model_dir):
    return build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)


# The README's command whose engine actors each commit their first unit and then hold the next
# one: the test sends SIGTERM once a part is on disk, while rows are still to do and the actors
# are busy. (Ray Data hands the driver a partition's parts only once the partition is done, so a
# run not held had often committed every part by the time a signal came.)
HELD = """
import sys, time
from slora_batch.ray import execute
from slora_batch.ray.stage import EngineActor
class HoldAfterFirst(EngineActor):  # defined here: pickled by value into the actors
    def __call__(self, batch):
        if self.calls >= 1:
            time.sleep(600)
        return super().__call__(batch)
execute.EngineActor = HoldAfterFirst
from cli import app
app(sys.argv[1:])
"""


def held_cli(job_file: Path) -> subprocess.Popen:
    """``slora-batch run JOB_FILE --ray local`` with its actors held after their first unit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", HELD, "run", str(job_file), "--ray", "local"]
    return subprocess.Popen(
        command, cwd=ROOT, env=env, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def terminate_once_a_part_is_committed(run: subprocess.Popen, out: Path) -> str:
    """SIGTERM once the first part is on disk; the run's stderr."""
    try:
        deadline = time.monotonic() + 400
        while not part_files(out) and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run.poll() is None, "the run ended before a part was committed"
        run.send_signal(signal.SIGTERM)
        _, stderr = run.communicate(timeout=400)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    return stderr


def test_readme_ray_local_survives_sigterm_and_completes_on_this_machine(
    tmp_path, tiny, monkeypatch
):
    lines = [
        json.dumps({"id": i, "adapter": "ab"[i % 2], "prompt": "the fox"}) for i in range(ROWS)
    ]
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    job_file = write_job(tmp_path, tiny, part_rows=2, sampling={"max_new_tokens": 2})
    out = tmp_path / "out"
    first = held_cli(job_file)
    stderr = terminate_once_a_part_is_committed(first, out)
    assert first.returncode == 143, stderr
    *before, last = stderr.strip().splitlines()  # last: the one line the CLI documents
    assert " WARNING slora_batch.cli: interrupted by SIGTERM" in last and "'tiny'" in last, stderr
    assert str(out.resolve()) in last and "resume" in last, stderr  # naming the job and output
    for dump in ("SIGTERM received", "Traceback", "execution failed", "Aborted"):
        assert dump not in stderr, stderr
    ray_lines = [line for line in before if "slora_batch.jobs" not in line]
    assert not any("WARNING" in line or "concurrency" in line for line in ray_lines), stderr
    # Ray kept quiet; the job's own notes on its input are warned as a run in one process does
    committed = len(outputs(out))
    assert read_success(out) is None and 0 < committed < ROWS

    second = CliRunner().invoke(app, ["run", str(job_file)], env=ENV)
    assert second.exit_code == 0, second.output
    resumed = re.search(r"resumed: (\d+) rows? w\w+ already done, (\d+) written", second.output)
    assert resumed, second.output
    assert resumed.groups() == (str(committed), str(ROWS - committed))  # what the first left
    rows = outputs(out)
    assert sorted(r["id"] for r in rows) == list(range(ROWS))  # every row once
    assert all(r["finish_reason"] == "length" for r in rows)
    assert read_success(out)["rows"] == ROWS

    (job,) = load_jobs(job_file)

    def connect(address):  # any Ray instance: this process holds the shared one
        raise AssertionError("a complete job started or joined Ray")

    monkeypatch.setattr(ray_job, "connect", connect)
    (summary,) = run_ray_jobs([job], RaySettings(address="local"))
    assert summary.complete_already and summary.rows_this_run == 0
