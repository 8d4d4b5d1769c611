"""Expert LoRA adapter files: what each format's tensors and config say, and the refusals that
name the adapter, the tensor or pattern and the numbers (``adapters.expert_files``), on a tiny
Qwen3-MoE (hidden 64, 8 experts of 32, 2 layers) and Mixtral (4 experts of 48)."""

from __future__ import annotations

import pytest
from factory import make_adapter
from moe_factory import make_moe_model, write_adapter

from slora_batch.engine.adapters.store import AdapterError, parse_adapter
from slora_batch.engine.models.spec import read_spec

P = "model.layers.{}.mlp.experts."


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    model_dir = make_moe_model(tmp_path_factory.mktemp("qwen"), "qwen3-moe")
    return model_dir, read_spec(model_dir)


def fused(rank: int, gate_up: bool = True, down: bool = True, layers=(0, 1)) -> dict:
    """Fused-format tensor shapes (8 experts, hidden 64, expert size 32): gate_up nested under
    base_layer when down is there too, as PEFT nests them."""
    tensors = {}
    for i in layers:
        if gate_up:
            nest = "base_layer." if down else ""
            tensors[P.format(i) + nest + "lora_A.weight"] = (8 * rank, 64)
            tensors[P.format(i) + nest + "lora_B.weight"] = (64, 8 * rank)
        if down:
            tensors[P.format(i) + "lora_A.weight"] = (8 * rank, 32)
            tensors[P.format(i) + "lora_B.weight"] = (64, 8 * rank)
    return tensors


def per_expert(rank: int, names=("gate_proj", "up_proj", "down_proj"), experts=8) -> dict:
    dims = {"gate_proj": (64, 32), "up_proj": (64, 32), "down_proj": (32, 64)}
    return {
        f"{P.format(i)}{e}.{name}.lora_{f}.weight": (rank, dims[name][0])
        if f == "A"
        else (dims[name][1], rank)
        for i in (0, 1)
        for e in range(experts)
        for name in names
        for f in "AB"
    }


def refused(name, path, spec) -> str:
    with pytest.raises(AdapterError) as err:
        parse_adapter(name, path, spec)
    message = str(err.value)
    assert repr(name) in message and str(path) in message
    return message


def test_fused_down_alone_is_read_by_its_shapes(qwen, tmp_path):
    model_dir, spec = qwen
    path = write_adapter(tmp_path / "d", fused(2, gate_up=False), rank=2, lora_alpha=6)
    info = parse_adapter("d", path, spec)
    assert info.targets == ("expert_down",) and info.expert_ranks == {"expert_down": 2}
    assert info.experts[0].scale == 3.0


def test_rank_pattern_sets_an_expert_parameters_rank_and_scale(qwen, tmp_path):
    model_dir, spec = qwen
    cfg = dict(rank_pattern={r".*\.gate_up_proj": 4}, alpha_pattern={r".*\.gate_up_proj": 2})
    tensors = {}
    for i in (0, 1):
        tensors[P.format(i) + "base_layer.lora_A.weight"] = (8 * 4, 64)
        tensors[P.format(i) + "base_layer.lora_B.weight"] = (64, 8 * 4)
        tensors[P.format(i) + "lora_A.weight"] = (8 * 2, 32)
        tensors[P.format(i) + "lora_B.weight"] = (64, 8 * 2)
    path = write_adapter(tmp_path / "p", tensors, rank=2, **cfg)
    info = parse_adapter("p", path, spec)
    assert info.expert_ranks == {"expert_gate_up": 4, "expert_down": 2}
    assert {f.target: f.scale for f in info.experts} == {"expert_gate_up": 0.5, "expert_down": 2.0}
    path = write_adapter(tmp_path / "q", fused(2), rank=2, **cfg)  # gate_up at 2, config says 4
    assert "gate_up_proj has ranks [2] per expert, the config says 4" in refused("q", path, spec)


