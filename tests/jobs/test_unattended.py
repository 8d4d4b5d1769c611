"""Nightly-safe jobs (issue 14), in process on the tiny model of ``test_jobrun``: identities that
cannot collide, duplicates refused, a complete job left alone, rows that cannot be stored, the
resume fingerprint, ids that keep their type, kept and unused columns, broken adapters, time-based
commits, and jobs of one file failing alone. Kills and signals are in ``test_unattended_kill``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from test_jobrun import (
    build_tiny,
    by_key,
    forbid_weights,
    load_job,
    make_rows,
    one_thread,  # noqa: F401 -- an autouse fixture: these tests run on one thread too
    outputs,
    write_job,
    write_jsonl,
    write_parquet,
)
from test_logs import records
from typer.testing import CliRunner

from cli import app
from slora_batch.engine.requests.request import Result
from slora_batch.jobs import manifest
from slora_batch.jobs import run as jobrun
from slora_batch.jobs.outdir import SUCCESS_FILE, part_files, read_success
from slora_batch.jobs.run import JobError, JobSummary, run_job
from slora_batch.jobs.validate import validate_job
from slora_batch.jobs.writer import OutputWriter

# Names that are new with issue 14 are imported in the tests that use them, so that the tests of
# its defects run (and fail) on the code before it too.
ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
MANIFEST_FILE = "_job.json"  # the output's record of what made its rows (README)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, sample_model_dir):
    return build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def write_lines(path: Path, lines: list[str | dict]) -> Path:
    """A JSONL file of rows (dicts) and raw lines (strings) in the given order."""
    path.write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    )
    return path


def parts_table(out: Path) -> pa.Table:
    return pq.read_table([p for _, p in part_files(out)])


def drop_parts_with(out: Path, wanted) -> int:
    """Delete every committed part holding a row for which ``wanted(row)``, and the marker, as a
    kill before those parts were committed would have left the directory. Returns rows lost."""
    lost = 0
    for _, path in part_files(out):
        rows = pq.read_table(path).to_pylist()
        if any(wanted(row) for row in rows):
            path.unlink()
            lost += len(rows)
    (out / SUCCESS_FILE).unlink(missing_ok=True)
    return lost


# -- defect 3: ids that cannot collide ----------------------------------------------------------


def test_rows_without_an_id_never_take_a_given_id_also_after_a_kill(tmp_path, tiny):
    """Issue 14, defect 3: a row without an id (or whose line or id cannot be read) used its
    input position as id, which equals a real id: after a kill the real row counted as done and
    was lost. Such rows now have a null id and are known by their source."""
    write_lines(tmp_path / "rows.jsonl", [
        {"prompt": "the quick brown fox"},          # line 1: no id (position 0)
        {"id": 0, "prompt": "jumps over the lazy"},  # line 2: the real id 0
        {"id": 1, "prompt": "dog while seven"},
        "{broken",                                   # line 4: position 3
        {"id": 3, "prompt": "wizards quietly hex"},
        {"id": 2.5, "prompt": "an unusable id"},     # line 6: position 5
        {"id": 5, "prompt": "the lazy dog"},
    ])  # fmt: skip
    job = load_job(tmp_path, tiny, part_rows=1, window=1)
    first = run_job(job)
    rows = outputs(tmp_path / "out")
    assert first.stats["rows"] == len(rows) == 7
    given = sorted(str(r["id"]) for r in rows if r["id"] is not None)
    assert given == ["0", "1", "3", "5"]  # each real id once, none taken by another row
    assert pq.read_schema(part_files(tmp_path / "out")[0][1]).field("id").type == pa.int64()
    no_id = {r["source"]: r for r in rows if r["id"] is None}
    assert set(no_id) == {"rows.jsonl line 1", "rows.jsonl line 4", "rows.jsonl line 6"}
    assert no_id["rows.jsonl line 1"]["finish_reason"] != "error"  # no id is not an error
    assert "rows.jsonl line 4: malformed JSON" in no_id["rows.jsonl line 4"]["error"]
    assert (
        "line 6: column 'id' must be a non-empty string or an integer, got float 2.5"
        in (no_id["rows.jsonl line 6"]["error"])
    )
    complete = {(r["id"], r["source"]): r["token_ids"] for r in rows}

    # a kill before the parts of the real row 0 and of line 1 were committed
    lost = drop_parts_with(
        tmp_path / "out", lambda r: r["id"] == 0 or r["source"] == "rows.jsonl line 1"
    )
    second = run_job(job)
    assert second.rows_this_run == lost == 2
    again = outputs(tmp_path / "out")
    assert sorted(r["id"] for r in again if r["id"] is not None) == [0, 1, 3, 5]
    assert {(r["id"], r["source"]): r["token_ids"] for r in again} == complete


# -- defect 4: duplicates -----------------------------------------------------------------------


def test_duplicate_rows_refuse_the_job_up_front_naming_both_lines(tmp_path, tiny, monkeypatch):
    """Issue 14, defect 4: a repeated (id, adapter) silently shadowed its twin on resume. The
    job is refused before any work, naming both lines; validate says the same."""
    rows = make_rows(6)
    rows.append({**rows[1], "prompt": "another prompt"})  # line 7 repeats line 2: r0001, "a"
    rows.append({**rows[2], "adapter": "a"})  # r0002 with another adapter: not a duplicate
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = load_job(tmp_path, tiny)
    forbid_weights(monkeypatch)
    expected = (
        r"job 'tiny': 1 input row repeats the \(id, adapter\) of an earlier row, and each must "
        r"be unique: rows.jsonl line 7 repeats rows.jsonl line 2 \(id 'r0001', adapter 'a'\)"
    )
    with pytest.raises(JobError, match=expected):
        validate_job(job)
    with pytest.raises(JobError, match=expected + r".*nothing was run"):
        run_job(job)
    assert (
        not list((tmp_path / "out").glob("part-*"))
        and not (tmp_path / "out" / MANIFEST_FILE).exists()
    )

    with_fanout = load_job(tmp_path, tiny, fanout="all")  # the sweep replaces adapters: ids repeat
    with pytest.raises(JobError, match=r"2 input rows repeat .* line 7 repeats rows.jsonl line 2 \(id 'r0001'\); rows.jsonl line 8 repeats rows.jsonl line 3"):  # fmt: skip
        run_job(with_fanout)


# -- defect 7: a complete job -------------------------------------------------------------------


def test_rerunning_a_complete_job_is_a_quick_no_op(tmp_path, tiny, monkeypatch):
    """Issue 14, defect 7: a re-run of a finished job built the engine, wrote nothing and
    overwrote the stats with zeros. It now returns at once: no engine, no model, no write."""
    write_jsonl(tmp_path / "rows.jsonl", make_rows(9))
    job = load_job(tmp_path, tiny)
    run_job(job)
    out = tmp_path / "out"
    before = {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in out.iterdir()}
    assert {"_stats.parquet", SUCCESS_FILE} <= set(before)
    forbid_weights(monkeypatch)  # building an engine or loading weights would raise

    def no_reading(*args, **kwargs):
        raise AssertionError("a complete job's input was read")

    monkeypatch.setattr(manifest, "scan_input", no_reading)  # the scan: no input row is read
    monkeypatch.setattr(jobrun, "pending_items", no_reading)  # nor done rows skipped
    summary = run_job(job)
    assert summary.complete_already and summary.rows_this_run == 0
    assert summary.stats["rows"] == 9 and summary.stats["completion_tokens"] > 0
    after = {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in out.iterdir()}
    assert after == before
    result = invoke("run", write_job(tmp_path, tiny))
    assert result.exit_code == 0 and "complete already (9 rows" in result.stdout


# -- defect 9: values the writer cannot store ---------------------------------------------------


def test_an_unencodable_id_or_adapter_is_an_error_row_and_the_rest_are_kept(tmp_path, tiny):
    """Issue 14, defect 9: a lone surrogate from a JSON escape in an id or adapter name made the
    writer's whole buffer unwritable: finished rows were lost and every re-run failed."""
    write_lines(tmp_path / "rows.jsonl", [
        *make_rows(3),
        '{"id": "\\ud800", "prompt": "the lazy dog"}',                   # line 4
        '{"id": "ok-4", "adapter": "\\udc00x", "prompt": "the lazy dog"}',  # line 5
        '{"id": "ok-5", "prompt": "half a pair \\ud83d here"}',            # line 6
        *make_rows(2, start=6),
    ])  # fmt: skip
    job = load_job(tmp_path, tiny, part_rows=100)  # every row in one buffer
    summary = run_job(job)
    rows = outputs(tmp_path / "out")
    assert summary.stats["rows"] == len(rows) == 8 and summary.stats["error_rows"] == 3
    errors = {r["source"]: r for r in rows if r["finish_reason"] == "error"}
    assert set(errors) == {"rows.jsonl line 4", "rows.jsonl line 5", "rows.jsonl line 6"}
    assert errors["rows.jsonl line 4"]["id"] is None
    assert (
        "column 'id': '\\ud800' has a character UTF-8 cannot encode"
        in errors["rows.jsonl line 4"]["error"]
    )
    assert errors["rows.jsonl line 5"]["id"] is None  # a row whose adapter is unreadable
    assert "(row id 'ok-4')" in errors["rows.jsonl line 5"]["error"]
    assert errors["rows.jsonl line 6"]["id"] == "ok-5"
    assert "column 'prompt'" in errors["rows.jsonl line 6"]["error"]
    assert sum(r["finish_reason"] != "error" for r in rows) == 5
    (tmp_path / "out" / SUCCESS_FILE).unlink()
    assert run_job(job).rows_this_run == 0  # and a re-run resumes cleanly


