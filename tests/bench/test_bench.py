"""The bench on the CPU: tiny shapes, a handful of requests, every system (benchmarks/README.md)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from slora_batch.bench import bench as bench_module
from slora_batch.bench.bench import BenchConfig, run_bench
from slora_batch.bench.cli import bench
from slora_batch.bench.engine_run import ARRIVAL_ORDER
from slora_batch.bench.floor import PARTS
from slora_batch.bench.model import RANKS
from slora_batch.bench.roofline import Work, kv_tokens_read
from slora_batch.bench.warmup import WARMUP_PROMPT, _warmup, warmup_groups
from slora_batch.bench.workload import Workload, adapter_sources, group_by_adapter
from slora_batch.engine.config import AUTO_MIN_SEQS, ConfigError

TINY = dict(
    model_preset="tiny",
    device="cpu",
    min_input=8,
    max_input=16,
    min_output=4,
    max_output=6,
    warmup_requests=2,
    peft_batch=4,
)


def test_workload_is_seeded_in_range_and_maps_adapters_by_draw():
    config = BenchConfig(requests=500, **TINY)
    a, b = Workload.generate(config, 300), Workload.generate(config, 300)
    assert a.prompts == b.prompts and a.output_lens == b.output_lens
    assert all(8 <= len(p) <= 16 and min(p) >= 3 and max(p) < 300 for p in a.prompts)
    assert all(4 <= n <= 6 for n in a.output_lens)
    assert a.adapters(0) == [None] * 500
    ids = [int(name[1:]) for name in a.adapters(10)]
    assert min(ids) >= 0 and max(ids) <= 9 and len(set(ids)) == 10
    assert ids == [int(d * 10) for d in a.draws]
    skewed = Workload.generate(BenchConfig(requests=500, skewed=True, **TINY), 300)
    assert np.mean([int(n[1:]) for n in skewed.adapters(100)]) < 20  # power(0.1): mostly low ids
    requests = a.requests(3, count=4)
    assert [r.max_new_tokens for r in requests] == a.output_lens[:4]
    assert all(r.ignore_eos and r.temperature == 0.0 for r in requests)


def test_adapter_ids_share_one_directory_per_rank(tmp_path):
    dirs = {rank: tmp_path / f"rank{rank}" for rank in RANKS}
    sources = adapter_sources(6, dirs)
    assert list(sources) == ["a0000", "a0001", "a0002", "a0003", "a0004", "a0005"]
    assert [sources[f"a000{i}"].name for i in range(6)] == [
        "rank8",
        "rank16",
        "rank32",
        "rank64",
        "rank8",
        "rank16",
    ]


def test_kv_tokens_read_sums_the_context_of_every_decode_step():
    assert kv_tokens_read(3, 4) == 4 + 5 + 6
    assert kv_tokens_read(7, 1) == 0 and kv_tokens_read(7, 0) == 0
    for prompt in (1, 5, 9):
        for generated in range(1, 12):
            assert kv_tokens_read(prompt, generated) == sum(prompt + j for j in range(1, generated))
    work = Work()
    work.add(3, 4)
    work.add(10, 1)
    assert (work.prompt_tokens, work.output_tokens, work.kv_tokens) == (13, 5, 15)
    assert work.flops(100) == 2 * 100 * 18


def test_engine_systems_get_the_workload_grouped_by_adapter():
    """Engine runs but arrival see the requests grouped by adapter (base rows first), each
    adapter's in arrival order, as a job's sort clusters them; the set of requests is the same."""
    workload = Workload.generate(BenchConfig(requests=40, **TINY), 300)
    arrival = workload.requests(7)
    grouped = group_by_adapter(arrival)
    assert sorted(r.id for r in grouped) == [r.id for r in arrival]
    names = [r.adapter for r in grouped]
    assert names == sorted(names) and len(set(names)) > 1
    for name in set(names):
        ids = [r.id for r in grouped if r.adapter == name]
        assert ids == sorted(ids)
    base = group_by_adapter([*arrival[:3], dataclasses.replace(arrival[3], adapter=None)])
    assert base[0].adapter is None and base[0].id == arrival[3].id
    assert "arrival" in ARRIVAL_ORDER and "slora" not in ARRIVAL_ORDER


def test_warmup_covers_each_rank_before_the_timed_run():
    """Grouped by adapter, the first requests of 10 adapters all use rank 8; the warm-up still
    runs each rank alone, in a batch of up to 8 and in a batch of whole prompts, then all ranks
    together, then the first requests cut and whole, so no Triton build for another rank's (or
    a longer prompt's) block shapes lands in the timed run."""
    workload = Workload.generate(BenchConfig(requests=200, **{**TINY, "max_input": 200}), 300)
    grouped = group_by_adapter(workload.requests(10))
    store = SimpleNamespace(
        info=lambda name: SimpleNamespace(rank=RANKS[int(name[1:]) % 4], dora=False)
    )
    assert {store.info(r.adapter).rank for r in grouped[:8]} == {RANKS[0]}
    groups = warmup_groups(grouped, store, 12)
    assert len(groups) == 15 and groups[13:] == [(grouped[:12], False), (grouped[:12], True)]
    ranks = [{store.info(r.adapter).rank for r in group} for group, _ in groups]
    assert ranks[:4] == [{r} for r in sorted(RANKS)] and ranks[4:8] == ranks[8:12] == ranks[:4]
    assert ranks[12] == set(RANKS)
    sizes = [len(group) for group, _ in groups]
    assert sizes[:4] == [1] * 4 and sizes[4:8] == [8] * 4 and sizes[8:13] == [12] * 4 + [32]
    assert [whole for _, whole in groups] == [False] * 8 + [True] * 5 + [False, True]
    short, whole = _warmup(groups[8][0], False), _warmup(groups[8][0], True)
    assert all(len(r.prompt_token_ids) <= WARMUP_PROMPT for r in short)
    assert [r.prompt_token_ids for r in whole] == [r.prompt_token_ids for r in groups[8][0]]
    assert max(len(r.prompt_token_ids) for r in whole) > WARMUP_PROMPT
    base = warmup_groups(group_by_adapter(workload.requests(0)), store, 12)
    assert [(len(group), whole) for group, whole in base] == [(12, False), (12, True)]
    assert warmup_groups(grouped, store, 0) == []


