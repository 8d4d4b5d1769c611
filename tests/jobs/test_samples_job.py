"""n samples per row through the job tool: every (id, adapter, sample_index) exactly once with
the engine's tokens, error rows standing for their samples in the counts (and in validate), a
SIGKILL between the samples of a row then a re-run that makes only the missing ones, and parts
written before ``sample_index`` existed read as sample 0 beside new ones.

Temperature 1 makes a row's samples differ; prompts are short and rows make 4 tokens each, so
the tiny model runs these in seconds on a CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_jobrun import (
    PAGES,
    build_tiny,
    load_job,
    make_rows,
    one_thread,  # noqa: F401 -- an autouse fixture: these tests run on one thread too
    outputs,
    write_job,
    write_jsonl,
)
from test_unattended_kill import killed_run

from slora_batch import Engine, EngineConfig, Request, SamplingConfig
from slora_batch.engine.requests.request import Result
from slora_batch.jobs.check import JobError
from slora_batch.jobs.outdir import part_files, read_success
from slora_batch.jobs.preview import preview
from slora_batch.jobs.resume import done_samples
from slora_batch.jobs.rows import row_key
from slora_batch.jobs.run import run_job
from slora_batch.jobs.samples import DoneSamples, SamplesDue, resumed
from slora_batch.jobs.validate import validate_job

SAMPLING = {"n": 3, "temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True}
KEYS = dict(sampling=SAMPLING, engine={"device": "cpu", "dtype": "float32", "num_pages": PAGES,
                                       "max_num_seqs": 4})  # fmt: skip


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, sample_model_dir):
    return build_tiny(tmp_path_factory.getbasetemp() / "tiny-llm", sample_model_dir)


def sampled_rows() -> list[dict]:
    """Four rows (base, "a", "b", base in chat turns); the second asks for 2 samples of its own."""
    rows = make_rows(4)
    rows[1]["n"] = 2
    return rows


def by_sample(rows: list[dict]) -> dict[tuple, tuple]:
    """(id, adapter, sample_index) -> (token_ids, text); fails when one is there twice."""
    keyed = {(r["id"], r["adapter"], r["sample_index"]): (r["token_ids"], r["text"]) for r in rows}
    assert len(keyed) == len(rows), "an output row appears twice"
    return keyed


def part_rows(paths: list[Path]) -> list[dict]:
    """The rows of each part by its own schema: one written before ``sample_index`` holds 0s."""
    return [{"sample_index": 0, **row} for path in paths for row in pq.read_table(path).to_pylist()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny) -> dict:
    """The samples of an uninterrupted run of ``sampled_rows``."""
    directory = tmp_path_factory.mktemp("reference")
    write_jsonl(directory / "rows.jsonl", sampled_rows())
    run_job(load_job(directory, tiny, **KEYS))
    return by_sample(outputs(directory / "out"))


def test_every_sample_once_with_the_engine_tokens_and_error_rows_in_the_counts(tmp_path, tiny):
    rows = sampled_rows()
    rows[2]["n"] = 1
    bad = [
        {"id": "bad-n", "prompt": "the fox", "n": 0},  # one error row, as the scan counts it
        {"id": "bad-prompt", "prompt": 123},  # one error row for its 3 samples
        {"id": "scored-n", "prompt": "the", "continuation": " fox", "n": 2},  # its own n
    ]
    scored = {"id": "scored", "prompt": "the", "continuation": " fox"}  # the job's n 3: 1 row
    write_jsonl(tmp_path / "rows.jsonl", rows + bad + [scored])
    events = []
    summary = run_job(load_job(tmp_path, tiny, **KEYS), progress=events.append)
    got = outputs(tmp_path / "out")
    samples = by_sample(got)
    ns = {"r0000": 3, "r0001": 2, "r0002": 1, "r0003": 3}
    # the base model's rows: adapter "" in the output
    good = {(r["id"], r["adapter"] or "", k) for r in rows for k in range(ns[r["id"]])}
    assert set(samples) == good | {(r["id"], "", 0) for r in [*bad, scored]}
    errors = {r["id"]: r["error"] for r in got if r["finish_reason"] == "error"}
    assert set(errors) == {"bad-n", "bad-prompt", "scored-n"}
    assert "per-row override: n must be an integer from 1 to 256, got 0" in errors["bad-n"]
    assert "n is for generated rows, not scored ones (the row asks n=2)" in errors["scored-n"]
    assert [r["finish_reason"] for r in got if r["id"] == "scored"] == ["score"]
    for i in ("r0000", "r0003"):  # three samples of one prompt at temperature 1 differ
        assert len({tuple(samples[i, "", k][0]) for k in range(3)}) > 1

    engine = Engine(tiny.model, adapters=tiny.adapters,
                    config=EngineConfig(device="cpu", dtype="float32", num_pages=PAGES),
                    sampling=SamplingConfig(**SAMPLING))  # fmt: skip
    expected = {
        (r.id, r.adapter or "", r.sample_index): (r.token_ids, r.text)
        for r in engine.generate(Request(**row) for row in rows)
    }
    assert {key: samples[key] for key in good} == expected
    alone = engine.generate(Request(**{**row, "n": 1}) for row in rows)  # sample 0 as without n
    assert {(r.id, r.adapter or "", 0): (r.token_ids, r.text) for r in alone} == {
        key: value for key, value in expected.items() if key[2] == 0
    }

    # 3 + 2 + 1 + 3 samples, 3 error rows and the scored row; the scan counted 3 for one of
    # those (bad-prompt) and the run lowered the total as it failed; scored rows count 1
    assert summary.stats["rows"] == summary.rows_this_run == read_success(tmp_path / "out")["rows"]
    assert (summary.stats["rows"], summary.stats["error_rows"]) == (13, 3)
    loading = next(e for e in events if e.phase == "loading")
    assert loading.rows_total == 3 + 2 + 1 + 3 + 1 + 3 + 1 + 1
    running = [e for e in events if e.phase == "running"]
    assert [e.rows_done for e in running] == list(range(1, 14))
    assert running[-1].rows_total == 13 and events[-1].rows_total == events[-1].rows_done == 13
    shown = preview(load_job(tmp_path, tiny, **KEYS), limit=10)
    assert [(p.id, p.text) for p in shown] == [(i, samples[i, a, 0][1]) for i, a, k in
                                               sorted(good) if k == 0]  # fmt: skip
    assert run_job(load_job(tmp_path, tiny, **KEYS)).complete_already
    problems = validate_job(load_job(tmp_path, tiny, **KEYS)).problems
    assert [p.split(": ")[0] for p in problems] == [f"rows.jsonl line {i}" for i in (5, 6, 7)]
    assert problems[2].endswith("n is for generated rows, not scored ones (the row asks n=2)")


def test_a_kill_between_the_samples_of_a_row_then_a_rerun_makes_only_the_missing_ones(
    tmp_path, tiny, reference
):
    """Parts of one row each: the job process is SIGKILLed after its fourth part, which leaves
    a row with some of its samples committed (no set of whole rows of 3, 2, 3 and 3 samples
    holds 4); the re-run's parts hold exactly the samples that were missing."""
    write_jsonl(tmp_path / "rows.jsonl", sampled_rows())
    keys = {**KEYS, "part_rows": 1, "part_seconds": 600}
    job_file = write_job(tmp_path, tiny, **keys)
    out = tmp_path / "out"
    killed_run(job_file, "after-part", 4)
    before = {path for _, path in part_files(out)}
    committed = by_sample(part_rows(sorted(before)))
    assert len(committed) == 4 and read_success(out) is None
    assert all(reference[key] == value for key, value in committed.items())
    per_row: dict[tuple, int] = {}
    for i, a, _ in committed:
        per_row[i, a] = per_row.get((i, a), 0) + 1
    assert any(count < {"r0001": 2}.get(i, 3) for (i, _), count in per_row.items())

    summary = run_job(load_job(tmp_path, tiny, **keys))
    made = by_sample(part_rows(sorted({path for _, path in part_files(out)} - before)))
    assert set(made) == set(reference) - set(committed)
    assert by_sample(outputs(out)) == reference
    assert (summary.rows_skipped, summary.rows_this_run) == (4, len(reference) - 4)
    assert summary.stats["rows"] == len(reference) == 11


