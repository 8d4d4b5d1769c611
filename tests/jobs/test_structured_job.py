"""Structured output in jobs: the response_format column (a JSONL object, a Parquet JSON string
or struct), the job's default with a schema_file relative to the job file, error rows for bad
formats, and validate compiling every distinct format, reporting failures by row."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from structured import PERSON, structured_case

from slora_batch.jobs.config import load_jobs
from slora_batch.jobs.outdir import part_files
from slora_batch.jobs.run import run_job
from slora_batch.jobs.validate import validate_job

REGEX = {"type": "regex", "regex": "[a-z]{2,4}-[0-9]{3}"}
CHOICE = {"type": "choice", "choice": ["yes", "no"]}
BAD = {"type": "regex", "regex": "[a-"}
PROMPTS = ["the quick fox", '{"name": "ada"}', "yes or no", "a lazy dog", "seven wizards", "hex"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return structured_case(tmp_path_factory.mktemp("structured-job"))


def write_job(root, model_dir, adapters, input_name):
    (root / "schemas").mkdir(exist_ok=True)
    (root / "schemas" / "person.json").write_text(json.dumps(PERSON))
    job = {
        "model": str(model_dir),
        "adapters": {name: str(path) for name, path in adapters.items()},
        "input": input_name,
        "output": f"out-{input_name}",
        "sampling": {"max_new_tokens": 40,
                     "response_format": {"type": "json_schema", "schema_file": "schemas/person.json"}},
        "engine": {"device": "cpu", "dtype": "float32", "num_pages": 4000},
    }  # fmt: skip
    (root / "job.yaml").write_text(yaml.safe_dump({"jobs": [job]}))
    (job_config,) = load_jobs(root / "job.yaml")
    return job_config


def outputs(job) -> dict:
    rows = pq.read_table([p for _, p in part_files(job.output)]).to_pylist()
    return {r["id"]: r for r in rows}


def check_row(row, fmt) -> None:
    assert row["error"] is None, row["error"]
    if row["finish_reason"] != "stop":
        return
    if fmt is None:  # the job's default: the schema file's
        import jsonschema

        jsonschema.validate(json.loads(row["text"]), PERSON)
    elif fmt["type"] == "regex":
        assert re.fullmatch(fmt["regex"], row["text"])
    else:
        assert row["text"] in fmt["choice"]


def test_jsonl_and_parquet_formats_and_the_default(tiny, tmp_path):
    model_dir, adapters = tiny
    formats = [None, REGEX, CHOICE, None, REGEX, BAD]
    lines = [
        {"id": f"r{i}", "adapter": [None, "r4", "r8"][i % 3], "prompt": p,
         **({"response_format": f} if f is not None else {})}
        for i, (p, f) in enumerate(zip(PROMPTS, formats, strict=True))
    ]  # fmt: skip
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    jsonl_job = write_job(tmp_path, model_dir, adapters, "rows.jsonl")
    report = validate_job(jsonl_job)
    assert len(report.problems) == 1
    assert "rows.jsonl line 6" in report.problems[0] and "Unclosed '['" in report.problems[0]
    run_job(jsonl_job)
    got = outputs(jsonl_job)
    for line, fmt in zip(lines, formats, strict=True):
        if fmt is BAD:
            bad = got[line["id"]]
            assert bad["finish_reason"] == "error" and "regex does not compile" in bad["error"]
            continue
        check_row(got[line["id"]], fmt)
    assert sum(r["finish_reason"] == "stop" for r in got.values()) >= 3

    # Parquet: the format as a JSON string column; then as a struct column (null fields absent)
    text = [json.dumps(f) if f is not None else None for f in formats]
    table = pa.table({"id": [x["id"] for x in lines], "adapter": [x["adapter"] for x in lines],
                      "prompt": PROMPTS, "response_format": text})  # fmt: skip
    pq.write_table(table, tmp_path / "rows.parquet")
    parquet_job = write_job(tmp_path, model_dir, adapters, "rows.parquet")
    run_job(parquet_job)
    again = outputs(parquet_job)
    assert {i: (r["token_ids"], r["finish_reason"]) for i, r in again.items()} == {
        i: (r["token_ids"], r["finish_reason"]) for i, r in got.items()
    }

    struct = pa.struct([("type", pa.string()), ("regex", pa.string()),
                        ("choice", pa.list_(pa.string()))])  # fmt: skip
    structs = [REGEX, CHOICE, None, {"type": "text"}]
    table = pa.table({"id": ["s0", "s1", "s2", "s3"], "prompt": PROMPTS[:4],
                      "response_format": pa.array(structs, type=struct)})  # fmt: skip
    pq.write_table(table, tmp_path / "structs.parquet")
    struct_job = write_job(tmp_path, model_dir, adapters, "structs.parquet")
    run_job(struct_job)
    rows = outputs(struct_job)
    check_row(rows["s0"], REGEX)
    check_row(rows["s1"], CHOICE)
    check_row(rows["s2"], None)  # null: the job's default
    assert rows["s3"]["error"] is None  # text: unconstrained

    # two schemas in one inferred struct column: each row's schema gets the other's property
    # names as null fields, which must read back as absent (else xgrammar rejects "null")
    name = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}},
            "required": ["name"]}  # fmt: skip
    age = {"type": "object", "properties": {"age": {"type": "integer", "maximum": 99}},
           "required": ["age"]}  # fmt: skip
    schemas = [{"type": "json_schema", "json_schema": {"name": n, "schema": s}}
               for n, s in (("name", name), ("age", age))]  # fmt: skip
    table = pa.table({"id": ["n", "a"], "prompt": PROMPTS[:2],
                      "response_format": pa.array(schemas)})  # fmt: skip
    assert pa.types.is_struct(table["response_format"].type)
    pq.write_table(table, tmp_path / "schemas.parquet")
    schema_job = write_job(tmp_path, model_dir, adapters, "schemas.parquet")
    run_job(schema_job)
    rows = outputs(schema_job)
    import jsonschema

    for key, schema in (("n", name), ("a", age)):
        assert rows[key]["error"] is None, rows[key]["error"]
        if rows[key]["finish_reason"] == "stop":
            jsonschema.validate(json.loads(rows[key]["text"]), schema)
    assert any(r["finish_reason"] == "stop" for r in rows.values())


def test_schema_file_is_read_relative_to_the_job_file(tiny, tmp_path):
    model_dir, adapters = tiny
    (tmp_path / "rows.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    job = write_job(tmp_path, model_dir, adapters, "rows.jsonl")
    assert job.sampling.response_format == {
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}
    }  # fmt: skip
    (tmp_path / "schemas" / "person.json").write_text("{broken")
    with pytest.raises(Exception, match=r"schema_file .*person\.json"):
        load_jobs(tmp_path / "job.yaml")


def test_data_parallel_workers_give_the_constrained_rows_of_one_process(tiny, tmp_path):
    """Structured output x data parallel: two workers (each its own grammar compiler) write the
    tokens one process writes, and the stats count the constrained draws."""
    from slora_batch.jobs.stats import read_stats

    model_dir, adapters = tiny
    formats = [None, REGEX, CHOICE, {"type": "json_object"}] * 3
    lines = [
        {"id": f"d{i}", "adapter": [None, "r4", "r8"][i % 3], "prompt": PROMPTS[i % 5],
         **({"response_format": f} if f is not None else {})}
        for i, f in enumerate(formats)
    ]  # fmt: skip
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    one = write_job(tmp_path, model_dir, adapters, "rows.jsonl")
    run_job(one)
    single = outputs(one)
    job = yaml.safe_load((tmp_path / "job.yaml").read_text())
    job["jobs"][0]["output"] = "out-dp"
    job["jobs"][0]["engine"]["data_parallel"] = 2
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    (two,) = load_jobs(tmp_path / "job.yaml")
    run_job(two)
    parallel = outputs(two)
    assert {i: (r["token_ids"], r["finish_reason"]) for i, r in parallel.items()} == {
        i: (r["token_ids"], r["finish_reason"]) for i, r in single.items()
    }
    for line, fmt in zip(lines, formats, strict=True):
        if fmt is None or fmt["type"] != "json_object":
            check_row(parallel[line["id"]], fmt)
    job_row, _ = read_stats(two.output)
    assert job_row["grammar_rows"] > 0 and job_row["grammar_mask_s"] > 0
