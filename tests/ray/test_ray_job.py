"""The job tool on a local Ray instance (2 engine actors, the tiny model, 50 adapters): the same
rows as the single-process run, exactly once across a killed busy actor (its unit retried) and a
killed driver whose orphaned actors commit late; a starved pipeline fails with the stage named;
the engine counters collected; and the ``generate`` Ray Data stage."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from factory import make_adapter  # noqa: E402
from test_jobrun import build_tiny, outputs, write_job  # noqa: E402

from slora_batch.jobs import manifest  # noqa: E402
from slora_batch.jobs.config import load_jobs  # noqa: E402
from slora_batch.jobs.outdir import part_files, read_success  # noqa: E402
from slora_batch.jobs.run import run_job  # noqa: E402
from slora_batch.jobs.stats import read_stats  # noqa: E402
from slora_batch.ray import RaySettings, generate, run_ray_job  # noqa: E402
from slora_batch.ray import job as ray_job  # noqa: E402
from slora_batch.ray.fence import part_run  # noqa: E402

ADAPTERS = 50
ROWS = 60
WORDS = ["the", "a", "dog", "fox", "seven", "hex"]
SETTINGS = dict(replicas=2, buckets=4, block_rows=10)  # 6 blocks x 4 buckets: many small parts
KEYS = dict(sampling={"max_new_tokens": 3}, part_rows=10)
pytestmark = pytest.mark.usefixtures("local_ray")  # conftest.py: the Ray instance the modules share


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, sample_model_dir):
    """The tiny model with 50 adapters of rank 2 (built once)."""
    tiny = build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)
    adapters = tmp_path_factory.getbasetemp() / "fifty"
    if not adapters.exists():
        make_adapters(tiny.model, adapters)
    tiny.adapters = adapters
    return tiny


def make_adapters(model_dir: Path, root: Path) -> None:
    """ad00 to ad49 on q and v: PEFT makes ad00, the others are its files with other random
    weights, drawn as ``make_adapter`` draws them (a PEFT adapter costs a model load each)."""
    import torch
    from safetensors.torch import load_file, save_file

    first = make_adapter(model_dir, root / "ad00", 2, ["q_proj", "v_proj"], 4, False, seed=0)
    weights = load_file(first / "adapter_model.safetensors")
    for i in range(1, ADAPTERS):
        generator = torch.Generator().manual_seed(i)
        drawn = {}
        for name, weight in weights.items():  # A: [rank, in], B: [out, rank]
            std = 1.0 / weight.shape[1] ** 0.5 if "lora_A" in name else 0.5 / 2**0.5
            drawn[name] = torch.randn(weight.shape, generator=generator) * std
        shutil.copytree(first, root / f"ad{i:02d}")
        save_file(drawn, root / f"ad{i:02d}" / "adapter_model.safetensors")


def write_rows(directory: Path) -> None:
    """60 one-word rows over 50 adapters and the base model, an unknown adapter, bad rows."""
    lines = []
    for i in range(ROWS):
        adapter = None if i % 51 == 50 else f"ad{i % 51:02d}"
        lines.append(json.dumps({"id": i, "adapter": adapter, "prompt": WORDS[i % len(WORDS)]}))
    lines[7] = json.dumps({"id": 7, "adapter": "no-such-adapter", "prompt": "the"})
    lines[20] = '{"id": 20, "prompt": '  # malformed JSON
    lines[33] = json.dumps({"id": 33, "adapter": "ad01", "prompt": ""})
    (directory / "rows.jsonl").write_text("\n".join(lines) + "\n")


def job_dir(directory: Path, tiny) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    write_rows(directory)
    write_job(directory, tiny, **KEYS)
    return directory


def rows_of(out: Path) -> dict[tuple, tuple]:
    """Output rows by (id, adapter, source); fails when one is there twice."""
    rows = outputs(out)
    keyed = {(r["id"], r["adapter"], r["source"]): r for r in rows}
    assert len(keyed) == len(rows), "an output row appears twice"
    return {
        k: (r["token_ids"], r["text"], r["finish_reason"], r["error"]) for k, r in keyed.items()
    }


@pytest.fixture(scope="module")
def reference_out(tmp_path_factory, tiny) -> Path:
    """The single-process run's output directory."""
    directory = job_dir(tmp_path_factory.mktemp("reference"), tiny)
    (job,) = load_jobs(directory / "jobs.yaml")
    run_job(job)
    return directory / "out"


