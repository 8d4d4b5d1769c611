"""Jobs end to end on a tiny random model: input formats, fan-out, error rows, resume, stats,
progress, validation without weights, and outputs equal to the engine API's.

The tiny model (2 layers, hidden 64) carries the sample model's tokenizer, so rows use ``prompt``
and ``messages`` as real inputs do; its vocabulary (49152) covers the tokenizer.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from factory import ALL, make_adapter

from slora_batch import Engine, Request
from slora_batch.jobs.check import JobError, check_job
from slora_batch.jobs.config import load_jobs
from slora_batch.jobs.lock import OutputLock
from slora_batch.jobs.outdir import LOCK_FILE, read_success
from slora_batch.jobs.preview import preview
from slora_batch.jobs.run import run_job
from slora_batch.jobs.validate import validate_job

CONTEXT = 256  # the tiny model's max_position_embeddings
PAGES = 16384  # 4 MiB of pool: enough for these jobs, and no 1 GiB allocation per engine
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "hex",
]


@dataclass
class Tiny:
    model: Path
    adapters: Path  # "a" (rank 4, q/v) and "b" (rank 8, every target)
    bad: dict[str, Path]  # incompatible adapters: "rank-mismatch", "dora"


# ``python -c SIGNALLER JOB SIGNAL N [PIDS]``: ``slora-batch run JOB`` that sends itself SIGNAL as
# its N-th row is written (first naming its worker processes in the file PIDS, if given): a
# signal at an exact row, where one from a test that watched the progress lines came after the
# last row when the run outpaced it. SIGINT as a terminal's foreground job has it: a shell's
# background job (CI started from one) starts with SIGINT ignored, which Python and the run keep.
SIGNALLER = """
import multiprocessing, os, signal, sys
from slora_batch.jobs import writer
signal.signal(signal.SIGINT, signal.default_int_handler)
job_file, sig, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
real_write, rows = writer.OutputWriter.write, 0
def write(self, result):
    global rows
    real_write(self, result)
    rows += 1
    if rows == n:
        if len(sys.argv) > 4:
            with open(sys.argv[4], "w") as handle:
                handle.write(" ".join(str(p.pid) for p in multiprocessing.active_children()))
        os.kill(os.getpid(), sig)  # delivered to the CLI's handler before the next row
