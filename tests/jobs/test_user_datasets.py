"""Users' own datasets as Hugging Face ships them, on the tiny model of ``test_jobrun`` (which
carries the sample model's tokenizer and chat template): a QA Parquet without ids, Alpaca through
``prompt_template``, ``apply_chat_template`` and ``system_prompt``, ids from input positions,
``keep_columns: all``, the raw-prompt warning, a ``validate`` that fails a job no row of can run
(with the key that fixes it), and ``limit``."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_jobrun import (
    build_tiny,
    load_job,
    one_thread,  # noqa: F401 -- an autouse fixture: these tests run on one thread too
    write_job,
)
from typer.testing import CliRunner

from cli import app
from slora_batch.engine.config import ConfigError
from slora_batch.engine.requests.tokens import load_tokenizer, tokenize
from slora_batch.jobs.check import JobError, check_job
from slora_batch.jobs.config import JobConfig
from slora_batch.jobs.outdir import part_files, read_success
from slora_batch.jobs.prompts import Prompts, parse_templates
from slora_batch.jobs.reader import iter_input_files, read_rows
from slora_batch.jobs.rows import to_request
from slora_batch.jobs.run import run_job
from slora_batch.jobs.validate import validate_job

ENV = {"COLUMNS": "250", "NO_COLOR": "1"}
QA = [
    {"question": "What is 2 plus 3?", "answer": "5"},
    {"question": "Name a primary colour.", "answer": "red"},
    {"question": "How many legs has a spider?", "answer": "8"},
    {"question": "What is the capital of France?", "answer": "Paris"},
]
ALPACA = [
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Name a primary colour.", "input": "", "output": "red"},
    {"instruction": "", "input": "orphan input", "output": "?"},
    {"instruction": "Reverse the word.", "input": "stop", "output": "pots"},
]
TEMPLATES = ["Task: {instruction}\nInput: {input}\nAnswer:", "Task: {instruction}\nAnswer:"]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, sample_model_dir):
    return build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)


def parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def output(out: Path) -> list[dict]:
    rows = pq.read_table([p for _, p in part_files(out)]).to_pylist()
    return sorted(rows, key=lambda r: (r["id"], r["adapter"] or ""))


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def test_qa_parquet_without_ids_runs_through_the_chat_template(tmp_path, tiny):
    """A Hub QA Parquet (question, answer; no id): mapped, sent as chat turns, ids from
    positions, every input column kept, each row's input position in row_index."""
    parquet(tmp_path / "qa.parquet", QA)
    job = load_job(tmp_path, tiny, input="qa.parquet", adapters=None, keep_columns="all",
                   columns={"prompt": "question"}, apply_chat_template=True,
                   sampling={"max_new_tokens": 3})  # fmt: skip
    report = validate_job(job)
    assert report.problems == [] and report.id_type == "int64"
    assert not any("apply_chat_template" in note for note in report.notes)
    summary = run_job(job)
    assert summary.stats["error_rows"] == 0
    rows = output(tmp_path / "out")
    assert [r["id"] for r in rows] == [0, 1, 2, 3]
    assert [r["row_index"] for r in rows] == [0, 1, 2, 3]
    assert [r["question"] for r in rows] == [q["question"] for q in QA]
    assert [r["answer"] for r in rows] == [q["answer"] for q in QA]
    assert [r["prompt"] for r in rows] == [q["question"] for q in QA]  # the text, unwrapped
    tokenizer = load_tokenizer(tiny.model)
    for row, qa in zip(rows, QA, strict=True):  # the prompt went through the chat template
        turn = [{"role": "user", "content": qa["question"]}]
        chat = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)  # fmt: skip
        assert row["prompt_tokens"] == len(chat) > len(tokenizer(qa["question"])["input_ids"])


def test_a_text_prompt_becomes_a_messages_row_with_the_system_prompt(tiny):
    """apply_chat_template reuses the messages path (``tokens._chat_ids``): the request is a
    messages row, its ids hold the template's tokens and the system prompt; a messages row
    without a system turn gets it first, one with its own keeps it."""
    columns = {key: key for key in ("id", "adapter", "prompt", "messages", "prompt_token_ids")}
    prompts = Prompts(chat=True, system="Answer in one word.")
    tokenizer = load_tokenizer(tiny.model)
    row = _row({"prompt": "What is 2 plus 3?"}, columns)
    request = to_request(row, JobConfig(name="j", model="m", input="i", output="o").sampling,
                         prompts=prompts)  # fmt: skip
    assert request.prompt is None and request.extra["prompt"] == "What is 2 plus 3?"
    assert request.messages == [{"role": "system", "content": "Answer in one word."},
                                {"role": "user", "content": "What is 2 plus 3?"}]  # fmt: skip
    ids = tokenize(request, tokenizer, 49152)
    text = tokenizer.decode(ids)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in ids
    assert "Answer in one word." in text and text.rstrip().endswith("assistant")
    own = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    for messages, first in (([{"role": "user", "content": "Hi"}], "Answer in one word."),
                            (own, "Be terse.")):  # fmt: skip
        item = to_request(
            _row({"messages": messages}, columns), request_sampling(), prompts=prompts
        )
        assert item.messages[0] == {"role": "system", "content": first}
        assert [m["role"] for m in item.messages] == ["system", "user"]