@pytest.fixture(scope="module")
def reference(reference_out) -> dict:
    return rows_of(reference_out)


def test_two_actors_write_the_rows_of_the_single_process_run(tmp_path, tiny, reference):
    """Input and output given as file:// URIs (the killed-actor test takes another filesystem): they name
    the local path, where the rows land as the single-process tool's would."""
    (job,) = load_jobs(job_dir(tmp_path, tiny) / "jobs.yaml")
    job.input, job.output = f"file://{tmp_path}/rows.jsonl", f"file://{tmp_path}/out"
    summary = run_ray_job(job, RaySettings(**SETTINGS))
    out = tmp_path / "out"
    assert rows_of(out) == reference
    assert len(reference) == ROWS and summary.stats["rows"] == ROWS
    errors = {k[0]: v[3] for k, v in reference.items() if v[2] == "error"}
    assert set(errors) == {7, None, 33}  # unknown adapter, malformed line (no id), empty prompt
    assert "unknown adapter 'no-such-adapter'" in errors[7]
    assert read_success(out)["rows"] == ROWS
    assert {"_job.json", "_stats.parquet", "_ray.json"} <= {p.name for p in out.iterdir()}
    actors = json.loads((out / "_ray.json").read_text())["actors"]
    assert sum(a["rows"] for a in actors) == ROWS and all(a["adapters"] >= 1 for a in actors)
    again = run_ray_job(job, RaySettings(**SETTINGS))  # complete: nothing runs
    assert again.complete_already and again.rows_this_run == 0


def slow_first_commit_fs(marks: Path):
    """The local disk as a non-local filesystem whose first part commit, in whichever actor
    makes it, leaves ``marks/<part>@<pid>`` and waits before writing: that actor is busy with
    that unit, its part not written yet."""
    import fsspec
    import pyarrow.fs as pafs

    class SlowFirstCommit(pafs.FSSpecHandler):  # local: pickled by value into the actors
        def open_output_stream(self, path, metadata):
            name = Path(path).name
            if name.startswith("part-") and not any(marks.iterdir()):
                (marks / f"{name}@{os.getpid()}").touch()
                time.sleep(60)
            return super().open_output_stream(path, metadata)

    marks.mkdir()
    return pafs.PyFileSystem(SlowFirstCommit(fsspec.filesystem("file")))