def test_the_writer_buffer_stays_writable_after_a_bad_row(tmp_path):
    """Issue 14, defect 9 at the writer: whatever reaches it, a row that cannot be stored as
    given becomes an error row before it enters the buffer, and bad text is replaced."""
    with OutputWriter(tmp_path, part_rows=100) as writer:
        writer.write(Result(id="\ud800", adapter=None, text="x"))
        writer.write(Result(id="text", adapter=None, text="bad \ud83d text", token_ids=[5]))
        writer.write(Result(id="good", adapter=None, text="ok", token_ids=[1]))
    rows = outputs(tmp_path)
    assert [(r["id"], r["finish_reason"]) for r in rows] == [
        (None, "error"), ("text", "stop"), ("good", "stop")
    ]  # fmt: skip
    assert rows[0]["error"].startswith("row cannot be stored: id '\\ud800' has characters")
    assert rows[1]["text"] == "bad \ufffd text"

    from slora_batch.jobs.rows import RowSource

    with OutputWriter(tmp_path, part_rows=100) as writer:  # the source names the row
        writer.write(
            Result(id="fine", adapter="a\udfff", text="x", extra={"source": "in.jsonl line 2"})
        )
        writer.write(Result(id=RowSource("in.jsonl line 5"), adapter=None, text="ok"))
    rows = outputs(tmp_path)[3:]
    assert [(r["id"], r["source"], r["finish_reason"]) for r in rows] == [
        (None, "in.jsonl line 2", "error"), (None, "in.jsonl line 5", "stop")
    ]  # fmt: skip
    assert rows[0]["error"].startswith("in.jsonl line 2: row cannot be stored: adapter 'a\\udfff'")


