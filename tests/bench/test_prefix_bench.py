"""The bench's prefix-cache systems on the CPU: ``prefix`` / ``prefix-off`` on the shared-prefix
rows, ``slora-off`` on the standard ones, ``samples`` / ``samples-separate``: their workloads,
plan, settings, requests, rows and acceptance lines."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
import typer
from typer.testing import CliRunner

from slora_batch.bench import cli as cli_module
from slora_batch.bench.acceptance import acceptance
from slora_batch.bench.bench import DEFAULT_SYSTEMS, SYSTEMS, BenchConfig, run_bench
from slora_batch.bench.model import build_model
from slora_batch.bench.prefix_run import sample_requests
from slora_batch.bench.timed_run import COUNTERS
from slora_batch.bench.warmup import _warmup
from slora_batch.bench.workload import PrefixWorkload, Workload, adapter_sources, drawn_adapters
from slora_batch.engine.config import ConfigError, EngineConfig
from slora_batch.engine.engine import assemble
from slora_batch.engine.execution.parts import EngineParts
from slora_batch.jobs.ordering import sort_key

PREFIX_SYSTEMS = ["slora", "slora-off", "prefix", "prefix-off", "samples", "samples-separate"]


# A step takes at most 8192 tokens (EngineConfig.max_num_batched_tokens) and a row finds only
# blocks cached by an earlier step: 24 rows of a 400-token prefix fill more than one step, so
# the rows admitted in the second step find their adapter's prefix.
TINY = dict(
    model_preset="tiny",
    device="cpu",
    warmup_requests=2,
    requests=6,
    min_input=20,
    max_input=40,
    min_output=4,
    max_output=6,
    prefix_rows=24,
    prefix_tokens=400,
    prefix_min_suffix=4,
    prefix_max_suffix=8,
    prefix_output=4,
    samples_prompts=4,
    samples_n=3,
)


def test_prefix_workload_has_one_prefix_per_adapter_and_draws_adapters_like_the_workload():
    config = BenchConfig(**{**TINY, "prefix_rows": 300, "prefix_tokens": 40, "adapters": [2, 5]})
    a, b = PrefixWorkload.generate(config, 300), PrefixWorkload.generate(config, 300)
    assert a.prefixes == b.prefixes and a.suffixes == b.suffixes
    assert len(a.prefixes) == 5 and all(len(p) == 40 for p in a.prefixes)
    assert len({tuple(p) for p in a.prefixes}) == 5
    assert all(4 <= len(s) <= 8 for s in a.suffixes) and len(a.suffixes) == 300
    assert all(min(p) >= 3 and max(p) < 300 for p in a.prefixes + a.suffixes)
    rows = a.requests(5)
    assert [r.adapter for r in rows] == drawn_adapters(a.draws, 5)
    for i, row in enumerate(rows):
        prefix = a.prefixes[int(row.adapter[1:])]
        assert row.prompt_token_ids == prefix + a.suffixes[i]
        assert (row.id, row.max_new_tokens, row.ignore_eos, row.temperature) == (i, 4, True, 0.0)
    # prefix j does not depend on the adapter counts asked for
    fewer = PrefixWorkload.generate(BenchConfig(**{**TINY, "prefix_rows": 300,
                                                   "prefix_tokens": 40, "adapters": [2]}), 300)  # fmt: skip
    assert fewer.prefixes == a.prefixes[:2] and fewer.suffixes == a.suffixes
    ordered = sorted(rows, key=sort_key)  # what run_prefix hands the engine
    names = [r.adapter for r in ordered]
    assert names == sorted(names)
    for name in set(names):
        prompts = [r.prompt_token_ids for r in ordered if r.adapter == name]
        assert prompts == sorted(prompts)


def test_sample_requests_are_one_request_of_n_or_n_requests_at_temperature_one():
    prompts = Workload.generate(BenchConfig(**TINY), 300, count=4).requests(2)
    joined = sample_requests(prompts, 3, separate=False)
    assert [(r.id, r.n, r.temperature) for r in joined] == [(i, 3, 1.0) for i in range(4)]
    separate = sample_requests(prompts, 3, separate=True)
    assert [r.id for r in separate] == list(range(12))
    assert all(r.n is None and r.temperature == 1.0 for r in separate)
    assert [r.prompt_token_ids for r in separate] == [p.prompt_token_ids for p in prompts
                                                     for _ in range(3)]  # fmt: skip
    assert {r.max_new_tokens for r in separate[3:6]} == {prompts[1].max_new_tokens}
    warm = _warmup(joined, True)  # the warm-up runs the sampled path too
    assert all(r.n == 3 and r.temperature == 1.0 for r in warm)


def test_an_engine_gives_n_results_per_sampled_prompt(tmp_path):
    model = build_model("tiny", torch.device("cpu"), torch.float32, tmp_path, seed=0, hf=False)
    sources = adapter_sources(2, model.write_adapters(tmp_path / "adapters", 0))
    prompts = Workload.generate(BenchConfig(**TINY), 300, count=4).requests(2)
    config = EngineConfig(device="cpu", dtype="float32", num_pages=16384)
    engine = assemble(model.model_dir, sources, config, parts=EngineParts(model.weights))
    results = list(engine.generate(sample_requests(prompts, 3, separate=False)))
    assert sorted((r.id, r.sample_index) for r in results) == [(i, k) for i in range(4)
                                                                for k in range(3)]  # fmt: skip
    assert all(r.completion_tokens == prompts[r.id].max_new_tokens for r in results)
    separate = list(engine.generate(sample_requests(prompts, 3, separate=True)))
    assert Counter(r.id for r in separate) == Counter(range(12))


def test_prefix_systems_are_planned_on_request_with_the_issue_defaults():
    added = {"slora-off", "prefix", "prefix-off", "samples", "samples-separate"}
    assert added <= set(SYSTEMS) and not added & set(DEFAULT_SYSTEMS)
    plan = BenchConfig(systems=PREFIX_SYSTEMS, adapters=[50, 2]).plan()
    assert plan == [(s, n) for s in PREFIX_SYSTEMS for n in (2, 50)]
    d = BenchConfig()
    assert (d.prefix_rows, d.prefix_tokens, d.prefix_min_suffix, d.prefix_max_suffix,
            d.prefix_output, d.samples_prompts, d.samples_n) == (4000, 1024, 32, 128, 64, 500, 8)  # fmt: skip
    for bad in (
        dict(prefix_rows=0),
        dict(prefix_tokens=0),
        dict(prefix_min_suffix=0),
        dict(prefix_min_suffix=9, prefix_max_suffix=8),
        dict(prefix_output=0),
        dict(samples_prompts=0),
        dict(samples_n=0),
        dict(samples_n=257),
    ):
        with pytest.raises(ConfigError):
            BenchConfig(**bad)


def test_cli_fills_the_prefix_settings(monkeypatch):
    seen = []
    monkeypatch.setattr(cli_module, "run_bench", lambda config: seen.append(config) or ([], {}))
    monkeypatch.setattr(cli_module, "markdown", lambda rows, meta: "")
    app = typer.Typer()
    app.command()(cli_module.bench)
    args = ["--systems", "prefix,prefix-off,samples", "--prefix-rows", "50", "--prefix-tokens",
            "9", "--prefix-min-suffix", "2", "--prefix-max-suffix", "3", "--prefix-output", "5",
            "--samples-prompts", "7", "--samples-n", "4"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (config,) = seen
    assert config.systems == ["prefix", "prefix-off", "samples"]
    got = [getattr(config, k) for k in ("prefix_rows", "prefix_tokens", "prefix_min_suffix",
           "prefix_max_suffix", "prefix_output", "samples_prompts", "samples_n")]  # fmt: skip
    assert got == [50, 9, 2, 3, 5, 7, 4]


def test_acceptance_lines_of_the_prefix_cache():
    def row(system, n, tok):
        return {"system": system, "adapters": n, "output_tokens_per_s": tok, "error": None,
                "roofline_fraction": 0.5, "decode_host_share": math.nan}  # fmt: skip

    rows = [row("slora", 10, 99.0), row("slora-off", 10, 100.0), row("prefix", 50, 310.0),
            row("prefix-off", 50, 100.0), row("prefix", 5, 10.0), row("samples", 50, 390.0),
            row("samples-separate", 50, 100.0)]  # fmt: skip
    lines = acceptance(rows)
    assert "- prefix@5 / prefix-off@5: not measured" in lines
    assert any(s.startswith("- prefix@50 / prefix-off@50 = 3.10 (need >= 3): pass") for s in lines)
    assert any(s.startswith("- slora@10 / slora-off@10 = 0.99 (need >= 0.98): pass") for s in lines)
    assert any(s.startswith("- samples@50 / samples-separate@50 = 3.90 (need >= 4): FAIL")
               for s in lines)  # fmt: skip
    # slora without slora-off (the default bench) asks for no such line
    assert not [s for s in acceptance([row("slora", 10, 99.0)]) if "-off" in s]


def test_prefix_cache_systems_run_and_report_their_counters(tmp_path):
    config = BenchConfig(systems=PREFIX_SYSTEMS, adapters=[2], out=tmp_path / "out", **TINY)
    rows, _ = run_bench(config)
    assert [(r["system"], r["adapters"]) for r in rows] == [(s, 2) for s in PREFIX_SYSTEMS]
    by = {r["system"]: r for r in rows}
    for row in rows:
        assert row["error"] is None and row["error_rows"] == 0 and not row["truncated"]
        assert row["finished"] == row["requests"] and row["length_mismatches"] == 0
        assert row["output_tokens_per_s"] > 0 and 0 < row["roofline_fraction"] < math.inf
        assert set(COUNTERS) <= set(row)
        assert row["block_evictions"] == 0  # the warm-up's blocks, freed at its end, are not
    for off in ("slora-off", "prefix-off"):
        assert by[off]["prefix_hit_tokens"] == 0
    # the cache is on for samples-separate: a prompt's later copies wait for the blocks its first
    # copy computes and start past them (engine/scheduling/scheduler.py, Scheduler._admit)
    assert by["samples-separate"]["prefix_hit_tokens"] > 0
    assert by["prefix-off"]["cached_blocks"] == by["slora-off"]["cached_blocks"] == 0
    prefix = by["prefix"]
    assert prefix["prefix_hit_tokens"] > 0 and prefix["prefix_hit_tokens"] % 16 == 0
    assert prefix["cached_blocks"] > 0
    assert prefix["requests"] == 24 and prefix["output_tokens"] == 24 * 4
    assert prefix["prompt_tokens"] == by["prefix-off"]["prompt_tokens"]
    assert prefix["flops"] < by["prefix-off"]["flops"]  # cached prompt tokens are not computed
    samples, separate = by["samples"], by["samples-separate"]
    assert samples["prompts"] == 4 and samples["samples_n"] == separate["samples_n"] == 3
    assert samples["requests"] == separate["requests"] == samples["finished"] == 12
    assert samples["output_tokens"] == separate["output_tokens"]
    assert samples["prefix_hit_tokens"] > 0  # the other samples start past the first's blocks
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert set(summary) == set(PREFIX_SYSTEMS)
    text = (tmp_path / "out" / "results.md").read_text()
    for line in ("- prefix@2 / prefix-off@2 = ", "- slora@2 / slora-off@2 = ",
                 "- samples@2 / samples-separate@2 = ", "- shared-prefix workload: 24 rows",
                 "| samples | 2 | 12/12 |", "prefix hit tokens"):  # fmt: skip
        assert line in text
    checks = [s for s in text.splitlines() if "-off@2 = " in s or "-separate@2 = " in s]
    assert len(checks) == 3 and all("(need >= " in s for s in checks)