def test_a_killed_busy_actor_is_restarted_its_unit_retried_no_row_twice(
    tmp_path, tiny, reference, caplog
):
    """On a filesystem other than the local disk (``slow_first_commit_fs``: the runner takes
    the non-local path, no flock, no rename, no ``os`` calls): the killed actor's unit is
    retried by its restart; a complete job does not run again; a lost part is made again by the
    next run, and only its rows."""
    (job,) = load_jobs(job_dir(tmp_path, tiny) / "jobs.yaml")
    out, marks, killed = tmp_path / "out", tmp_path / "marks", []
    filesystem = slow_first_commit_fs(marks)

    def kill_the_busy_actor():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not any(marks.iterdir()):
            time.sleep(0.05)
        for mark in marks.iterdir():
            part, pid = mark.name.split("@")
            assert not (out / part).exists()
            os.kill(int(pid), signal.SIGKILL)
            killed.append((part, int(pid)))

    def run():  # one actor, killed in its unit, restarted by Ray Data, the unit retried
        settings = RaySettings(**{**SETTINGS, "replicas": 1})
        return run_ray_job(job, settings, filesystem=filesystem)

    killer = threading.Thread(target=kill_the_busy_actor)
    killer.start()
    with caplog.at_level("WARNING", logger="slora_batch.jobs.lock"):
        summary = run()
    killer.join()
    assert killed, "no engine actor was caught in the middle of a unit"
    (part, pid), actors = killed[0], json.loads((out / "_ray.json").read_text())["actors"]
    assert (out / part).exists(), "the killed actor's unit was not retried"
    assert not any(a["actor"].endswith(f":{pid}") for a in actors)  # its restart made it
    assert summary.stats["rows"] == ROWS
    assert rows_of(out) == reference
    assert "is not locked" in caplog.text
    names = {p.name for p in out.iterdir()}
    assert {"_job.json", "_stats.parquet", "_ray.json", "_SUCCESS"} <= names
    assert not any(n.startswith(".") for n in names)  # no flock file, no temp files
    assert read_success(out)["rows"] == ROWS

    again = run()
    assert again.complete_already and again.rows_this_run == 0

    import pyarrow.parquet as pq

    number, victim = part_files(out)[len(part_files(out)) // 2]
    missing = pq.read_metadata(victim).num_rows
    victim.unlink()
    (out / "_SUCCESS").unlink()  # as in the single-process tool, _SUCCESS says "complete"
    resumed = run()
    assert not resumed.complete_already
    assert resumed.rows_this_run == missing and resumed.rows_skipped == ROWS - missing
    assert rows_of(out) == reference and read_success(out)["rows"] == ROWS
    regenerated = [p for _, p in part_files(out) if part_run(p.name) == part_run(victim.name) + 1]
    assert [pq.read_metadata(p).num_rows for p in regenerated] == [missing]  # by the next run


# A driver of its own joins the session's Ray instance, as a second job on a cluster does; its
# one actor holds its fourth part back (Ray Data hands the driver a partition's parts only once
# the partition is done): the test kills the run once three parts are on disk, which, without
# the hold, a run that outpaced the test had passed (a loaded machine). Ray ends the actors of
# a driver that died.
DRIVER = """
import os, sys, time
import fsspec
import pyarrow.fs as pafs
import ray
from slora_batch.jobs.config import load_jobs
from slora_batch.ray import RaySettings, run_ray_job

class HoldAfterThree(pafs.FSSpecHandler):  # the local disk; pickled by value into the actor
    parts = 0
    def open_output_stream(self, path, metadata):
        if os.path.basename(path).startswith("part-"):
            HoldAfterThree.parts += 1
            if HoldAfterThree.parts > 3:
                time.sleep(600)
        return super().open_output_stream(path, metadata)

ray.init(address=sys.argv[2], log_to_driver=False)
(job,) = load_jobs(sys.argv[1])
filesystem = pafs.PyFileSystem(HoldAfterThree(fsspec.filesystem("file")))
run_ray_job(job, RaySettings(replicas=1, buckets=4, block_rows=10), filesystem=filesystem)
"""


def late_part(out: Path, reference_out: Path, committed: dict, like: Path) -> Path:
    """A part an orphaned actor of the killed run commits after the next run started: rows not
    committed yet (the next run makes them too), under a name of the killed run's kind."""
    import pyarrow.parquet as pq

    table = pq.read_table(sorted(reference_out.glob("part-*.parquet")))
    keys = list(zip(table["id"].to_pylist(), table["adapter"].to_pylist(), strict=True))
    pending = [i for i, k in enumerate(keys) if not any(k == c[:2] for c in committed)][:5]
    digits = like.name.removeprefix("part-").removesuffix(".parquet")
    name = f"part-{digits[:-1]}{(int(digits[-1]) + 5) % 10}.parquet"  # the same run, another unit
    pq.write_table(table.take(pending), out / name)
    return out / name


def test_a_killed_driver_rerun_removes_late_parts_and_resumes(
    tmp_path, tiny, reference, reference_out, monkeypatch, local_ray
):
    directory = job_dir(tmp_path, tiny)
    out = directory / "out"
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(directory / "jobs.yaml"), local_ray],
        start_new_session=True,  # the driver and any process it started: one group
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(part_files(out)) < 3 and driver.poll() is None:
            time.sleep(0.05)
        assert driver.poll() is None, "the driver finished before it could be killed"
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
    committed = rows_of(out)
    assert 0 < len(committed) < ROWS and read_success(out) is None
    killed_parts = {p.name for _, p in part_files(out)}
    (job,) = load_jobs(directory / "jobs.yaml")
    late: list[Path] = []

    killed_run = max(part_run(name) for name in killed_parts)

    def orphan_commits_late():  # once the re-run commits, an old actor's part lands too
        deadline = time.monotonic() + 180  # (a part of the killed run's own surviving actors,
        while time.monotonic() < deadline:  # committed before the re-run's fence, is no trigger)
            if any(part_run(p.name) > killed_run for _, p in part_files(out)):
                like = out / sorted(killed_parts)[0]
                late.append(late_part(out, reference_out, committed, like))
                return
            time.sleep(0.02)

    orphan = threading.Thread(target=orphan_commits_late)
    real_remove = ray_job.remove_late_parts

    def remove_once_the_orphan_committed(out_dir, fence):  # the late part lands mid-run, as it
        orphan.join()  # would from a slow actor: not after the run's last look (a race on a
        return real_remove(out_dir, fence)  # loaded machine)

    monkeypatch.setattr(ray_job, "remove_late_parts", remove_once_the_orphan_committed)
    orphan.start()
    # other units than the killed run's (8 adapter buckets, not 4): the rows its parts hold are
    # skipped by row, whichever unit they fall in now; one actor, as the killed run's
    summary = run_ray_job(job, RaySettings(replicas=1, buckets=8, block_rows=10))
    orphan.join()
    assert late, "the re-run committed no part"
    assert not late[0].exists(), "the orphan's late part was kept"
    assert summary.rows_skipped >= len(committed)
    assert summary.rows_skipped + summary.rows_this_run == ROWS
    assert rows_of(out) == reference  # every row once: the late part's rows are the re-run's


