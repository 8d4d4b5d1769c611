"""The job manifest (``manifest.py``, issue 23): a resume compares what the engine settings
resolve to (device kind, dtype, kernel backend) and each file's content digest, reads outputs of
the previous version and records both from then on; and the output directory reads as its rows
alone (issue 24: the stats are ``_stats.parquet``)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch
from test_jobrun import (
    PAGES,
    build_tiny,
    load_job,
    make_rows,
    one_thread,  # noqa: F401 -- an autouse fixture
    write_jsonl,
)

from slora_batch.engine.config import EngineConfig
from slora_batch.engine.resolution import resolve
from slora_batch.jobs import run as jobrun
from slora_batch.jobs.check import check_job
from slora_batch.jobs.manifest import fingerprint, fingerprint_changes
from slora_batch.jobs.outdir import MANIFEST_FILE, SUCCESS_FILE, part_files
from slora_batch.jobs.run import JobError, run_job

AUTO = {"device": "auto", "dtype": "auto", "num_pages": PAGES}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, sample_model_dir):
    return build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)


def interrupted(out) -> None:
    """Leave the output as a kill after its first part would: the rest of the rows pending."""
    for _, path in part_files(out)[1:]:
        path.unlink()
    (out / SUCCESS_FILE).unlink()


def manifest_of(out) -> dict:
    return json.loads((out / MANIFEST_FILE).read_text())


def test_resume_refuses_rows_of_another_resolved_device_and_dtype(tmp_path, tiny, monkeypatch):
    """Issue 23: a job started with device and dtype auto on a CPU (float32) and resumed where a
    GPU is seen (bfloat16, Triton) is refused before an engine is built, naming both; the
    settings written out that resolve the same resume."""
    write_jsonl(tmp_path / "rows.jsonl", make_rows(6))
    run_job(load_job(tmp_path, tiny, engine=AUTO, part_rows=2))
    out = tmp_path / "out"
    assert manifest_of(out)["fingerprint"]["engine"] == {
        "device": "cpu", "dtype": "float32", "backend": "torch"
    }  # fmt: skip
    interrupted(out)
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        patch.setattr(jobrun, "_build_engine", lambda plan: pytest.fail("an engine was built"))
        with pytest.raises(JobError) as refused:
            run_job(load_job(tmp_path, tiny, engine=AUTO, part_rows=2))
    message = str(refused.value)
    assert "engine.dtype resolved float32 on cpu -> bfloat16 on cuda" in message
    assert "engine.device resolved cpu -> cuda" in message
    assert "engine.backend resolved torch -> triton" in message
    assert len(part_files(out)) == 1
    explicit = {**AUTO, "device": "cpu", "dtype": "float32"}  # what auto gave: the same rows
    summary = run_job(load_job(tmp_path, tiny, engine=explicit, part_rows=2))
    assert summary.rows_skipped == 2 and summary.stats["rows"] == 6


def test_an_engine_built_otherwise_than_recorded_is_refused_before_any_row():
    """The safeguard after the build: a data-parallel engine's "cuda x2" against cpu rows."""
    engine = SimpleNamespace(device="cuda x2", dtype=torch.bfloat16)
    recorded = {"device": "cpu", "dtype": "float32", "backend": "torch"}
    with pytest.raises(JobError, match=r"device cpu -> cuda; dtype float32 -> bfloat16"):
        jobrun.check_resolution("j", "out", engine, recorded)
    jobrun.check_resolution(
        "j", "out", SimpleNamespace(device="cpu", dtype=torch.float32), recorded
    )


def test_a_rewrite_of_the_same_size_is_refused_and_a_touch_is_not(tmp_path, tiny):
    """Issue 23: size and mtime alone let a rewritten input of the same size (and a restored
    mtime) resume into rows of the old one. The content digest refuses it; the same content
    touched resumes."""
    rows = make_rows(6)
    write_jsonl(tmp_path / "rows.jsonl", rows)
    run_job(load_job(tmp_path, tiny, part_rows=2))
    out = tmp_path / "out"
    interrupted(out)
    mtime = (tmp_path / "rows.jsonl").stat().st_mtime_ns
    write_jsonl(tmp_path / "rows.jsonl", [*rows[:5], {**rows[5], "id": "r9999"}])
    os.utime(tmp_path / "rows.jsonl", ns=(mtime, mtime))
    with pytest.raises(JobError, match=r"input rows.jsonl changed \(content differs, same size"):
        run_job(load_job(tmp_path, tiny, part_rows=2))
    write_jsonl(tmp_path / "rows.jsonl", rows)  # the same rows again: a newer mtime only
    assert (tmp_path / "rows.jsonl").stat().st_mtime_ns != mtime
    summary = run_job(load_job(tmp_path, tiny, part_rows=2))
    assert (summary.rows_skipped, summary.stats["rows"]) == (2, 6)