# -- resume fingerprint -------------------------------------------------------------------------


def test_resume_refuses_an_output_made_from_other_inputs_or_settings(tmp_path, tiny):
    """Resume knows what it resumes: a changed input file, sampling, job key or adapter is named
    and refused (nothing stale is mixed in); --overwrite starts over."""
    shutil.copytree(tiny.adapters, tmp_path / "adapters")
    rows = make_rows(8)
    write_jsonl(tmp_path / "rows.jsonl", rows)
    keys = {"adapters": str(tmp_path / "adapters"), "part_rows": 2}
    run_job(load_job(tmp_path, tiny, **keys))
    out = tmp_path / "out"
    parts = {p: p.read_bytes() for _, p in part_files(out)}

    def refused(match: str, **changes) -> None:
        with pytest.raises(JobError, match=match):
            run_job(load_job(tmp_path, tiny, **{**keys, **changes}))
        assert {p: p.read_bytes() for _, p in part_files(out)} == parts

    hint = r"Nothing was run; re-run with --overwrite to start over"
    refused(r"sampling.max_new_tokens 8 -> 4\. " + hint, sampling={"max_new_tokens": 4})
    refused(r"keep_columns None -> \['label'\]", keep_columns=["label"])
    (out / SUCCESS_FILE).unlink()  # as after a kill: incomplete outputs are refused the same
    write_jsonl(tmp_path / "rows.jsonl", rows + make_rows(1, start=8))
    size = (tmp_path / "rows.jsonl").stat().st_size
    refused(rf"holds rows made from other inputs or settings: input rows.jsonl changed \(size [\d,]+ -> {size:,} bytes\)")  # fmt: skip
    write_jsonl(
        tmp_path / "rows.jsonl", [{**rows[0], "prompt": rows[0]["prompt"][::-1]}, *rows[1:]]
    )
    recorded = json.loads((out / MANIFEST_FILE).read_text())["fingerprint"]["input"]["rows.jsonl"]
    os.utime(tmp_path / "rows.jsonl", ns=(0, recorded[1]))  # same size and mtime, rewritten
    refused(r"input rows.jsonl changed \(content differs, same size")
    write_jsonl(tmp_path / "rows.jsonl", rows)
    weights = tmp_path / "adapters" / "a" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    (tmp_path / "adapters" / "c").mkdir()
    refused(r"adapter 'a' file adapter_model.safetensors changed \(content differs.*adapter 'c' added")  # fmt: skip

    summary = run_job(load_job(tmp_path, tiny, **keys), overwrite=True)
    assert summary.rows_skipped == 0 and summary.rows_this_run == 8


