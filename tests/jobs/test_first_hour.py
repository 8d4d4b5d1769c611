"""A new user's first hour (issue 24): ``validate`` refuses what ``run`` refuses before work and
lists every unknown key and (``--all``) every row problem; progress rates count the tokens
computed and the ETA the work left; messages say no more than is true (error rows compute
nothing, the rest of the error rows, this run's tokens beside the whole output's, what an
interrupted job has committed); a missing adapters directory, an empty input, a job refused for
repeated ids and an over-long prompt each say what they are and leave nothing behind."""

from __future__ import annotations

import logging

import pyarrow.parquet as pq
import pytest
import yaml
from test_jobrun import (
    CONTEXT,
    Tiny,
    build_tiny,
    forbid_weights,
    load_job,
    make_rows,
    one_thread,  # noqa: F401 -- an autouse fixture: these tests run on one thread too
    outputs,
    write_job,
    write_jsonl,
)
from typer.testing import CliRunner

from cli import app
from slora_batch.engine.config import ConfigError
from slora_batch.jobs import progress
from slora_batch.jobs.check import JobError
from slora_batch.jobs.config import load_jobs
from slora_batch.jobs.progress import JobProgress
from slora_batch.jobs.run import run_job
from slora_batch.jobs.validate import validate_job

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, sample_model_dir) -> Tiny:
    return build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def test_every_unknown_key_of_every_job_is_reported_at_once(tmp_path):
    path = tmp_path / "jobs.yaml"
    job = {"name": "j", "model": "m", "input": "in.jsonl", "output": "out"}
    path.write_text(
        yaml.safe_dump(
            {
                "jobs": [
                    {**job, "sampling": {"max_new_token": 8, "temprature": 0.5}},
                    {**job, "name": "k", "output": "o2", "engine": {"data_paralel": 2}},
                ]
            }
        )
    )
    with pytest.raises(ConfigError) as caught:
        load_jobs(path)
    message = str(caught.value)
    for key, job_name, section in (
        ("max_new_token", "j", "sampling"),
        ("temprature", "j", "sampling"),
        ("data_paralel", "k", "engine"),
    ):
        assert f"job {job_name!r}: unknown key {key!r} in {section}" in message, message
    assert "did you mean 'temperature'?" in message and "did you mean 'data_parallel'?" in message


def test_validate_refuses_a_tensor_parallel_size_the_model_does_not_divide(
    tmp_path, tiny, monkeypatch
):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    job = load_job(tmp_path, tiny, engine={"device": "cpu", "tensor_parallel": 3})
    forbid_weights(monkeypatch)
    message = r"job 'tiny': model .*: tensor_parallel 3 must divide the attention heads 4"
    with pytest.raises(JobError, match=message):
        validate_job(job)
    with pytest.raises(JobError, match=message):  # run: the same words, before any work
        run_job(job)
    assert not (tmp_path / "out").exists()


def test_validate_refuses_an_output_run_refuses(tmp_path, tiny):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    run_job(load_job(tmp_path, tiny))
    changed = load_job(tmp_path, tiny, sampling={"max_new_tokens": 5})
    with pytest.raises(JobError) as by_run:
        run_job(changed)
    with pytest.raises(JobError) as by_validate:
        validate_job(changed)
    assert "sampling.max_new_tokens 8 -> 5" in str(by_run.value)
    assert str(by_validate.value) == str(by_run.value)


def test_validate_all_lists_every_row_problem(tmp_path, tiny, monkeypatch):
    bad = [{"id": f"x{i}", "adapter": f"nope{i}", "prompt": "hi"} for i in range(13)]
    write_jsonl(tmp_path / "rows.jsonl", make_rows(2) + bad)
    forbid_weights(monkeypatch)
    path = write_job(tmp_path, tiny)
    cut = invoke("validate", path)
    assert cut.exit_code == 0, cut.output
    assert cut.stdout.count("row problem:") == 10
    assert "... and 3 more row problems (--all lists every one)" in cut.stdout
    full = invoke("validate", path, "--all")
    assert full.exit_code == 0, full.output
    assert full.stdout.count("row problem:") == 13 and "more row problems" not in full.stdout
    assert all(f"unknown adapter 'nope{i}'" in full.stdout for i in range(13))