def test_plan_order_and_validation():
    plan = BenchConfig(adapters=[1, 1000, 10], ablation_adapters=[1000]).plan()
    assert plan == [
        ("base", 0),
        ("slora", 1),
        ("slora", 10),
        ("slora", 1000),
        ("peft", 1),
        ("peft", 10),
        ("bmm", 1000),
        ("no-unified", 1000),
        ("arrival", 1000),
    ]
    assert BenchConfig(systems=["peft"], adapters=[1000]).plan() == [("peft", 100)]
    for bad in (
        dict(systems=["vllm"]),
        dict(peft_adapters=[101]),
        dict(adapters=[0]),
        dict(min_output=9, max_output=8),
        dict(model_preset="llama-70b"),
    ):
        with pytest.raises(ConfigError):
            BenchConfig(**bad)


@pytest.mark.slow
def test_cli_runs_every_system_and_writes_sane_figures(tmp_path):
    app = typer.Typer()
    app.command()(bench)
    out = tmp_path / "out"
    args = [
        "--model-preset",
        "tiny",
        "--device",
        "cpu",
        "--systems",
        "slora,base,peft,bmm,no-unified,arrival",
        "--adapters",
        "3",
        "--requests",
        "6",
        "--min-input",
        "8",
        "--max-input",
        "16",
        "--min-output",
        "4",
        "--max-output",
        "6",
        "--peft-requests",
        "4",
        "--peft-batch",
        "4",
        "--warmup-requests",
        "2",
        "--out",
        str(out),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    for name in ("results.parquet", "results.md", "summary.json", "run.json", "throughput.png"):
        assert (out / name).is_file(), name
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert [(r["system"], r["adapters"]) for r in rows] == [
        ("base", 0),
        ("slora", 3),
        ("peft", 3),
        ("bmm", 3),
        ("no-unified", 3),
        ("arrival", 3),
    ]
    workload = Workload.generate(BenchConfig(requests=6, **TINY), 300)
    for row in rows:
        asked = workload.output_lens[: row["requests"]]
        assert row["error"] is None
        assert row["requests"] == (4 if row["system"] == "peft" else 6)
        assert row["finished"] == row["requests"] and not row["truncated"]
        assert row["error_rows"] == 0 and row["length_mismatches"] == 0
        assert row["output_tokens"] == sum(asked)
        assert row["prompt_tokens"] == sum(map(len, workload.prompts[: row["requests"]]))
        assert row["requests_per_s"] > 0 and row["output_tokens_per_s"] > 0 and row["wall_s"] > 0
        assert 0 < row["roofline_fraction"] < math.inf and row["floor_s"] > 0
        assert row["weight_sets"] == (0 if row["system"] == "base" else 3)
        if row["system"] != "peft":
            assert row["steps"] > 0 and 0 <= row["host_share"] <= 1
            # the step-by-step floor: every engine run is traced, its parts add up
            assert 0 < row["floor_fraction"] <= 1, row["floor_fraction"]
            parts = sum(row[k] for k in PARTS)
            assert math.isclose(parts, row["floor2_s"], rel_tol=1e-9)
            assert math.isclose(row["floor2_s"] / row["wall_s"], row["floor_fraction"])
            assert row["max_num_seqs"] >= AUTO_MIN_SEQS  # auto, resolved and recorded
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"base", "slora", "peft", "bmm", "no-unified", "arrival"}
    assert set(summary["base"]) == {"0"} and set(summary["slora"]) == {"3"}
    assert set(summary["slora"]["3"]) == {
        "requests_per_s",
        "output_tokens_per_s",
        "roofline_fraction",
        "floor_fraction",
    }
    meta = json.loads((out / "run.json").read_text())
    assert (
        meta["matmul_tflops"] > 0 and meta["copy_tb_per_s"] > 0 and meta["card"].startswith("cpu")
    )
    assert "| slora | 3 | 6/6 |" in (out / "results.md").read_text()


