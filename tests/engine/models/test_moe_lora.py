"""LoRA on a mixture-of-experts block's experts and router against transformers + PEFT, token
for token in fp32 on CPU (tiny random Qwen3-MoE, Mixtral and OLMoE, ``moe_factory``).

Adapters in both formats PEFT writes: ``target_parameters`` on the fused 3-D expert parameters
(both, or down_proj alone beside the router), PEFT's own conversion of ``target_modules`` that
name the experts (gate_up at rank 2r through a rank_pattern, with rslora), and transformers 4's
per-expert modules with the router; beside attention-only adapters and base rows, in one batch;
then in a pool small enough to preempt rows and evict adapters.
"""

from __future__ import annotations

import pytest
import torch
from factory import make_adapter, make_rows
from moe_factory import (
    VOCAB,
    assert_parity,
    expert_adapters,
    make_expert_adapter,
    make_moe_model,
    reference_each,
    run,
)

from slora_batch import Engine, EngineConfig, Request
from slora_batch.engine.adapters.store import AdapterStore, parse_adapter
from slora_batch.engine.models.spec import read_spec

ROWS = 24
KINDS = ("qwen3-moe", "mixtral", "olmoe")


@pytest.fixture(scope="module", params=KINDS)
def case(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    model_dir = make_moe_model(root, kind, seed=3)
    adapters = expert_adapters(model_dir, root / "adapters", kind)
    rows = make_rows(ROWS, VOCAB, list(adapters), seed=len(kind))
    return kind, model_dir, adapters, rows, reference_each(model_dir, adapters, rows)


def test_expert_lora_tokens_equal_transformers_peft(case):
    kind, model_dir, adapters, rows, expected = case
    results, engine = run(model_dir, adapters, rows, num_pages=20000, max_num_batched_tokens=40)
    assert_parity(results, expected)
    assert engine.counters.preemptions == 0 and engine.counters.steps > 10


def test_expert_adapters_change_the_tokens(case):
    """The expert adapters are not no-ops: most of their rows differ from the base model's."""
    kind, model_dir, adapters, rows, expected = case
    base = reference_each(model_dir, adapters, [dict(r, adapter=None) for r in rows])
    changed = [r["id"] for r in rows if r["adapter"] and expected[r["id"]] != base[r["id"]]]
    assert len(changed) >= ROWS // 2, changed


def test_expert_lora_parity_with_preemption_and_eviction(case):
    kind, model_dir, adapters, rows, expected = case
    store = AdapterStore(read_spec(model_dir), adapters)
    biggest = sorted(store.pages(name) for name in adapters)[-2:]
    longest = max(2 * (len(r["prompt_token_ids"]) + r["max_new_tokens"]) for r in rows)
    results, engine = run(
        model_dir,
        adapters,
        rows,
        num_pages=longest + sum(biggest),  # the longest row beside the two largest adapters
        max_num_batched_tokens=32,
        max_adapters_per_batch=2,
    )
    assert_parity(results, expected)
    assert engine.counters.preemptions > 0 and engine.counters.adapter_evictions > 0


class ExpertLog:
    """The reference backend, recording for each expert-LoRA call how many experts served
    tokens of two or more adapters that have expert targets."""

    def __init__(self) -> None:
        from types import ModuleType

        from slora_kernels import ref

        self.ops = ModuleType("ref+expert-log")
        self.ops.__dict__.update({k: v for k, v in vars(ref).items() if not k.startswith("__")})
        self.ops.fused_moe_lora = self._moe_lora
        self.ref = ref
        self.shared: list[int] = []

    def _moe_lora(self, x, w_gate_up, w_down, topk_weights, topk_ids, pool_layer, meta, targets):
        has = (meta.slot_offsets[:, list(targets), 0] >= 0).any(dim=1)  # [slots]
        slots = meta.b_slot.long()[:, None].expand_as(topk_ids)
        on_experts = (slots >= 0) & has[slots.clamp(min=0)]
        served = {
            e: set(slots[(topk_ids == e) & on_experts].tolist()) for e in topk_ids.unique().tolist()
        }
        self.shared.append(sum(len(s) >= 2 for s in served.values()))
        args = (x, w_gate_up, w_down, topk_weights, topk_ids, pool_layer, meta, targets)
        return self.ref.fused_moe_lora(*args)


def test_rows_of_several_expert_adapters_routed_to_the_same_experts(case):
    """Steps whose experts each serve tokens of several expert adapters give every row the
    tokens transformers + PEFT gives it alone."""
    from slora_batch.engine.engine import assemble
    from slora_batch.engine.execution.parts import EngineParts

    kind, model_dir, adapters, rows, expected = case
    log = ExpertLog()
    config = EngineConfig(device="cpu", dtype="float32", num_pages=20000, max_num_batched_tokens=96)
    engine = assemble(model_dir, adapters, config, parts=EngineParts(ops=log.ops))
    results = {r.id: r for r in engine.generate(Request(**row) for row in rows)}
    assert_parity(results, expected)
    assert max(log.shared) >= 2, log.shared  # two experts each serving two expert adapters


def test_expert_targets_ranks_and_scales(case):
    """Each format's expert targets: the fused parameters at r, PEFT's conversion of
    target_modules at 2r for gate_up (its rank_pattern and alpha_pattern, rslora scale from
    them), the per-expert modules' gate and up read as one gate_up of 2r at their own scale."""
    kind, model_dir, adapters, _, _ = case
    spec = read_spec(model_dir)
    infos = {name: parse_adapter(name, path, spec) for name, path in adapters.items()}
    fused = infos["fused"]
    assert fused.targets == ("q", "expert_gate_up", "expert_down")
    assert fused.expert_ranks == {"expert_gate_up": 3, "expert_down": 3}
    assert fused.expert_format == "fused" and {f.scale for f in fused.experts} == {2.0}
    assert infos["down-router"].targets == ("router", "expert_down")
    modules = infos["modules-rs"]
    assert modules.expert_ranks == {"expert_gate_up": 4, "expert_down": 2}
    scales = {f.target: f.scale for f in modules.experts}
    assert scales == pytest.approx({"expert_gate_up": 6 / 4**0.5, "expert_down": 3 / 2**0.5})
    per_expert = infos["per-expert"]
    assert per_expert.targets == ("o", "router", "expert_gate_up", "expert_down")
    assert per_expert.expert_format == "per_expert"
    assert per_expert.expert_ranks == {"expert_gate_up": 8, "expert_down": 4}
    assert {f.scale for f in per_expert.experts} == {2.0}


def test_expert_pages_are_each_experts_rank_rows(case):
    """An expert target takes E x r_t rows of each factor's pages: the store's page count, and
    the pages a resident expert adapter holds in the pool."""
    kind, model_dir, adapters, rows, _ = case
    spec = read_spec(model_dir)
    store = AdapterStore(spec, adapters)
    experts, hidden, inter = spec.num_experts, spec.hidden_size, spec.expert_size
    pages = spec.pages_per_row
    gate_up = experts * 3 * (pages(hidden) + pages(2 * inter))
    down = experts * 3 * (pages(inter) + pages(hidden))
    q = 3 * (pages(hidden) + pages(spec.q_dim))
    assert store.pages("fused") == q + gate_up + down
    config = EngineConfig(device="cpu", dtype="float32", num_pages=20000)
    engine = Engine(model_dir, adapters=adapters, config=config)
    list(
        engine.generate([Request(id=0, adapter="fused", prompt_token_ids=[5, 6], max_new_tokens=1)])
    )
    resident = engine.residency._resident["fused"]  # its pages: private, the pool's bookkeeping
    assert resident.pages.size == store.pages("fused")


def test_an_expert_adapter_larger_than_the_pool_is_an_error_row(tmp_path):
    """A row whose expert adapter can never fit the pool gets an error row saying so at once;
    the base and attention rows beside it run."""
    model_dir = make_moe_model(tmp_path, "qwen3-moe")
    big = make_expert_adapter(model_dir, tmp_path / "big", 8, 8, seed=0)
    small = make_adapter(model_dir, tmp_path / "small", 2, ["q_proj"], 2, False, seed=1)
    adapters = {"big": big, "small": small}
    need = AdapterStore(read_spec(model_dir), adapters).pages("big")
    config = EngineConfig(device="cpu", dtype="float32", num_pages=need // 2)
    engine = Engine(model_dir, adapters=adapters, config=config)
    rows = [
        Request(id=i, adapter=a, prompt_token_ids=[5, 6, 7], max_new_tokens=2)
        for i, a in enumerate(["big", "small", None])
    ]
    results = {r.id: r for r in engine.generate(rows)}
    assert results[0].finish_reason == "error" and f"adapter {need}" in results[0].error
    assert results[1].error is None and results[2].error is None


def test_expert_and_router_lora_refused_under_tensor_parallel(tmp_path):
    """A store holding a rank's shard refuses adapters on the router or the experts by name
    (their LoRA has no tensor-parallel cut); attention adapters stay."""
    model_dir = make_moe_model(tmp_path, "mixtral")
    adapters = {
        "experts": make_expert_adapter(model_dir, tmp_path / "experts", 2, 2, seed=0),
        "router": make_adapter(model_dir, tmp_path / "router", 2, ["gate"], 2, False, seed=1),
        "attention": make_adapter(model_dir, tmp_path / "att", 2, ["q_proj"], 2, False, seed=2),
    }
    store = AdapterStore(read_spec(model_dir), adapters, shard=(0, 2))
    infos, broken = store.check_all()
    assert [info.name for info in infos] == ["attention"]
    assert "expert_gate_up, expert_down" in str(broken["experts"])
    assert "router" in str(broken["router"]) and "tensor_parallel 2" in str(broken["router"])


def test_expert_rows_follow_peft_delta_weight(tmp_path):
    """The host rows of a fused adapter give each expert PEFT's delta weight: B^T rows times
    A rows equal ``ParamWrapper.get_delta_weight`` of the loaded PeftModel, expert by expert."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from slora_batch.engine.adapters.store import load_weights

    model_dir = make_moe_model(tmp_path, "qwen3-moe")
    path = make_expert_adapter(model_dir, tmp_path / "a", 3, 5, seed=0)
    spec = read_spec(model_dir)
    weights = load_weights(parse_adapter("a", path, spec), spec)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), path)
    down = model.base_model.model.model.layers[1].mlp.experts  # the outer wrapper: down_proj
    for target, wrapper in (("expert_down", down), ("expert_gate_up", down.base_layer)):
        delta = wrapper.get_delta_weight("default")  # [E, d_out, d_in]
        a = weights.a[target][1].view(spec.num_experts, 3, -1)
        b_t = weights.b_t[target][1].view(spec.num_experts, 3, -1)
        assert torch.allclose(b_t.transpose(1, 2) @ a, delta, atol=1e-6), target
