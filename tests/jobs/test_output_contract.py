"""The output directory's contract, for every job kind: ``pd.read_parquet(out)`` reads the job's
rows and nothing else (every other file's name starts with "_"), parts hold the columns of their
job kind (recorded in the manifest, so a resume writes parts of the same schema), ``row_index``
and ``prompt`` tell each row's input, base-model rows have adapter "" (a groupby keeps them), and
an OpenAI batch's custom_id is in one of its two files. The eval sweep's part is in
``tests/eval/test_sweep.py`` (its job is the slow one there)."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_jobrun import PAGES, load_job, make_rows, one_thread, write_jsonl  # noqa: F401
from test_openai_batch import CHAT, KEYS, good_lines, line, read_jsonl, write_batch

from slora_batch.jobs.manifest import read_manifest, write_manifest
from slora_batch.jobs.openai_output import ERRORS_FILE, OLD_FILES, OUTPUT_FILE
from slora_batch.jobs.outdir import SUCCESS_FILE, part_files
from slora_batch.jobs.run import run_job
from slora_batch.jobs.schema import LEGACY_COLUMNS, job_columns

GENERATED = job_columns(scoring=False, logprobs=False)
SCORED = job_columns(scoring=True, logprobs=False)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, sample_model_dir):
    from test_jobrun import build_tiny

    return build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)


def own_columns(out) -> list[str]:
    """The output's own columns of every part (asserted to be one schema)."""
    schemas = {tuple(pq.read_schema(path).names) for _, path in part_files(out)}
    assert len(schemas) == 1, schemas
    return list(schemas.pop())


def test_generation_rows_their_input_and_base_rows_in_a_groupby(tmp_path, tiny):
    rows = make_rows(9)  # base, "a", "b"; prompts and chat messages
    rows[4] = {"id": "tokens", "adapter": "a", "prompt_token_ids": [5, 6, 7]}
    write_jsonl(tmp_path / "rows.jsonl", rows)
    run_job(load_job(tmp_path, tiny, part_rows=4))  # parts of 4 rows in the engine's order
    out = tmp_path / "out"
    df = pd.read_parquet(out)

    assert sorted(df["id"]) == sorted(r["id"] for r in rows) and len(df) == len(rows)
    assert list(df.columns) == GENERATED == own_columns(out)  # no scoring columns, no logprobs
    assert read_manifest(out)["output_columns"] == GENERATED
    ordered = df.sort_values("row_index")
    assert list(ordered["id"]) == [r["id"] for r in rows]  # row_index: the input's order
    assert list(ordered["row_index"]) == list(range(len(rows)))
    for row, prompt in zip(rows, ordered["prompt"], strict=True):
        if "prompt" in row:
            assert prompt == row["prompt"]
        elif "messages" in row:
            assert json.loads(prompt) == row["messages"]  # messages as JSON text
        else:
            assert pd.isna(prompt)  # token ids: no text prompt
    per_adapter = df.groupby("adapter").size().to_dict()
    assert per_adapter == {"": 3, "a": 3, "b": 3}  # "" = the base model, kept by the groupby
    assert set(df["finish_reason"]) <= {"stop", "length"}


def test_logprobs_rows_get_the_logprobs_column_only(tmp_path, tiny):
    rows = make_rows(3)
    rows[1]["logprobs"] = 2
    write_jsonl(tmp_path / "rows.jsonl", rows)
    run_job(load_job(tmp_path, tiny))
    df = pd.read_parquet(tmp_path / "out")
    assert list(df.columns) == job_columns(scoring=False, logprobs=True)
    by_id = df.set_index("id")
    assert len(by_id.loc["r0001", "logprobs"]) == by_id.loc["r0001", "completion_tokens"] > 0
    assert by_id.loc["r0000", "logprobs"] is None


def test_scoring_rows_get_the_scoring_columns(tmp_path, tiny):
    rows = [
        {"id": 1, "prompt": "the quick brown", "continuation": " fox"},
        {"id": 2, "adapter": "a", "prompt": "the lazy", "choices": [" dog", " fox"], "answer": 0},
        {"id": 3, "prompt": "seven wizards"},  # a generated row beside them
    ]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    run_job(load_job(tmp_path, tiny))
    df = pd.read_parquet(tmp_path / "out").set_index("id")
    assert list(df.reset_index().columns) == SCORED
    assert sorted(df.index) == [1, 2, 3]
    assert df.loc[1, "finish_reason"] == "score" and df.loc[1, "continuation_tokens"] > 0
    assert df.loc[2, "best_choice"] in (0, 1) and df.loc[2, "correct"] in (True, False)
    assert pd.isna(df.loc[3, "logprob"]) and df.loc[3, "text"] != ""
    assert list(df.sort_values("row_index").index) == [1, 2, 3]