def test_parts_without_sample_index_resume_as_sample_0_beside_new_ones(tmp_path, tiny):
    """An output as a version before n left it: its parts have no ``sample_index``, its
    manifest no ``sampling.n`` and its scan no per-row counts. It resumes with n 1 (the default
    it was made with), read by resume, stats and preview; with n 3 it is refused."""
    rows = make_rows(6)
    write_jsonl(tmp_path / "rows.jsonl", rows)
    keys = {**KEYS, "sampling": {**SAMPLING, "n": 1}, "part_rows": 2}
    first = run_job(load_job(tmp_path, tiny, **keys))
    out = tmp_path / "out"
    complete = by_sample(outputs(out))
    parts = [path for _, path in part_files(out)]
    pq.write_table(pq.read_table(parts[0]).drop_columns(["sample_index"]), parts[0])
    for path in parts[1:]:
        path.unlink()
    (out / "_SUCCESS").unlink()
    manifest = json.loads((out / "_job.json").read_text())
    del manifest["fingerprint"]["sampling"]["n"]
    for key in ("own_n_rows", "own_n_samples"):
        del manifest["scan"][key]
    (out / "_job.json").write_text(json.dumps(manifest))

    done = done_samples(out)
    old = pq.read_table(parts[0]).to_pylist()
    assert len(done) == 2 and all(
        done.missing(row_key(r["id"], r["adapter"]), 1) == [] for r in old
    )
    with pytest.raises(JobError, match=r"sampling.n None -> 3"):
        run_job(load_job(tmp_path, tiny, **{**keys, "sampling": SAMPLING}))
    summary = run_job(load_job(tmp_path, tiny, **keys))
    assert (summary.rows_skipped, summary.rows_this_run) == (2, 4)
    assert "sample_index" not in pq.read_table(parts[0]).column_names
    assert by_sample(part_rows(sorted(out.glob("part-*")))) == complete  # old rows: sample 0
    assert summary.stats["rows"] == first.stats["rows"] == 6
    assert summary.stats["completion_tokens"] == first.stats["completion_tokens"]
    shown = preview(load_job(tmp_path, tiny, **keys), limit=3)
    assert [p.id for p in shown] == ["r0000", "r0001", "r0002"]


