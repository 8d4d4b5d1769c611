"""Jobs over two data-parallel workers (issue 16): the rows of one engine, and exactly-once
resume after a worker is killed or the driver is killed: at data_parallel 2 after a killed
worker, on one engine in the test's process after a stopped worker or driver (a job may resume
with another data_parallel; it spares two worker start-ups a re-run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_jobrun import (
    SIGNALLER,
    build_tiny,
    generated,
    load_job,
    make_rows,
    one_thread,  # noqa: F401 -- an autouse fixture: these tests run on one thread too
    outputs,
    write_job,
    write_jsonl,
)
from test_logs import records

from slora_batch.engine.parallel.data_parallel import WorkerDied
from slora_batch.engine.parallel.dp_worker import beat_s
from slora_batch.jobs import run as jobrun
from slora_batch.jobs.outdir import part_files, read_success
from slora_batch.jobs.run import run_job

ROWS = 36
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
ENGINE = {
    "device": "cpu",
    "dtype": "float32",
    "num_pages": 16384,
    "max_num_seqs": 4,
    "lookahead": 16,
}  # fmt: skip chunks of 2 rows: both workers get rows of 36
KEYS = dict(part_rows=4, part_seconds=0.05, sampling={"max_new_tokens": 8}, engine=ENGINE)
DP2 = {**KEYS, "engine": {**ENGINE, "data_parallel": 2}}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, sample_model_dir):
    return build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny) -> dict:
    """The outputs of an uninterrupted run on one engine."""
    directory = tmp_path_factory.mktemp("reference")
    write_jsonl(directory / "rows.jsonl", make_rows(ROWS))
    run_job(load_job(directory, tiny, **KEYS))
    return generated(outputs(directory / "out"))


def committed(out: Path) -> dict:
    """The committed rows by key; raises when a row is there twice."""
    return generated(outputs(out)) if part_files(out) else {}


def test_two_workers_write_the_rows_of_one_engine(tmp_path, tiny, reference):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(ROWS))
    summary = run_job(load_job(tmp_path, tiny, **DP2))
    assert summary.rows_this_run == summary.stats["rows"] == ROWS
    assert summary.stats["device"] == "cpu x2" and summary.stats["dtype"] == "float32"
    assert committed(tmp_path / "out") == reference


@pytest.mark.slow
def test_a_killed_worker_fails_the_run_and_a_rerun_resumes_its_rows(
    tmp_path, tiny, reference, monkeypatch
):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(ROWS))
    engines = []
    build = jobrun._build_engine
    monkeypatch.setattr(
        jobrun, "_build_engine", lambda plan: engines.append(build(plan)) or engines[-1]
    )

    def kill_worker_1(update) -> None:
        if update.phase == "running" and update.rows_this_run == 8 and len(engines) == 1:
            os.kill(engines[0].pids[1], signal.SIGKILL)

    with pytest.raises(WorkerDied) as died:
        run_job(load_job(tmp_path, tiny, **DP2), progress=kill_worker_1)
    pid = engines[0].pids[1]
    assert f"worker 1 (cpu, pid {pid}) died with exit code -9 (SIGKILL)" in str(died.value)
    out = tmp_path / "out"
    now = committed(out)
    assert 8 <= len(now) < ROWS and read_success(out) is None
    assert all(reference[key] == value for key, value in now.items())  # whole rows only
    engines.append("rerun")  # no kill in the re-run
    summary = run_job(load_job(tmp_path, tiny, **DP2))
    assert summary.rows_skipped == len(now) and summary.rows_this_run == ROWS - len(now)
    assert committed(out) == reference and read_success(out)["rows"] == ROWS


@pytest.mark.slow
def test_a_worker_that_stops_answering_fails_the_run_naming_it(tmp_path, tiny, reference,
                                                               monkeypatch):  # fmt: skip
    """A stopped worker (SIGSTOP: alive, silent) is detected after worker_timeout_s, killed,
    and named; the other worker's rows are written, and a re-run resumes the rest."""
    write_jsonl(tmp_path / "rows.jsonl", make_rows(ROWS))
    engines, stopped = [], []
    build = jobrun._build_engine
    monkeypatch.setattr(
        jobrun, "_build_engine", lambda plan: engines.append(build(plan)) or engines[-1]
    )

    def stop_worker_1(update) -> None:
        if update.phase == "running" and update.rows_this_run == 8 and not stopped:
            stopped.append(time.monotonic())
            os.kill(engines[0].pids[1], signal.SIGSTOP)

    timeout = 4.0
    keys = {**DP2, "engine": {**DP2["engine"], "worker_timeout_s": timeout}}
    with pytest.raises(WorkerDied) as died:
        run_job(load_job(tmp_path, tiny, **keys), progress=stop_worker_1)
    waited = time.monotonic() - stopped[0]
    pid = engines[0].pids[1]
    message = str(died.value)
    assert f"worker 1 (cpu, pid {pid}) stopped answering: it sent nothing for" in message
    silent = float(message.split("sent nothing for ")[1].split(" s")[0])
    # Silence counts from the worker's last message, up to one heartbeat before the stop; the
    # message rounds it to 0.1 s, so a silence just past the bound reads as the bound itself
    # (4.03 s reads "4.0": a loaded machine found it so); found by the bound, not after 300 s.
    assert timeout <= silent <= waited + beat_s(timeout) + 0.05
    assert waited < 60 * timeout
    assert "re-run to resume them" in message
    assert parent_and_state(pid)[1] in ("gone", "Z")  # killed, not left stopped
    out = tmp_path / "out"
    now = committed(out)
    assert 8 <= len(now) < ROWS and read_success(out) is None
    assert all(reference[key] == value for key, value in now.items())
    engines.append("rerun")
    summary = run_job(load_job(tmp_path, tiny, **KEYS))  # resumed on one engine, in here
    assert summary.rows_skipped == len(now) and summary.rows_this_run == ROWS - len(now)
    assert committed(out) == reference and read_success(out)["rows"] == ROWS