writer.OutputWriter.write = write
from cli import app
app(["run", job_file, "--progress-every", "0"])
"""


def build_tiny(root: Path, sample_model_dir: Path) -> Tiny:
    """The tiny model, its adapters and two broken adapters under ``root`` (built once)."""
    tiny = Tiny(
        root / "model", root / "adapters", {n: root / "bad" / n for n in ("rank-mismatch", "dora")}
    )
    if (root / "done").exists():
        return tiny
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        tie_word_embeddings=True, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
        pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tiny.model)
    for file in sample_model_dir.iterdir():
        if file.name.startswith("tokenizer") or file.suffix == ".jinja":
            shutil.copy(file, tiny.model / file.name)
    make_adapter(tiny.model, tiny.adapters / "a", 4, ["q_proj", "v_proj"], 8, False, seed=1)
    make_adapter(tiny.model, tiny.adapters / "b", 8, ALL, 8, False, seed=2)
    for name, edit in (("rank-mismatch", {"r": 8}), ("dora", {"use_dora": True})):
        shutil.copytree(tiny.adapters / "a", tiny.bad[name])
        config_path = tiny.bad[name] / "adapter_config.json"
        config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **edit}))
    (root / "done").touch()
    return tiny


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's ops are too small to split between threads: one thread runs these tests
    several times faster (ten times on a busy 2-core machine)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, sample_model_dir) -> Tiny:
    return build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)


def make_rows(n: int, start: int = 0) -> list[dict]:
    """Rows cycling base / "a" / "b", prompts and chat messages of varied lengths."""
    rows = []
    for i in range(start, start + n):
        text = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 9))
        row = {"id": f"r{i:04d}", "adapter": [None, "a", "b"][i % 3]}
        if i % 4 == 3:
            row["messages"] = [{"role": "user", "content": text}]
        else:
            row["prompt"] = text
        rows.append(row)
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    full = [{"prompt": None, "messages": None, **row} for row in rows]
    pq.write_table(pa.Table.from_pylist(full), path)
    return path


def write_job(directory: Path, tiny: Tiny, **keys) -> Path:
    """A job file for the tiny model; ``keys`` override or add job keys."""
    job = {
        "name": "tiny",
        "model": str(tiny.model),
        "adapters": str(tiny.adapters),
        "input": "rows.jsonl",
        "output": "out",
        "part_rows": 16,
        "sampling": {"max_new_tokens": 8},
        "engine": {"device": "cpu", "dtype": "float32", "num_pages": PAGES},
        **keys,
    }
    path = directory / "jobs.yaml"
    path.write_text(yaml.safe_dump({"jobs": [job]}))
    return path


def load_job(directory: Path, tiny: Tiny, **keys):
    (job,) = load_jobs(write_job(directory, tiny, **keys))
    return job


def outputs(out_dir: Path) -> list[dict]:
    return pq.read_table(sorted(Path(out_dir).glob("part-*.parquet"))).to_pylist()


def by_key(rows: list[dict]) -> dict[tuple, dict]:
    keyed = {(r["id"], r["adapter"]): r for r in rows}
    assert len(keyed) == len(rows), "an output row appears twice"
    return keyed


def generated(rows: list[dict]) -> dict[tuple, tuple]:
    return {k: (r["token_ids"], r["text"], r["finish_reason"]) for k, r in by_key(rows).items()}


def test_jsonl_parquet_and_a_directory_give_the_same_outputs(tmp_path, tiny):
    rows = make_rows(24)
    write_jsonl(tmp_path / "rows.jsonl", rows)
    write_parquet(tmp_path / "rows.parquet", rows)
    write_jsonl(tmp_path / "dir" / "1.jsonl", rows[:8])
    write_parquet(tmp_path / "dir" / "2.parquet", rows[8:17])
    write_jsonl(tmp_path / "dir" / "3.jsonl", rows[17:])
    results = {}
    for name, spec in (("jsonl", "rows.jsonl"), ("parquet", "rows.parquet"), ("dir", "dir")):
        job = load_job(tmp_path, tiny, input=spec, output=f"out-{name}")
        summary = run_job(job)
        assert summary.stats["rows"] == summary.rows_this_run == 24
        assert summary.stats["error_rows"] == 0
        results[name] = generated(outputs(tmp_path / f"out-{name}"))
    assert results["jsonl"] == results["parquet"] == results["dir"]
    assert {adapter for _, adapter in results["jsonl"]} == {"", "a", "b"}  # "": the base model


def test_outputs_equal_the_engine_api(tmp_path, tiny):
    rows = make_rows(18)
    rows[4]["max_new_tokens"] = 3  # per-row sampling override
    write_jsonl(tmp_path / "rows.jsonl", rows)
    run_job(load_job(tmp_path, tiny, sampling={"max_new_tokens": 12}))
    got = generated(outputs(tmp_path / "out"))
    from slora_batch import EngineConfig, SamplingConfig

    engine = Engine(tiny.model, adapters=tiny.adapters,
                    config=EngineConfig(device="cpu", dtype="float32", num_pages=PAGES),
                    sampling=SamplingConfig(max_new_tokens=12))  # fmt: skip
    expected = {
        (r.id, r.adapter or ""): (r.token_ids, r.text, r.finish_reason)
        for r in engine.generate(Request(**row) for row in rows)
    }
    assert got == expected
    assert len(got[("r0004", "a")][0]) <= 3


def test_fanout_runs_every_row_through_base_and_every_adapter(tmp_path, tiny):
    rows = make_rows(5)
    rows[0]["adapter"] = "nope"  # a row's own adapter is replaced by the sweep's
    write_jsonl(tmp_path / "rows.jsonl", rows)
    summary = run_job(load_job(tmp_path, tiny, fanout="all"))
    keys = set(by_key(outputs(tmp_path / "out")))
    assert keys == {(r["id"], a) for r in rows for a in ("", "a", "b")}
    assert summary.stats["error_rows"] == 0 and summary.stats["adapters_seen"] == 2
    shown = preview(load_job(tmp_path, tiny, fanout="all"), limit=5)
    assert [(p.id, p.adapter) for p in shown] == [("r0000", None), ("r0000", "a"), ("r0000", "b")]
    assert shown[0].prompt == rows[0]["prompt"]


def test_bad_rows_become_error_rows_and_the_job_completes(tmp_path, tiny):
    rows = make_rows(6)
    rows += [
        {"id": "missing-adapter", "adapter": "nope", "prompt": "hello"},
        {"id": "empty", "prompt": ""},
        {"id": "too-long", "prompt": "word " * (CONTEXT + 50)},
        {"id": "wrong-type", "prompt": 123},
    ]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    summary = run_job(load_job(tmp_path, tiny))
    out = {r["id"]: r for r in outputs(tmp_path / "out")}
    assert len(out) == 10
    errors = {i: r["error"] for i, r in out.items() if r["finish_reason"] == "error"}
    assert set(errors) == {"missing-adapter", "empty", "too-long", "wrong-type"}
    assert "row 'missing-adapter'" in errors["missing-adapter"]
    assert "unknown adapter 'nope' (2 adapters known)" in errors["missing-adapter"]
    assert "rows.jsonl line 8: column 'prompt' is empty" in errors["empty"]
    assert "row 'too-long'" in errors["too-long"]
    assert f"does not fit the context of {CONTEXT} tokens" in errors["too-long"]
    assert "line 10: column 'prompt' must be a string, got int 123" in errors["wrong-type"]
    assert all(out[i]["token_ids"] == [] and out[i]["text"] == "" for i in errors)
    assert all(r["error"] is None for i, r in out.items() if i not in errors)
    assert summary.stats["error_rows"] == 4 and summary.stats["ok_rows"] == 6
    assert read_success(tmp_path / "out")["rows"] == 10
    per_adapter = {row["adapter"]: row for row in summary.adapters}
    assert per_adapter["nope"]["error_rows"] == per_adapter["nope"]["rows"] == 1


def test_resume_skips_done_rows_and_stats_count_the_whole_output(tmp_path, tiny):
    rows = make_rows(24)
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = load_job(tmp_path, tiny, part_rows=6)
    first = run_job(job)
    complete = generated(outputs(tmp_path / "out"))
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    assert len(parts) == 4
    lost = pq.read_table(parts[1]).num_rows + pq.read_table(parts[3]).num_rows
    parts[1].unlink()
    parts[3].unlink()
    (tmp_path / "out" / "_SUCCESS").unlink()  # as after a kill

    second = run_job(job)
    assert (second.rows_skipped, second.rows_this_run) == (24 - lost, lost)
    assert generated(outputs(tmp_path / "out")) == complete
    for key in ("rows", "ok_rows", "prompt_tokens", "completion_tokens"):
        assert second.stats[key] == first.stats[key], key
    stats = pq.read_table(tmp_path / "out" / "_stats.parquet").to_pylist()
    assert stats[0]["kind"] == "job" and stats[0]["rows"] == 24
    assert [r["rows"] for r in stats[1:]] == [8, 8, 8]
    # this run's share beside the whole output's counts: its rates are of its own tokens
    job_row = stats[0]
    assert job_row["rows_this_run"] == sum(r["rows_this_run"] for r in stats[1:]) == lost
    this_run = job_row["completion_tokens_this_run"]
    assert this_run == second.completion_tokens_this_run < job_row["completion_tokens"]
    assert job_row["tokens_per_s"] == pytest.approx(this_run / job_row["engine_s"])
    assert job_row["requests_per_s"] == pytest.approx(lost / job_row["engine_s"])
    assert read_success(tmp_path / "out")["rows"] == 24

    third = run_job(job)  # complete: nothing to generate, stats unchanged
    assert third.complete_already and third.rows_this_run == 0 and third.stats["rows"] == 24
    fourth = run_job(job, overwrite=True)
    assert fourth.rows_skipped == 0 and fourth.rows_this_run == 24
    assert generated(outputs(tmp_path / "out")) == complete


def test_stats_and_progress(tmp_path, tiny):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(12))
    events = []
    summary = run_job(load_job(tmp_path, tiny), progress=events.append)
    assert [e.phase for e in events[:2]] == ["scanning", "loading"]
    assert events[-1].phase == "done"
    running = [e for e in events if e.phase == "running"]
    assert [e.rows_done for e in running] == list(range(1, 13))
    assert [e.rows_this_run for e in running] == list(range(1, 13))
    assert events[0].rows_total is None and all(e.rows_total == 12 for e in events[1:])
    assert running[-1].completion_tokens == summary.stats["completion_tokens"] > 0
    table = pq.read_table(tmp_path / "out" / "_stats.parquet")
    job_row = table.to_pylist()[0]
    assert job_row["device"] == "cpu" and job_row["dtype"] == "float32"
    assert job_row["adapter_loads"] == 2 and job_row["adapters_seen"] == 2
    assert job_row["peak_pool_pages"] > 0 and job_row["tokens_per_s"] > 0
    # tokens/s counts engine time; load, warmup, reading and writing are their own fields: each
    # measured (building the runner is warmup even on a CPU) and none counted in another
    assert job_row["load_s"] > 0 and job_row["warmup_s"] > 0 and job_row["engine_s"] > 0
    assert job_row["write_s"] > 0 and job_row["read_s"] > 0
    assert job_row["tokens_per_s"] == pytest.approx(
        job_row["completion_tokens"] / job_row["engine_s"]
    )
    busy = sum(job_row[key] for key in ("load_s", "warmup_s", "engine_s", "read_s", "write_s"))
    assert busy <= job_row["wall_s"]
    assert job_row["adapter_disk_loads"] == 2 and job_row["adapters_broken"] == 0
    adapters = table.to_pylist()[1:]
    assert [r["adapter"] for r in adapters] == [None, "a", "b"]
    assert all(r["seconds"] > 0 and r["tokens"] == r["completion_tokens"] for r in adapters)


def test_output_directory_is_locked_while_a_job_runs(tmp_path, tiny):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    job = load_job(tmp_path, tiny)
    with OutputLock(job.output), pytest.raises(JobError, match=r"job 'tiny': output directory .* is in use by another run"):  # fmt: skip
        run_job(job)
    assert not list(Path(job.output).glob("part-*"))
    run_job(job)
    assert read_success(job.output)["rows"] == 3
    assert not (Path(job.output) / LOCK_FILE).exists()  # removed on release, safely


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"input": "missing.jsonl"}, r"job 'tiny': input '.*missing.jsonl' does not exist"),
        ({"adapters": "missing-dir"}, r"job 'tiny': adapters directory '.*missing-dir' does not exist"),
        ({"model": "/nonexistent/model"}, r"job 'tiny': model '/nonexistent/model': no such directory"),
    ],
)  # fmt: skip
def test_job_level_errors_fail_before_any_work(tmp_path, tiny, monkeypatch, keys, message):
    write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    job = load_job(tmp_path, tiny, **keys)
    forbid_weights(monkeypatch)
    with pytest.raises(JobError, match=message):
        validate_job(job)
    with pytest.raises(JobError, match=message):
        run_job(job)
    assert not (tmp_path / "out").exists()


def forbid_weights(monkeypatch) -> None:
    import slora_batch.engine.engine
    import slora_batch.engine.models.loader

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(slora_batch.engine.models.loader, "load_model", refuse)
    monkeypatch.setattr(slora_batch.engine.engine, "load_model", refuse, raising=False)
    monkeypatch.setattr(slora_batch.engine.engine.Engine, "__init__", refuse)


def test_validate_reports_row_problems_without_loading_weights(tmp_path, tiny, monkeypatch):
    rows = make_rows(4) + [
        {"id": "missing-adapter", "adapter": "nope", "prompt": "hello"},
        {"id": "too-long", "prompt": "word " * (CONTEXT + 50)},
        {"id": "wrong-type", "prompt": 123},
    ]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    write_parquet(tmp_path / "typed.parquet", [{"id": 1, "prompt": 5}])
    forbid_weights(monkeypatch)
    report = validate_job(load_job(tmp_path, tiny))
    assert report.rows_total == 7 and report.rows_checked == 7
    assert [a.name for a in report.adapters] == ["a", "b"]
    assert len(report.problems) == 3
    assert "line 5: unknown adapter 'nope'" in report.problems[0]
    assert "line 6: prompt of" in report.problems[1] and "context of 256" in report.problems[1]
    assert "line 7: column 'prompt' must be a string" in report.problems[2]
    with pytest.raises(JobError, match="none of the 1 input rows checked can run") as typed:
        validate_job(load_job(tmp_path, tiny, input="typed.parquet"))  # no row can run: fails
    assert "column 'prompt' has type int64" in str(typed.value)
    assert validate_job(load_job(tmp_path, tiny, fanout="all")).rows_total == 7
    plan = check_job(load_job(tmp_path, tiny, fanout="all"))
    plan.rows_total = 7
    assert plan.total == 21
