"""Models and adapters named as on the Hugging Face Hub (``org/name``, ``org/name@rev``), resolved
through a Hugging Face cache built in tmp (``HF_HOME``, blobs and snapshot symlinks as
``huggingface_hub`` writes them) with the network off: the same outputs as local paths, a
revision's own snapshot, every missing name refused at once before any work, a local directory
of the same name first, the manifest's snapshot, and local paths for the engines."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from test_jobrun import (
    PAGES,
    build_tiny,
    forbid_weights,
    generated,
    load_job,
    make_rows,
    one_thread,  # noqa: F401 -- an autouse fixture: these tests run on one thread too
    outputs,
    write_job,
    write_jsonl,
)
from typer.testing import CliRunner

from cli import app
from slora_batch import Engine, EngineConfig, Request
from slora_batch.engine.hub import HubError, locate
from slora_batch.jobs.check import JobError, check_job
from slora_batch.jobs.outdir import MANIFEST_FILE
from slora_batch.jobs.run import run_job
from slora_batch.jobs.validate import validate_job

MAIN, V2 = "a" * 39 + "1", "b" * 39 + "2"  # commit hashes: refs/main and refs/v2


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, sample_model_dir):
    return build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)


def cache_repo(cache: Path, repo_id: str, source: Path, commit: str, ref: str = "main") -> Path:
    """``source``'s files as snapshot ``commit`` of ``repo_id`` in the Hub cache ``cache``
    (content-addressed blobs, relative symlinks), with ``refs/<ref>`` naming it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub(tmp_path, tiny, monkeypatch) -> Path:
    """A cache under ``HF_HOME`` holding org/tiny (the model), org/a (adapter "a" at main,
    adapter "b" at v2) and org/b (adapter "b"); the network off."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf" / "hub"
    cache_repo(cache, "org/tiny", tiny.model, MAIN)
    cache_repo(cache, "org/a", tiny.adapters / "a", MAIN)
    cache_repo(cache, "org/a", tiny.adapters / "b", V2, ref="v2")
    cache_repo(cache, "org/b", tiny.adapters / "b", MAIN)
    return cache


def test_hub_names_resolve_offline_and_give_the_local_paths_outputs(tmp_path, tiny, hub):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(9))
    local = {"a": str(tiny.adapters / "a"), "b": str(tiny.adapters / "b")}
    named = {"a": "org/a", "b": "org/b"}
    reference = run_job(load_job(tmp_path, tiny, adapters=local, output="local"))
    summary = run_job(load_job(tmp_path, tiny, model="org/tiny", adapters=named, output="hub"))
    assert summary.rows_this_run == reference.rows_this_run == 9
    assert summary.error_rows_this_run == 0
    assert generated(outputs(tmp_path / "hub")) == generated(outputs(tmp_path / "local"))
    manifest = json.loads((tmp_path / "hub" / MANIFEST_FILE).read_text())
    recorded = manifest["fingerprint"]["hub"]
    assert recorded["model"] == {"name": "org/tiny", "repo": "org/tiny", "commit": MAIN}
    assert recorded["adapter 'b'"] == {"name": "org/b", "repo": "org/b", "commit": MAIN}
    assert "hub" not in json.loads((tmp_path / "local" / MANIFEST_FILE).read_text())["fingerprint"]


def test_a_revision_resolves_its_own_snapshot(hub, tiny):
    located = locate("org/tiny", {"x": "org/a", "y": "org/a@v2", "z": f"org/a@{V2}"})
    assert located.model == hub / "models--org--tiny" / "snapshots" / MAIN
    assert located.adapters["x"] == hub / "models--org--a" / "snapshots" / MAIN
    assert located.adapters["y"] == located.adapters["z"] == hub / "models--org--a/snapshots" / V2
    assert {label: s.commit for label, s in located.snapshots.items()} == {
        "model": MAIN, "adapter 'x'": MAIN, "adapter 'y'": V2, "adapter 'z'": V2
    }  # fmt: skip
    # "y" is adapter b's files: the job checks it as b (rank 8 on every target)
    written = (located.adapters["y"] / "adapter_config.json").read_text()
    assert written == (tiny.adapters / "b" / "adapter_config.json").read_text()


def test_missing_names_are_all_refused_by_name_before_any_work(tmp_path, tiny, hub, monkeypatch):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    adapters = {"a": "org/a", "gone": "org/nope", "late": "org/a@v9", "bad": "org/bad--name"}
    job = load_job(tmp_path, tiny, model="org/missing", adapters=adapters)
    forbid_weights(monkeypatch)
    for attempt in (validate_job, run_job):
        with pytest.raises(JobError) as caught:
            attempt(job)
        message = str(caught.value)
        assert message.startswith("job 'tiny': 4 names not found"), message
        assert "model 'org/missing' (revision main" in message
        assert "adapter 'gone' 'org/nope' (revision main" in message
        assert "adapter 'late' 'org/a@v9' (revision v9" in message
        assert "adapter 'bad' 'org/bad--name' is no directory and no Hub name" in message
        assert "adapter 'a'" not in message  # cached: not missing
        assert "`huggingface-cli download org/missing`" in message
        assert "`huggingface-cli download org/a --revision v9`" in message
        assert "unset HF_HUB_OFFLINE" in message
    assert not (tmp_path / "out").exists()
    result = CliRunner().invoke(
        app, ["validate", str(write_job(tmp_path, tiny, model="org/missing"))],
        env={"COLUMNS": "200", "NO_COLOR": "1"},
    )  # fmt: skip
    assert result.exit_code == 1
    # stderr is not a terminal: one ERROR line of the log format
    assert " ERROR slora_batch.cli: job 'tiny': 1 name not found" in result.stderr, result.stderr
    assert "model 'org/missing'" in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_a_local_directory_of_the_same_name_wins(tmp_path, tiny, hub):
    shutil.copytree(tiny.model, tmp_path / "org" / "tiny")
    shutil.copytree(tiny.adapters / "b", tmp_path / "org" / "a")  # the cache's org/a is "a"
    write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    plan = check_job(load_job(tmp_path, tiny, model="org/tiny", adapters={"x": "org/a"}))
    assert plan.model_path == tmp_path / "org" / "tiny"
    assert plan.sources == {"x": str(tmp_path / "org" / "a")}
    assert plan.snapshots == {}
    assert [(a.name, a.rank) for a in plan.adapters] == [("x", 8)]  # b's rank, not a's 4


def test_a_resume_resolving_to_another_snapshot_is_refused(tmp_path, tiny, hub):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    job = load_job(tmp_path, tiny, model="org/tiny", adapters={"a": "org/a", "b": "org/b"})
    assert run_job(job).rows_this_run == 3
    (hub / "models--org--a" / "refs" / "main").write_text(V2)  # a newer download of org/a
    with pytest.raises(JobError, match=rf"adapter 'a' 'org/a' resolves to snapshot {V2} now, "
                       rf"the rows were made from {MAIN} \(pin it with org/a@{MAIN}\)"):  # fmt: skip
        run_job(job)
    pinned = load_job(
        tmp_path, tiny, model="org/tiny", adapters={"a": f"org/a@{MAIN}", "b": "org/b"}
    )
    again = run_job(pinned)
    assert again.complete_already and again.rows_this_run == 0


def test_engines_get_local_paths(tmp_path, tiny, hub, monkeypatch):
    """The job resolves once: the engine (and its data-parallel workers, tensor-parallel ranks)
    is handed the snapshots' directories, never a Hub name."""
    import slora_batch.engine.parallel.data_parallel as data_parallel

    handed = []

    def record(model, adapters, *rest):
        handed.append((model, adapters))
        raise RuntimeError("recorded")

    monkeypatch.setattr(data_parallel, "open_engine", record)
    write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    job = load_job(tmp_path, tiny, model="org/tiny", adapters={"a": "org/a@v2"})
    with pytest.raises(RuntimeError, match="recorded"):
        run_job(job)
    ((model, adapters),) = handed
    assert Path(model) == hub / "models--org--tiny" / "snapshots" / MAIN
    assert adapters == {"a": hub / "models--org--a" / "snapshots" / V2}


