"""The Ray job runner on a filesystem other than the local disk: input listing and reading, the
output's files and parts through ``pyarrow.fs`` (fsspec's in-memory filesystem). Whole jobs on a
non-local filesystem (the local disk wrapped as a ``PyFileSystem``, which every Ray worker
process can reach) run, skip and resume in test_ray_job's killed-actor test."""

from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray")
fsspec = pytest.importorskip("fsspec")

import pyarrow as pa  # noqa: E402
import pyarrow.fs as pafs  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from slora_batch.jobs.fsio import FsDir  # noqa: E402
from slora_batch.jobs.outdir import part_files, read_success, write_success  # noqa: E402
from slora_batch.jobs.reader import InputError, iter_input_files, read_rows  # noqa: E402
from slora_batch.jobs.scan import scan_input  # noqa: E402
from slora_batch.ray.fs import commit_table  # noqa: E402

COLUMNS = {"id": "id", "adapter": "adapter", "prompt": "prompt", "messages": "messages"}


@pytest.fixture
def memory():
    """A fresh in-memory pyarrow filesystem (fsspec's, wrapped)."""
    store = fsspec.filesystem("memory")
    store.store.clear()
    store.pseudo_dirs.clear()
    store.pseudo_dirs.append("")
    return pafs.PyFileSystem(pafs.FSSpecHandler(store))


def put(fs, path: str, data: bytes) -> None:
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as handle:
        handle.write(data)


def test_input_files_are_listed_and_read_through_the_filesystem(memory):
    lines = [{"id": 1, "adapter": "a", "prompt": "x", "tag": "t"}, {"id": 2, "prompt": "y"}]
    put(memory, "/in/b.jsonl", b"\n".join(json.dumps(r).encode() for r in lines) + b"\n{bad\n")
    table = pa.table({"id": [3, 4], "adapter": ["a", None], "prompt": ["z", "w"]})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    put(memory, "/in/a.parquet", sink.getvalue().to_pybytes())
    put(memory, "/in/_skip.jsonl", b"{}\n")
    put(memory, "/in/deep/c.jsonl", b'{"id": 5, "prompt": "v"}\n')
    put(memory, "/in/notes.txt", b"no\n")
    names = lambda files: [str(f) for f in files]  # noqa: E731
    assert names(iter_input_files("/in", memory)) == ["/in/a.parquet", "/in/b.jsonl"]
    assert names(iter_input_files("/in/*.jsonl", memory)) == ["/in/b.jsonl"]
    assert names(iter_input_files("/in/**/*.jsonl", memory)) == [
        "/in/b.jsonl",
        "/in/deep/c.jsonl",
    ]
    assert names(iter_input_files("/in/b.jsonl", memory)) == ["/in/b.jsonl"]
    for spec, message in [
        ("/in/missing.jsonl", "does not exist"),
        ("/in/notes.txt", "unsupported file type"),
        ("/in/*.csv", "no .jsonl or .parquet files match"),
    ]:
        with pytest.raises(InputError, match=message):
            iter_input_files(spec, memory)
    files = iter_input_files("/in", memory)
    rows = list(read_rows(files, COLUMNS, keep=["tag"], fs=memory))
    assert [(r.name, r.number, r.values.get("id"), r.error is None) for r in rows] == [
        ("a.parquet", 0, 3, True),
        ("a.parquet", 1, 4, True),
        ("b.jsonl", 1, 1, True),
        ("b.jsonl", 2, 2, True),
        ("b.jsonl", 3, None, False),
    ]
    assert rows[2].kept == {"tag": "t"}
    scan = scan_input(files, COLUMNS, ["tag"], False, fs=memory)
    assert scan.rows == 5 and scan.id_type == "int64" and scan.keep["tag"] == pa.string()


def test_output_files_and_parts_are_committed_through_the_filesystem(memory):
    out = FsDir(memory, "/out/job")
    assert part_files(out) == [] and read_success(out) is None
    commit_table(out, "part-00003.parquet", pa.table({"id": [1]}))
    write_success(out, "job", rows=1)
    assert [(n, str(p)) for n, p in part_files(out)] == [(3, "/out/job/part-00003.parquet")]
    assert read_success(out)["rows"] == 1
    assert out.names() == ["_SUCCESS", "part-00003.parquet"]  # no temp name was left
