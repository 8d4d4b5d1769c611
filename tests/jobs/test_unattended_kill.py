"""Kills and signals (issue 14): a job killed with SIGKILL at five moments of its commit
protocol, or stopped by SIGTERM / SIGINT, ends after re-runs with every row exactly once and
the tokens of an uninterrupted run.

The killed runs are ``slora-batch run`` in a child process (``DRIVER``), which sends itself
SIGKILL at an exact moment: after its n-th part is committed, with the n-th part's temp file
whole but not renamed, halfway through writing it, after the last part before the stats, after
the stats before the marker. What SIGKILL leaves on disk does not depend on who sent it. The
child processes are forked from a warm interpreter (``warm_runs``): the imports once, not per run.
"""

from __future__ import annotations

import os
import signal
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
from warm_runs import run_script

from slora_batch.jobs.outdir import LOCK_FILE, TMP_MARK, part_files, read_success
from slora_batch.jobs.run import run_job

ROWS = 36
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
# Rows finish a few at a time (max_num_seqs 4); parts hold 4 rows or 50 ms of results.
KEYS = dict(part_rows=4, part_seconds=0.05, sampling={"max_new_tokens": 8},
            engine={"device": "cpu", "dtype": "float32", "num_pages": 16384, "max_num_seqs": 4})  # fmt: skip

DRIVER = """
import io, os, signal, sys
from slora_batch.jobs import lifecycle, outdir, stats, writer

job_file, moment, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
parts = 0
real_commit = writer.commit_file

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def commit(path, write):
    global parts
    if not path.name.startswith("part-"):
        return real_commit(path, write)
    parts += 1
    temp = path.with_name(f".{path.name}{outdir.TMP_MARK}{os.getpid()}")
    if moment == "temp-whole" and parts == n:
        with open(temp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        die()
    if moment == "temp-half" and parts == n:
        data = io.BytesIO()
        write(data)
        with open(temp, "wb") as handle:
            handle.write(data.getvalue()[: len(data.getvalue()) // 2])
            handle.flush()
        die()
    real_commit(path, write)
    if moment == "after-part" and parts == n:
        die()

writer.commit_file = commit  # the parts' commits; stats, manifest and marker are outdir's
if moment == "before-stats":
    stats.write_stats = lambda *args, **kwargs: die()
if moment == "before-marker":
    lifecycle.write_success = lambda *args, **kwargs: die()

from cli import app
app(["run", job_file, "--quiet"])
"""


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, sample_model_dir):
    return build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny) -> dict:
    """The outputs of an uninterrupted run."""
    directory = tmp_path_factory.mktemp("reference")
    write_jsonl(directory / "rows.jsonl", make_rows(ROWS))
    run_job(load_job(directory, tiny, **KEYS))
    return generated(outputs(directory / "out"))


def killed_run(job_file: Path, moment: str, n: int = 1) -> None:
    done = run_script(DRIVER, job_file, moment, n, cwd=job_file.parent, env=ENV)
    assert done.returncode == -signal.SIGKILL, (moment, done.returncode, done.stderr[-2000:])


def committed(out: Path) -> dict:
    """The committed rows by key; raises when a row is there twice."""
    return generated(outputs(out)) if part_files(out) else {}


@pytest.mark.slow
def test_sigkill_at_five_moments_then_resume_gives_every_row_once(tmp_path, tiny, reference):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(ROWS))
    job_file = write_job(tmp_path, tiny, **KEYS)
    out = tmp_path / "out"
    seen: dict = {}
    for moment, n in (("after-part", 2), ("temp-whole", 1), ("temp-half", 2),
                      ("before-stats", 1), ("before-marker", 1)):  # fmt: skip
        killed_run(job_file, moment, n)
        now = committed(out)
        assert read_success(out) is None, moment
        assert now.items() >= seen.items(), moment  # committed rows stay as they were
        assert all(reference[key] == value for key, value in now.items()), moment
        if moment == "temp-whole":
            assert now == seen and list(out.glob(f".part-*{TMP_MARK}*")), moment
        elif moment == "before-stats":
            assert now == reference and not (out / "_stats.parquet").exists()
        elif moment == "before-marker":
            assert (out / "_stats.parquet").exists()
        else:
            assert len(now) > len(seen), moment
        seen = now
    summary = run_job(load_job(tmp_path, tiny, **KEYS))
    assert summary.rows_this_run == 0 and summary.stats["rows"] == ROWS
    assert read_success(out)["rows"] == ROWS
    assert committed(out) == reference
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("part-")) == [
        "_SUCCESS",
        "_job.json",
        "_stats.parquet",
    ]  # fmt: skip no temp file, no lock file


@pytest.mark.parametrize(("sig", "code", "name"), [(signal.SIGTERM, 143, "SIGTERM"),
                                                   (signal.SIGINT, 130, "SIGINT")])  # fmt: skip
def test_a_signal_commits_every_finished_row_then_resume_completes(
    tmp_path, tiny, reference, sig, code, name
):
    """SIGTERM and SIGINT: every row finished before the signal is committed (parts here are
    only ever committed by the signal: 1000 rows or 10 minutes), the exit status is 143 / 130
    with one line on stderr, and a re-run completes the job."""
    write_jsonl(tmp_path / "rows.jsonl", make_rows(ROWS))
    keys = {**KEYS, "part_rows": 1000, "part_seconds": 600}
    job_file = write_job(tmp_path, tiny, **keys)
    finished = 12  # the run signals itself as its 12th row is written (SIGNALLER)
    done = run_script(SIGNALLER, job_file, int(sig), finished, cwd=ROOT, env=ENV)
    stderr = done.stderr
    assert done.returncode == code, stderr[-3000:]
    out = tmp_path / "out"
    now = committed(out)
    # stderr is a log: every line a record; a planned stop logs no ERROR and no traceback,
    # and ends with one WARNING that says what is committed and that a re-run resumes
    logged = records(stderr)
    assert "Traceback" not in stderr and not [r for r in logged if r[0] == "ERROR"], stderr
    assert logged[-1] == ("WARNING", "slora_batch.cli", (
        f"interrupted by {name}: job 'tiny' has {len(now)} rows committed in {out} ({len(now)} "
        f"of them this run); {ROWS - len(now)} of {ROWS} are left; run the same command again "
        "to resume"
    ))  # fmt: skip
    assert sum("interrupted" in message for _, _, message in logged) == 1
    assert len(now) >= finished and all(reference[key] == value for key, value in now.items())
    assert read_success(out) is None and not (out / LOCK_FILE).exists()
    assert not list(out.glob(f".*{TMP_MARK}*"))
    summary = run_job(load_job(tmp_path, tiny, **keys))
    assert summary.rows_skipped == len(now) and summary.rows_this_run == ROWS - len(now)
    assert committed(out) == reference