def test_a_stale_manifest_without_rows_starts_afresh_and_rows_without_one_are_refused(
    tmp_path, tiny
):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(4))
    run_job(load_job(tmp_path, tiny))
    out = tmp_path / "out"
    for path in out.iterdir():  # a kill after the manifest, before the first part
        if path.name != MANIFEST_FILE:
            path.unlink()
    write_jsonl(tmp_path / "rows.jsonl", make_rows(5))
    assert run_job(load_job(tmp_path, tiny)).rows_this_run == 5  # no row was stale: no refusal
    (out / MANIFEST_FILE).unlink()  # parts of an older version, which wrote no manifest
    with pytest.raises(JobError, match=rf"holds parts but no {MANIFEST_FILE}, so what produced them is unknown"):  # fmt: skip
        run_job(load_job(tmp_path, tiny))


# -- ids keep their type --------------------------------------------------------------------


def test_ids_keep_their_type_and_resume_compares_across_types(tmp_path, tiny):
    """Int ids come back as int64, string ids as strings; a file mixing both writes strings
    (7 as "7"), and resume finds such rows done."""
    ints = [{"id": 10 + i, "prompt": f"the quick fox {i}"} for i in range(4)]
    write_jsonl(tmp_path / "ints.jsonl", ints)
    write_parquet(tmp_path / "ints.parquet", ints)
    mixed = [{"id": 7, "prompt": "the quick fox"}, {"id": "x", "prompt": "the lazy dog"},
             {"id": 2**70, "prompt": "a big one"}, {"prompt": "no id"}]  # fmt: skip
    write_jsonl(tmp_path / "mixed.jsonl", mixed)
    for name in ("ints.jsonl", "ints.parquet"):
        run_job(load_job(tmp_path, tiny, input=name, output=f"out-{name}"))
        table = parts_table(tmp_path / f"out-{name}")
        assert table.schema.field("id").type == pa.int64()
        assert sorted(table["id"].to_pylist()) == [10, 11, 12, 13]
    job = load_job(tmp_path, tiny, input="mixed.jsonl", output="out-mixed", part_rows=1, window=1)
    run_job(job)
    out = tmp_path / "out-mixed"
    table = parts_table(out)
    assert table.schema.field("id").type == pa.string()
    assert sorted(table["id"].to_pylist(), key=str) == ["1180591620717411303424", "7", None, "x"]
    assert drop_parts_with(out, lambda r: r["id"] == "x") == 1
    again = run_job(job)  # the int 7 of the input is the "7" of the output: done
    assert (again.rows_skipped, again.rows_this_run) == (3, 1)
    assert len(outputs(out)) == 4

    write_jsonl(tmp_path / "both.jsonl", [{"id": 7, "prompt": "a"}, {"id": "7", "prompt": "b"}])
    with pytest.raises(JobError, match=r"line 2 repeats both.jsonl line 1 \(id 7"):
        run_job(load_job(tmp_path, tiny, input="both.jsonl", output="out-both"))


