"""The job tool's side of scoring and logprobs: the scoring columns and ``logprobs`` read from
JSONL and Parquet into requests, bad values as error rows, the new part columns written and read
back, outputs holding parts of the schema before them, ``scored_rows`` and ``accuracy`` in the
stats, the choice preference table's data and its drawing. No model runs: a stub engine scores
by hand-made rules, so these run in seconds on a CPU."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slora_batch.engine.config import SamplingConfig
from slora_batch.engine.requests.request import Request, Result
from slora_batch.jobs import run as jobrun
from slora_batch.jobs.check import JobError, check_job
from slora_batch.jobs.config import load_jobs
from slora_batch.jobs.manifest import (
    MANIFEST_VERSION,
    fingerprint,
    fingerprint_changes,
    write_manifest,
)
from slora_batch.jobs.preference import choice_preference
from slora_batch.jobs.reader import read_rows
from slora_batch.jobs.resume import done_samples
from slora_batch.jobs.rows import row_key, to_request
from slora_batch.jobs.scan import scan_input
from slora_batch.jobs.schema import CORE_FIELDS, OUTPUT_COLUMNS, part_schema
from slora_batch.jobs.stats import accuracy, output_counts, read_stats
from slora_batch.jobs.validate import validate_job
from slora_batch.jobs.writer import OutputWriter

COLUMNS = {"id": "id", "adapter": "adapter", "prompt": "prompt", "messages": "messages"}
MODEL = {  # config.json only: enough for check_job, and no tokenizer
    "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64,
}  # fmt: skip
# parts before the scoring columns and sample_index
OLD_FIELDS = [pa.field("id", pa.int64()), *(f for f in CORE_FIELDS if f.name != "sample_index")]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def requests(files: list[Path], columns: dict[str, str] = COLUMNS) -> list[Request | Result]:
    return [to_request(row, SamplingConfig()) for row in read_rows(files, columns)]


def scoring(item: Request) -> dict:
    names = ("continuation", "choices", "continuation_token_ids", "choices_token_ids")
    return {name: getattr(item, name) for name in (*names, "answer", "logprobs")}


def test_scoring_columns_from_jsonl_and_parquet_into_requests(tmp_path):
    rows = [
        {"id": 1, "prompt": "2+2=", "continuation": " 4", "answer": 0},
        {"id": 2, "prompt": "Sky?", "choices": ["blue", "green"], "answer": "blue"},
        {"id": 3, "prompt_token_ids": [5, 6], "continuation_token_ids": [7, 8]},
        {"id": 4, "prompt_token_ids": [5], "choices_token_ids": [[7], [8, 9]], "answer": 1},
        {"id": 5, "prompt": "Hi", "logprobs": 3, "max_new_tokens": 4},
        # an answer on a generated row (a reference solution) is not read
        {"id": 6, "prompt": "Solve", "answer": "#### 72"},
        # sampling overrides on a scored row are checked and have no effect
        {"id": 7, "prompt": "Pick", "choices": ["a", "b"], "max_new_tokens": 9, "answer": 1},
    ]
    want = {
        1: {"continuation": " 4", "answer": 0},
        2: {"choices": ["blue", "green"], "answer": "blue"},
        3: {"continuation_token_ids": [7, 8]},
        4: {"choices_token_ids": [[7], [8, 9]], "answer": 1},
        5: {"logprobs": 3},
        6: {},
        7: {"choices": ["a", "b"], "answer": 1},
    }
    empty = dict.fromkeys(scoring(Request(id=0)))
    jsonl = requests([write_jsonl(tmp_path / "rows.jsonl", rows)])
    # Parquet: one type per column, so integer answers only (text answers: the next test)
    typed = [{**row, "answer": 0} if row["id"] == 2 else row for row in rows]
    typed = [{k: v for k, v in row.items() if row["id"] != 6 or k != "answer"} for row in typed]
    names = list(dict.fromkeys(k for row in typed for k in row))
    pq.write_table(pa.table({k: [row.get(k) for row in typed] for k in names}),
                   tmp_path / "rows.parquet")  # fmt: skip
    parquet = requests([tmp_path / "rows.parquet"])
    want_parquet = {**want, 2: {**want[2], "answer": 0}}
    for items, expected in ((jsonl, want), (parquet, want_parquet)):
        assert all(isinstance(item, Request) for item in items), [
            item.error for item in items if isinstance(item, Result)
        ]
        assert {item.id: scoring(item) for item in items} == {
            i: {**empty, **fields} for i, fields in expected.items()
        }
        assert [item.scored for item in items] == [True] * 4 + [False] * 2 + [True]
        assert items[4].max_new_tokens == 4 and items[6].max_new_tokens == 9


def test_parquet_answer_as_text_and_renamed_columns(tmp_path):
    path = tmp_path / "mc.parquet"
    table = pa.table(
        {
            "key": [1, 2, 3],
            "question": ["a?", "b?", "c?"],
            "options": pa.array([["x", "y"], ["u", "v", "w"], None], pa.list_(pa.string())),
            "label": ["y", None, None],
            "target": [None, None, " z"],
        }
    )
    pq.write_table(table, path)
    columns = {**COLUMNS, "id": "key", "prompt": "question", "choices": "options",
               "answer": "label", "continuation": "target"}  # fmt: skip
    first, second, third = requests([path], columns)
    assert (first.choices, first.answer) == (["x", "y"], "y")
    assert (second.choices, second.answer) == (["u", "v", "w"], None)
    assert (third.continuation, third.choices) == (" z", None)
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["q"], "options": [["x", "y"]], "label": ["n"]}), bad)
    (result,) = requests([bad], columns)
    assert result.error == "bad.parquet row 0: column 'label': 'n' is not among the choices"


BAD_ROWS = [
    ({"continuation": ""}, "column 'continuation' is empty"),
    ({"continuation": 5}, "column 'continuation' must be a string, got int 5"),
    ({"choices": []}, "column 'choices' must be a non-empty list of strings, got list []"),
    ({"choices": "yes"}, "column 'choices' must be a non-empty list of strings, got str 'yes'"),
    ({"choices": ["a", 3]}, "choices[1] must be a non-empty string, got int 3"),
    ({"choices": ["a", ""]}, "choices[1] must be a non-empty string, got str ''"),
    ({"choices": ["a", "\ud800"]}, "choices[1]: '\\ud800' has a character UTF-8 cannot encode"),
    ({"continuation": "a", "choices": ["b"]},
     "give one of the scoring columns, not 'continuation' and 'choices'"),
    ({"continuation_token_ids": []},
     "column 'continuation_token_ids' must be a non-empty list of token ids (integers >= 0)"),
    ({"continuation_token_ids": [3, -1]},
     "column 'continuation_token_ids' must be a non-empty list of token ids (integers >= 0), "
     "got list [3, -1]"),
    ({"choices_token_ids": []},
     "column 'choices_token_ids' must be a non-empty list of token id lists, got list []"),
    ({"choices_token_ids": [[1], []]},
     "choices_token_ids[1] must be a non-empty list of token ids (integers >= 0), got list []"),
    ({"choices_token_ids": [1, 2]},
     "choices_token_ids[0] must be a non-empty list of token ids (integers >= 0), got int 1"),
    ({"choices": ["a", "b", "c"], "answer": 3},
     "column 'answer': 3 is not a choice index (0 to 2)"),
    ({"choices": ["a", "b"], "answer": -1}, "column 'answer': -1 is not a choice index (0 to 1)"),
    ({"choices": ["a", "b"], "answer": 1.0},
     "column 'answer' must be a choice's index (an integer) or its text, got float 1.0"),
    ({"choices": ["a", "b"], "answer": True},
     "column 'answer' must be a choice's index (an integer) or its text, got bool True"),
    ({"choices": ["a", "b"], "answer": "c"}, "column 'answer': 'c' is not among the choices"),
    ({"choices_token_ids": [[1], [2]], "answer": "a"},
     "column 'answer': a row of token ids takes its answer as an index, got str 'a'"),
    ({"continuation": " 4", "answer": 1},
     "column 'answer' on a continuation row must be 0 or the continuation's text (its one "
     "choice: correct then says whether the continuation is the model's greedy one), got int 1"),
    ({"continuation": " 4", "answer": True},
     "column 'answer' on a continuation row must be 0 or the continuation's text"),
    ({"continuation": " 4", "answer": "4"},
     "column 'answer' on a continuation row must be 0 or the continuation's text"),
    ({"continuation_token_ids": [4], "answer": " 4"},
     "column 'answer' on a continuation row must be 0 (its one choice"),
    ({"logprobs": 21}, "column 'logprobs' must be from 0 to 20, got 21"),
    ({"logprobs": -1}, "column 'logprobs' must be from 0 to 20, got -1"),
    ({"logprobs": 2.5}, "column 'logprobs' must be an integer from 0 to 20, got float 2.5"),
    ({"logprobs": "3"}, "column 'logprobs' must be an integer from 0 to 20, got str '3'"),
    ({"logprobs": True}, "column 'logprobs' must be an integer from 0 to 20, got bool True"),
    ({"choices": ["a", "b"], "logprobs": 2},
     "column 'logprobs' is for generated rows; this row is scored (column 'choices')"),
]  # fmt: skip


def test_a_continuation_row_s_answer_is_0_or_its_text(tmp_path):
    rows = [{"id": i, "prompt": "2+2=", "continuation": " 4", "answer": a}
            for i, a in enumerate([0, " 4"])]  # fmt: skip
    items = requests([write_jsonl(tmp_path / "rows.jsonl", rows)])
    assert [(item.continuation, item.answer) for item in items] == [(" 4", 0), (" 4", " 4")]


def test_bad_scoring_values_become_error_rows_naming_file_row_and_reason(tmp_path):
    rows = [{"id": i, "prompt": "Q", **fields} for i, (fields, _) in enumerate(BAD_ROWS)]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = requests([path])
    for i, (item, (_, reason)) in enumerate(zip(out, BAD_ROWS, strict=True)):
        assert isinstance(item, Result) and item.finish_reason == "error", (i, item)
        assert item.error.startswith(f"rows.jsonl line {i + 1}: {reason}"), (item.error, reason)
        assert item.id == i and item.extra["source"] == f"rows.jsonl line {i + 1}"


def test_validate_reports_bad_scoring_values_and_what_does_not_fit(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL))
    rows = [
        {"id": 1, "prompt_token_ids": [5, 6], "choices_token_ids": [[7], [8, 9]], "answer": 1},
        {"id": 2, "prompt_token_ids": [5], "choices_token_ids": [[7], [8]], "answer": 2},
        {"id": 3, "prompt_token_ids": [5], "continuation": " text"},
        {"id": 4, "prompt_token_ids": list(range(40)), "continuation_token_ids": [1] * 30},
        {"id": 5, "prompt_token_ids": [5], "logprobs": 2},
    ]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    (tmp_path / "jobs.yaml").write_text(
        f"jobs:\n  - name: v\n    model: {model}\n    input: rows.jsonl\n    output: out\n"
    )
    (job,) = load_jobs(tmp_path / "jobs.yaml")
    report = validate_job(job)
    assert report.rows_checked == 5
    assert (
        report.problems[0] == "rows.jsonl line 2: column 'answer': 2 is not a choice index (0 to 1)"
    )
    assert report.problems[1].startswith("rows.jsonl line 3: cannot tokenize: ")
    assert "no tokenizer" in report.problems[1]  # a text continuation needs one
    assert report.problems[2:] == [
        "rows.jsonl line 4: context of 40 tokens + a continuation of 30 tokens does not fit the "
        "context of 64 tokens"
    ]
    pq.write_table(pa.table({"prompt": ["q"], "choices": ["a|b"], "answer": [1.5]}),
                   tmp_path / "rows.parquet")  # fmt: skip
    (tmp_path / "rows.jsonl").unlink()
    (job,) = load_jobs(tmp_path / "jobs.yaml")
    job.input = str(tmp_path / "rows.parquet")
    with pytest.raises(JobError, match="none of the 1 input rows checked can run") as failed:
        validate_job(job)  # its one row cannot run: the job fails validation, naming why
    problems = str(failed.value)
    assert "column 'choices' has type string: its non-null values will be error rows" in problems
    assert "column 'answer' has type double: its non-null values will be error rows" in problems
    ids_only = {"prompt_token_ids": [[5, 6]], "choices_token_ids": [[[7], [8]]], "answer": [0]}
    pq.write_table(pa.table(ids_only), tmp_path / "rows.parquet")
    assert validate_job(job).problems == []  # no text column needed, no tokenizer either


def scored_results() -> list[Result]:
    """One result of every kind, with every new field set where it applies."""
    top = [
        {"token_id": 9, "text": "b", "logprob": -0.5},
        {"token_id": 8, "text": "c", "logprob": -2.0},
    ]
    return [
        Result(id=1, adapter="a", text="", prompt_tokens=4, finish_reason="score",
               logprob=-3.25, token_logprobs=[-1.0, -2.25], is_greedy=False,
               continuation_tokens=2, correct=None),
        Result(id=2, adapter=None, text="", prompt_tokens=5, finish_reason="score",
               choice_logprobs=[-4.0, -1.5, -9.0], choice_tokens=[2, 1, 3],
               choice_greedy=[False, True, False], best_choice=1, best_choice_norm=1,
               correct=True),
        Result(id=3, adapter="a", text="ab", token_ids=[7, 9], prompt_tokens=3,
               completion_tokens=2, finish_reason="length",
               logprobs=[{"token_id": 7, "text": "a", "logprob": -0.1, "top": []},
                         {"token_id": 9, "text": "\udc80b", "logprob": -0.5, "top": top}]),
        Result(id=4, adapter="a", text="", finish_reason="error", error="bad row"),
        Result(id=5, adapter="a", text="hi", token_ids=[3], prompt_tokens=2,
               completion_tokens=1, finish_reason="stop"),
    ]  # fmt: skip


NEW_TYPES = {
    "logprob": pa.float64(),
    "token_logprobs": pa.list_(pa.float64()),
    "is_greedy": pa.bool_(),
    "continuation_tokens": pa.int64(),
    "choice_logprobs": pa.list_(pa.float64()),
    "choice_tokens": pa.list_(pa.int64()),
    "choice_greedy": pa.list_(pa.bool_()),
    "best_choice": pa.int64(),
    "best_choice_norm": pa.int64(),
    "correct": pa.bool_(),
    "logprobs": pa.list_(
        pa.struct([
            ("token_id", pa.int64()), ("text", pa.string()), ("logprob", pa.float64()),
            ("top", pa.list_(pa.struct([("token_id", pa.int64()), ("text", pa.string()),
                                        ("logprob", pa.float64())]))),
        ])
    ),
}  # fmt: skip


def test_writer_round_trips_every_new_column(tmp_path):
    schema = part_schema("int64", {"label": pa.string()})
    results = scored_results()
    results[0].extra = {"source": "rows.jsonl line 1", "label": "kept"}
    with OutputWriter(tmp_path / "out", part_rows=10, schema=schema) as writer:
        for result in results:
            writer.write(result)
        with pytest.raises(ValueError, match="finish_reason 'scored' is not one of stop, length"):
            writer.write(Result(id=6, adapter=None, text="", finish_reason="scored"))
    table = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    assert table.schema == schema
    assert {name: table.schema.field(name).type for name in NEW_TYPES} == NEW_TYPES
    assert all(table.schema.field(name).nullable for name in NEW_TYPES)
    assert table.column_names[-1] == "label" and table.column_names[:9] == list(OUTPUT_COLUMNS[:9])
    got = {row["id"]: row for row in table.to_pylist()}
    for result in results:
        row = got[result.id]
        for name in NEW_TYPES:
            if name != "logprobs":
                assert row[name] == getattr(result, name), (result.id, name)
    assert [got[i]["finish_reason"] for i in range(1, 6)] == [
        "score",
        "score",
        "length",
        "error",
        "stop",
    ]
    assert got[1]["source"] == "rows.jsonl line 1" and got[1]["label"] == "kept"
    entries = got[3]["logprobs"]
    assert entries[0] == {"token_id": 7, "text": "a", "logprob": -0.1, "top": []}
    assert entries[1]["text"] == "\ufffdb"  # a lone surrogate cannot be stored: replaced
    assert entries[1]["top"] == results[2].logprobs[1]["top"]
    assert all(got[i]["logprobs"] is None for i in (1, 2, 4, 5))


def write_old_part(path: Path, rows: list[dict], kept: list[pa.Field] = ()) -> None:
    """A part as the writer wrote it before the scoring columns existed."""
    defaults = {"adapter": None, "text": "old", "token_ids": [1], "prompt_tokens": 1,
                "completion_tokens": 1, "finish_reason": "length", "error": None, "source": None}  # fmt: skip
    table = pa.Table.from_pylist([{**defaults, **row} for row in rows],
                                 schema=pa.schema([*OLD_FIELDS, *kept]))  # fmt: skip
    pq.write_table(table, path)


def test_old_and_new_parts_in_one_output_are_read_by_resume_stats_and_preference(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    write_old_part(out / "part-00000.parquet", [
        {"id": 10, "adapter": "a"}, {"id": 11}, {"id": 12, "adapter": "a", "finish_reason": "error",
                                                  "error": "x", "text": "", "token_ids": []},
    ])  # fmt: skip
    with OutputWriter(out, part_rows=10, schema=part_schema("int64")) as writer:
        for result in scored_results():
            writer.write(result)
    assert sorted(p.name for p in out.glob("part-*")) == [
        "part-00000.parquet",
        "part-00001.parquet",
    ]
    assert done_samples(out).keys() == {row_key(i, a) for i, a in
                              [(10, "a"), (11, None), (12, "a"), (1, "a"), (2, None), (3, "a"),
                               (4, "a"), (5, "a")]}  # fmt: skip
    counts = output_counts(out)
    # error rows count no tokens: they computed nothing
    assert counts["a"] == {"rows": 6, "ok_rows": 4, "error_rows": 2, "prompt_tokens": 10,
                           "completion_tokens": 4, "scored_rows": 1, "answered_rows": 0,
                           "correct_rows": 0}  # fmt: skip
    assert counts[None] == {"rows": 2, "ok_rows": 2, "error_rows": 0, "prompt_tokens": 6,
                            "completion_tokens": 1, "scored_rows": 1, "answered_rows": 1,
                            "correct_rows": 1}  # fmt: skip
    assert (accuracy(counts["a"]), accuracy(counts[None])) == (None, 1.0)
    preference = choice_preference(out)
    assert (preference.columns, preference.most_choices, preference.answers) == (3, 3, True)
    (base,) = preference.adapters
    assert (base.adapter, base.rows, base.shares, base.beyond, base.accuracy) == (
        None, 1, [0.0, 1.0, 0.0], 0.0, 1.0
    )  # fmt: skip
    old_only = tmp_path / "old"
    old_only.mkdir()
    write_old_part(old_only / "part-00000.parquet", [{"id": 1}])
    assert choice_preference(old_only) is None and choice_preference(tmp_path / "none") is None


class ScoringStub:
    """Stands in for the engine: a choices row's best choice is its longest, a continuation is
    always greedy, a generated row makes two tokens, with ``logprobs`` alternatives each."""

    device, dtype = "cpu", "float32"

    def __init__(self) -> None:
        self.counters = SimpleNamespace(adapters_resident=0, load_s=0.0, warmup_s=0.0,
                                        disk_loads=0, adapter_loads=0, adapter_evictions=0,
                                        prefetch_hits=0, peak_pages=0)  # fmt: skip

    def generate(self, requests):
        for request in requests:
            yield self.result(request)

    @staticmethod
    def result(request: Request) -> Result:
        common = {"id": request.id, "adapter": request.adapter or None, "prompt_tokens": 2,
                  "extra": request.extra}  # fmt: skip
        choices = request.choices or request.choices_token_ids
        if choices is not None:
            sums = [len(c) - 10.0 for c in choices]
            best = sums.index(max(sums))
            answer = request.answer
            answer = choices.index(answer) if isinstance(answer, str) else answer
            return Result(**common, text="", finish_reason="score", choice_logprobs=sums,
                          choice_tokens=[len(c) for c in choices],
                          choice_greedy=[i == best for i in range(len(choices))],
                          best_choice=best, best_choice_norm=best,
                          correct=None if answer is None else answer == best)  # fmt: skip
        if request.scored:
            n = len(request.continuation or request.continuation_token_ids)
            return Result(**common, text="", finish_reason="score", logprob=-1.5 * n,
                          token_logprobs=[-1.5] * n, is_greedy=True, continuation_tokens=n,
                          correct=None if request.answer is None else True)  # fmt: skip
        entries = None
        if request.logprobs is not None:
            top = [{"token_id": 5 + k, "text": f"t{k}", "logprob": -k - 0.25}
                   for k in range(request.logprobs)]  # fmt: skip
            entries = [{"token_id": 5, "text": "t0", "logprob": -0.25, "top": top}] * 2
        return Result(**common, text="t0t0", token_ids=[5, 5], completion_tokens=2,
                      finish_reason="length", logprobs=entries)  # fmt: skip

    def close(self) -> None:
        pass


def model_dir(root: Path) -> Path:
    model = root / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(MODEL))
    return model


def write_job(root: Path, **keys) -> Path:
    job = {"name": "score", "model": str(model_dir(root)), "input": "rows.jsonl",
           "output": "out", "part_rows": 3, **keys}  # fmt: skip
    (root / "jobs.yaml").write_text(json.dumps({"jobs": [job]}))  # YAML reads JSON
    return root / "jobs.yaml"


SCORED_ROWS = [
    {"id": 1, "adapter": "a", "prompt": "Q1", "choices": ["x", "yy", "z"], "answer": 1},
    {"id": 2, "adapter": "a", "prompt": "Q2", "choices": ["xxx", "y", "z"], "answer": "y"},
    {"id": 3, "adapter": None, "prompt": "Q3", "choices": ["x", "yy"], "answer": 1},
    {"id": 4, "adapter": "a", "prompt": "Q4", "choices": ["x", "yy"]},
    {"id": 5, "adapter": None, "prompt": "Q5", "continuation": " yes"},
    {"id": 6, "adapter": "b", "prompt": "Q6", "logprobs": 2},
    {"id": 7, "adapter": "b", "prompt": "Q7", "choices": []},
]


def test_a_job_with_scored_rows_writes_scores_stats_and_the_preference(tmp_path, monkeypatch):
    monkeypatch.setattr(jobrun, "_build_engine", lambda plan: ScoringStub())
    write_jsonl(tmp_path / "rows.jsonl", SCORED_ROWS)
    (job,) = load_jobs(write_job(tmp_path))
    summary = jobrun.run_job(job)
    out = tmp_path / "out"
    rows = {r["id"]: r for p in sorted(out.glob("part-*")) for r in pq.read_table(p).to_pylist()}
    assert [rows[i]["finish_reason"] for i in range(1, 8)] == ["score"] * 5 + ["length", "error"]
    assert [rows[i]["best_choice"] for i in range(1, 5)] == [1, 0, 1, 1]
    assert [rows[i]["correct"] for i in range(1, 6)] == [True, False, True, None, None]
    assert rows[5]["token_logprobs"] == [-1.5] * 4 and rows[5]["is_greedy"] is True
    assert [len(e["top"]) for e in rows[6]["logprobs"]] == [2, 2]
    assert rows[7]["error"].startswith("rows.jsonl line 7: column 'choices' must be a non-empty")
    assert json.loads((out / "_job.json").read_text())["reads"][-1] == "logprobs"
    job_row, adapters = read_stats(out)
    assert (job_row["scored_rows"], job_row["accuracy"]) == (5, 2 / 3)
    assert summary.stats["scored_rows"] == 5
    by_adapter = {r["adapter"]: (r["rows"], r["scored_rows"], r["accuracy"]) for r in adapters}
    assert by_adapter == {None: (2, 2, 1.0), "a": (3, 3, 0.5), "b": (2, 0, None)}
    preference = choice_preference(out)
    assert (preference.columns, preference.answers) == (3, True)
    assert [(a.adapter, a.rows, a.shares, a.accuracy) for a in preference.adapters] == [
        (None, 1, [0.0, 1.0, 0.0], 1.0),
        ("a", 3, [1 / 3, 2 / 3, 0.0], 0.5),
    ]
    assert [a.shares_norm for a in preference.adapters] == [a.shares for a in preference.adapters]
    from slora_batch import console

    with console.out.capture() as captured:
        console.print_summary(summary, job)
    text = captured.get()
    assert "scored: 5 rows, accuracy 66.7%" in text
    assert "choice preference per adapter" in text
    lines = [line for line in text.splitlines() if "(base)" in line or "│ a " in line]
    assert any("(base)" in line and "100% / 100%" in line for line in lines)
    assert any("33% / 33%" in line and "67% / 67%" in line and "50.0%" in line for line in lines)
    # the rows' choices differ: the columns are headed by index
    assert summary.choice_labels is None and preference.heads == ["0", "1", "2"]


def test_the_preference_columns_are_headed_by_the_choices_every_row_shares(tmp_path, monkeypatch):
    monkeypatch.setattr(jobrun, "_build_engine", lambda plan: ScoringStub())
    styles = ["plain", "SHOUT", "Arr, matey!  a pirate's   answer"]
    rows = [{"id": i, "adapter": [None, "a"][i % 2], "prompt": f"Q{i}", "choices": styles}
            for i in range(4)] + [{"id": 9, "prompt": "Q9", "continuation": " yes"}]  # fmt: skip
    write_jsonl(tmp_path / "rows.jsonl", rows)
    (job,) = load_jobs(write_job(tmp_path))
    summary = jobrun.run_job(job)
    assert summary.choice_labels == styles
    heads = ["0 plain", "1 SHOUT", "2 Arr, matey! a p…"]
    assert choice_preference(tmp_path / "out", summary.choice_labels).heads == heads
    from slora_batch import console

    with console.out.capture() as captured:
        console.print_summary(summary, job)
    assert all(head in captured.get() for head in heads)
    again = jobrun.run_job(job)  # complete: the heads from the manifest's scan
    assert again.complete_already and again.choice_labels == styles


def test_the_job_s_choice_labels_head_the_columns_when_the_choices_differ(tmp_path, monkeypatch):
    """The sample eval's way: each row's choices differ, each position is one style."""
    monkeypatch.setattr(jobrun, "_build_engine", lambda plan: ScoringStub())
    write_jsonl(tmp_path / "rows.jsonl", SCORED_ROWS)
    (job,) = load_jobs(write_job(tmp_path, choice_labels=["plain", "shout", "pirate"]))
    summary = jobrun.run_job(job)
    assert choice_preference(tmp_path / "out", summary.choice_labels).heads == [
        "0 plain", "1 shout", "2 pirate"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="choice_labels must be a non-empty list"):
        load_jobs(write_job(tmp_path, choice_labels=["plain", ""]))


def legacy_output(root: Path, rows: list[dict], keep: list[str] | None, unused: dict) -> Path:
    """An output as a version before the scoring columns left it: a manifest without "reads",
    whose scan saw ``unused`` columns, and one old-schema part of the first two rows."""
    write_jsonl(root / "rows.jsonl", rows)
    (job,) = load_jobs(write_job(root, **({"keep_columns": keep} if keep else {})))
    plan = check_job(job)
    scan = scan_input(plan.files, job.columns, job.keep_columns, False, OUTPUT_COLUMNS)
    scan.unused.update(unused)
    out = root / "out"
    out.mkdir()
    manifest = {"version": MANIFEST_VERSION, "job": job.name, "fingerprint": fingerprint(plan),
                "scan": scan.to_json()}  # fmt: skip
    write_manifest(out, manifest)
    kept = [pa.field(name, scan.keep[name]) for name in keep or ()]
    write_old_part(out / "part-00000.parquet",
                   [{"id": r["id"], **{k: r.get(k) for k in keep or ()}} for r in rows[:2]],
                   kept)  # fmt: skip
    return root / "jobs.yaml"


def test_an_output_of_an_older_version_resumes_beside_new_parts(tmp_path, monkeypatch):
    monkeypatch.setattr(jobrun, "_build_engine", lambda plan: ScoringStub())
    # a reference answer kept beside generated rows: read now, but it changes none of them
    rows = [{"id": i, "prompt": f"Q{i}", "answer": f"#### {i}"} for i in range(4)]
    (job,) = load_jobs(legacy_output(tmp_path, rows, keep=["answer"], unused={}))
    summary = jobrun.run_job(job)
    assert (summary.rows_skipped, summary.rows_this_run) == (2, 2)
    out = tmp_path / "out"
    parts = [pq.read_table(p) for p in sorted(out.glob("part-*"))]
    assert "correct" not in parts[0].column_names and "correct" in parts[1].column_names
    got = {r["id"]: r for part in parts for r in part.to_pylist()}
    assert sorted(got) == [0, 1, 2, 3] and [got[i]["answer"] for i in range(4)] == [
        f"#### {i}" for i in range(4)
    ]
    assert [got[i]["text"] for i in range(4)] == ["old", "old", "t0t0", "t0t0"]
    job_row, adapters = read_stats(out)
    assert (job_row["rows"], job_row["scored_rows"], job_row["accuracy"]) == (4, 0, None)
    assert [(r["adapter"], r["rows"], r["completion_tokens"]) for r in adapters] == [(None, 4, 6)]
    assert choice_preference(out) is None
    assert jobrun.run_job(job).complete_already  # and a re-run finds it complete


def test_an_older_output_whose_input_has_a_scoring_column_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(jobrun, "_build_engine", lambda plan: ScoringStub())
    rows = [{"id": i, "prompt": f"Q{i}"} for i in range(3)]
    rows[2]["choices"] = ["a", "b"]  # ignored by the version that made the first rows
    (job,) = load_jobs(legacy_output(tmp_path, rows, None, {"choices": [1, "rows.jsonl line 3"]}))
    with pytest.raises(JobError, match="input column 'choices' is read now"):
        jobrun.run_job(job)
    assert len(list((tmp_path / "out").glob("part-*"))) == 1  # nothing was run


def test_a_sampling_setting_added_later_at_its_default_keeps_older_outputs():
    sampling = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": False}
    new = {"input": {}, "model": {"model": "m", "files": {}}, "adapters": {},
           "sampling": sampling, "job": {"columns": {}}}  # fmt: skip
    older = {**new, "sampling": {"max_new_tokens": 8, "temperature": 0.0}}  # no ignore_eos yet
    assert fingerprint_changes(older, new) == []
    changed = {**new, "sampling": {**sampling, "ignore_eos": True}}
    assert fingerprint_changes(older, changed) == ["sampling.ignore_eos None -> True"]
    assert fingerprint_changes(new, {**new, "job": {"columns": {}, "fanout": "all"}}) == [
        "fanout None -> 'all'"
    ]


def test_scored_rows_through_the_engine_match_the_engine_api(tmp_path):
    """The job path around the real engine (a tiny random model, rows of token ids): the part
    rows hold what ``Engine.generate`` returns for the same requests."""
    pytest.importorskip("slora_batch.engine.requests.scoring")
    from factory import make_model

    from slora_batch import Engine, EngineConfig

    model = make_model(tmp_path, "gqa")  # config and weights, no tokenizer
    rows = [
        {"id": 1, "prompt_token_ids": [5, 6, 7], "choices_token_ids": [[8], [9, 10], [11]],
         "answer": 1},
        {"id": 2, "prompt_token_ids": [5, 6], "continuation_token_ids": [7, 8], "answer": 0},
        {"id": 3, "prompt_token_ids": [9, 10], "logprobs": 2},
    ]  # fmt: skip
    pq.write_table(pa.table({k: [r.get(k) for r in rows] for k in dict.fromkeys(
        k for r in rows for k in r)}), tmp_path / "rows.parquet")  # fmt: skip
    (tmp_path / "jobs.yaml").write_text(
        f"jobs:\n  - name: s\n    model: {model}\n    input: rows.parquet\n    output: out\n"
        "    sampling: {max_new_tokens: 3, ignore_eos: true}\n"
        "    engine: {device: cpu, dtype: float32, num_pages: 2000}\n"
    )
    (job,) = load_jobs(tmp_path / "jobs.yaml")
    jobrun.run_job(job)
    got = {r["id"]: r for p in sorted((tmp_path / "out").glob("part-*"))
           for r in pq.read_table(p).to_pylist()}  # fmt: skip
    engine = Engine(model, config=EngineConfig(device="cpu", num_pages=2000))
    want = {
        r.id: r
        for r in engine.generate(
            Request(id=row["id"], max_new_tokens=3, ignore_eos=True,
                    **{k: v for k, v in row.items() if k != "id"})
            for row in rows
        )
    }  # fmt: skip
    assert [got[i]["finish_reason"] for i in (1, 2, 3)] == ["score", "score", "length"], got
    floats = ("logprob", "token_logprobs", "choice_logprobs")  # batches differ: a tolerance
    for i, result in want.items():
        for name in NEW_TYPES:
            value, expected = got[i][name], getattr(result, name)
            if name == "logprobs" and expected is not None:
                assert [e["token_id"] for e in value] == [e["token_id"] for e in expected]
                assert [[t["token_id"] for t in e["top"]] for e in value] == [
                    [t["token_id"] for t in e["top"]] for e in expected
                ]
                value = [x["logprob"] for e in value for x in (e, *e["top"])]
                expected = [x["logprob"] for e in expected for x in (e, *e["top"])]
            if expected is not None and (name in floats or name == "logprobs"):
                assert value == pytest.approx(expected, rel=1e-4, abs=1e-5), (i, name)
            else:
                assert value == expected, (i, name)
    # and what transformers computes: each choice's sum, the best of them, whether it is the answer
    import torch
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def logp(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(reference(input_ids=torch.tensor([ids])).logits[0], dim=-1)

    sums = []
    for choice in rows[0]["choices_token_ids"]:
        table = logp([5, 6, 7, *choice])
        sums.append(sum(table[2 + j, t].item() for j, t in enumerate(choice)))
    best = max(range(3), key=sums.__getitem__)
    assert got[1]["choice_logprobs"] == pytest.approx(sums, abs=1e-4)
    assert got[1]["best_choice"] == best and got[1]["correct"] == (best == 1)
    table = logp([5, 6, 7, 8])
    greedy = all(int(table[1 + j].argmax()) == t for j, t in enumerate([7, 8]))
    assert got[2]["is_greedy"] == greedy and got[2]["correct"] == greedy  # answer 0: is_greedy
    assert len(got[3]["logprobs"]) == 3 and all(len(e["top"]) == 2 for e in got[3]["logprobs"])