def test_done_samples_and_what_a_resumed_row_asks_for():
    done = DoneSamples()
    done.add("row", 0, False)
    done.add("row", 2, False)
    done.add("failed", 0, True)  # an error row stands for every sample of its row
    assert (done.missing("row", 4), done.missing("failed", 4), done.missing("new", 2)) == (
        [1, 3], [], [0, 1]
    )  # fmt: skip
    assert len(done) == 3 and done.keys() == {"row", "failed"}
    request = Request(id="row", prompt="x", n=4)
    assert resumed(request, [0, 1, 2, 3], 4) is request  # nothing committed: as it was
    assert resumed(request, [1, 3], 4).sample_indices == [1, 3]
    error = Result(id="row", adapter=None, text="", finish_reason="error", error="bad")
    assert resumed(error, [1, 3], 4).sample_index == 1

    due = SamplesDue()
    due.add(Request(id=1, prompt="x", n=3), 3)
    due.add(Request(id=2, prompt="x", sample_indices=[1, 2]), 2)
    due.add(Request(id=3, prompt="x"), 1)
    ok = Result(id=1, adapter=None, text="t", sample_index=2)
    failed = [Result.failed(Request(id=i, prompt="x"), "no room") for i in (1, 2, 3)]
    assert [due.finished(ok)] + [due.finished(r) for r in failed] == [1, 2, 2, 1]
    assert [r.sample_index for r in failed] == [0, 1, 0]


def test_an_int_id_and_its_text_are_one_id_and_draw_the_same_samples(tmp_path, tiny):
    """A file that mixes id types writes 7 as "7", and resume has them as one id: each sample
    of the row is the same whichever form the input gave (seeded on the id's text)."""
    drawn = []
    for seven in (7, "7"):
        directory = tmp_path / type(seven).__name__
        write_jsonl(directory / "rows.jsonl", [{"id": seven, "prompt": "the quick fox"},
                                               {"id": "y", "prompt": "a lazy dog"}])  # fmt: skip
        run_job(load_job(directory, tiny, **KEYS))
        drawn.append(by_sample(outputs(directory / "out")))
    assert (
        sorted(drawn[0])
        == sorted(drawn[1])
        == sorted((i, "", k) for i in ("7", "y") for k in range(3))
    )
    assert drawn[0] == drawn[1]
    assert len({drawn[0]["7", "", k][1] for k in range(3)}) > 1  # temperature 1: samples differ