# -- columns: kept, unused ----------------------------------------------------------------------


def test_keep_columns_carry_input_columns_with_their_types(tmp_path, tiny):
    rows = make_rows(6)
    for i, row in enumerate(rows):
        row.update(
            label=i, task=f"t{i % 2}", meta={"k": i, "tag": "x"}, mixed=i if i % 2 else f"s{i}"
        )
    del rows[3]["label"]  # absent: null
    rows[4]["prompt"] = ""  # an error row keeps its columns too
    write_jsonl(tmp_path / "rows.jsonl", rows)
    run_job(load_job(tmp_path, tiny, keep_columns=["label", "task", "meta", "mixed"]))
    table = parts_table(tmp_path / "out")
    schema = table.schema
    assert schema.names[-4:] == ["label", "task", "meta", "mixed"]
    assert schema.field("label").type == pa.int64() and schema.field("task").type == pa.string()
    assert schema.field("meta").type == pa.struct([("k", pa.int64()), ("tag", pa.string())])
    from slora_batch.jobs.schema import JSON_TEXT

    assert schema.field("mixed").type == pa.string() and schema.field("mixed").metadata == JSON_TEXT
    got = {r["id"]: r for r in table.to_pylist()}
    for row in rows:
        out = got[row["id"]]
        assert out["label"] == row.get("label") and out["task"] == row["task"]
        assert out["meta"] == row["meta"]
        assert out["mixed"] == (
            row["mixed"] if isinstance(row["mixed"], str) else json.dumps(row["mixed"])
        )
    assert got["r0004"]["finish_reason"] == "error" and got["r0004"]["label"] == 4

    write_parquet(tmp_path / "rows.parquet", [{**r, "score": 0.5 * i} for i, r in enumerate(make_rows(3))])  # fmt: skip
    pq.write_table(
        pq.read_table(tmp_path / "rows.parquet").cast(
            pa.schema(
                [
                    f if f.name != "score" else pa.field("score", pa.float32())
                    for f in pq.read_schema(tmp_path / "rows.parquet")
                ]
            )  # fmt: skip
        ),
        tmp_path / "rows.parquet",
    )
    run_job(load_job(tmp_path, tiny, input="rows.parquet", output="out-all", keep_columns="all"))
    table = parts_table(tmp_path / "out-all")
    assert table.schema.field("score").type == pa.float32()  # the input's own type
    assert sorted(table["score"].to_pylist()) == [0.0, 0.5, 1.0]


def test_unused_columns_are_reported_with_a_did_you_mean(tmp_path, tiny, monkeypatch):
    rows = make_rows(4)
    rows[0]["max_tokens"] = 5
    rows[2]["max_tokens"] = 6
    rows[1]["promt"] = "typo"
    rows[3]["label"] = "x"
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = load_job(tmp_path, tiny)
    expected = [
        "column 'max_tokens' in 2 rows (first: rows.jsonl line 1) is neither used nor kept (did you mean 'max_new_tokens'?)",
        "column 'promt' in 1 row (first: rows.jsonl line 2) is neither used nor kept (did you mean 'prompt'?)",
        "column 'label' in 1 row (first: rows.jsonl line 4) is neither used nor kept (add it to keep_columns to carry it to the output)",
    ]  # fmt: skip
    forbid = monkeypatch.context()
    with forbid as patch:
        forbid_weights(patch)
        assert column_notes(validate_job(job).notes) == expected
        result = invoke("validate", write_job(tmp_path, tiny))
        assert result.exit_code == 0 and "note: " + expected[0] in result.stdout
    assert column_notes(run_job(job).notes) == expected
    result = invoke("run", write_job(tmp_path, tiny, output="out-cli"))
    assert result.exit_code == 0 and "note: " + expected[1] in result.stdout
    kept = run_job(load_job(tmp_path, tiny, output="out-kept", keep_columns=["label"]))
    assert [n.split(" in ")[0] for n in column_notes(kept.notes)] == [
        "column 'max_tokens'",
        "column 'promt'",
    ]


