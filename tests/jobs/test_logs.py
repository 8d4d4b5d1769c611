"""What a run logs and prints: one log format without a terminal, the levels a default run
shows (the sample model's conversion, a job's start and end), a stop without an ERROR line,
rates that read the same in progress lines and summaries, whole names at any width, no
third-party progress bars in logs, and the warning for a job whose rows are mostly empty."""

from __future__ import annotations

import io
import logging
import os
import re

import pyarrow.parquet as pq
import pytest
from rich.console import Console
from test_jobrun import (
    build_tiny,
    load_job,
    make_rows,
    one_thread,  # noqa: F401 -- an autouse fixture: these tests run on one thread too
    write_job,
    write_jsonl,
)
from typer.testing import CliRunner

from cli import _Terminated, app
from slora_batch import console
from slora_batch.engine.counters import EngineCounters
from slora_batch.engine.requests.request import Result
from slora_batch.eval.report import eval_table
from slora_batch.jobs import run as jobrun
from slora_batch.jobs.check import check_job
from slora_batch.jobs.outdir import part_files
from slora_batch.jobs.run import run_job, run_plan
from slora_batch.jobs.stats import STATS_SCHEMA
from slora_batch.jobs.summary import JobSummary

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
# a log line of a run without a terminal: time, level, logger, message
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR) ([\w.]+): (.*)$")
RATES = re.compile(
    r"([\d,]+\.\d) generated tok/s, ([\d,]+\.\d) prefill\+decode tok/s \(engine time\)"
)


def records(stderr: str) -> list[tuple[str, str, str]]:
    """(level, logger, message) of every line; fails on a line of another format."""
    lines = stderr.strip().splitlines()
    matches = [LOG_LINE.match(line) for line in lines]
    assert all(matches), [line for line, m in zip(lines, matches, strict=True) if not m]
    return [m.groups() for m in matches]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, sample_model_dir):
    return build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)


@pytest.fixture
def restore_logging(monkeypatch):
    """``setup_logging`` configures the process's logging and, without a terminal, sets the
    progress bars' variables: put them back after the test."""
    for name in console.PROGRESS_BAR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    names = ("slora_batch", *console.CHATTY)
    levels = {name: logging.getLogger(name).level for name in names}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, saved in levels.items():
        logging.getLogger(name).setLevel(saved)
    logging.captureWarnings(False)


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def test_a_logged_run_has_one_format_and_its_progress_rates_are_its_summarys(
    tmp_path, tiny, monkeypatch, restore_logging
):
    """stderr not a terminal: every line is a log record (the command's, the library's, the
    progress lines); the job's start says the rows to do; the last progress line's rates are
    the summary's and ``_stats.parquet``'s, under the same labels."""
    write_jsonl(tmp_path / "rows.jsonl", make_rows(6))
    result = invoke("run", write_job(tmp_path, tiny), "--progress-every", "0")
    assert result.exit_code == 0, result.output
    logged = records(result.stderr)
    assert ("INFO", "slora_batch.jobs.lifecycle", "job tiny: 6 rows to do") in logged
    assert not [r for r in logged if r[0] == "ERROR"], logged
    progress = [message for _, name, message in logged if name == "slora_batch.progress"]
    assert progress[0] == "job tiny: loading the model"
    assert progress[-1].startswith("job tiny: 6/6 rows (100.0%), ") and progress[-1].endswith(
        ", done"
    )
    (speed,) = [line for line in result.stdout.splitlines() if " speed " in line]
    shown = RATES.search(speed).groups()
    assert RATES.search(progress[-1]).groups() == shown
    stats = pq.read_table(tmp_path / "out" / "_stats.parquet").to_pylist()[0]
    assert shown == (f"{stats['tokens_per_s']:,.1f}", f"{stats['computed_tokens_per_s']:,.1f}")
    assert stats["tokens_per_s"] == pytest.approx(
        stats["completion_tokens_this_run"] / stats["engine_s"]
    )
    # without a terminal, no third-party progress bars, in this process or its children
    assert all(os.environ[name] == "1" for name in console.PROGRESS_BAR_VARIABLES)