def request_sampling():
    return JobConfig(name="j", model="m", input="i", output="o").sampling


def _row(values: dict, columns: dict[str, str], fields: dict | None = None):
    from slora_batch.jobs.reader import InputRow

    return InputRow(0, Path("rows.jsonl"), "rows.jsonl", 1, values, columns, {}, None,
                    fields or {})  # fmt: skip


def test_alpaca_through_prompt_template(tmp_path, tiny):
    """Alpaca (instruction, input, output): each row takes the first template it fills (an
    empty input: the second); a row that fills none is an error row naming the row, the
    templates and the column; ids are positions; the reference output is kept."""
    parquet(tmp_path / "alpaca.parquet", ALPACA)
    job = load_job(tmp_path, tiny, input="alpaca.parquet", adapters=None, keep_columns="all",
                   prompt_template=TEMPLATES, sampling={"max_new_tokens": 2})  # fmt: skip
    report = validate_job(job)
    assert len(report.problems) == 1 and "row 2" in report.problems[0]
    assert any("apply_chat_template: true" in note for note in report.notes)  # raw text
    run_job(job)
    rows = output(tmp_path / "out")
    assert [r["id"] for r in rows] == [0, 1, 2, 3]
    assert [r["output"] for r in rows] == ["5", "red", "?", "pots"]
    assert [r["instruction"] for r in rows] == [a["instruction"] for a in ALPACA]
    assert rows[0]["prompt"] == "Task: Add the numbers.\nInput: 2 and 3\nAnswer:"
    assert rows[1]["prompt"] == "Task: Name a primary colour.\nAnswer:"  # empty input
    assert rows[3]["prompt"] == "Task: Reverse the word.\nInput: stop\nAnswer:"
    bad = rows[2]
    assert bad["finish_reason"] == "error" and bad["row_index"] == 2
    assert "alpaca.parquet row 2" in bad["error"] and "no prompt_template fits" in bad["error"]
    assert "column 'instruction', which is empty" in bad["error"]
    assert all(r["error"] is None for r in rows if r["id"] != 2)
    other = load_job(tmp_path, tiny, input="alpaca.parquet", adapters=None, keep_columns="all",
                     prompt_template=TEMPLATES[1], sampling={"max_new_tokens": 2})  # fmt: skip
    with pytest.raises(JobError, match="rows made from other inputs or settings: prompt_template"):
        run_job(other)  # the template decides the rows: in the fingerprint


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{} and {instruction}", "is positional"),
        ("{0}", "is positional"),
        ("{row.instruction}", "reads an attribute or an item"),
        ("{choices[0]}", "reads an attribute or an item"),
        ("{score:.2f}", "has a conversion or format spec"),
        ("{instruction!r}", "has a conversion or format spec"),
        ("Answer: {instruction", "write a literal brace as {{ or }}"),
        ("No column here", "names no input column"),
        ("", "must be a non-empty string"),
        ([], "a non-empty list"),
        (["{a}", "{a}"], "lists a template twice"),
    ],
)
def test_a_bad_prompt_template_is_refused_at_load(template, message):
    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("[", r"\[")):
        JobConfig(name="j", model="m", input="i.jsonl", output="o", prompt_template=template)


def test_template_fields_and_literal_braces():
    (template,) = parse_templates('{{"q": "{question}"}} {question} {answer}')
    assert template.fields == ("question", "answer")
    assert template.render({"question": "2+3?", "answer": 5}) == '{"q": "2+3?"} 2+3? 5'
    prompts = Prompts(tuple(parse_templates(["{a} {b}", "{a}"])))
    assert prompts.render({"a": "x", "b": "  "}) == ("x", None)
    text, why = prompts.render({"b": "y"})
    assert text is None and "template 0: '{a} {b}' needs column 'a', which is missing" in why


