"""The ``slora-batch`` command: help, run (summary, outputs, samples), --quiet, --job, validate,
job-level errors as one message without a traceback, and kill -9 mid-run then resume."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_jobrun import (
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
from test_unattended_kill import killed_run
from typer.testing import CliRunner

from cli import app
from slora_batch.jobs.outdir import read_success
from slora_batch.jobs.run import run_job

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}  # wide enough that rich wraps no message


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, sample_model_dir):
    return build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def test_help_explains_every_option():
    top = invoke("--help")
    assert top.exit_code == 0
    assert all(command in top.output for command in ("run", "validate", "bench"))
    run = invoke("run", "--help").output
    for option, words in (
        ("--job", "Run only the job with this name"),
        ("--overwrite", "start over"),
        ("--quiet", "nothing but errors"),
        ("--verbose", "debug messages"),
        ("--progress-every", "not a terminal"),
    ):
        assert option in run and words in run, option
    assert "JOBS_FILE" in run and "relative to the file" in run
    validate = invoke("validate", "--help").output
    assert "no engine, no weights" in validate and "--job" in validate


def test_run_prints_a_summary_where_the_outputs_are_and_a_few(tmp_path, tiny):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(9))
    result = invoke("run", write_job(tmp_path, tiny))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "job tiny" in out and "per adapter" in out
    assert f"outputs: {tmp_path / 'out'}" in out
    assert "a few outputs" in out and "r0000" in out
    assert "Traceback" not in result.output
    assert read_success(tmp_path / "out")["rows"] == 9

    again = invoke("run", write_job(tmp_path, tiny))  # complete: nothing to do, nothing built
    assert again.exit_code == 0
    assert (
        f"job tiny: complete already (9 rows in {tmp_path / 'out'}); nothing to do" in again.stdout
    )


def test_quiet_prints_nothing(tmp_path, tiny):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(4))
    result = invoke("run", write_job(tmp_path, tiny), "--quiet", "--overwrite")
    assert result.exit_code == 0
    assert result.stdout == "" and result.stderr == ""
    assert read_success(tmp_path / "out")["rows"] == 4


def test_job_option_picks_one_job(tmp_path, tiny):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    base = yaml.safe_load(write_job(tmp_path, tiny).read_text())["jobs"][0]
    jobs = [
        {**base, "name": "first", "output": "out-1"},
        {**base, "name": "second", "output": "out-2"},
    ]
    (tmp_path / "two.yaml").write_text(yaml.safe_dump({"jobs": jobs}))
    result = invoke("run", tmp_path / "two.yaml", "--job", "second", "-q")
    assert result.exit_code == 0
    assert not (tmp_path / "out-1").exists() and read_success(tmp_path / "out-2")["rows"] == 3
    missing = invoke("run", tmp_path / "two.yaml", "--job", "third")
    assert missing.exit_code == 1
    # stderr is not a terminal here: the error is a log line (time, level, logger, message)
    assert missing.stderr.strip().endswith(
        " ERROR slora_batch.cli: no job 'third' (jobs: first, second)"
    )


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"windw": 3}, "error: jobs.yaml: job 'tiny': unknown key 'windw' (did you mean 'window'?)"),
        ({"input": "missing.jsonl"}, "error: job 'tiny': input '{dir}/missing.jsonl' does not exist"),
        ({"model": "./missing-model"}, "error: job 'tiny': model '{dir}/missing-model': no such directory"),
        ({"limit": 0}, "error: jobs.yaml: job 'tiny': limit must be an integer >= 1 or null, got 0"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("command", ["run", "validate"])
def test_a_bad_job_fails_with_one_message(tmp_path, tiny, monkeypatch, command, keys, message):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    forbid_weights(monkeypatch)
    result = invoke(command, write_job(tmp_path, tiny, **keys))
    assert result.exit_code == 1
    logged = " ERROR slora_batch.cli: " + message.format(dir=tmp_path).removeprefix("error: ")
    assert result.stderr.strip().endswith(logged), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == "" and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_validate_reports_without_loading_weights(tmp_path, tiny, monkeypatch):
    write_jsonl(
        tmp_path / "rows.jsonl", make_rows(5) + [{"id": "x", "adapter": "nope", "prompt": "hi"}]
    )
    forbid_weights(monkeypatch)
    result = invoke("validate", write_job(tmp_path, tiny))
    assert result.exit_code == 0, result.output
    assert "job tiny: ok" in result.stdout
    assert "2 adapters, ranks [4, 8]" in result.stdout
    assert "input: 1 file, 6 rows; 6 checked; ids: string" in result.stdout
    assert "row problem: " in result.stdout and "line 6: unknown adapter 'nope'" in result.stdout
    assert not (tmp_path / "out").exists()


def test_kill_9_mid_run_then_resume_yields_every_row_once(tmp_path, tiny):
    """A run killed after a few parts, then re-run, ends with exactly the rows (and outputs) of
    an uninterrupted run. The killed run is a process of its own; the re-run needs none."""
    rows = make_rows(64)
    write_jsonl(tmp_path / "rows.jsonl", rows)
    # four rows at a time, committed four to a part: parts appear one by one
    keys = dict(part_rows=4, sampling={"max_new_tokens": 8},
                engine={"device": "cpu", "dtype": "float32", "num_pages": 16384, "max_num_seqs": 4})  # fmt: skip
    job_file = write_job(tmp_path, tiny, **keys)
    # the run kills itself once its second part is committed (test_unattended_kill's driver): a
    # kill from here once the part appeared came after the last row when the run outpaced the test
    killed_run(job_file, "after-part", 2)
    out = tmp_path / "out"
    assert read_success(out) is None
    killed_rows = len(outputs(out))
    assert 8 <= killed_rows < len(rows)

    resumed = invoke("run", job_file, "--quiet")  # the same command, in this process
    assert resumed.exit_code == 0, resumed.output
    assert read_success(out)["rows"] == len(rows)

    reference = run_job(load_job(tmp_path, tiny, output="reference", **keys))
    assert reference.rows_this_run == len(rows)
    got = generated(outputs(out))  # raises when a row appears twice
    assert sorted(i for i, _ in got) == sorted(r["id"] for r in rows)
    assert got == generated(outputs(tmp_path / "reference"))


def test_the_cli_loads_neither_torch_nor_the_bench_to_answer():
    """``--help``, argument errors and job-file errors answer without torch; ``validate``
    (which reads the model's tokenizer) loads no benchmark module."""
    script = (
        "import sys, cli\n"
        "from typer.testing import CliRunner\n"
        "CliRunner().invoke(cli.app, ['--help'])\n"
        "CliRunner().invoke(cli.app, ['validate', 'no-such-file.yaml'])\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "CliRunner().invoke(cli.app, ['validate', 'jobs/sample.yaml'])\n"
        "bench = sorted(m for m in sys.modules if m.startswith('slora_batch.bench'))\n"
        "assert not bench, bench\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("command", ["run", "validate"])
def test_an_unsupported_architecture_is_named_with_the_supported_ones(tmp_path, tiny, command):
    import json

    from slora_batch.engine.models.spec import SUPPORTED_ARCHITECTURES

    write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    other = tmp_path / "gpt2"
    other.mkdir()
    cfg = json.loads((tiny.model / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    result = invoke(command, write_job(tmp_path, tiny, model="./gpt2"))
    assert result.exit_code == 1
    assert "architecture 'GPT2LMHeadModel' is not supported" in result.stderr, result.stderr
    assert f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})" in result.stderr
    assert "Qwen3ForCausalLM" in result.stderr and "Phi3ForCausalLM" in result.stderr
    assert not (tmp_path / "out").exists()
