"""The bench's parallel systems on the CPU: base-par and slora-par at --tensor-parallel 2 next to
one device, job-par at --data-parallel 2, and the RandomWeights they make on each rank."""

from __future__ import annotations

import pytest
import torch

from slora_batch.bench.acceptance import acceptance
from slora_batch.bench.bench import BenchConfig, run_bench
from slora_batch.bench.model import RandomWeights
from slora_batch.engine.config import ConfigError
from slora_batch.engine.models.spec import read_spec

TINY = dict(model_preset="tiny", device="cpu", min_input=8, max_input=16, min_output=4,
            max_output=6, warmup_requests=2, requests=16, adapters=[3])  # fmt: skip


@pytest.mark.slow
def test_tensor_parallel_runs_beside_one_device(tmp_path):
    config = BenchConfig(tensor_parallel=2, out=tmp_path / "out", **TINY)
    assert config.systems == ["base", "slora", "base-par", "slora-par"]
    rows, _ = run_bench(config)
    by_system = {r["system"]: r for r in rows}
    assert set(by_system) == {"base", "slora", "base-par", "slora-par"}
    for row in rows:
        assert row["error"] is None and row["finished"] == 16 and row["output_tokens"] > 0
    assert by_system["slora-par"]["tensor_parallel"] == 2
    assert by_system["slora"]["tensor_parallel"] == 1
    lines = "\n".join(acceptance(rows))
    assert "slora-par@3 (tp 2 x dp 1)" in lines and "x slora@3" in lines


def test_the_job_at_data_parallel_two_makes_the_tokens_of_the_engine(tmp_path):
    """``job-par``: the real job path at the bench's layout, beside ``slora-par`` on the same
    requests; its row names the layout and the acceptance compares the two."""
    config = BenchConfig(systems=["slora-par", "job-par"], systems_given=True, data_parallel=2,
                         out=tmp_path / "out", **TINY)  # fmt: skip
    rows, _ = run_bench(config)
    engine, job = ({r["system"]: r for r in rows}[s] for s in ("slora-par", "job-par"))
    assert job["error"] is None and job["finished"] == job["requests"] == 16
    assert (job["tensor_parallel"], job["data_parallel"]) == (1, 2)
    assert job["output_tokens"] == engine["output_tokens"] > 0 and job["error_rows"] == 0
    lines = "\n".join(acceptance(rows))
    assert "job-par@3 / slora-par@3 (tp 1 x dp 2) = " in lines and "- job-par@3: " in lines


def test_parallel_systems_need_a_parallel_layout():
    for system in ("slora-par", "job-par"):
        with pytest.raises(ConfigError, match="need --tensor-parallel or --data-parallel above"):
            BenchConfig(systems=[system], systems_given=True)
    with pytest.raises(ConfigError, match="tensor_parallel must be >= 1"):
        BenchConfig(tensor_parallel=0)


def test_random_weights_depend_on_name_and_seed_only(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1).save_pretrained(tmp_path)  # fmt: skip
    spec = read_spec(tmp_path)
    weights = RandomWeights(spec, seed=3, dtype=torch.float32)
    q = weights.pop("model.layers.0.self_attn.q_proj.weight")
    assert q.shape == (16, 16) and torch.equal(
        q, weights.pop("model.layers.0.self_attn.q_proj.weight")
    )
    assert not torch.equal(q, RandomWeights(spec, 4, torch.float32).pop(
        "model.layers.0.self_attn.q_proj.weight"))  # fmt: skip
    assert weights.pop("model.layers.0.self_attn.k_proj.weight").shape == (8, 16)
    assert weights.pop("model.layers.0.mlp.down_proj.weight").shape == (16, 24)
    assert torch.equal(weights.pop("model.norm.weight"), torch.ones(16))
    assert weights.pop("no.such.tensor") is None
    names = dict(weights.items())
    assert "lm_head.weight" in names and len(names) == 9 + 3
    assert weights.num_params() == sum(t.numel() for t in names.values())