def test_validate_counts_adapters_as_the_run_does(tmp_path, tiny):
    """A broken adapter is not one the row could use: both say the usable ones."""
    write_jsonl(tmp_path / "rows.jsonl", [{"id": "x", "adapter": "aa", "prompt": "hello"}])
    adapters = {"a": str(tiny.adapters / "a"), "b": str(tiny.adapters / "b")}
    adapters.update({name: str(path) for name, path in tiny.bad.items()})
    job = load_job(tmp_path, tiny, adapters=adapters)
    with pytest.raises(JobError) as caught:  # its one row cannot run: validation fails
        validate_job(job)
    run_job(job)
    (row,) = outputs(tmp_path / "out")
    said = "unknown adapter 'aa' (2 adapters known; nearest: a)"
    assert f"{said}. The key to look at: adapters" in str(caught.value)
    assert row["error"].endswith(said), row["error"]


def test_a_missing_adapters_directory_is_named_as_a_directory(tmp_path, tiny, monkeypatch):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    job = load_job(tmp_path, tiny, adapters="missing-dir")
    forbid_weights(monkeypatch)
    for check in (validate_job, run_job):
        with pytest.raises(JobError) as caught:
            check(job)
        message = str(caught.value)
        assert "adapters directory '" in message and "missing-dir' does not exist" in message
        assert "'*'" not in message
    assert not (tmp_path / "out").exists()


def test_a_job_refused_for_repeated_ids_leaves_no_output_directory(tmp_path, tiny):
    rows = make_rows(3)
    write_jsonl(tmp_path / "rows.jsonl", rows + [rows[1]])
    with pytest.raises(JobError, match="nothing was run"):
        run_job(load_job(tmp_path, tiny, output="deep/out"))
    assert not (tmp_path / "deep" / "out").exists()


def test_an_empty_input_warns(tmp_path, tiny, caplog):
    (tmp_path / "rows.jsonl").write_text("")
    job = load_job(tmp_path, tiny)
    assert any("the input has no rows" in note for note in validate_job(job).notes)
    with caplog.at_level(logging.WARNING, logger="slora_batch.jobs"):
        summary = run_job(job)
    assert summary.stats["rows"] == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("job tiny: the input has no rows" in m and "rows.jsonl" in m for m in warned)
    assert any("the input has no rows" in note for note in summary.notes)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_error_rows_count_no_tokens_and_the_summary_says_how_many_more(tmp_path, tiny):
    """A rejected over-long prompt computes nothing: the stats count only the ok rows' tokens.
    The summary shows a few error messages and how many more there are; the tokenizer's own
    warning about the long row stays out of stderr."""
    long_row = {"id": "long", "prompt": "word " * 9000}  # past the tokenizer's 8192 too
    unknown = [{"id": f"u{i}", "adapter": "nope", "prompt": "hi"} for i in range(4)]
    write_jsonl(tmp_path / "rows.jsonl", make_rows(3) + [long_row] + unknown)
    # transformers' loggers do not propagate to the root: listen on the tokenizer's own
    tokenizer_log, records = logging.getLogger("transformers.tokenization_utils_base"), Records()
    tokenizer_log.addHandler(records)
    try:
        result = invoke("run", write_job(tmp_path, tiny))
    finally:
        tokenizer_log.removeHandler(records)
    assert result.exit_code == 0, result.output
    assert not [m for m in records.messages if "sequence length" in m], records.messages
    rows = outputs(tmp_path / "out")
    ok = [r for r in rows if r["error"] is None]
    assert len(ok) == 3
    stats = pq.read_table(tmp_path / "out" / "_stats.parquet").to_pylist()[0]
    assert stats["prompt_tokens"] == sum(r["prompt_tokens"] for r in ok)
    assert stats["completion_tokens"] == sum(r["completion_tokens"] for r in ok)
    assert f"{stats['prompt_tokens']:,} prompt" in result.stdout
    assert result.stdout.count("error row:") == 3
    assert "... and 2 more error rows" in result.stdout
    assert "Token indices sequence length" not in result.stderr
    assert stats["prompt_tokens"] < CONTEXT * 3


def event(**fields) -> JobProgress:
    base = dict(job="j", phase="running", rows_done=0, rows_total=240, completion_tokens=0,
                elapsed_s=0.0, adapters_resident=1, rows_this_run=0)  # fmt: skip
    return JobProgress(**{**base, **fields})