@pytest.mark.slow
def test_time_limits_cut_runs_and_a_failed_system_does_not_stop_the_others(tmp_path, monkeypatch):
    real = bench_module.run_engine

    def broken_bmm(ctx, system, n):
        if system == "bmm":
            raise RuntimeError("bmm kernel missing")
        return real(ctx, system, n)

    monkeypatch.setattr(bench_module, "run_engine", broken_bmm)
    config = BenchConfig(
        systems=["slora", "peft", "bmm"],
        adapters=[2],
        requests=128,
        peft_requests=16,
        max_seconds=0.2,
        peft_max_seconds=0.3,
        out=tmp_path / "out",
        **{**TINY, "max_output": 150},
    )
    rows, meta = run_bench(config)
    asked = Workload.generate(config, 300).output_lens
    by_system = {r["system"]: r for r in rows}
    assert by_system["bmm"]["error"] == "RuntimeError: bmm kernel missing"
    for system in ("slora", "peft"):
        row = by_system[system]
        assert row["error"] is None and row["truncated"]
        assert row["finished"] < row["requests"]
        assert 0 < row["output_tokens"] < sum(asked[: row["requests"]])
    assert json.loads((tmp_path / "out" / "summary.json").read_text()).keys() == {"slora", "peft"}
    assert not meta["skipped"]


def test_total_seconds_skips_runs_that_would_end_past_it():
    config = BenchConfig(max_seconds=60, peft_max_seconds=100, total_seconds=90)
    assert not bench_module._over_budget(config, "slora", started=_now(0))
    assert bench_module._over_budget(config, "peft", started=_now(0))
    assert bench_module._over_budget(config, "slora", started=_now(40))


def _now(ago: float) -> float:
    import time

    return time.perf_counter() - ago


def test_outputs_are_written_for_a_failed_first_run(tmp_path):
    from slora_batch.bench.report import markdown, write_outputs

    meta = {
        "date": "d",
        "card": "c",
        "commit": "x",
        "dtype": "bfloat16",
        "parameters": 10,
        "versions": dict.fromkeys(("torch", "triton", "transformers", "peft"), "1"),
        "matmul_tflops": 1.0,
        "copy_tb_per_s": 1.0,
        "adapter_weight_sets": 4,
        "skipped": [],
        "settings": {
            k: getattr(BenchConfig(), k)
            for k in (
                "model_preset",
                "requests",
                "min_input",
                "max_input",
                "min_output",
                "max_output",
                "skewed",
                "seed",
                "max_seconds",
                "peft_max_seconds",
            )
        },
    }
    rows = [{"system": "slora", "adapters": 2, "error": "boom", "weight_sets": 2}]
    write_outputs(Path(tmp_path), rows, meta)
    assert pq.read_table(tmp_path / "results.parquet").num_rows == 1
    assert "failed: boom" in markdown(rows, meta)
    assert json.loads((tmp_path / "summary.json").read_text()) == {}


def test_the_job_system_runs_the_job_tool_on_the_same_requests(tmp_path):
    """``job``: the model, one adapter directory per id and a Parquet input on disk, a real job
    run; its rows are the workload's, with the tokens the in-process engine makes."""
    config = BenchConfig(
        systems=["slora", "job"], adapters=[6], requests=24, max_seconds=0,
        out=tmp_path / "out", **TINY,
    )  # fmt: skip
    rows, _ = run_bench(config)
    slora, job = ({r["system"]: r for r in rows}[s] for s in ("slora", "job"))
    assert job["error"] is None and job["finished"] == job["requests"] == 24
    assert job["length_mismatches"] == 0 and job["error_rows"] == 0
    assert (job["output_tokens"], job["prompt_tokens"]) == (
        slora["output_tokens"],
        slora["prompt_tokens"],
    )
    assert job["adapter_disk_loads"] == 6  # six ids, six directories read, though 4 weight sets
    assert job["job_wall_s"] >= job["wall_s"] > 0 and job["end_to_end_tokens_per_s"] > 0