def test_rank_pattern_on_attention_sets_its_modules_rank(qwen, tmp_path):
    model_dir, spec = qwen
    targets = ["q_proj", "v_proj"]
    path = make_adapter(
        model_dir, tmp_path / "a", 2, targets, 4, False, seed=0, rank_pattern={"q_proj": 4}
    )
    info = parse_adapter("a", path, spec)
    assert info.module_ranks("q", spec.num_layers)[0] == (4,) * spec.num_layers
    assert info.module_ranks("v", spec.num_layers)[0] == (2,) * spec.num_layers


@pytest.mark.parametrize(
    ("tensors", "reason"),
    [
        (
            {P.format(i) + f: (16, 64) for i in (0, 1) for f in ("lora_A.weight", "lora_B.weight")},
            "shapes A [16, 64], B [16, 64]",
        ),
        (fused(2, layers=(0,)), "every mixture-of-experts layer needs it ([0, 1])"),
        ({P.format(0) + "lora_A.weight": (16, 32)}, "has factors ['A']"),
        (per_expert(2, experts=7), "has 28 of 32 LoRA factors"),
        (per_expert(2) | fused(2), "both fused (target_parameters) and per-expert"),
        (per_expert(3), "has shape [3, 32], the model needs [2, 32]"),
        (
            {k: s for k, s in per_expert(2).items() if "w9" not in k}
            | {P.format(0) + "0.w9.lora_A.weight": (2, 64)},
            "projection 'w9'; Qwen3MoeForCausalLM's experts have gate_proj, up_proj, down_proj",
        ),
    ],
    ids=["shapes", "a-layer-missing", "no-b", "an-expert-missing", "both-formats", "rank", "name"],
)
def test_expert_tensors_that_peft_does_not_write_are_refused(qwen, tmp_path, tensors, reason):
    model_dir, spec = qwen
    path = write_adapter(tmp_path / "bad", tensors, rank=2)
    assert reason in refused("bad", path, spec)


def test_per_expert_rslora_keeps_the_scale_it_was_trained_with(qwen, tmp_path):
    """gate and up of rank r become one gate_up of 2r at their own scale alpha / sqrt(r) (not
    2 alpha / sqrt(2r), what PEFT's conversion of the config gives under rslora)."""
    model_dir, spec = qwen
    path = write_adapter(tmp_path / "rs", per_expert(4), rank=4, lora_alpha=8, use_rslora=True)
    info = parse_adapter("rs", path, spec)
    assert info.expert_format == "per_expert"
    assert info.expert_ranks == {"expert_gate_up": 8, "expert_down": 4}
    assert {f.scale for f in info.experts} == {4.0}


def test_mixtral_names_its_transformers_4_experts(tmp_path):
    model_dir = make_moe_model(tmp_path, "mixtral")
    spec = read_spec(model_dir)
    assert spec.expert_names == ("w1", "w3", "w2")
    tensors = {
        f"model.layers.{i}.block_sparse_moe.experts.{e}.{n}.lora_{f}.weight": (2, d_in)
        if f == "A"
        else (d_out, 2)
        for i in (0, 1)
        for e in range(4)
        for n, (d_in, d_out) in (("w1", (64, 48)), ("w3", (64, 48)), ("w2", (48, 64)))
        for f in "AB"
    }
    tensors |= {f"model.layers.{i}.block_sparse_moe.gate.lora_A.weight": (2, 64) for i in (0, 1)}
    tensors |= {f"model.layers.{i}.block_sparse_moe.gate.lora_B.weight": (4, 2) for i in (0, 1)}
    info = parse_adapter("m", write_adapter(tmp_path / "m", tensors, rank=2), spec)
    assert info.targets == ("router", "expert_gate_up", "expert_down")
    assert spec.adapter_pages(2, info.targets, info.expert_ranks) == (
        2 * (2 + 1)  # router: A rows of 64, B^T rows of 4, pages of 32
        + 4 * 4 * (2 + 3)  # gate_up: 4 experts x 2r rows of 64 and of 96
        + 4 * 2 * (2 + 2)  # down: 4 experts x r rows of 48 and of 64
    )