def test_a_template_column_the_input_lacks_fails_the_job_before_any_work(tmp_path, tiny):
    parquet(tmp_path / "alpaca.parquet", ALPACA)
    job = load_job(tmp_path, tiny, input="alpaca.parquet", adapters=None,
                   prompt_template=["{instruction}\n{inptu}", "{instruction}"])  # fmt: skip
    expected = (
        "prompt_template names column 'inptu', which the input does not have (its columns: "
        "instruction, input, output); did you mean 'input'?"
    )
    with pytest.raises(JobError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        validate_job(job)
    with pytest.raises(JobError, match="nothing was run"):
        run_job(job)
    assert not (tmp_path / "out").exists()


def test_apply_chat_template_on_a_model_without_one_fails_naming_the_model(tmp_path, tiny):
    model = tmp_path / "plain-model"
    shutil.copytree(tiny.model, model)
    settings_path = model / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text())
    settings.pop("chat_template", None)
    settings_path.write_text(json.dumps(settings))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    parquet(tmp_path / "qa.parquet", QA)
    job = load_job(tmp_path, tiny, model=str(model), input="qa.parquet", adapters=None,
                   columns={"prompt": "question"}, apply_chat_template=True)  # fmt: skip
    with pytest.raises(
        JobError, match=f"apply_chat_template: model '{model}'.* has no chat template"
    ):
        check_job(job)
    without = load_job(tmp_path, tiny, model=str(model), input="qa.parquet", adapters=None,
                       columns={"prompt": "question"})  # fmt: skip
    assert check_job(without).chat_template is False
    assert not any("chat template" in n for n in validate_job(without).notes)