def test_the_rate_counts_tokens_computed_and_the_eta_the_work_left():
    # 60 s after the engine was ready, one row out (its 40 tokens), 2,808 tokens computed
    early = event(rows_done=1, rows_this_run=1, completion_tokens=40, elapsed_s=60.0,
                  computed_tokens=2808, row_tokens=100)  # fmt: skip
    assert progress.tokens_per_s(early) == pytest.approx(46.8)
    rates = "0.7 generated tok/s, 46.8 prefill+decode tok/s (engine time), "
    assert rates in progress.progress_line(early)
    # 240 rows of ~100 tokens: 24,000 tokens of work, 2,808 done, at 46.8 tok/s
    assert progress.seconds_left(early) == pytest.approx((24000 - 2808) / 46.8)
    # a resumed run: 100 rows of earlier runs, 40 of this run took 4,000 tokens; 140 rows were
    # left at its start, 14,000 tokens of work, 8,000 computed at 80 tok/s: 75 s left
    resumed = event(rows_done=140, rows_this_run=40, elapsed_s=100.0, computed_tokens=8000,
                    row_tokens=4000)  # fmt: skip
    assert progress.seconds_left(resumed) == pytest.approx(75.0)
    assert progress.progress_line(resumed).endswith("ETA 0:01:15")
    # nothing finished yet: a rate, no ETA; nothing computed: neither
    assert progress.seconds_left(event(elapsed_s=5.0, computed_tokens=500)) is None
    assert progress.tokens_per_s(event(elapsed_s=5.0, computed_tokens=500)) == 100.0
    assert progress.tokens_per_s(event()) == 0.0 and "ETA" not in progress.progress_line(event())
    assert progress.seconds_left(event(rows_done=240, rows_this_run=240, elapsed_s=9.0,
                              computed_tokens=900, row_tokens=900)) == 0.0  # fmt: skip


def test_a_scoring_job_shows_a_rate(tmp_path, tiny):
    rows = [
        {"id": i, "adapter": [None, "a"][i % 2], "prompt": f"question {i} is",
         "choices": [" yes", " no, not at all", " maybe"]}
        for i in range(6)
    ]  # fmt: skip
    write_jsonl(tmp_path / "rows.jsonl", rows)
    events: list[JobProgress] = []
    summary = run_job(load_job(tmp_path, tiny), progress=events.append)
    assert summary.stats["scored_rows"] == 6 and summary.stats["completion_tokens"] == 0
    running = [e for e in events if e.phase == "running"]
    assert running and all(e.computed_tokens > 0 and progress.tokens_per_s(e) > 0 for e in running)
    assert progress.seconds_left(running[-1]) == 0.0
    rates = f"0.0 generated tok/s, {progress.tokens_per_s(running[-1]):,.1f} prefill+decode tok/s"
    assert rates in progress.progress_line(running[-1])
    assert progress.tokens_per_s(running[-1]) > 0.0


def test_an_interrupted_job_says_what_is_committed_and_what_is_left(tmp_path, tiny, capsys):
    import typer

    from cli import _interrupted
    from slora_batch.console import ProgressDisplay

    write_jsonl(tmp_path / "rows.jsonl", make_rows(6))
    job = load_job(tmp_path, tiny)
    display = ProgressDisplay(enabled=False, live=False)
    # loading, nothing written yet: none committed, all ten left
    display.update(event(job="tiny", phase="loading", rows_total=10))
    with pytest.raises(typer.Exit):
        _interrupted("SIGTERM", display, [job], 143)
    said = capsys.readouterr().err
    assert "interrupted by SIGTERM: job 'tiny' has 0 rows committed" in said
    assert "10 of 10 are left" in said and "are committed" not in said
    run_job(job)  # six rows committed; say four more were due
    display.update(event(job="tiny", rows_done=8, rows_total=10, rows_this_run=8))
    with pytest.raises(typer.Exit):
        _interrupted("SIGTERM", display, [job], 143)
    said = capsys.readouterr().err
    assert "has 6 rows committed" in said and "(6 of them this run)" in said
    assert "4 of 10 are left" in said


def test_after_a_resume_the_summary_gives_this_runs_tokens_beside_the_whole_outputs(tmp_path):
    from slora_batch.console import _tokens
    from slora_batch.jobs.summary import JobSummary

    stats = {"prompt_tokens": 1000, "completion_tokens": 500, "scored_rows": 0}
    resumed = JobSummary("j", tmp_path, stats, [], rows_skipped=30, rows_this_run=10,
                         prompt_tokens_this_run=250, completion_tokens_this_run=120)  # fmt: skip
    assert _tokens(resumed) == (
        "1,000 prompt, 500 generated in the whole output; this run 250 prompt, 120 generated"
    )
    fresh = JobSummary("j", tmp_path, stats, [], rows_skipped=0, rows_this_run=40)
    assert _tokens(fresh) == "1,000 prompt, 500 generated"
    scored = {"prompt_tokens": 900, "completion_tokens": 0, "scored_rows": 12}
    assert _tokens(JobSummary("j", tmp_path, scored, [], 0, 12)) == (
        "900 prompt tokens scored (12 rows)"
    )