def test_fanout_rows_and_a_resume_keeps_the_recorded_schema(tmp_path, tiny):
    rows = make_rows(4)
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = load_job(tmp_path, tiny, fanout="all", part_rows=3)
    run_job(job)
    out = tmp_path / "out"
    df = pd.read_parquet(out)
    assert len(df) == 3 * len(rows) and df.groupby("adapter").size().to_dict() == {
        "": 4,
        "a": 4,
        "b": 4,
    }
    assert set(zip(df["id"], df["row_index"], strict=True)) == {
        (r["id"], i) for i, r in enumerate(rows)
    }
    # a resume writes parts of the columns the manifest records: the job's...
    manifest = read_manifest(out)
    parts = part_files(out)
    for columns in (manifest["output_columns"], None):
        parts[-1][1].unlink()  # rows to do again
        (out / SUCCESS_FILE).unlink()
        if columns is None:  # ...or, an earlier version's manifest, every column of that time
            write_manifest(out, {k: v for k, v in manifest.items() if k != "output_columns"})
        summary = run_job(job)
        assert summary.rows_this_run > 0 and summary.stats["rows"] == 3 * len(rows)
        written = pq.read_schema(parts[-1][1]).names
        assert written == (GENERATED if columns else list(LEGACY_COLUMNS))
    # parts of both versions, base rows null in one and "" in the other: every reader reads both
    first = pq.read_table(parts[0][1])
    nulls = pa.array([a or None for a in first["adapter"].to_pylist()], pa.string())
    assert nulls.null_count > 0
    index = first.schema.get_field_index("adapter")
    pq.write_table(first.set_column(index, first.schema.field(index), nulls), parts[0][1])
    (out / SUCCESS_FILE).unlink()
    summary = run_job(job)
    assert summary.rows_this_run == 0 and summary.stats["rows"] == 3 * len(rows)
    assert [a["adapter"] for a in summary.adapters] == [None, "a", "b"]
    assert {a["adapter"]: a["rows"] for a in summary.adapters} == {None: 4, "a": 4, "b": 4}


def test_openai_batch_files_beside_the_rows_and_a_repeated_custom_id(tmp_path, tiny):
    lines = good_lines(4)
    lines.append(line(lines[1]["custom_id"], CHAT, {"model": "a", "messages": [
        {"role": "user", "content": "again"}]}))  # fmt: skip
    write_batch(tmp_path / "batch.jsonl", lines)
    run_job(load_job(tmp_path, tiny, **KEYS))
    out = tmp_path / "out"
    df = pd.read_parquet(out)  # the two JSONL files are not read as data
    assert len(df) == len(lines) and list(df.columns) == [*GENERATED, "openai_request"]
    assert sorted(df["row_index"]) == list(range(len(lines)))
    output, errors = read_jsonl(out / OUTPUT_FILE), read_jsonl(out / ERRORS_FILE)
    repeated = lines[1]["custom_id"]
    assert sorted(x["custom_id"] for x in output) == sorted(x["custom_id"] for x in lines[:4])
    assert [x["custom_id"] for x in errors] == [None]  # in one file only: the output file
    message = errors[0]["error"]["message"]
    assert message.startswith("batch.jsonl line 5: ") and f'"{repeated}"' in message
    assert "first on batch.jsonl line 2" in message

    # an output of the previous layout: its files under the old names, the repeated custom_id
    # in both; the complete job writes them under the new names and removes the old ones
    for new, old in zip((OUTPUT_FILE, ERRORS_FILE), OLD_FILES, strict=True):
        (out / new).rename(out / old)
    summary = run_job(load_job(tmp_path, tiny, **KEYS))
    assert summary.complete_already
    assert not any((out / old).exists() for old in OLD_FILES)
    assert read_jsonl(out / OUTPUT_FILE) == output and read_jsonl(out / ERRORS_FILE) == errors
    assert len(pd.read_parquet(out)) == len(lines)


def test_ray_read_tasks_number_rows_across_files(tmp_path, tiny):
    """A Ray read task reads one input file: its rows' row_index continue from the files before
    it, as the single-process tool numbers them."""
    import pickle

    import pyarrow as pa

    pytest.importorskip("ray")
    from slora_batch.jobs.check import check_job
    from slora_batch.jobs.manifest import scan_for_run
    from slora_batch.jobs.reader import input_root
    from slora_batch.jobs.samples import DoneSamples
    from slora_batch.ray.execute import read_units

    rows = make_rows(7)
    write_jsonl(tmp_path / "in" / "1.jsonl", rows[:3])
    write_jsonl(tmp_path / "in" / "2.jsonl", rows[3:])
    plan = check_job(load_job(tmp_path, tiny, input="in"))
    scan = scan_for_run(plan)
    assert scan.file_rows == [3, 4]
    files = pa.table({"file": [str(f) for f in plan.files], "index": [0, 1]})
    units = read_units(files, plan, scan, DoneSamples(), input_root(plan.files), 4, 2)
    items = [pickle.loads(item) for item in units["_slora_item"].to_pylist()]
    assert {item.id: item.extra["row_index"] for item in items} == {
        row["id"]: i for i, row in enumerate(rows)
    }
