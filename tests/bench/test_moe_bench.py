"""The bench on a mixture of experts (benchmarks/README.md, "The MoE workload"): the presets'
weights under the names and shapes transformers gives them, the adapters on the experts, and
the CLI on tiny-moe with adapters on attention and on the experts."""

from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest
import torch
import typer
from typer.testing import CliRunner

from slora_batch import EngineConfig, Request
from slora_batch.bench.bench import BenchConfig
from slora_batch.bench.cli import bench
from slora_batch.bench.floor import PARTS
from slora_batch.bench.model import EXPERT_RANKS, build_model
from slora_batch.bench.workload import Workload, adapter_sources
from slora_batch.engine.adapters.store import AdapterStore
from slora_batch.engine.config import ConfigError
from slora_batch.engine.models.spec import EXPERT_TARGETS


def test_random_weights_are_named_and_shaped_as_transformers_builds_the_preset(tmp_path):
    """Every tensor of Qwen3-30B-A3B's transformers model (built on the meta device), by name
    and shape, fused 3-D experts and the router included: 30.5B parameters, none made."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = build_model("qwen3-30b-a3b", torch.device("cpu"), torch.bfloat16, tmp_path, 0, hf=False)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model.model_dir))
    want = {name: tuple(t.shape) for name, t in hf.state_dict().items()}
    weights = model.weights
    assert {name: weights.shape(name) for name in weights.names()} == want
    assert weights.shape("model.layers.0.mlp.experts.gate_up_proj") == (128, 2 * 768, 2048)
    assert model.num_params == weights.num_params() == sum(math.prod(s) for s in want.values())


def test_tiny_moe_random_weights_load_and_spread_tokens_over_the_experts(tmp_path):
    """The engine loads tiny-moe from RandomWeights alone (nothing left over); its random
    router sends a batch's tokens to every expert of each layer, as the floor assumes."""
    from slora_batch.engine.engine import assemble
    from slora_batch.engine.execution.parts import EngineParts
    from slora_batch.engine.models import moe

    model = build_model("tiny-moe", torch.device("cpu"), torch.float32, tmp_path, 0, hf=False)
    chosen = []
    route = moe.top_experts

    def recorded(logits, top_k, norm_topk):
        weights, ids = route(logits, top_k, norm_topk)
        chosen.append(ids)
        return weights, ids

    config = EngineConfig(device="cpu", dtype="float32", num_pages=4096)
    engine = assemble(model.model_dir, {}, config, parts=EngineParts(model.weights))
    gen = torch.Generator().manual_seed(0)
    requests = [
        Request(id=i, prompt_token_ids=torch.randint(3, 300, (8,), generator=gen).tolist(),
                max_new_tokens=2, ignore_eos=True)
        for i in range(16)
    ]  # fmt: skip
    moe.top_experts = recorded
    try:
        results = list(engine.generate(requests))
    finally:
        moe.top_experts = route
    assert len(results) == 16 and all(r.error is None for r in results)
    spec = model.spec
    prefill = chosen[: spec.num_layers]  # the first step: 128 tokens, each layer's routing
    assert len(prefill[0]) == 128
    assert all(len(ids.unique()) == spec.num_experts for ids in prefill)


def test_expert_adapters_cycle_ranks_8_and_16_and_page_every_expert(tmp_path):
    model = build_model("tiny-moe", torch.device("cpu"), torch.float32, tmp_path, 0, hf=False)
    dirs = model.write_adapters(tmp_path / "adapters", seed=0, targets="experts")
    assert tuple(dirs) == EXPERT_RANKS
    sources = adapter_sources(5, dirs)
    assert [sources[f"a000{i}"] for i in range(5)] == [dirs[8], dirs[16]] * 2 + [dirs[8]]
    config = json.loads((dirs[16] / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    store = AdapterStore(model.spec, sources)
    for name, rank in (("a0000", 8), ("a0001", 16)):
        info = store.info(name)
        assert info.expert_format == "fused" and info.rank == rank
        assert info.expert_ranks == dict.fromkeys(EXPERT_TARGETS, rank)
        assert set(info.targets) == {"q", "k", "v", "o", *EXPERT_TARGETS}
    paged = store.paged("a0001")
    assert paged.data.abs().sum() > 0 and paged.num_pages == store.pages("a0001")


def test_expert_adapters_need_a_moe_preset_and_the_engine_systems():
    BenchConfig(model_preset="tiny-moe", adapter_targets="experts", systems=["base", "slora"])
    with pytest.raises(ConfigError, match="mixture-of-experts model_preset"):
        BenchConfig(adapter_targets="experts", systems=["slora"])
    with pytest.raises(ConfigError, match="leave peft out"):
        BenchConfig(model_preset="tiny-moe", adapter_targets="experts")  # default systems
    with pytest.raises(ConfigError, match="adapter_targets must be one of"):
        BenchConfig(model_preset="tiny-moe", adapter_targets="mlp")


@pytest.mark.parametrize("targets", ["attention", "experts"])
def test_cli_on_tiny_moe_writes_sane_figures(tmp_path, targets):
    app = typer.Typer()
    app.command()(bench)
    out = tmp_path / "out"
    args = ["--model-preset", "tiny-moe", "--device", "cpu", "--systems", "base,slora",
            "--adapters", "3", "--adapter-targets", targets, "--requests", "6", "--min-input",
            "8", "--max-input", "16", "--min-output", "4", "--max-output", "6",
            "--warmup-requests", "2", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert [(r["system"], r["adapters"]) for r in rows] == [("base", 0), ("slora", 3)]
    workload = Workload.generate(BenchConfig(requests=6, min_input=8, max_input=16,
                                             min_output=4, max_output=6), 300)  # fmt: skip
    for row in rows:
        assert row["error"] is None and row["finished"] == 6 and row["error_rows"] == 0
        assert row["output_tokens"] == sum(workload.output_lens)
        assert 0 < row["roofline_fraction"] < math.inf
        assert 0 < row["floor_fraction"] <= 1, row["floor_fraction"]
        assert math.isclose(sum(row[k] for k in PARTS), row["floor2_s"], rel_tol=1e-9)
    slora = rows[1]
    assert slora["weight_sets"] == (2 if targets == "experts" else 3)
    assert slora["floor_adapter_s"] > 0
    meta = json.loads((out / "run.json").read_text())
    assert meta["adapter_ranks"] == ([8, 16] if targets == "experts" else [8, 16, 32, 64])
    assert meta["active_parameters"] < meta["parameters"]
    on = "q, k, v, o and the experts" if targets == "experts" else "q, k, v, o, ranks"
    assert f"adapters on {on}" in (out / "results.md").read_text()


def test_the_expert_adapters_check_sets_slora_at_100_against_base():
    from slora_batch.bench.acceptance import acceptance

    figures = {"roofline_fraction": 0.5, "decode_host_share": math.nan, "decode_turns": 0}
    base = {"system": "base", "adapters": 0, "output_tokens_per_s": 1000.0, **figures}
    experts = {"system": "slora", "adapters": 100, "output_tokens_per_s": 760.0,
               "adapter_targets": "experts", **figures}  # fmt: skip
    attention = {**experts, "adapter_targets": "attention"}
    lines = [line for line in acceptance([base, experts]) if "on the experts" in line]
    assert lines == ["- slora@100 on the experts / base = 0.76 (need >= 0.75): pass"]
    assert not [line for line in acceptance([base, attention]) if "on the experts" in line]