def test_progress_bars_are_off_without_a_terminal_and_kept_on_one(monkeypatch, restore_logging):
    import datasets
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

    monkeypatch.setattr(console, "err", Console(file=io.StringIO(), force_terminal=True))
    console.setup_logging(quiet=False, verbose=False)
    assert not any(name in os.environ for name in console.PROGRESS_BAR_VARIABLES)
    try:
        monkeypatch.setattr(console, "err", Console(file=io.StringIO()))
        console.setup_logging(quiet=False, verbose=False)
        assert all(os.environ[name] == "1" for name in console.PROGRESS_BAR_VARIABLES)
        assert not datasets.utils.logging.is_progress_bar_enabled()
        assert are_progress_bars_disabled()
    finally:
        datasets.utils.logging.enable_progress_bar()
        enable_progress_bars()


def test_library_loggers_that_bring_their_own_handler_log_in_the_one_format(
    monkeypatch, capsys, restore_logging
):
    """transformers, datasets and huggingface_hub put a stderr handler of their own on their
    logger: without a terminal it is taken off, their records go through the run's format."""
    import transformers  # noqa: F401 -- imported: its handler is on its logger

    logger = logging.getLogger("transformers")
    own = logging.StreamHandler()  # as transformers' own, had it been imported after the setup
    logger.addHandler(own)
    logger.propagate = False
    monkeypatch.setattr(console, "err", Console(file=io.StringIO()))
    console.setup_logging(quiet=False, verbose=False)
    assert own not in logger.handlers and logger.propagate
    logging.getLogger("transformers.models.llama").warning("a library warning")
    ((level, name, message),) = records(capsys.readouterr().err)
    assert (level, name, message) == ("WARNING", "transformers.models.llama", "a library warning")


