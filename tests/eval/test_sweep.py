"""The eval job: every task for the base model and four adapters in one engine (one pass over
the fanned-out requests), lm-eval's metrics per adapter equal to ``hf`` with ``peft=``, and a
re-run that finds the job complete and writes nothing new."""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import TASKS

pytest.importorskip("lm_eval")

# A sweep that kills itself (SIGKILL) right after committing its second part.
KILL = """
import os, signal, sys
from slora_batch.jobs import writer
from slora_batch.jobs.config import load_jobs
from slora_batch.runner import run_job

parts = 0
real_commit = writer.commit_file

def commit(path, write):
    global parts
    real_commit(path, write)
    if path.name.startswith("part-"):
        parts += 1
        if parts == 2:
            os.kill(os.getpid(), signal.SIGKILL)

writer.commit_file = commit
from slora_batch.eval import worker

start = worker.ScoringProcess.__init__

def started(self, *args, **kwargs):
    start(self, *args, **kwargs)
    print("scoring process", self.process.pid, flush=True)

worker.ScoringProcess.__init__ = started
(job,) = load_jobs(sys.argv[1])
run_job(job)
"""


@pytest.mark.slow
def test_sweep_runs_one_engine_and_equals_hf(tmp_path, eval_setup, monkeypatch):
    """Killed (SIGKILL after its second part) and run again: its scoring process ends with
    it, the re-run computes only the rest, in one engine for every adapter and task, every
    request once per adapter, and lm-eval's metrics equal ``hf`` with ``peft=`` (the base model
    and adapter "b"). The re-runs score in the job's process (``scoring_here``)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from scoring_here import without_scoring_process
    from test_lm import hf_reference

    import slora_batch.engine.parallel.data_parallel as data_parallel
    from slora_batch.eval.report import (
        OLD_RESULTS_DIR,
        OLD_RESULTS_FILE,
        RESULTS_DIR,
        RESULTS_FILE,
    )
    from slora_batch.jobs.config import load_jobs
    from slora_batch.jobs.outdir import part_files
    from slora_batch.runner import run_job

    model_dir, adapters, tasks_dir = eval_setup
    job = {"name": "sweep", "model": str(model_dir), "adapters": str(adapters), "output": "out",
           "part_rows": 6, "eval": {"tasks": TASKS, "include_path": str(tasks_dir),
                                    "bootstrap_iters": 0},
           "engine": {"device": "cpu", "dtype": "float32", "num_pages": 16384,
                      "max_num_seqs": 4}}  # fmt: skip
    (tmp_path / "jobs.yaml").write_text(yaml.safe_dump({"jobs": [job]}))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", KILL, str(tmp_path / "jobs.yaml")], env=env,
                          timeout=600, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert len(part_files(tmp_path / "out")) == 2
    (pid,) = [int(line.split()[-1]) for line in proc.stdout.splitlines()
              if line.startswith("scoring process")]  # fmt: skip
    assert gone(pid, 120), "the scoring process outlived the job's process"
    (config,) = load_jobs(tmp_path / "jobs.yaml")
    without_scoring_process(monkeypatch)  # the re-runs score every adapter here
    built = []
    open_engine = data_parallel.open_engine
    monkeypatch.setattr(data_parallel, "open_engine",
                        lambda *a, **k: built.append(1) or open_engine(*a, **k))  # fmt: skip
    summary = run_job(config)
    assert summary.rows_skipped > 0 and summary.rows_this_run > 0  # only the rest was computed
    assert len(built) == 1  # one engine for every adapter and task
    names = [None, "a", "b", "c", "d"]
    assert {r["adapter"] for r in summary.eval_results} == set(names)
    out = tmp_path / "out"
    rows = pq.read_table(out / RESULTS_FILE).to_pylist()
    assert rows == summary.eval_results
    parts = pq.read_table([p for _, p in part_files(out)]).to_pylist()
    # the directory read as a dataset is the job's rows: the requests and results files are not
    assert pq.read_table(out).num_rows == len(parts)
    per_adapter = {a: sum((r["adapter"] or None) == a for r in parts) for a in names}
    assert {r["adapter"] for r in parts} == {"", "a", "b", "c", "d"}  # "": the base model
    assert len(set(per_adapter.values())) == 1 and summary.stats["rows"] == len(parts)
    assert len({(r["adapter"], str(r["id"])) for r in parts}) == len(parts)  # each once
    for name in (None, "b"):  # "b": test_lm.py compares its reference too (computed once)
        ref = hf_reference(model_dir, adapters / name if name else None, tasks_dir)
        for task in TASKS:
            for row in (r for r in rows if r["adapter"] == name and r["task"] == task):
                want = ref["results"][task][f"{row['metric']},none"]
                assert math.isclose(row["value"], want, rel_tol=1e-5), (name, task, row)
    texts = {p.name: p.read_bytes() for p in (out / RESULTS_DIR).iterdir()}
    # the previous layout's names (read as data by dataset readers): replaced by the re-run
    (out / RESULTS_FILE).rename(out / OLD_RESULTS_FILE)
    (out / RESULTS_DIR).rename(out / OLD_RESULTS_DIR)
    again = run_job(config)  # complete: nothing runs, the same results, all scored here
    assert again.complete_already and len(built) == 1 and again.eval_results == rows
    assert {p.name: p.read_bytes() for p in (out / RESULTS_DIR).iterdir()} == texts
    assert len(texts) == len(names)
    assert not (out / OLD_RESULTS_FILE).exists() and not (out / OLD_RESULTS_DIR).exists()
    assert pq.read_table(out).num_rows == len(parts)


def gone(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` ends (or is a zombie) within ``seconds``."""
    import time
    from pathlib import Path

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return True
        if "\nState:\tZ" in status:
            return True
        time.sleep(0.2)
    return False


