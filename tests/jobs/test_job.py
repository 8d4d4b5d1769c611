"""Job file loading: strict keys at every level, defaults merge, paths, fan-out."""

from __future__ import annotations

from pathlib import Path

import pytest

from slora_batch.engine.config import ConfigError, EngineConfig, SamplingConfig
from slora_batch.jobs.check import adapter_names, fanout_adapters
from slora_batch.jobs.config import JobConfig, load_jobs


def write(tmp_path: Path, text: str, name: str = "jobs.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


MINIMAL = """
jobs:
  - name: sample
    model: smollm2-135m-instruct
    input: rows.jsonl
    output: out/sample
"""


def test_minimal_job_defaults(tmp_path):
    (job,) = load_jobs(write(tmp_path, MINIMAL))
    assert job.name == "sample"
    assert job.model == "smollm2-135m-instruct"
    assert job.adapters is None
    assert job.sampling == SamplingConfig()
    assert job.engine == EngineConfig()
    assert job.columns == {
        "id": "id",
        "adapter": "adapter",
        "prompt": "prompt",
        "messages": "messages",
        "prompt_token_ids": "prompt_token_ids",
        "continuation": "continuation",
        "choices": "choices",
        "continuation_token_ids": "continuation_token_ids",
        "choices_token_ids": "choices_token_ids",
        "answer": "answer",
    }
    assert (job.fanout, job.window, job.part_rows) == (None, 8192, 4096)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("defaultz: {}\njobs: []", "jobs.yaml: unknown top-level key 'defaultz'"),
        (
            "jobs:\n  - {name: sample, model: m, input: a.jsonl, output: o, windw: 3}",
            "jobs.yaml: job 'sample': unknown key 'windw' (did you mean 'window'?)",
        ),
        (
            "jobs:\n  - {name: sample, model: m, input: a.jsonl, output: o, sampling: {temprature: 1}}",
            "jobs.yaml: job 'sample': unknown key 'temprature' in sampling",
        ),
        (
            "jobs:\n  - {name: sample, model: m, input: a.jsonl, output: o, engine: {max_seqs: 1}}",
            "jobs.yaml: job 'sample': unknown key 'max_seqs' in engine",
        ),
        (
            "jobs:\n  - {name: sample, model: m, input: a.jsonl, output: o, columns: {text: t}}",
            "jobs.yaml: job 'sample': unknown key 'text' in columns",
        ),
        (
            "defaults: {sampling: {top: 1}}\njobs:\n  - {model: m, input: a.jsonl, output: o}",
            "jobs.yaml: defaults: unknown key 'top' in sampling",
        ),
        (
            "jobs:\n  - {model: m, input: a.jsonl, output: o, engine: {dtype: int8}}",
            "jobs.yaml: job 'jobs-0': engine: dtype must be auto",
        ),
        (
            "jobs:\n  - {model: m, output: o}",
            "jobs.yaml: job 'jobs-0': missing required key 'input'",
        ),
        ("jobs:\n  - {input: a.jsonl, output: o}", "missing required key 'model'"),
        ("jobs: []", "'jobs' must be a non-empty list"),
        (
            "jobs:\n  - {model: m, input: a.jsonl, output: o, window: 0}",
            "window must be an integer >= 1",
        ),
        (
            "jobs:\n  - {name: a, model: m, input: a.jsonl, output: o}\n"
            "  - {name: a, model: m, input: a.jsonl, output: p}",
            "jobs 'a' and 'a' have the same name",
        ),
        (
            "jobs:\n  - {name: a, model: m, input: a.jsonl, output: o}\n"
            "  - {name: b, model: m, input: a.jsonl, output: o}",
            "jobs 'a' and 'b' have the same output",
        ),
        ("jobs: [", "jobs.yaml: invalid YAML"),
    ],
)
def test_config_errors_name_key_and_job(tmp_path, text, expected):
    with pytest.raises(ConfigError) as info:
        load_jobs(write(tmp_path, text))
    assert expected in str(info.value)


def test_defaults_deep_merge(tmp_path):
    text = """
defaults:
  model: smollm2-135m-instruct
  sampling: {max_new_tokens: 32, temperature: 0.7}
  engine: {device: cpu, dtype: float32}
  columns: {prompt: question}
  part_rows: 10
jobs:
  - input: a.jsonl
    output: out/a
    sampling: {temperature: 0.0}
    columns: {id: key}
  - name: second
    input: b.jsonl
    output: out/b
    engine: {max_num_seqs: 4}
    part_rows: 20
"""
    first, second = load_jobs(write(tmp_path, text, "sweep.yaml"))
    assert first.name == "sweep-0" and second.name == "second"
    assert first.sampling.max_new_tokens == 32 and first.sampling.temperature == 0.0
    assert second.sampling.temperature == 0.7
    assert first.engine.device == "cpu" and first.engine.max_num_seqs == "auto"
    assert second.engine.dtype == "float32" and second.engine.max_num_seqs == 4
    assert first.columns["prompt"] == "question" and first.columns["id"] == "key"
    assert second.columns["id"] == "id" and second.columns["prompt"] == "question"
    assert (first.part_rows, second.part_rows) == (10, 20)


