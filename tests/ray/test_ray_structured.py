"""Structured output on Ray (issue 27): constrained rows of every format, on several adapters and
the base model, read from JSONL (the format as an object) and Parquet (as a JSON string), give
on an engine actor the rows of the single-process run; the constrained ones that stop are valid
documents; the stats count the constrained draws of every actor; a schema the compiler rejects
is an error row naming the row and the reason, and harms no other row. The ``generate`` stage
gives the same rows from a dataset whose formats are objects (an Arrow struct column)."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

ray = pytest.importorskip("ray")

from structured import PERSON  # noqa: E402
from test_structured_job import (  # noqa: E402, F401 -- the tiny model built once per module
    CHOICE,
    PROMPTS,
    REGEX,
    check_row,
    outputs,
    tiny,
)

from slora_batch.jobs.config import load_jobs  # noqa: E402
from slora_batch.jobs.feed import RunRecord  # noqa: E402
from slora_batch.jobs.response_format import format_value, struct_value  # noqa: E402
from slora_batch.jobs.run import run_job  # noqa: E402
from slora_batch.jobs.stats import read_stats  # noqa: E402
from slora_batch.ray import RaySettings, generate, run_ray_job  # noqa: E402
from slora_batch.ray import job as ray_job  # noqa: E402
from slora_batch.ray.stage import COUNTERS  # noqa: E402

LABEL = {
    "type": "object",
    "properties": {
        "label": {"enum": ["yes", "no"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["label", "n"],
}
GRAMMAR = {"type": "grammar", "grammar": 'root ::= "(" [0-9] [0-9]? ")"'}
FORMATS = [
    None,
    REGEX,
    CHOICE,
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "label", "schema": LABEL}},
    {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    GRAMMAR,
]
BROKEN = {  # a reference to a definition the schema lacks: xgrammar rejects it
    "type": "json_schema",
    "json_schema": {"name": "broken", "schema": {"type": "object",
                    "properties": {"a": {"$ref": "#/$defs/missing"}}}},
}  # fmt: skip
MAX_NEW_TOKENS = 32  # enough for every format but the person schema's (per row: 96)
JSONL_ROWS = 8  # the first rows go to rows.jsonl, the rest to rows.parquet
ENGINE = {"device": "cpu", "dtype": "float32", "num_pages": 4000}
pytestmark = pytest.mark.usefixtures("local_ray")  # conftest.py: the shared Ray instance


def make_rows() -> list[dict]:
    """Every format twice over the base model and both adapters, and the broken schema's row
    (in rows.parquet, beside good rows of its adapter)."""
    rows = []
    for i, fmt in enumerate(FORMATS * 2):
        row = {"id": f"s{i}", "adapter": [None, "r4", "r8"][i % 3], "prompt": PROMPTS[i % 6]}
        if fmt is not None:
            row["response_format"] = fmt
        if fmt is FORMATS[5]:
            row["max_new_tokens"] = 96
        rows.append(row)
    rows.append({"id": "broken", "adapter": "r4", "prompt": PROMPTS[0], "response_format": BROKEN})
    return rows


def write_inputs(root, rows: list[dict]) -> None:
    """rows.jsonl (formats as objects) and rows.parquet (formats as JSON strings)."""
    (root / "in").mkdir()
    jsonl = "".join(json.dumps(r) + "\n" for r in rows[:JSONL_ROWS])
    (root / "in" / "rows.jsonl").write_text(jsonl)
    rest = rows[JSONL_ROWS:]
    formats = [json.dumps(r["response_format"]) if "response_format" in r else None for r in rest]
    table = pa.table({
        "id": [r["id"] for r in rest],
        "adapter": pa.array([r["adapter"] for r in rest], pa.string()),
        "prompt": [r["prompt"] for r in rest],
        "max_new_tokens": pa.array([r.get("max_new_tokens") for r in rest], pa.int64()),
        "response_format": pa.array(formats, pa.string()),
    })  # fmt: skip
    pq.write_table(table, root / "in" / "rows.parquet")


def load_job(root, model_dir, adapters, output: str):
    job = {
        "name": "structured",
        "model": str(model_dir),
        "adapters": {name: str(path) for name, path in adapters.items()},
        "input": "in",
        "output": output,
        "part_rows": 4,
        "sampling": {"max_new_tokens": MAX_NEW_TOKENS},
        "engine": ENGINE,
    }
    (root / f"{output}.yaml").write_text(yaml.safe_dump({"jobs": [job]}))
    (config,) = load_jobs(root / f"{output}.yaml")
    return config


def check_document(row: dict, fmt: dict) -> None:
    """A constrained row: no error, and when it stopped, a document of its format."""
    if fmt["type"] in ("regex", "choice"):
        check_row(row, fmt)
        return
    assert row["error"] is None, row["error"]
    if row["finish_reason"] != "stop":
        return
    if fmt["type"] == "grammar":
        assert re.fullmatch(r"\([0-9][0-9]?\)", row["text"]), row["text"]
        return
    value = json.loads(row["text"])  # strict: no raw control character (JSON rows' masks)
    if fmt["type"] == "json_schema":
        import jsonschema

        jsonschema.validate(value, fmt["json_schema"]["schema"])


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny):  # noqa: F811
    """The inputs' directory and the single-process run's output rows by id."""
    root = tmp_path_factory.mktemp("ray-structured")
    write_inputs(root, make_rows())
    job = load_job(root, *tiny, "out-single")
    run_job(job)
    return root, outputs(job)


def test_the_ray_job_gives_the_constrained_rows_of_the_single_process_run(
    tiny,  # noqa: F811
    single,
):
    """One engine actor: rows the job tool hands an actor are the same however many there are
    (test_ray_job's two-actor run), and each actor costs seconds of CPU to start; the counters of
    several actors add up in ``test_the_grammar_counters_of_every_actor_add_up``."""
    root, want = single
    rows = make_rows()
    job = load_job(root, *tiny, "out-ray")
    summary = run_ray_job(job, RaySettings(replicas=1, buckets=3, block_rows=3))
    got = outputs(job)

    fields = ("token_ids", "text", "finish_reason", "error")
    assert {i: tuple(r[f] for f in fields) for i, r in got.items()} == {
        i: tuple(r[f] for f in fields) for i, r in want.items()
    }
    assert len(got) == len(rows) and summary.stats["rows"] == len(rows)
    actors = json.loads((root / "out-ray" / "_ray.json").read_text())["actors"]
    assert sum(a["rows"] for a in actors) == len(rows)

    for out in (want, got):
        broken = out["broken"]
        assert broken["finish_reason"] == "error" and broken["token_ids"] == []
        assert "rows.parquet" in broken["error"] and "row 'broken'" in broken["error"]
        assert "json_schema does not compile" in broken["error"] and "$defs" in broken["error"]
    for row in rows[:-1]:
        result, fmt = got[row["id"]], row.get("response_format")
        assert result["error"] is None, result["error"]
        if fmt is None:
            continue
        check_document(result, fmt)
        if fmt["type"] != "json_object":  # the others are short enough to finish
            assert result["finish_reason"] == "stop", (row["id"], result["text"])

    stats = {kind: read_stats(root / f"out-{kind}")[0] for kind in ("single", "ray")}
    assert stats["ray"]["grammar_rows"] == stats["single"]["grammar_rows"] > 0
    assert stats["ray"]["grammar_mask_s"] > 0
    assert stats["ray"]["error_rows"] == stats["single"]["error_rows"] == 1


def test_generate_stage_takes_formats_as_a_struct_column(tiny, single):  # noqa: F811
    """The Ray Data stage on a dataset whose formats are objects (an Arrow struct column, its
    fields the union of every row's: Ray fills the others with nulls, and a row without a format
    may arrive as a struct of nulls, or, once the sort joins blocks of different struct types,
    as a struct of empty values: '' and 0 at every leaf): the single-process run's rows."""
    model_dir, adapters = tiny
    _, want = single
    items = [{"adapter": None, "max_new_tokens": None, "response_format": None, **r}
             for r in make_rows()]  # fmt: skip
    result = generate(
        ray.data.from_items(items, override_num_blocks=3),  # not a block an item
        str(model_dir),
        {name: str(path) for name, path in adapters.items()},
        engine=ENGINE,
        sampling={"max_new_tokens": MAX_NEW_TOKENS},
        batch_rows=4,
    )
    got = {r["id"]: r for r in result.take_all()}
    fields = ("token_ids", "text", "finish_reason")
    assert {i: tuple(r[f] for f in fields) for i, r in got.items()} == {
        i: tuple(r[f] for f in fields) for i, r in want.items()
    }
    assert [i for i, r in got.items() if r["error"]] == ["broken"]
    assert "dataset row 'broken'" in got["broken"]["error"]
    assert "json_schema does not compile" in got["broken"]["error"]


def test_a_struct_value_loses_its_null_fields_at_every_depth():
    union = {"type": "json_schema", "regex": None, "choice": None, "json_schema": {
        "name": "label", "schema": {"type": "object", "required": ["label"], "properties": {
            "label": {"enum": ["yes", None], "maxLength": None}, "name": None}}}}  # fmt: skip
    assert struct_value(union) == {"type": "json_schema", "json_schema": {
        "name": "label", "schema": {"type": "object", "required": ["label"], "properties": {
            "label": {"enum": ["yes", None]}}}}}  # fmt: skip
    assert struct_value({"type": None, "regex": None, "json_schema": None}) is None
    # Ray Data's stand-in for a null struct (blocks of other struct types joined): no format
    zeros = {"type": "", "regex": "", "choice": [], "json_schema": {"name": "", "schema": {
        "type": "", "properties": {"n": {"minimum": 0}}, "required": []}}}  # fmt: skip
    assert format_value(zeros) is None
    assert format_value(union) == struct_value(union)  # a format's zeros stay (enum, minimum)


def test_the_grammar_counters_of_every_actor_add_up():
    """Each summary carries its actor's engine totals so far: the run keeps every actor's latest
    and adds them up (the run above has one actor)."""

    def summary(actor: str, calls: int, grammar_rows: int, grammar_mask_s: float) -> dict:
        return {
            "actor": actor, "calls": calls, "fenced": False, "rows": 1, "tokens": 1,
            "prompt_tokens": 1, "error_rows": 0, "errors": [], "load_s": 0.1, "warmup_s": 0.0,
            "device": "cpu", "dtype": "float32", **dict.fromkeys(COUNTERS, 0),
            "grammar_rows": grammar_rows, "grammar_mask_s": grammar_mask_s,
        }  # fmt: skip

    run = RunRecord("structured", 0, 3, lambda update: None)
    summaries = [summary("a:1", 1, 5, 0.5), summary("a:1", 2, 9, 0.75), summary("b:2", 1, 4, 0.25)]
    ray_job._account(run, summaries, RaySettings())
    assert run.counters.grammar_rows == 9 + 4 and run.counters.grammar_mask_s == 0.75 + 0.25