def test_validate_builds_the_requests_without_touching_the_output(tmp_path, eval_setup):
    """An eval job that never ran validates: its requests are built in a temporary directory,
    checked like any input, and no output directory appears."""
    from slora_batch.jobs.config import load_jobs
    from slora_batch.runner import validate_job

    model_dir, adapters, tasks_dir = eval_setup
    job = {"name": "sweep", "model": str(model_dir), "adapters": str(adapters), "output": "out",
           "eval": {"tasks": TASKS, "include_path": str(tasks_dir), "limit": 2},
           "engine": {"device": "cpu", "dtype": "float32"}}  # fmt: skip
    (tmp_path / "jobs.yaml").write_text(yaml.safe_dump({"jobs": [job]}))
    (config,) = load_jobs(tmp_path / "jobs.yaml")
    report = validate_job(config)
    assert not report.problems, report.problems
    assert report.sweep is not None and len(report.sweep) == 5  # base + 4 adapters
    assert report.rows_total > 0 and report.rows_checked > 0
    assert not (tmp_path / "out").exists()


def test_adapters_share_the_built_instances_and_rendered_documents(eval_setup):
    """Every adapter's evaluate gets the instances built once, emptied of the last answers, and
    each document's templates rendered once (a caller mutating a returned list changes no
    later answer)."""
    from slora_batch.eval.tasks import (
        build_requests,
        load_tasks,
        reuse_doc_templates,
        reuse_instances,
    )
    from slora_batch.jobs.eval_keys import EvalConfig

    _, _, tasks = eval_setup
    loaded = load_tasks(EvalConfig(tasks=["tiny_mc"], include_path=str(tasks)))
    build_requests(loaded, None)
    task = loaded["tasks"]["tiny_mc"]
    built = list(task.instances)
    built[0].resps.append((-1.0, False))
    reuse_instances(loaded)
    task.build_all_requests(limit=None, rank=0, world_size=1)
    assert task.instances == built and all(i.resps == [] for i in task.instances)

    calls = []
    render = type(task).doc_to_choice.__get__(task)
    task.doc_to_choice = lambda doc, *a, **k: calls.append(doc) or render(doc, *a, **k)
    reuse_doc_templates(loaded)
    doc = next(iter(task.eval_docs))
    first = task.doc_to_choice(doc)
    first.append("mutated by a caller")
    assert task.doc_to_choice(dict(doc)) == render(doc) and len(calls) == 1