def column_notes(notes: list[str]) -> list[str]:
    """The notes on columns (the tiny model's raw-prompt note aside: ``test_user_datasets``)."""
    return [note for note in notes if note.startswith("column ")]


# -- one bad thing costs only its own rows ------------------------------------------------------


def test_a_broken_adapter_costs_only_its_rows(tmp_path, tiny, monkeypatch):
    adapters = {"a": str(tiny.adapters / "a"), "b": str(tiny.adapters / "b"),
                "dora": str(tiny.bad["dora"]), "mismatch": str(tiny.bad["rank-mismatch"])}  # fmt: skip
    rows = make_rows(6)
    rows += [{"id": "d1", "adapter": "dora", "prompt": "the lazy dog"},
             {"id": "m1", "adapter": "mismatch", "prompt": "the lazy dog"},
             {"id": "u1", "adapter": "nope", "prompt": "the lazy dog"}]  # fmt: skip
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = load_job(tmp_path, tiny, adapters=adapters)
    with monkeypatch.context() as patch:
        forbid_weights(patch)
        report = validate_job(job)
    assert sorted(report.broken) == ["dora", "mismatch"]
    assert "lora_magnitude_vector (DoRA's magnitude)" in report.broken["dora"]  # none in it
    assert any("line 7: adapter 'dora' cannot run: " in p for p in report.problems)
    summary = run_job(job)
    assert summary.stats["rows"] == 9 and summary.stats["adapters_broken"] == 2
    assert sorted(summary.broken) == ["dora", "mismatch"]
    out = {r["id"]: r for r in outputs(tmp_path / "out")}
    assert all(out[r["id"]]["finish_reason"] != "error" for r in rows[:6])
    assert out["d1"]["error"].startswith("rows.jsonl line 7: row 'd1' (adapter 'dora'): ")
    assert "DoRA" in out["d1"]["error"]
    assert out["m1"]["error"].startswith("rows.jsonl line 8: row 'm1' (adapter 'mismatch'): ")
    assert out["u1"]["error"].startswith("rows.jsonl line 9: row 'u1' (adapter 'nope'): unknown adapter 'nope'")  # fmt: skip
    result = invoke("run", write_job(tmp_path, tiny, adapters=adapters, output="out-cli"))
    assert result.exit_code == 0
    assert (
        "unusable adapter: dora: " in result.stdout and "its rows are error rows" in result.stdout
    )


def test_a_failed_job_does_not_stop_the_jobs_after_it(tmp_path, tiny):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    write_jsonl(tmp_path / "dups.jsonl", make_rows(2) + make_rows(1))
    base = yaml.safe_load(write_job(tmp_path, tiny).read_text())["jobs"][0]
    jobs = [
        {**base, "name": "first", "input": "missing.jsonl", "output": "out-1"},
        {**base, "name": "second", "input": "dups.jsonl", "output": "out-2"},
        {**base, "name": "third", "output": "out-3"},
    ]
    (tmp_path / "three.yaml").write_text(yaml.safe_dump({"jobs": jobs}))
    result = invoke("run", tmp_path / "three.yaml", "-q")
    assert result.exit_code == 1
    errors = [(name, message) for level, name, message in records(result.stderr)]
    assert errors[0][0] == "slora_batch.cli" and errors[-1][0] == "slora_batch.cli"
    assert errors[0][1].startswith("job 'first': input ") and "does not exist" in errors[0][1]
    assert errors[1][1].startswith("job 'second': 1 input row repeats the (id, adapter)")
    assert errors[-1][1] == "failed: 2 of 3 jobs (first, second)"
    assert read_success(tmp_path / "out-3")["rows"] == 3