def test_a_starved_pipeline_fails_naming_the_starved_stage(tmp_path, tiny):
    (job,) = load_jobs(job_dir(tmp_path, tiny) / "jobs.yaml")

    @ray.remote
    class Holder:  # takes every free CPU: the read tasks cannot start
        def ready(self) -> bool:
            return True

    holder = Holder.options(num_cpus=ray.available_resources()["CPU"]).remote()
    ray.get(holder.ready.remote())
    failures: list[BaseException] = []

    def run() -> None:
        try:
            run_ray_job(job, RaySettings(**SETTINGS, stall_s=3))
        except Exception as exc:
            failures.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout=120)
    ray.kill(holder)
    runner.join(timeout=240)  # a run that hung until now finishes once the CPUs are back
    assert failures, "a starved run did not fail"
    message = str(failures[0])
    assert "MapBatches(read_units)" in message and "starved" in message and "'tiny'" in message


def test_an_interrupted_overwrite_leaves_no_previous_ray_file(tmp_path, tiny, monkeypatch):
    directory = job_dir(tmp_path, tiny)
    (directory / "out").mkdir()
    (directory / "out" / "_ray.json").write_text('{"actors": []}\n')  # a previous run's account
    (job,) = load_jobs(directory / "jobs.yaml")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(manifest, "write_manifest", interrupted)  # interrupted once cleared
    with pytest.raises(KeyboardInterrupt):
        run_ray_job(job, RaySettings(**SETTINGS), overwrite=True)
    assert not (directory / "out" / "_ray.json").exists()