def test_the_sample_model_conversion_logs_its_start_and_end_by_default(
    tmp_path, monkeypatch, capsys, restore_logging
):
    from slora_batch.engine.models import sample_model

    def convert(gguf, target):
        (target / "config.json").write_text("{}")
        (target / "model.safetensors").write_bytes(b"")

    monkeypatch.setenv("SLORA_BATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sample_model, "_find_sample_gguf", lambda: tmp_path / "sample.gguf")
    monkeypatch.setattr(sample_model, "_convert_gguf", convert)
    monkeypatch.setattr(console, "err", Console(file=io.StringIO()))
    console.setup_logging(quiet=False, verbose=False)
    path = sample_model.resolve_model(sample_model.SAMPLE_MODEL_ALIAS)
    assert (path / "config.json").is_file()
    logged = records(capsys.readouterr().err)
    messages = [m for level, name, m in logged if name == sample_model.__name__ and level == "INFO"]
    assert len(messages) == 2, logged
    assert messages[0].startswith("converting sample.gguf into ")
    assert messages[1].startswith("converted smollm2-135m-instruct in ")
    console.setup_logging(quiet=True, verbose=False)  # --quiet: errors only
    monkeypatch.setenv("SLORA_BATCH_CACHE", str(tmp_path / "cache-2"))
    sample_model.resolve_model(sample_model.SAMPLE_MODEL_ALIAS)
    assert capsys.readouterr().err == ""


def _stopping_engine(monkeypatch, exc: BaseException, at_step: int = 20) -> list:
    """Jobs' engines whose forward raises ``exc`` at step ``at_step``, mid-step; the list
    gets each one's ``failed`` as it is closed."""
    engines = []
    build = jobrun._build_engine

    def build_engine(plan):
        engine = build(plan)
        forward, calls = engine.runner.forward, [0]

        def stopping(*args, **kwargs):
            calls[0] += 1
            if calls[0] == at_step:
                raise exc
            return forward(*args, **kwargs)

        engine.runner.forward = stopping
        close = engine.close
        engine.close = lambda: (engines.append(engine.failed), close())  # why it failed
        return engine

    monkeypatch.setattr(jobrun, "_build_engine", build_engine)
    return engines


@pytest.mark.parametrize("stop", [_Terminated, KeyboardInterrupt], ids=["SIGTERM", "SIGINT"])
def test_a_stop_in_the_middle_of_a_step_logs_no_error(tmp_path, tiny, monkeypatch, caplog, stop):
    """SIGTERM's exception (the CLI raises it) and SIGINT's, raised in the engine's step: the
    engine refuses further use, as after any step that raised, but logs no ERROR: the caller
    says what the stop left. An engine error still logs one."""
    caplog.set_level(logging.DEBUG, logger="slora_batch")
    write_jsonl(tmp_path / "rows.jsonl", make_rows(12))
    job = load_job(tmp_path, tiny, engine={"device": "cpu", "dtype": "float32",
                                           "num_pages": 16384, "max_num_seqs": 2})  # fmt: skip
    engines = _stopping_engine(monkeypatch, stop())
    with pytest.raises(stop):
        run_job(job)
    assert engines[0].startswith("its step 20 raised ")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert part_files(tmp_path / "out")  # the rows finished before the stop are committed

    caplog.clear()
    _stopping_engine(monkeypatch, RuntimeError("CUDA error: an illegal memory access"))
    with pytest.raises(Exception, match="illegal memory access"):
        run_job(job)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["engine failed: its step 20 raised RuntimeError: CUDA error: an illegal "
                      "memory access"]  # fmt: skip


class _FixedEngine:
    """An engine that answers every row with a fixed text, "" for ``empty`` of every 4 rows."""

    device, dtype = "cpu", "float32"

    def __init__(self, empty: int) -> None:
        self.empty, self.counters = empty, EngineCounters()

    def generate(self, requests):
        for i, request in enumerate(requests):
            text = "" if i % 4 < self.empty else "an answer"
            yield Result(id=request.id, adapter=request.adapter or None, text=text,
                         token_ids=[7] if text else [], prompt_tokens=3,
                         completion_tokens=1 if text else 0)  # fmt: skip

    def close(self) -> None:
        pass


RAW = "6 of 8 generated rows (75%) have empty text; a chat (instruct) model given raw prompts"
CHAT = "6 of 8 generated rows (75%) have empty text; check the job's 'stop' strings"


@pytest.mark.parametrize(
    ("empty", "chat", "note"),
    [(3, False, RAW), (3, True, CHAT), (2, False, None), (0, False, None)],
)
def test_a_job_whose_rows_are_mostly_empty_says_so(tmp_path, tiny, monkeypatch, caplog, empty,
                                                   chat, note):  # fmt: skip
    """More than half of the generated rows empty: a WARNING and a summary line with the
    counts and the likely cause (raw prompts to a chat model when most rows were raw text);
    half or fewer: neither."""
    caplog.set_level(logging.INFO, logger="slora_batch")
    rows = make_rows(8)  # 6 raw text prompts, 2 messages rows
    if chat:
        rows = [{"id": r["id"], "adapter": r["adapter"],
                 "messages": r.get("messages") or [{"role": "user", "content": r["prompt"]}]}
                for r in rows]  # fmt: skip
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = load_job(tmp_path, tiny)
    summary = run_plan(check_job(job), build_engine=lambda plan: _FixedEngine(empty))
    assert (summary.generated_rows_this_run, summary.empty_rows_this_run) == (8, 2 * empty)
    said = [r for r in caplog.records if "have empty text" in r.getMessage()]
    assert all(r.levelno == logging.WARNING for r in said)
    if note is None:
        assert said == []
    else:
        (warning,) = [r.getMessage() for r in said]
        assert warning.startswith(f"job tiny: {note}"), warning
        if not chat:
            assert "'apply_chat_template: true'" in warning and "'messages' rows" in warning
    shown = Console(file=io.StringIO(), width=200)
    monkeypatch.setattr(console, "out", shown)
    monkeypatch.setattr(console, "preview", lambda job, limit: [])
    console.print_summary(summary, job)
    printed = shown.file.getvalue()
    assert ("have empty text" in printed) == (note is not None), printed
    assert note is None or f"warning: {note}" in printed, printed


def _columns(text: str) -> list[str]:
    """Each table column's text, its lines joined (a folded cell reads whole), and the text
    outside tables joined (a folded title)."""
    streams: dict[int, str] = {}
    outside = ""
    for line in text.splitlines():
        fields = re.split(r"[│┃]", line)
        if len(fields) == 1:
            outside += line.strip()
            continue
        for k, field in enumerate(fields):
            streams[k] = streams.get(k, "") + field.strip()
    return [outside, *streams.values()]


def test_a_summary_at_width_40_prints_whole_names(tmp_path, monkeypatch):
    job_name = "nightly_eval_of_every_adapter_in_the_store"
    adapters = ["customer_support_adapter_v2_final", "legal_summaries_adapter_long_name"]
    tasks = ["sample_task_alpha_long_name", "sample_task_beta_long_name"]
    stats = {name: 0 for name in STATS_SCHEMA.names}
    stats.update(device="cpu", dtype="float32", wall_s=1.0, engine_s=0.5, read_s=0.1,
                 write_s=0.1, tokens_per_s=10.0, computed_tokens_per_s=20.0,
                 requests_per_s=1.0, rows=4, ok_rows=4)  # fmt: skip
    summary = JobSummary(
        job=job_name, output=tmp_path / "out", stats=stats, rows_skipped=0, rows_this_run=4,
        adapters=[{"adapter": a, "rows": 2, "error_rows": 0, "tokens": 5, "seconds": 0.2}
                  for a in adapters],
    )  # fmt: skip
    narrow = Console(file=io.StringIO(), width=40)
    monkeypatch.setattr(console, "out", narrow)
    monkeypatch.setattr(console, "preview", lambda job, limit: [])
    console.print_summary(summary, job=None)
    rows = [{"adapter": a, "task": t, "metric": "acc", "value": 0.5, "stderr": 0.01, "n": 10}
            for a in adapters for t in tasks]  # fmt: skip
    narrow.print(eval_table(rows))
    text = narrow.file.getvalue()
    assert "…" not in text
    assert all(len(line) <= 40 for line in text.splitlines() if re.search("[│┃]", line))
    columns = _columns(text)
    for name in [job_name, *adapters, *tasks]:
        assert any(name in column for column in columns), (name, text)


def test_a_summary_off_a_terminal_is_as_wide_as_it_needs(monkeypatch, restore_logging):
    """stdout not a terminal and COLUMNS unset: no 80-column cut; COLUMNS, when set, rules."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(console, "out", Console(file=io.StringIO()))
    monkeypatch.setattr(console, "err", Console(file=io.StringIO()))
    console.setup_logging(quiet=False, verbose=False)
    assert console.out.width == console.LOG_WIDTH
    monkeypatch.setenv("COLUMNS", "120")
    console.setup_logging(quiet=False, verbose=False)
    assert console.out.width == 120


def test_an_older_stats_file_reads_with_this_versions_columns(tmp_path):
    """A ``_stats.parquet`` of an earlier version has no this-run columns: they read as None,
    the rest as written."""
    import pyarrow as pa

    from slora_batch.jobs.stats import THIS_RUN_KEYS, read_stats

    new = {*THIS_RUN_KEYS, "computed_tokens", "computed_tokens_per_s"}
    older = pa.schema([field for field in STATS_SCHEMA if field.name not in new])
    rows = [{"kind": "job", "rows": 10, "tokens_per_s": 25.0},
            {"kind": "adapter", "adapter": "a", "rows": 10, "tokens": 50, "seconds": 2.0}]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows, schema=older), tmp_path / "_stats.parquet")
    job_row, (adapter_row,) = read_stats(tmp_path)
    assert set(job_row) == set(adapter_row) == set(STATS_SCHEMA.names) - {"kind"}
    assert job_row["rows"] == 10 and job_row["tokens_per_s"] == 25.0
    assert all(job_row[key] is None and adapter_row[key] is None for key in new)
    assert adapter_row["tokens"] == 50 and adapter_row["seconds"] == 2.0