def test_raw_prompts_to_a_chat_model_are_warned_of(tmp_path, tiny, caplog):
    """validate says it once in its notes, run once as a logging WARNING, naming the key."""
    parquet(tmp_path / "qa.parquet", QA[:2])
    job = load_job(tmp_path, tiny, input="qa.parquet", adapters=None,
                   columns={"prompt": "question"}, sampling={"max_new_tokens": 1})  # fmt: skip
    notes = [n for n in validate_job(job).notes if "apply_chat_template" in n]
    assert len(notes) == 1 and "apply_chat_template: true" in notes[0]
    assert "'question'" in notes[0] and "raw text" in notes[0]
    with caplog.at_level(logging.WARNING, logger="slora_batch"):
        run_job(job)
    warned = [r for r in caplog.records if "apply_chat_template: true" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING


def test_validate_fails_an_alpaca_job_without_a_prompt_and_names_the_fix(tmp_path, tiny, caplog):
    """No prompt column and no template: validate exits 1, its message names prompt_template
    (built from the input's own columns) and columns, and never a scoring column; a run writes
    its error rows and warns the same (first: the CLI's logging set-up replaces caplog's)."""
    parquet(tmp_path / "alpaca.parquet", ALPACA)
    job = load_job(tmp_path, tiny, input="alpaca.parquet", adapters=None, output="out-run")
    with caplog.at_level(logging.WARNING, logger="slora_batch"):
        summary = run_job(job)
    assert summary.stats["error_rows"] == 4
    assert summary.notes[0].startswith("the input has none of the prompt columns")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("columns: {prompt: instruction}" in m for m in warned) == 1
    result = invoke("validate", write_job(tmp_path, tiny, input="alpaca.parquet", adapters=None))
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    assert "the input has none of the prompt columns 'prompt', 'messages'" in said
    assert "(its columns: instruction, input, output)" in said
    assert 'prompt_template: ["{instruction}\\n\\n{input}", "{instruction}"]' in said
    assert "columns: {prompt: instruction}" in said
    assert "apply_chat_template: true" in said  # the tiny model has a chat template
    assert "continuation" not in said and "choices" not in said
    mapped = write_job(tmp_path, tiny, input="alpaca.parquet", adapters=None,
                       columns={"prompt": "instruction"}, output="out-mapped")  # fmt: skip
    assert invoke("validate", mapped).exit_code == 0


def test_validate_fails_a_job_no_checked_row_of_can_run(tmp_path, tiny):
    parquet(tmp_path / "alpaca.parquet", [{**row, "input": ""} for row in ALPACA])
    job = load_job(tmp_path, tiny, input="alpaca.parquet", adapters=None,
                   prompt_template="{instruction}: {input}")  # fmt: skip
    with pytest.raises(JobError) as caught:
        validate_job(job)
    message = str(caught.value)
    assert "none of the 4 input rows checked can run" in message
    assert "which is empty" in message and "The key to look at: prompt_template" in message


def test_an_unused_column_is_not_taken_for_a_scoring_column(tmp_path, tiny):
    rows = [{"prompt": "Say hi", "instruction": "be kind", "choice": ["a", "b"], "promt": "x"}]
    (tmp_path / "rows.jsonl").write_text(json.dumps(rows[0]) + "\n")
    notes = validate_job(load_job(tmp_path, tiny, adapters=None)).notes
    hints = {n.split("'")[1]: n.rsplit("(", 1)[-1] for n in notes if n.startswith("column ")}
    assert hints["instruction"] == "add it to keep_columns to carry it to the output)"
    assert hints["choice"] == "did you mean 'choices'?)"  # a list beside a prompt: scoring data
    assert hints["promt"] == "did you mean 'prompt'?)"


def test_keep_all_keeps_a_column_named_as_an_output_column_under_input_name(tmp_path, tiny):
    rows = [{"prompt": "Say hi", "text": "reference text", "error": 0.5}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = run_job(load_job(tmp_path, tiny, adapters=None, keep_columns="all",
                               sampling={"max_new_tokens": 1}))  # fmt: skip
    (row,) = output(tmp_path / "out")
    assert row["input_text"] == "reference text" and row["input_error"] == 0.5
    assert row["input_prompt"] == "Say hi" == row["prompt"] and row["error"] is None
    assert "column 'text' is kept as 'input_text': the output has its own 'text'" in summary.notes


def test_limit_runs_the_first_rows_and_a_larger_one_adds_the_rest(tmp_path, tiny):
    """Two files without ids: limit 4 runs rows 0-3 (across the files), then no limit adds
    rows 4-5 to the same output, none twice; ids and row_index are positions in the input."""
    parquet(tmp_path / "data" / "a.parquet", QA[:3])
    parquet(tmp_path / "data" / "b.parquet", QA[1:])
    keys = dict(input="data", adapters=None, columns={"prompt": "question"},
                sampling={"max_new_tokens": 2}, part_rows=2)  # fmt: skip
    first = run_job(load_job(tmp_path, tiny, limit=4, **keys))
    assert first.rows_this_run == 4 and read_success(tmp_path / "out")["rows"] == 4
    assert [r["id"] for r in output(tmp_path / "out")] == [0, 1, 2, 3]
    assert run_job(load_job(tmp_path, tiny, limit=4, **keys)).complete_already
    second = run_job(load_job(tmp_path, tiny, **keys))
    assert (second.rows_skipped, second.rows_this_run) == (4, 2)
    rows = output(tmp_path / "out")
    assert [r["id"] for r in rows] == [r["row_index"] for r in rows] == [0, 1, 2, 3, 4, 5]
    questions = [q["question"] for q in QA[:3] + QA[1:]]
    assert [r["prompt"] for r in rows] == questions
    assert read_success(tmp_path / "out")["rows"] == 6
    files = iter_input_files(str(tmp_path / "data"))  # the reader's limit and start
    limited = read_rows(files, JobConfig(name="j", model="m", input="i", output="o").columns,
                        limit=5, position_ids=True)  # fmt: skip
    assert [(r.position, r.values["id"], r.number) for r in limited] == [
        (0, 0, 0), (1, 1, 1), (2, 2, 2), (3, 3, 0), (4, 4, 1)]  # fmt: skip
    for bad in (0, -1, True, "3"):
        with pytest.raises(ConfigError, match="limit must be an integer >= 1"):
            JobConfig(name="j", model="m", input="i.jsonl", output="o", limit=bad)


def test_a_templated_row_is_checked_as_a_prompt_row():
    columns = {key: key for key in ("id", "adapter", "prompt", "messages", "prompt_token_ids")}
    prompts = Prompts(tuple(parse_templates("Q: {question}")))
    bad = to_request(
        _row({}, columns, {"question": "x\ud800"}), request_sampling(), prompts=prompts
    )
    assert "prompt_template's prompt: " in bad.error and "lone surrogate" in bad.error
    both = _row({"messages": [{"role": "user", "content": "hi"}]}, columns, {"question": "q"})
    error = to_request(both, request_sampling(), prompts=prompts).error
    assert "prompt_template makes the prompt, and the row gives column 'messages' too" in error
    ok = to_request(_row({"prompt": "ignored"}, columns, {"question": "q"}), request_sampling(),
                    prompts=prompts)  # fmt: skip
    assert (ok.prompt, ok.extra["prompt"], ok.extra["row_index"]) == ("Q: q", "Q: q", 0)