def test_the_engine_resolves_hub_names_itself(tiny, hub):
    config = EngineConfig(device="cpu", dtype="float32", num_pages=PAGES)
    requests = [Request(id=i, adapter=[None, "a", "b"][i % 3], prompt=f"the quick fox {i}",
                        max_new_tokens=6) for i in range(6)]  # fmt: skip
    local = Engine(tiny.model, adapters=tiny.adapters, config=config)
    named = Engine("org/tiny", adapters={"a": "org/a", "b": "org/a@v2"}, config=config)
    want = {r.id: r.token_ids for r in local.generate(requests)}
    assert {r.id: r.token_ids for r in named.generate(requests)} == want
    local.close(), named.close()
    with pytest.raises(HubError, match="adapter 'c' 'org/c'"):
        Engine("org/tiny", adapters={"c": "org/c"}, config=config)


def test_an_uncached_name_is_downloaded_when_the_network_is_allowed(hub, tiny, monkeypatch):
    """Cache first; then, with HF_HUB_OFFLINE unset, a download of the engine's files only; a
    download that fails makes the name missing (the Hub is played by a stand-in here)."""
    import huggingface_hub

    from slora_batch.engine.hub import ALLOW_PATTERNS

    real, downloads = huggingface_hub.snapshot_download, []

    def stand_in(repo_id, *, local_files_only=False, **kwargs):
        if not local_files_only:
            downloads.append((repo_id, kwargs["revision"], kwargs["allow_patterns"]))
            if repo_id != "org/new":
                raise OSError(f"404 Client Error: {repo_id} not found")
            cache_repo(Path(kwargs["cache_dir"]), repo_id, tiny.adapters / "a", V2)
        return real(repo_id, local_files_only=True, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", stand_in)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    located = locate("org/tiny", {"new": "org/new"})
    assert located.adapters["new"] == hub / "models--org--new" / "snapshots" / V2
    assert downloads == [("org/new", None, ALLOW_PATTERNS)]  # org/tiny came from the cache
    with pytest.raises(HubError) as caught:
        locate("org/tiny", {"new": "org/new", "x": "org/absent@v3"})
    message = str(caught.value)
    assert "adapter 'x' 'org/absent@v3' (revision v3: download failed: OSError: 404" in message
    assert "`huggingface-cli download org/absent --revision v3`" in message
    assert "HF_HUB_OFFLINE" not in message and "'new'" not in message


def test_validate_names_the_snapshot(tmp_path, tiny, hub, monkeypatch):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(4))
    forbid_weights(monkeypatch)
    job = load_job(tmp_path, tiny, model="org/tiny", adapters={"a": "org/a", "b": "org/b"})
    report = validate_job(job)
    assert report.model.startswith(f"org/tiny@{MAIN[:12]} (") and str(hub) in report.model
    assert [(a.name, a.rank) for a in report.adapters] == [("a", 4), ("b", 8)]
    assert report.problems == [] and not (tmp_path / "out").exists()