def test_a_large_file_touched_is_refused_as_its_middle_was_not_compared(tmp_path):
    big, small = 5 << 20, 1000
    old = {"input": {"big": [big, 1, "d1"], "small": [small, 1, "d2"]}}
    new = {
        "input": {"big": [big, 2, "d1"], "small": [small, 2, "d2"]},
        "model": {"model": "m", "files": {}},
        "adapters": {},
        "sampling": {},
        "job": {},
        "engine": {"device": "cpu", "dtype": "float32", "backend": "torch"},
    }
    old = {**new, **old}
    changes = fingerprint_changes(old, new)
    assert len(changes) == 1 and changes[0].startswith("input big changed (modified ")
    assert "first and last MiB are the same" in changes[0]


def test_an_output_of_the_previous_version_resumes_and_records_the_resolution(tmp_path, tiny):
    """A manifest without the resolution and digests (the previous version's) is compared as
    before (sizes, mtimes, the raw dtype), resumes, and has both recorded afterwards; its
    ``stats.parquet`` is read and replaced by ``_stats.parquet``."""
    write_jsonl(tmp_path / "rows.jsonl", make_rows(6))
    run_job(load_job(tmp_path, tiny, part_rows=2))
    out = tmp_path / "out"
    manifest = manifest_of(out)
    old = manifest["fingerprint"]
    del old["engine"]
    for section in (old["input"], old["model"]["files"], *old["adapters"].values()):
        for name, stat in section.items():
            section[name] = stat[:2]
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    (out / "_stats.parquet").rename(out / "stats.parquet")
    complete = run_job(load_job(tmp_path, tiny, part_rows=2))
    assert complete.complete_already and complete.stats["rows"] == 6  # the old stats, read
    interrupted(out)
    summary = run_job(load_job(tmp_path, tiny, part_rows=2))
    assert (summary.rows_skipped, summary.stats["rows"]) == (2, 6)
    recorded = manifest_of(out)["fingerprint"]
    assert recorded["engine"] == {"device": "cpu", "dtype": "float32", "backend": "torch"}
    assert len(recorded["input"]["rows.jsonl"]) == 3  # size, mtime, digest
    assert not (out / "stats.parquet").exists() and (out / "_stats.parquet").exists()
    assert ds.dataset(out, format="parquet").count_rows() == 6


def test_the_output_directory_reads_as_its_rows(tmp_path, tiny):
    """Issue 24: pyarrow's (and so pandas' and Spark's) directory readers read ``stats.parquet``
    as data rows with null ids. Every file but the parts starts with "_" now."""
    write_jsonl(tmp_path / "rows.jsonl", make_rows(6))
    run_job(load_job(tmp_path, tiny, part_rows=4))
    out = tmp_path / "out"
    table = pq.read_table(out)
    assert table.num_rows == 6
    assert sorted(table["id"].to_pylist()) == [f"r{i:04d}" for i in range(6)]
    assert ds.dataset(out, format="parquet").count_rows() == 6
    pandas = pytest.importorskip("pandas")
    assert len(pandas.read_parquet(out)) == 6


def test_a_ray_run_records_what_its_actors_resolve_to(tmp_path, tiny):
    """Ray's driver may see no GPU while its actors do: ``gpu`` decides device auto."""
    write_jsonl(tmp_path / "rows.jsonl", make_rows(1))
    plan = check_job(load_job(tmp_path, tiny, engine=AUTO))
    assert fingerprint(plan, gpu=True)["engine"] == {
        "device": "cuda", "dtype": "bfloat16", "backend": "triton"
    }  # fmt: skip
    assert fingerprint(plan, gpu=False)["engine"]["dtype"] == "float32"
    half = EngineConfig(device="cuda", dtype="float16", backend="torch")
    assert resolve(half) == {"device": "cuda", "dtype": "float16", "backend": "torch"}