def test_a_job_the_engine_fails_is_reported_and_the_next_runs(tmp_path, tiny, monkeypatch):
    """A crash of one job's engine (a device error, say) costs that job only; every engine is
    closed before the next job builds its own, so the next one gets the whole device."""
    write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    jobs = [load_job(tmp_path, tiny, name=n, output=f"out-{n}") for n in ("a", "b", "c")]
    events = []
    build = jobrun._build_engine

    def engine_for(plan):
        name = plan.job.name
        if name == "b":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        engine = build(plan)
        close = engine.close
        events.append(f"built {name}")
        engine.close = lambda: (events.append(f"closed {name}"), close())
        return engine

    from slora_batch.jobs.summary import JobFailure
    from slora_batch.runner import run_jobs

    monkeypatch.setattr(jobrun, "_build_engine", engine_for)
    outcomes = list(run_jobs(jobs))
    assert [type(o) for o in outcomes] == [JobSummary, JobFailure, JobSummary]
    assert outcomes[1].error == (
        "job 'b' failed: RuntimeError: CUDA error: an illegal memory access was encountered"
    )
    assert events == ["built a", "closed a", "built c", "closed c"]
    assert (
        read_success(tmp_path / "out-c")["rows"] == 3 and read_success(tmp_path / "out-b") is None
    )


# -- commits by time ----------------------------------------------------------------------------


def test_parts_are_committed_by_time_as_well_as_by_rows(tmp_path):
    now = [0.0]
    writer = OutputWriter(tmp_path, part_rows=1000, part_seconds=30.0, clock=lambda: now[0])

    def row(i: int) -> Result:
        return Result(id=i, adapter=None, text="x", token_ids=[1])

    writer.write(row(0))
    now[0] = 10.0
    writer.write(row(1))
    writer.tick()
    assert part_files(tmp_path) == []
    now[0] = 30.0  # the oldest buffered row has waited 30 s
    writer.tick()
    assert [pq.read_table(p).num_rows for _, p in part_files(tmp_path)] == [2]
    writer.write(row(2))  # the clock of the next part starts with its first row
    now[0] = 59.0
    writer.write(row(3))
    assert len(part_files(tmp_path)) == 1
    now[0] = 60.0
    writer.write(row(4))
    writer.close()
    assert [pq.read_table(p).num_rows for _, p in part_files(tmp_path)] == [2, 3]


def test_a_job_commits_parts_by_time(tmp_path, tiny):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(12))
    engine = {"device": "cpu", "dtype": "float32", "num_pages": 16384, "max_num_seqs": 2}
    run_job(load_job(tmp_path, tiny, part_rows=4096, part_seconds=0.001, engine=engine))
    assert len(part_files(tmp_path / "out")) > 1  # never 4096 rows, yet several parts
    assert len(by_key(outputs(tmp_path / "out"))) == 12


# -- the command line ---------------------------------------------------------------------------


def test_progress_lines_without_a_terminal_and_verbose_debug(tmp_path, tiny):
    """Unattended (stderr not a terminal): plain progress lines with rows done/total, tok/s,
    adapters resident and ETA, no live bars or carriage returns; --verbose adds debug logs."""
    write_jsonl(tmp_path / "rows.jsonl", make_rows(6))
    result = invoke("run", write_job(tmp_path, tiny), "--progress-every", "0")
    assert result.exit_code == 0, result.output
    assert "\r" not in result.stderr and "━" not in result.stderr
    logged = [(name, message) for level, name, message in records(result.stderr)]
    assert logged[0] == ("slora_batch.jobs.manifest", "job tiny: scanning 1 input file")
    assert ("slora_batch.progress", "job tiny: loading the model") in logged
    progress = [message for name, message in logged if "/6 rows" in message]
    assert len(progress) == 7  # each row, then the end
    assert progress[-2].startswith("job tiny: 6/6 rows (100.0%), ")
    assert "generated tok/s, " in progress[-2] and "adapters resident, ETA 0:00:00" in progress[-2]
    assert progress[-1].endswith(", done")
    quiet = invoke("run", write_job(tmp_path, tiny), "--overwrite", "--verbose", "--quiet")
    assert quiet.stderr == ""
    verbose = invoke("run", write_job(tmp_path, tiny), "--overwrite", "--verbose")
    assert "DEBUG slora_batch.jobs.writer: committed " in verbose.stderr