def parent_and_state(pid: int) -> tuple[int | None, str]:
    try:
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None, "gone"
    return int(fields[1]), fields[0]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_stopped_driver_leaves_no_worker_and_a_rerun_completes(tmp_path, tiny, reference, sig):
    """A killed driver's workers exit on their own (their pipe from it closes); a terminated
    one stops them before it exits with 143."""
    write_jsonl(tmp_path / "rows.jsonl", make_rows(ROWS))
    job_file = write_job(tmp_path, tiny, **DP2)
    # the driver signals itself as its 6th row is written, naming its workers first (SIGNALLER)
    pids = tmp_path / "workers.txt"
    command = [sys.executable, "-c", SIGNALLER, str(job_file), str(int(sig)), "6", str(pids)]
    driver = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    code = 143 if sig == signal.SIGTERM else -signal.SIGKILL
    assert driver.returncode == code, driver.stderr[-3000:]
    if sig == signal.SIGTERM:  # a planned stop: no ERROR line (the driver's or a worker's)
        logged = records(driver.stderr)
        assert not [r for r in logged if r[0] == "ERROR"] and "Traceback" not in driver.stderr
        assert logged[-1][:2] == ("WARNING", "slora_batch.cli"), driver.stderr[-3000:]
    workers = [int(pid) for pid in pids.read_text().split()]
    assert len(workers) >= 2, workers  # the two engine workers
    deadline = time.monotonic() + 15
    left = workers
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [pid for pid in workers if parent_and_state(pid)[1] not in ("gone", "Z")]
    assert not left, f"worker processes still running after the driver was killed: {left}"
    out = tmp_path / "out"
    now = committed(out)
    assert read_success(out) is None  # killed mid-job
    assert all(reference[key] == value for key, value in now.items())
    summary = run_job(load_job(tmp_path, tiny, **KEYS))  # resumed on one engine, in here
    assert summary.rows_skipped == len(now) and summary.rows_this_run == ROWS - len(now)
    assert committed(out) == reference and read_success(out)["rows"] == ROWS


ACCEPTANCE_ROWS = 5000
AT_SCALE = {"device": "cpu", "dtype": "float32", "num_pages": 8000, "data_parallel": 2}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["scored", "equal-length"])
def test_rows_that_finish_at_launch_complete_every_row_once(tmp_path, tiny, kind):
    """Issue 23's acceptance: 5000 scored rows, and 5000 generated rows of equal length, at
    data_parallel 2 with the default lookahead (each worker's bound of rows outstanding is
    1152): every row finishes in the step that launches it, and every row is written once."""
    rows = []
    for k in range(ACCEPTANCE_ROWS):
        row = {"id": f"r{k:05d}", "adapter": [None, "a", "b"][k % 3],
               "prompt_token_ids": [3 + k % 40000, 7, 9]}  # fmt: skip
        if kind == "scored":
            row["continuation_token_ids"] = [11, 12]
        rows.append(row)
    write_jsonl(tmp_path / "rows.jsonl", rows)
    sampling = {"max_new_tokens": 2, "ignore_eos": True}
    summary = run_job(load_job(tmp_path, tiny, part_rows=1000, sampling=sampling, engine=AT_SCALE))
    assert summary.rows_this_run == summary.stats["rows"] == ACCEPTANCE_ROWS
    written = outputs(tmp_path / "out")
    assert sorted(r["id"] for r in written) == [row["id"] for row in rows]  # each once
    assert not [r["error"] for r in written if r["error"]]
    reasons = {r["finish_reason"] for r in written}
    assert reasons == ({"score"} if kind == "scored" else {"length"}), reasons
    if kind == "equal-length":
        assert {len(r["token_ids"]) for r in written} == {2}
    assert read_success(tmp_path / "out")["rows"] == ACCEPTANCE_ROWS