def test_engine_counters_warmup_and_prefix_cache_come_from_the_actors(tmp_path, tiny):
    """Also this run's error rows and token counts in the summary, as the single process gives
    them (error rows compute nothing)."""
    prompt = " ".join(WORDS * 8)  # 48 words: full prefix blocks every row after the first shares
    lines = [json.dumps({"id": i, "adapter": "ad00", "prompt": prompt}) for i in range(6)]
    lines += [json.dumps({"id": 6 + i, "adapter": "nope", "prompt": prompt}) for i in range(4)]
    stats, summaries = {}, {}
    for kind in ("single", "ray"):
        directory = tmp_path / kind
        directory.mkdir()
        (directory / "rows.jsonl").write_text("\n".join(lines) + "\n")
        (job,) = load_jobs(write_job(directory, tiny, **KEYS))
        if kind == "single":
            summaries[kind] = run_job(job)
        else:  # one actor, one unit: the single engine's requests in the same order
            summaries[kind] = run_ray_job(job, RaySettings(replicas=1, buckets=1, block_rows=100))
        stats[kind] = read_stats(directory / "out")[0]
    assert stats["ray"]["warmup_s"] > 0
    assert stats["ray"]["prefix_hit_tokens"] == stats["single"]["prefix_hit_tokens"] > 0
    assert stats["ray"]["tokens_per_s"] * stats["ray"]["engine_s"] == pytest.approx(
        stats["ray"]["completion_tokens"]
    )
    single, ray_run = summaries["single"], summaries["ray"]
    assert ray_run.error_rows_this_run == single.error_rows_this_run == 4
    assert ray_run.prompt_tokens_this_run == single.prompt_tokens_this_run > 0
    assert ray_run.completion_tokens_this_run == single.completion_tokens_this_run > 0


def test_generate_stage_gives_the_job_tool_rows_with_file_uris(tmp_path, tiny, reference):
    lines = (job_dir(tmp_path, tiny) / "rows.jsonl").read_text().splitlines()
    rows = [json.loads(line) for i, line in enumerate(lines) if i != 20]
    for row in rows:
        row["source"] = f"rows.jsonl line {row['id'] + 1}"
    # two blocks: from_items makes one a row by default, and the stage's sort then runs
    # hundreds of tasks (seconds each on a loaded 2-core machine)
    ds = ray.data.from_items([{"adapter": None, **r} for r in rows], override_num_blocks=2)
    result = generate(
        ds,
        str(tiny.model),
        str(tiny.adapters),
        engine={"device": "cpu", "dtype": "float32", "num_pages": 16384},
        sampling={"max_new_tokens": 3},
        replicas=1,  # two actors: test_two_actors_write_the_rows_of_the_single_process_run
        batch_rows=16,
    )
    result.write_parquet(f"file://{tmp_path}/stage")
    got = rows_of_files(sorted((tmp_path / "stage").glob("*.parquet")))
    want = {k: v for k, v in reference.items() if k[0] != 20 and k[0] is not None}
    assert got == want


def rows_of_files(files: list[Path]) -> dict[tuple, tuple]:
    import pyarrow.parquet as pq

    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    keyed = {(r["id"], r["adapter"], r["source"]): r for r in rows}
    assert len(keyed) == len(rows)
    return {
        k: (r["token_ids"], r["text"], r["finish_reason"], r["error"]) for k, r in keyed.items()
    }


@pytest.mark.parametrize("address,given,want", [("local", None, "0"), (None, "5", "5"),
                                                ("ray://head:10001", None, None)])  # fmt: skip
def test_a_local_instance_starts_its_workers_at_this_commands_priority(
    monkeypatch, address, given, want
):
    """Ray starts workers at nice 15 unless told otherwise: a local instance's engine actors
    then lost ~28:1 to any busy process beside them. ``connect`` tells the raylet it starts
    (through its environment) to keep them at nice 0; a user's own setting and a remote
    cluster's are left alone."""
    from slora_batch.ray.job import WORKER_NICENESS, connect

    environ = {k: v for k, v in os.environ.items() if k != WORKER_NICENESS}
    if given is not None:
        environ[WORKER_NICENESS] = given
    monkeypatch.setattr(os, "environ", environ)  # what connect sets stays in the test
    monkeypatch.setattr(ray_job, "_started_here", ray_job._started_here)
    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.append(os.environ.get(WORKER_NICENESS)))
    connect(address)
    assert seen == [want]