def test_messages_count_in_words(tmp_path, tiny):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(2))
    job_file = write_job(tmp_path, tiny, part_rows=1, window=1)
    assert invoke("run", job_file, "-q").exit_code == 0
    drop_parts_with(tmp_path / "out", lambda r: r["id"] == "r0001")
    result = invoke("run", job_file)
    assert "resumed: 1 row was already done, 1 written this run" in result.stdout
    assert "│ rows     │ 2 rows (2 ok, 0 errors)" in result.stdout
    write_jsonl(tmp_path / "rows.jsonl", make_rows(1))  # another input: another output
    job_file = write_job(tmp_path, tiny, output="out-1")
    assert "input: 1 file, 1 row; 1 checked" in invoke("validate", job_file).stdout


def test_keep_columns_all_takes_every_input_column(tmp_path, tiny):
    rows = make_rows(4)
    for i, row in enumerate(rows):
        row.update(label=f"l{i}", text="an input column called text", max_new_tokens=4)
    rows[2]["late"] = 1.5  # first seen in the third row: null before
    write_jsonl(tmp_path / "rows.jsonl", rows)
    summary = run_job(load_job(tmp_path, tiny, keep_columns="all"))
    table = parts_table(tmp_path / "out")
    # every column but the id and adapter, those the job reads too; one named as an output
    # column under "input_<name>"
    assert table.schema.names[-6:] == [
        "input_prompt", "label", "input_text", "max_new_tokens", "late", "messages"
    ]  # fmt: skip
    assert table.schema.field("late").type == pa.float64()
    got = {r["id"]: r for r in table.to_pylist()}
    assert [got[r["id"]]["late"] for r in rows] == [None, None, 1.5, None]
    assert [got[r["id"]]["input_text"] for r in rows] == ["an input column called text"] * 4
    assert [got[r["id"]]["input_prompt"] for r in rows] == [r.get("prompt") for r in rows]
    assert column_notes(summary.notes) == [
        "column 'prompt' is kept as 'input_prompt': the output has its own 'prompt'",
        "column 'text' is kept as 'input_text': the output has its own 'text'",
    ]


# -- defect 1: a chat template that raises ------------------------------------------------------

RAISING_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_chat_template_that_raises_is_an_error_row_and_validate_reports_it(tmp_path, tiny):
    """Defect 1 (c06029c): a template's ``raise_exception`` (Llama-2, Mistral and Gemma refuse a
    system turn) escaped as jinja2's TemplateError: the job died at that row on every rerun and
    validate called the job fine. Now the row is an error row naming its line and the
    template's message; the other rows run; validate lists it."""
    model = tmp_path / "model"
    shutil.copytree(tiny.model, model)
    settings_path = model / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text())
    settings["chat_template"] = RAISING_TEMPLATE
    settings_path.write_text(json.dumps(settings))
    (model / "chat_template.jinja").unlink(missing_ok=True)  # transformers 5 reads it first
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    write_lines(
        tmp_path / "rows.jsonl",
        [
            {"id": 1, "messages": [{"role": "user", "content": "Hello there"}]},
            {"id": 2, "messages": system},
            {"id": 3, "prompt": "plain text"},
        ],
    )
    job = load_job(tmp_path, tiny, model=str(model))
    report = validate_job(job)
    assert any("line 2" in p and "System role not supported" in p for p in report.problems)
    run_job(job)
    rows = {r["id"]: r for r in parts_table(tmp_path / "out").to_pylist()}
    assert rows[2]["finish_reason"] == "error"
    assert "line 2" in rows[2]["error"] and "System role not supported" in rows[2]["error"]
    assert rows[1]["error"] is None and rows[3]["error"] is None
    assert read_success(tmp_path / "out")["rows"] == 3
