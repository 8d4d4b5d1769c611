"""Input listing, streaming rows into requests (bad rows become error results)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slora_batch.engine.config import SamplingConfig
from slora_batch.engine.requests.request import Request, Result
from slora_batch.jobs.lock import OutputLock
from slora_batch.jobs.outdir import LOCK_FILE, OutputError, read_success, write_success
from slora_batch.jobs.reader import InputError, iter_input_files, read_rows
from slora_batch.jobs.resume import done_samples
from slora_batch.jobs.rows import RowSource, row_key, to_request
from slora_batch.jobs.schema import PART_SCHEMA, SCORE_FIELDS
from slora_batch.jobs.stats import STATS_SCHEMA, output_counts, write_stats
from slora_batch.jobs.writer import OutputWriter

COLUMNS = {"id": "id", "adapter": "adapter", "prompt": "prompt", "messages": "messages"}
SAMPLING = SamplingConfig()
ROWS = [
    {"id": "a", "adapter": "shout", "prompt": "Hello"},
    {"id": "b", "adapter": None, "prompt": "Hi there", "max_new_tokens": 5, "stop": "\n"},
    {
        "id": "c",
        "adapter": "",
        "messages": [{"role": "user", "content": "Hey"}],
        "temperature": 0.5,
    },
    {"id": None, "adapter": "calm", "prompt": "Why?", "top_k": 3, "seed": 11, "ignore_eos": True},
]


def write_jsonl(path: Path, rows: list, raw_lines: dict[int, str] | None = None) -> Path:
    lines = [json.dumps(row) for row in rows]
    for index, text in (raw_lines or {}).items():
        lines.insert(index, text)
    path.write_text("\n".join(lines) + "\n")
    return path


def requests(files: list[Path], columns: dict[str, str] = COLUMNS) -> list[Request | Result]:
    return [to_request(row, SAMPLING) for row in read_rows(files, columns)]


def bare(items: list[Request | Result]) -> list[Request | Result]:
    """The items without ``extra`` and ``source``, which name the file they came from."""
    return [
        dataclasses.replace(i, extra=None, **({"source": None} if isinstance(i, Request) else {}))
        for i in items
    ]


def done_ids(out_dir: Path) -> set[str]:
    """The ids of the done keys ("<length>:<id><adapter>")."""
    keys = done_samples(out_dir).keys()
    return {rest[: int(n)] for n, rest in (key.split(":", 1) for key in keys)}


def test_iter_input_files(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("b.jsonl", "a.parquet", "c.JSONL", "notes.txt", ".hidden.jsonl", "_meta.parquet"):
        (data / name).write_text("")
    (data / "sub").mkdir()
    (data / "sub" / "d.jsonl").write_text("")
    assert [p.name for p in iter_input_files(str(data))] == ["a.parquet", "b.jsonl", "c.JSONL"]
    assert [p.name for p in iter_input_files(str(data / "*.jsonl"))] == ["b.jsonl"]
    assert [p.name for p in iter_input_files(str(data / "**" / "*.jsonl"))] == [
        "b.jsonl",
        "d.jsonl",
    ]
    assert iter_input_files(str(data / "b.jsonl")) == [data / "b.jsonl"]
    with pytest.raises(InputError, match=r"'.*/data/\*\.csv': no \.jsonl or \.parquet files match"):
        iter_input_files(str(data / "*.csv"))
    with pytest.raises(InputError, match="missing.jsonl' does not exist"):
        iter_input_files(str(data / "missing.jsonl"))
    with pytest.raises(InputError, match="unsupported file type '.txt'"):
        iter_input_files(str(data / "notes.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="empty': directory holds no"):
        iter_input_files(str(tmp_path / "empty"))


def test_jsonl_and_parquet_give_identical_requests(tmp_path):
    jsonl = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    parquet = tmp_path / "rows.parquet"
    keys = dict.fromkeys(k for row in ROWS for k in row)  # from_pylist only sees row 0's keys
    pq.write_table(pa.table({k: [row.get(k) for row in ROWS] for k in keys}), parquet)
    from_jsonl, from_parquet = requests([jsonl]), requests([parquet])
    assert bare(from_jsonl)[:3] == bare(from_parquet)[:3]
    assert bare(from_jsonl)[:3] == [
        Request(id="a", adapter="shout", prompt="Hello"),
        Request(id="b", prompt="Hi there", max_new_tokens=5, stop=["\n"]),
        Request(id="c", messages=[{"role": "user", "content": "Hey"}], temperature=0.5),
    ]
    # no id: the row is known by where it came from, which no given id can equal
    assert from_jsonl[3].id == RowSource("rows.jsonl line 4")
    assert from_parquet[3].id == RowSource("rows.parquet row 3")
    assert bare(from_jsonl)[3] == dataclasses.replace(
        Request(id=None, adapter="calm", prompt="Why?", top_k=3, seed=11, ignore_eos=True),
        id=from_jsonl[3].id,
    )
    assert from_jsonl[0].source == "rows.jsonl line 1"
    assert from_jsonl[0].extra == {"source": "rows.jsonl line 1", "row_index": 0, "prompt": "Hello"}
    assert from_jsonl[2].extra["prompt"] == '[{"role": "user", "content": "Hey"}]'  # JSON text
    int_ids = [{"id": 10, "prompt": "x"}, {"id": None, "prompt": "y"}]
    pq.write_table(pa.Table.from_pylist(int_ids), parquet)
    from_parquet = requests([parquet])
    assert [r.id for r in from_parquet] == [10, RowSource("rows.parquet row 1")]
    from_jsonl = requests([write_jsonl(tmp_path / "rows.jsonl", int_ids)])
    assert [r.id for r in from_jsonl] == [10, RowSource("rows.jsonl line 2")]


def test_directory_of_files_numbers_rows_globally(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "1.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    pq.write_table(pa.Table.from_pylist([{"prompt": "c"}, {"prompt": "d"}]), data / "2.parquet")
    write_jsonl(data / "3.jsonl", [{"prompt": "e"}], raw_lines={0: ""})  # blank line skipped
    rows = list(read_rows(iter_input_files(str(data)), COLUMNS))
    assert [(r.position, r.file.name, r.number) for r in rows] == [
        (0, "1.jsonl", 1), (1, "1.jsonl", 2), (2, "2.parquet", 0), (3, "2.parquet", 1), (4, "3.jsonl", 2)
    ]  # fmt: skip
    out = [to_request(r, SAMPLING) for r in rows]
    assert [(str(r.id), r.prompt) for r in out] == [
        ("1.jsonl line 1", "a"), ("1.jsonl line 2", "b"), ("2.parquet row 0", "c"),
        ("2.parquet row 1", "d"), ("3.jsonl line 2", "e"),
    ]  # fmt: skip
    assert all(isinstance(r.id, RowSource) for r in out)


def test_bad_rows_become_error_results(tmp_path):
    good = {"id": "ok", "prompt": "fine"}
    bad = [
        {"id": "int-prompt", "prompt": 5},
        {"id": "empty", "prompt": ""},
        {"id": "msg-str", "messages": "hello"},
        {"id": "msg-role", "messages": [{"role": 1, "content": "x"}]},
        {"id": "msg-extra", "messages": [{"role": "user", "content": "x", "name": "bob"}]},
        {"id": "both", "prompt": "p", "messages": [{"role": "user", "content": "x"}]},
        {"id": "neither"},
        {"id": 1.5, "prompt": "p"},
        {"id": "adapter-int", "adapter": 3, "prompt": "p"},
        {"id": "bad-temp", "prompt": "p", "temperature": -1},
    ]
    path = write_jsonl(
        tmp_path / "rows.jsonl", [good, *bad, good], raw_lines={1: "{not json", 2: "[1, 2]"}
    )
    out = requests([path])
    assert [type(o).__name__ for o in out] == ["Request"] + ["Result"] * 12 + ["Request"]
    errors = [o.error for o in out[1:-1]]
    expected = [
        "rows.jsonl line 2: malformed JSON",
        "rows.jsonl line 3: expected a JSON object, got list",
        "rows.jsonl line 4: column 'prompt' must be a string, got int 5",
        "rows.jsonl line 5: column 'prompt' is empty",
        "rows.jsonl line 6: column 'messages' must be a non-empty list",
        "rows.jsonl line 7: messages[0].role must be a non-empty string, got int 1",
        "rows.jsonl line 8: messages[0] has unsupported key 'name'",
        "rows.jsonl line 9: give one of the prompt columns, not 'prompt' and 'messages'",
        "rows.jsonl line 10: row has none of the columns 'prompt', 'messages', 'prompt_token_ids'",
        "rows.jsonl line 11: column 'id' must be a non-empty string or an integer, got float 1.5",
        "rows.jsonl line 12: column 'adapter' must be a string or null, got int 3",
        "rows.jsonl line 13: per-row override: temperature must be >= 0",
    ]
    for error, want in zip(errors, expected, strict=True):
        assert want in error
    assert all(o.finish_reason == "error" and o.text == "" for o in out[1:-1])
    # unreadable lines and rows whose id or adapter cannot be read are known by their source
    assert [o.id for o in out[1:4]] == [
        RowSource("rows.jsonl line 2"), RowSource("rows.jsonl line 3"), "int-prompt"
    ]  # fmt: skip
    assert out[10].id == RowSource("rows.jsonl line 11")  # id 1.5
    assert out[11].id == RowSource("rows.jsonl line 12") and "(row id 'adapter-int')" in errors[10]


def test_parquet_wrong_column_type_and_mapped_names(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"key": ["x", "y"], "question": [1, 2]}), path)
    out = requests([path], {**COLUMNS, "id": "key", "prompt": "question"})
    assert [o.id for o in out] == ["x", "y"]
    assert "rows.parquet row 1: column 'question' must be a string, got int 2" in out[1].error


def test_unreadable_parquet_names_the_file_and_missing_columns_are_row_errors(tmp_path):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match="broken.parquet: cannot read as Parquet"):
        requests([broken])
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), other)
    out = requests([other])
    assert [o.id for o in out] == [
        RowSource("other.parquet row 0"),
        RowSource("other.parquet row 1"),
    ]
    assert "other.parquet row 1: row has none of the columns 'prompt', 'messages'" in out[1].error


def test_parquet_messages_struct_with_null_fields(tmp_path):
    path = tmp_path / "rows.parquet"
    messages = [
        [{"role": "user", "content": "a", "name": None}],
        [{"role": "user", "content": "b", "name": "x"}],
    ]
    pq.write_table(pa.table({"messages": messages}), path)
    first, second = requests([path])
    assert first.messages == [{"role": "user", "content": "a"}]
    assert "unsupported key 'name'" in second.error


def result(id_, adapter=None, tokens=(1, 2), reason="stop", error=None) -> Result:
    return Result(id=id_, adapter=adapter, text=f"t{id_}", token_ids=list(tokens), prompt_tokens=3,
                  completion_tokens=len(tokens), finish_reason=reason, error=error)  # fmt: skip


def test_writer_parts_schema_and_types(tmp_path):
    with OutputWriter(tmp_path / "out", part_rows=2) as writer:
        for i in range(5):
            writer.write(result(i, adapter="a" if i % 2 else ""))
        writer.write(result("x", reason="error", tokens=(), error="bad"))
    parts = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert parts == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert writer.rows_written == 6
    table = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    assert table.schema == PART_SCHEMA
    assert table.schema.field("token_ids").type == pa.list_(pa.int32())
    assert table.to_pylist()[1] == {
        "id": "1", "adapter": "a", "row_index": None, "sample_index": 0, "prompt": None,
        "text": "t1", "token_ids": [1, 2], "prompt_tokens": 3, "completion_tokens": 2,
        "finish_reason": "stop", "error": None, "source": None,
        **{f.name: None for f in SCORE_FIELDS}, "logprobs": None,  # a generated row: no scores
    }  # fmt: skip
    # the base model's rows: "" (a groupby on adapter keeps them)
    assert pq.read_table(tmp_path / "out" / "part-00000.parquet")["adapter"].to_pylist() == [
        "",
        "a",
    ]
    last = pq.read_table(tmp_path / "out" / "part-00002.parquet").to_pylist()
    assert last[-1]["finish_reason"] == "error" and last[-1]["error"] == "bad"


def test_crash_leftovers_are_ignored_and_numbering_continues(tmp_path):
    out = tmp_path / "out"
    with OutputWriter(out, part_rows=2) as writer:
        for i in range(4):
            writer.write(result(i))
    stale = out / ".part-00002.parquet.tmp-99999"  # a kill -9 during the third commit
    stale.write_bytes(b"PAR1 half a file")
    assert done_ids(out) == {"0", "1", "2", "3"}
    writer = OutputWriter(out, part_rows=2)
    assert not stale.exists()
    assert writer.next_part == 2
    writer.write(result(4))
    writer.close()
    assert sorted(p.name for p in out.iterdir())[-1] == "part-00002.parquet"
    assert done_ids(out) == {"0", "1", "2", "3", "4"}


def test_failed_commit_leaves_no_part_and_keeps_the_rows(tmp_path, monkeypatch):
    writer = OutputWriter(tmp_path, part_rows=10)
    writer.write(result(1))

    def disk_full(table, handle):
        handle.write(b"PAR1 half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq, "write_table", disk_full)
    with pytest.raises(OSError, match="No space left"):
        writer.flush()
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_FILE]
    monkeypatch.undo()
    writer.close()  # the rows are still buffered: committed once the disk has room
    assert done_ids(tmp_path) == {"1"}


def test_resume_keys_with_fanout(tmp_path):
    with OutputWriter(tmp_path, part_rows=3) as writer:
        for adapter in (None, "a", ""):
            writer.write(result(7, adapter=adapter))
        writer.write(result("8", adapter="b"))
    keys = done_samples(tmp_path).keys()
    assert keys == {row_key("7", None), row_key("7", "a"), row_key("8", "b")}
    assert row_key(7, "") in keys
    assert done_ids(tmp_path) == {"7", "8"}
    assert done_ids(tmp_path / "missing") == set()


def test_reopen_and_overwrite(tmp_path):
    with OutputWriter(tmp_path, part_rows=1) as writer:
        writer.write(result(1))
    write_stats(tmp_path, {"rows": 1}, [])
    write_success(tmp_path, "job", 1)
    (tmp_path / "README").write_text("user file")
    OutputWriter(tmp_path, part_rows=1).close()  # resume: the job is incomplete again
    assert read_success(tmp_path) is None
    assert (tmp_path / "part-00000.parquet").exists() and (tmp_path / "_stats.parquet").exists()
    write_success(tmp_path, "job", 1)
    writer = OutputWriter(tmp_path, part_rows=1, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE, "README"]
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README"]  # the lock file goes too
    writer = OutputWriter(tmp_path, part_rows=1)
    assert writer.next_part == 0 and done_ids(tmp_path) == set()
    writer.close()


def test_one_writer_per_directory(tmp_path):
    first = OutputWriter(tmp_path / "out", part_rows=1)
    with pytest.raises(OutputError, match=rf"'.*out' is in use by another run \(pid {os.getpid()}"):
        OutputWriter(tmp_path / "out", part_rows=1)
    first.close()
    with OutputLock(tmp_path / "out") as lock:  # released on close: a later run may take it
        OutputWriter(tmp_path / "out", part_rows=1, lock=lock).close()
        with pytest.raises(OutputError, match="in use by another run"):
            OutputLock(tmp_path / "out")
    OutputWriter(tmp_path / "out", part_rows=1).close()


def test_unreadable_part_is_named(tmp_path):
    (tmp_path / "part-00000.parquet").write_bytes(b"not parquet")
    with pytest.raises(OutputError, match=r"part-00000.parquet: committed part is unreadable"):
        done_samples(tmp_path)


def test_stats_columns_and_types(tmp_path):
    job_row = {
        "rows": 10, "ok_rows": 9, "error_rows": 1, "prompt_tokens": 100, "completion_tokens": 50,
        "wall_s": 2, "tokens_per_s": 25.0, "requests_per_s": 5.0, "adapters_seen": 2,
        "adapter_loads": 3, "adapter_evictions": 1, "prefetch_hits": 2, "peak_pool_pages": 77,
        "device": "cpu", "dtype": "float32",
    }  # fmt: skip
    adapter_rows = [{"adapter": None, "rows": 4, "tokens": 20, "seconds": 1.0},
                    {"adapter": "a", "rows": 6, "tokens": 30, "seconds": 1.5}]  # fmt: skip
    table = pq.read_table(write_stats(tmp_path, job_row, adapter_rows))
    assert table.schema == STATS_SCHEMA
    assert table["kind"].to_pylist() == ["job", "adapter", "adapter"]
    assert table["adapter"].to_pylist() == [None, None, "a"]
    assert table["wall_s"].to_pylist() == [2.0, None, None]
    assert table["tokens"].to_pylist() == [None, 20, 30]
    for name in ("rows", "ok_rows", "error_rows", "adapter_loads", "peak_pool_pages"):
        assert table.schema.field(name).type == pa.int64()
    assert [p.name for p in tmp_path.iterdir()] == ["_stats.parquet"]
    with pytest.raises(ValueError, match="unknown column 'wall'"):
        write_stats(tmp_path, {"wall": 1.0}, [])


def test_success_marker(tmp_path):
    write_success(tmp_path, "sample", 42)
    marker = read_success(tmp_path)
    assert marker["job"] == "sample" and marker["rows"] == 42 and marker["time"].endswith("Z")


def test_output_counts_per_adapter_over_every_part(tmp_path):
    with OutputWriter(tmp_path, part_rows=2) as writer:
        writer.write(result(1))
        writer.write(result(2, adapter="a", tokens=(5, 6, 7)))
        writer.write(result(3, adapter="a", reason="error", tokens=(), error="bad"))
    no_scores = {"scored_rows": 0, "answered_rows": 0, "correct_rows": 0}
    # the error row's 3 prompt tokens are not counted: an error row computed nothing
    assert output_counts(tmp_path) == {
        None: {"rows": 1, "ok_rows": 1, "error_rows": 0, "prompt_tokens": 3, "completion_tokens": 2,
               **no_scores},
        "a": {"rows": 2, "ok_rows": 1, "error_rows": 1, "prompt_tokens": 3, "completion_tokens": 3,
              **no_scores},
    }  # fmt: skip
    assert output_counts(tmp_path / "missing") == {}