def test_relative_paths_resolve_against_job_file(tmp_path, monkeypatch):
    jobs_dir = tmp_path / "conf"
    jobs_dir.mkdir()
    (jobs_dir / "models" / "tiny").mkdir(parents=True)
    (jobs_dir / "ad" / "a").mkdir(parents=True)  # a relative path that is no directory: a Hub name
    text = """
jobs:
  - model: models/tiny
    adapters: adapters
    input: data/*.jsonl
    output: /abs/out
  - model: smollm2-135m-instruct
    adapters: {a: ad/a, b: /x/b, c: org/hub-adapter@v1, d: ./ad/d}
    input: rows.parquet
    output: out
  - model: org/hub-model
    input: rows.parquet
    output: out2
"""
    monkeypatch.chdir(tmp_path)  # the working directory must not matter
    first, second, third = load_jobs(write(jobs_dir, text))
    base = jobs_dir.resolve()
    assert first.model == str(base / "models/tiny")
    assert first.adapters == str(base / "adapters")
    assert first.input == str(base / "data/*.jsonl")
    assert first.output == "/abs/out"
    assert second.model == "smollm2-135m-instruct"
    assert second.adapters == {
        "a": str(base / "ad/a"), "b": "/x/b", "c": "org/hub-adapter@v1", "d": str(base / "ad/d")
    }  # fmt: skip
    assert second.output == str(base / "out")
    assert third.model == "org/hub-model"


def test_fanout_forms(tmp_path):
    adapters = tmp_path / "adapters"
    for name in ("shout", "calm"):
        (adapters / name).mkdir(parents=True)
        (adapters / name / "adapter_config.json").write_text("{}")
    (adapters / "README.md").write_text("files are not adapters")
    common = {"name": "j", "model": "m", "input": "i.jsonl", "output": "o"}
    job = JobConfig(**common, adapters=str(adapters), fanout="all")
    assert adapter_names(job.adapters) == ["calm", "shout"]
    assert fanout_adapters(job) == [None, "calm", "shout"]
    job = JobConfig(**common, adapters=str(adapters), fanout=["shout", ""])
    assert job.fanout == ["shout", None]
    assert fanout_adapters(job) == ["shout", None]
    assert fanout_adapters(JobConfig(**common)) is None
    with pytest.raises(ConfigError, match="fanout names adapter 'loud', not found"):
        fanout_adapters(JobConfig(**common, adapters=str(adapters), fanout=["loud"]))
    with pytest.raises(ConfigError, match="lists an adapter twice"):
        JobConfig(**common, adapters={"a": "p"}, fanout=["", None])
    with pytest.raises(ConfigError, match="not in adapters"):
        JobConfig(**common, adapters={"a": "p"}, fanout=["b"])
    with pytest.raises(ConfigError, match="has no adapters"):
        JobConfig(**common, fanout=["a"])
    with pytest.raises(ConfigError, match="fanout must be"):
        JobConfig(**common, fanout="some")


def test_fanout_from_yaml(tmp_path):
    text = """
jobs:
  - name: sweep
    model: smollm2-135m-instruct
    adapters: {a: a, b: b}
    input: rows.jsonl
    output: out
    fanout: [null, a, b]
"""
    (job,) = load_jobs(write(tmp_path, text))
    assert fanout_adapters(job) == [None, "a", "b"]


def test_columns_validation():
    common = {"name": "j", "model": "m", "input": "i.jsonl", "output": "o"}
    with pytest.raises(ConfigError, match="two keys to one input column"):
        JobConfig(**common, columns={"prompt": "text", "messages": "text"})
    with pytest.raises(ConfigError, match="columns.id must be a non-empty string"):
        JobConfig(**common, columns={"id": ""})


def test_keep_columns_and_part_seconds(tmp_path):
    common = {"name": "j", "model": "m", "input": "i.jsonl", "output": "o"}
    job = JobConfig(**common)
    assert (job.keep_columns, job.part_seconds) == (None, 30.0)
    assert JobConfig(**common, keep_columns="all").keep_columns == "all"
    assert JobConfig(**common, keep_columns=["label", "task"]).keep_columns == ["label", "task"]
    # a name the output has is kept as "input_<name>" (``scan.kept_name``), not refused
    assert JobConfig(**common, keep_columns=["text"]).keep_columns == ["text"]
    assert JobConfig(**common, part_seconds=2).part_seconds == 2.0
    for keep, message in (
        ([], "keep_columns must be 'all' or a non-empty list of input column names"),
        ("label", "keep_columns must be 'all' or a non-empty list"),
        (["a", "a"], "keep_columns lists a column twice"),
        (["key"], "keep_columns: 'key' is the id or adapter column, already in the output"),
    ):
        with pytest.raises(ConfigError, match=message):
            JobConfig(**common, keep_columns=keep, columns={"id": "key"})
    for seconds in (0, -1, True, "30"):
        with pytest.raises(ConfigError, match="part_seconds must be a number > 0"):
            JobConfig(**common, part_seconds=seconds)
    text = MINIMAL + "    keep_columns: [label]\n    part_seconds: 5\n"
    (job,) = load_jobs(write(tmp_path, text))
    assert (job.keep_columns, job.part_seconds) == (["label"], 5.0)


def test_an_eval_job_loads_without_lm_eval_and_runs_only_through_the_runner(tmp_path):
    """The ``eval:`` section is the job file's (``jobs/eval_keys.py``): the job loads with its
    input the requests file in its output; the job tool refuses to run it as plain rows (its
    input is built and scored by the sweep, which ``slora_batch.runner`` plugs in), and writes
    nothing."""
    from slora_batch.jobs.check import JobError
    from slora_batch.jobs.eval_keys import REQUESTS_FILE
    from slora_batch.jobs.run import run_job

    text = "jobs:\n  - {name: e, model: m, output: out, eval: {tasks: [t], limit: 2}}\n"
    (job,) = load_jobs(write(tmp_path, text))
    assert job.eval.tasks == ["t"] and job.fanout == "all"
    assert job.input == str(tmp_path / "out" / REQUESTS_FILE)
    with pytest.raises(JobError, match=r"job 'e' has an eval section: .*slora_batch\.runner"):
        run_job(job)
    assert not (tmp_path / "out").exists()
