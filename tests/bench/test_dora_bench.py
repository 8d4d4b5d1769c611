"""The bench's DoRA system on the CPU: ``slora-dora`` is slora's workload with one adapter id in
four a DoRA adapter of its rank; its weight sets, plan, warm-up groups, CLI rows and check."""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import torch
import typer
from safetensors.torch import load_file
from typer.testing import CliRunner

from slora_batch.bench.acceptance import acceptance
from slora_batch.bench.bench import BenchConfig
from slora_batch.bench.cli import bench
from slora_batch.bench.model import RANKS, build_model
from slora_batch.bench.warmup import warmup_groups
from slora_batch.bench.workload import Workload, adapter_sources, group_by_adapter, is_dora
from slora_batch.engine.adapters.store import AdapterStore
from slora_batch.engine.config import ConfigError

MAGNITUDE = "lora_magnitude_vector"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model (RandomWeights), its rank directories and their DoRA twins."""
    root = tmp_path_factory.mktemp("dora")
    model = build_model("tiny", torch.device("cpu"), torch.float32, root, seed=0, hf=False)
    plain = model.write_adapters(root / "adapters", 0)
    return model, plain, model.write_dora_adapters(root / "adapters", 0, plain)


def test_one_id_in_four_is_dora_and_every_rank_has_some(tmp_path):
    plain = {rank: tmp_path / f"rank{rank}" for rank in RANKS}
    dora = {rank: tmp_path / f"dora-rank{rank}" for rank in RANKS}
    sources = adapter_sources(1000, plain, dora)
    assert adapter_sources(1000, plain) == {
        name: plain[RANKS[i % 4]] for i, name in enumerate(sources)
    }  # slora's ids; slora-dora's differ only in the DoRA ones
    kinds = Counter(
        (path.name.startswith("dora-"), RANKS[i % 4]) for i, path in enumerate(sources.values())
    )
    assert sum(n for (d, _), n in kinds.items() if d) == 252  # 62 runs of 4 ids, and 992-995
    assert {rank: kinds[(True, rank)] for rank in RANKS} == dict.fromkeys(RANKS, 63)
    assert [i for i in range(40) if is_dora(i)] == [0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35]
    for i, path in enumerate(sources.values()):
        assert path == (dora if is_dora(i) else plain)[RANKS[i % 4]]


def test_dora_directories_hold_the_plain_factors_and_realistic_magnitudes(tiny, tmp_path):
    model, plain, dora = tiny
    assert list(dora) == list(plain) == list(RANKS)
    spec = model.spec
    for rank in RANKS:
        a = load_file(plain[rank] / "adapter_model.safetensors")
        b = load_file(dora[rank] / "adapter_model.safetensors")
        assert {k: v for k, v in b.items() if MAGNITUDE not in k}.keys() == a.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
        magnitudes = {k: v for k, v in b.items() if MAGNITUDE in k}
        assert len(magnitudes) == spec.num_layers * 4  # q, k, v, o of every layer
        info = AdapterStore(spec, {"d": dora[rank]}).info("d")
        assert info.dora and info.kind == "DoRA" and info.rank == rank
        assert not AdapterStore(spec, {"p": plain[rank]}).info("p").dora
    again = model.write_dora_adapters(tmp_path, 0, plain)  # the seed fixes the magnitudes
    for rank in RANKS:
        first = load_file(dora[rank] / "adapter_model.safetensors")
        assert all(
            torch.equal(v, first[k])
            for k, v in load_file(again[rank] / "adapter_model.safetensors").items()
        )


def test_dora_magnitudes_sit_near_the_norms_of_the_adapted_base_rows(tiny):
    """g = m / ||W + s B A|| per output channel, with W the base weights the engine makes:
    near 1, spread by the magnitudes' factor (0.8-1.2) and the tiny rows' own noise."""
    model, _, dora = tiny
    gs = []
    for rank in RANKS:
        tensors = load_file(dora[rank] / "adapter_model.safetensors")
        for layer in range(model.spec.num_layers):
            for target in "qkvo":
                key = f"base_model.model.model.layers.{layer}.self_attn.{target}_proj"
                w = model.weights.pop(f"model.layers.{layer}.self_attn.{target}_proj.weight")
                adapted = w + tensors[f"{key}.lora_B.weight"] @ tensors[f"{key}.lora_A.weight"]
                gs.append(tensors[f"{key}.{MAGNITUDE}"] / adapted.norm(dim=1))
    g = torch.cat(gs)
    assert 0.95 < g.mean() < 1.05 and 0.1 < g.std() < 0.25, (g.mean(), g.std())
    assert g.min() > 0.4 and g.max() < 2.0  # tails: 64-input rows vary by about 9%


def test_slora_dora_is_planned_after_slora_and_only_on_attention_adapters():
    config = BenchConfig(systems=["slora-dora", "slora"], adapters=[1000, 10])
    assert config.plan() == [("slora", 10), ("slora", 1000), ("slora-dora", 10),
                             ("slora-dora", 1000)]  # fmt: skip
    assert "slora-dora" not in BenchConfig().systems  # not in the default list
    with pytest.raises(ConfigError, match="slora-dora runs DoRA adapters on q, k, v, o"):
        BenchConfig(model_preset="tiny-moe", adapter_targets="experts", systems=["slora-dora"])


def test_warmup_runs_dora_and_plain_adapters_of_a_rank_apart(tmp_path):
    """Steps with and without a DoRA adapter build different expand kernels: each kind of a
    rank gets its own warm-up groups."""
    workload = Workload.generate(BenchConfig(requests=200, model_preset="tiny"), 300)
    grouped = group_by_adapter(workload.requests(8))

    def info(name: str) -> SimpleNamespace:
        i = int(name[1:])
        return SimpleNamespace(rank=RANKS[i % 4], dora=is_dora(i))

    groups = warmup_groups(grouped, SimpleNamespace(info=info), 12)
    kinds = [{(info(r.adapter).rank, info(r.adapter).dora) for r in group} for group, _ in groups]
    both = sorted((rank, d) for rank in RANKS for d in (False, True))
    assert kinds[:8] == [{kind} for kind in both] and kinds[8:16] == kinds[:8]
    assert kinds[24] == set(both) and len(groups) == 27


def test_cli_runs_slora_and_slora_dora_on_the_same_requests(tmp_path):
    app = typer.Typer()
    app.command()(bench)
    out = tmp_path / "out"
    args = ["--model-preset", "tiny", "--device", "cpu", "--systems", "slora,slora-dora",
            "--adapters", "8", "--requests", "8", "--min-input", "8", "--max-input", "16",
            "--min-output", "4", "--max-output", "6", "--warmup-requests", "0",
            "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert [(r["system"], r["adapters"]) for r in rows] == [("slora", 8), ("slora-dora", 8)]
    workload = Workload.generate(BenchConfig(requests=8, min_input=8, max_input=16,
                                             min_output=4, max_output=6), 300)  # fmt: skip
    for row in rows:
        assert row["error"] is None and row["finished"] == 8 and not row["truncated"]
        assert row["error_rows"] == 0 and row["length_mismatches"] == 0
        assert row["output_tokens"] == sum(workload.output_lens)
        assert row["prompt_tokens"] == sum(map(len, workload.prompts))
        assert row["output_tokens_per_s"] > 0 and 0 < row["roofline_fraction"] < math.inf
    slora, dora = rows
    assert (slora["weight_sets"], dora["weight_sets"]) == (4, 8)
    # the engine parsed ids 0-3 as DoRA and ran their rows
    on_dora = sum(is_dora(int(name[1:])) for name in workload.adapters(8))
    assert dora["dora_adapters"] == 4 and dora["dora_rows"] == on_dora > 0
    assert slora["dora_adapters"] is None and slora["dora_rows"] is None
    text = (out / "results.md").read_text()
    assert "- slora-dora@8 / slora@8 = " in text and "4 of 8 ids DoRA" in text
    assert "- slora-dora: slora's requests and adapter ids" in text


def test_the_dora_check_sets_slora_dora_against_slora_at_each_count():
    figures = {"roofline_fraction": 0.5, "decode_host_share": math.nan, "decode_turns": 0,
               "finished": 2000, "decode_batch": 250.0}  # fmt: skip
    slora = {"system": "slora", "adapters": 1000, "output_tokens_per_s": 10000.0, **figures}
    dora = {**slora, "system": "slora-dora", "output_tokens_per_s": 9600.0,
            "dora_adapters": 252, "dora_rows": 510}  # fmt: skip
    slow = {**dora, "adapters": 100, "output_tokens_per_s": 9000.0}
    lines = [line for line in acceptance([slora, dora, slow]) if "slora-dora" in line]
    assert lines == [
        "- slora-dora@1000 / slora@1000 = 0.96 (need >= 0.95): pass; 9600 against 10000 output "
        "tok/s; 252 of 1000 ids DoRA, 510 of 2000 rows done on them; decode batch 250 vs 250",
        "- slora-dora@100 / slora: not measured; 252 of 100 ids DoRA, 510 of 2000 rows done on "
        "them",
    ]
    failed = acceptance([slora, {**dora, "output_tokens_per_s": 9400.0}])
    assert any(line.startswith("- slora-dora@1000 / slora@1000 = 0.94 (need >= 0.95): FAIL")
               for line in failed)  # fmt: skip
    assert not [line for line in acceptance([slora]) if "slora-dora" in line]
