"""Mixture-of-experts bases (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE) against transformers + PEFT,
token for token in fp32 on CPU, with LoRA on attention in the same batch as base rows.

Tiny random models (``moe_factory``): top-2 routing over 4 or 8 experts, Qwen's
``norm_topk_prob``, Mixtral's renormalized top-k, Qwen2-MoE's shared expert and a dense layer
(``mlp_only_layers``), OLMoE's whole-projection q/k norms. Adapters: attention targets of ranks
1, 3, 5, 8 (rslora) and 16 in one batch; adapters on the MoE block that cannot run (the shared
expert, half of the experts' gate/up pair) are refused by name. LoRA on the experts and the
router: ``test_moe_lora``.
"""

from __future__ import annotations

import pytest
import torch
from factory import make_adapter, make_rows, reference
from moe_factory import (
    MOE_KINDS,
    VOCAB,
    assert_parity,
    make_attention_adapters,
    make_moe_model,
    moe_hf_model,
    run,
    save_fused,
    write_adapter,
)

from slora_batch import Engine, EngineConfig, Request
from slora_batch.engine.models.spec import ModelError, read_spec

ROWS = 30


@pytest.fixture(scope="module", params=MOE_KINDS)
def moe_case(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    model_dir = make_moe_model(root, kind, seed=MOE_KINDS.index(kind))
    adapters = make_attention_adapters(model_dir, root / "adapters")
    rows = make_rows(ROWS, VOCAB, list(adapters), seed=len(kind))
    return kind, model_dir, adapters, rows, reference(model_dir, adapters, rows)


def test_moe_greedy_tokens_equal_transformers_peft(moe_case):
    kind, model_dir, adapters, rows, expected = moe_case
    results, engine = run(model_dir, adapters, rows, num_pages=20000, max_num_batched_tokens=40)
    assert_parity(results, expected)
    assert engine.counters.preemptions == 0 and engine.counters.steps > 10
    assert engine.spec.num_experts in (4, 8) and engine.spec.experts_per_token == 2


def test_moe_parity_with_preemption_and_eviction(moe_case):
    kind, model_dir, adapters, rows, expected = moe_case
    longest = max(2 * (len(r["prompt_token_ids"]) + r["max_new_tokens"]) for r in rows)
    spec = read_spec(model_dir)
    biggest = max(spec.adapter_pages(16, ("k", "v")), spec.adapter_pages(8, ("q", "k", "v", "o")))
    pages = longest + 2 * biggest  # the longest row beside two adapters
    results, engine = run(
        model_dir,
        adapters,
        rows,
        num_pages=pages,
        max_num_batched_tokens=32,
        max_adapters_per_batch=2,
    )
    assert_parity(results, expected)
    assert engine.counters.preemptions > 0, (kind, pages)
    assert engine.counters.adapter_evictions > 0


class RoutingLog:
    """The reference backend, recording for each MoE call which adapter slots' tokens each
    expert served (the step's ``b_slot`` is the last LoRA call's, in the same layer)."""

    def __init__(self) -> None:
        from types import ModuleType

        from slora_kernels import ref

        self.ops = ModuleType("ref+routing-log")
        self.ops.__dict__.update({k: v for k, v in vars(ref).items() if not k.startswith("__")})
        self.ops.lora_shrink, self.ops.fused_moe = self._shrink, self._moe
        self.ref, self.b_slot = ref, None
        self.shared: list[int] = []  # per MoE call: experts that served 2 or more adapters

    def _shrink(self, x, pool_layer, meta, target, out):
        self.b_slot = meta.b_slot
        self.ref.lora_shrink(x, pool_layer, meta, target, out)

    def _moe(self, x, w_gate_up, w_down, topk_weights, topk_ids):
        if self.b_slot is not None and self.b_slot.numel() == topk_ids.shape[0]:
            slots = self.b_slot[:, None].expand_as(topk_ids)
            served = {
                e: set(slots[(topk_ids == e) & (slots >= 0)].tolist())
                for e in topk_ids.unique().tolist()
            }
            self.shared.append(sum(len(s) >= 2 for s in served.values()))
        self.b_slot = None
        return self.ref.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)


@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral"])
def test_rows_of_several_adapters_routed_to_the_same_experts(tmp_path, kind):
    """Steps whose experts each serve tokens of several adapters (and base tokens) give every
    row the tokens transformers + PEFT gives it alone."""
    from slora_batch.engine.engine import assemble
    from slora_batch.engine.execution.parts import EngineParts

    model_dir = make_moe_model(tmp_path, kind, seed=7)
    adapters = make_attention_adapters(model_dir, tmp_path / "adapters")
    rows = make_rows(16, VOCAB, list(adapters), seed=3)
    expected = reference(model_dir, adapters, rows)
    log = RoutingLog()
    config = EngineConfig(device="cpu", dtype="float32", num_pages=8000, max_num_batched_tokens=96)
    engine = assemble(model_dir, adapters, config, parts=EngineParts(ops=log.ops))
    results = {r.id: r for r in engine.generate(Request(**row) for row in rows)}
    assert_parity(results, expected)
    assert max(log.shared) >= 2, log.shared  # two experts each serving two adapters at once


@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral"])
def test_fused_expert_tensors_load_as_the_per_expert_ones(tmp_path, kind):
    """transformers 5's in-memory layout (``mlp.experts.gate_up_proj`` [E, 2I, H] and
    ``down_proj`` [E, H, I], Mixtral's block under ``mlp``) from safetensors and from a state
    dict: the tokens of the per-expert files."""
    from slora_batch.engine.engine import assemble
    from slora_batch.engine.execution.parts import EngineParts

    model = moe_hf_model(kind, seed=2)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in model.state_dict())
    fused_dir = save_fused(model, tmp_path / "fused")
    split_dir = tmp_path / "split"
    model.save_pretrained(split_dir)
    rows = [dict(r, adapter=None) for r in make_rows(8, VOCAB, ["x"], seed=1)]
    config = EngineConfig(device="cpu", dtype="float32", num_pages=4000)
    outputs = []
    for engine in (
        Engine(split_dir, config=config),
        Engine(fused_dir, config=config),
        assemble(split_dir, None, config, parts=EngineParts(weights=model.state_dict())),
    ):
        outputs.append({r.id: r.token_ids for r in engine.generate(Request(**r) for r in rows)})
    assert outputs[0] == outputs[1] == outputs[2]


def expert_adapters(root, model_dir, kind) -> dict:
    """Adapters on the MoE block a model cannot run: one per-expert projection without its
    gate/up partner (transformers 4's modules: Qwen's gate_proj alone, Mixtral's w1 alone), a
    shared expert's MLP."""
    adapters = {}
    if kind == "qwen3-moe":
        per_expert = {
            f"model.layers.{i}.mlp.experts.{e}.gate_proj.lora_{f}.weight": (2, 64)
            if f == "A"
            else (32, 2)
            for i in range(2)
            for e in range(8)
            for f in "AB"
        }
        adapters["per-expert"] = write_adapter(
            root / "per-expert", per_expert, target_modules=["gate_proj"]
        )
    if kind == "mixtral":
        w1 = {
            f"model.layers.{i}.block_sparse_moe.experts.{e}.w1.lora_{f}.weight": (2, 64)
            if f == "A"
            else (48, 2)
            for i in range(2)
            for e in range(4)
            for f in "AB"
        }
        adapters["w1"] = write_adapter(root / "w1", w1, target_modules=["w1"])
    if kind == "qwen2-moe":
        shared = {  # written by hand: PEFT turns "gate_proj" on a Qwen2-MoE into the experts'
            # fused gate_up_proj and refuses it without up_proj
            f"model.layers.{i}.mlp.shared_expert.gate_proj.lora_{f}.weight": (2, 64)
            if f == "A"
            else (48, 2)
            for i in range(2)
            for f in "AB"
        }
        adapters["shared-mlp"] = write_adapter(
            root / "shared-mlp", shared, target_modules=["gate_proj"]
        )
    return adapters


MODULES = {  # the module each refused adapter's message names
    "per-expert": "experts.0.gate_proj",
    "w1": "experts.0.w1",
    "shared-mlp": "mlp.shared_expert.gate_proj",
}


@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral", "qwen2-moe"])
def test_adapters_the_moe_block_cannot_run_are_refused_by_name(tmp_path, kind):
    """Each such adapter's rows are error rows naming the adapter and the module; rows of an
    attention adapter beside them run."""
    model_dir = make_moe_model(tmp_path, kind)
    refused = expert_adapters(tmp_path / "refused", model_dir, kind)
    good = make_adapter(model_dir, tmp_path / "good", 4, ["q_proj", "v_proj"], 8, False, seed=1)
    config = EngineConfig(device="cpu", dtype="float32", num_pages=2000)
    engine = Engine(model_dir, adapters={**refused, "good": good}, config=config)
    names = [*refused, "good"]
    rows = [Request(id=n, adapter=n, prompt_token_ids=[5, 6, 7], max_new_tokens=2) for n in names]
    results = {r.id: r for r in engine.generate(rows)}
    assert results["good"].error is None and len(results["good"].token_ids) == 2
    for name in refused:
        error = results[name].error
        assert results[name].finish_reason == "error" and error, name
        assert repr(name) in error and MODULES[name] in error, error


def test_lora_refusal_names_the_shared_expert():
    """The reason ``ModelSpec.lora_refusal`` gives for a tensor on the shared expert; none for
    the experts, the router, an attention tensor or a dense model."""
    from factory import tiny_spec

    spec = tiny_spec(architecture="Qwen2MoeForCausalLM", num_experts=8, experts_per_token=2)
    key = "base_model.model.model.layers.3.mlp.shared_expert.gate_proj.lora_A.weight"
    reason = spec.lora_refusal(key)
    assert "mlp.shared_expert.gate_proj" in reason and "Qwen2MoeForCausalLM" in reason
    assert "q_proj, k_proj, v_proj, o_proj, gate, experts.gate_up_proj" in reason
    gate = "base_model.model.model.layers.0.mlp.shared_expert_gate.lora_B.weight"
    assert "LoRA on mlp.shared_expert_gate," in spec.lora_refusal(gate)
    for fine in (
        "base_model.model.model.layers.3.mlp.experts.base_layer.lora_A.weight",
        "base_model.model.model.layers.0.mlp.gate.lora_B.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
    ):
        assert spec.lora_refusal(fine) is None, fine
    assert tiny_spec().lora_refusal(key) is None


def test_spec_counts_the_experts_parameters(tmp_path):
    """``projection_params`` is the transformers model's parameter count less embeddings, LM
    head, norms and biases: every expert, the router, the shared expert and its gate."""
    for kind in MOE_KINDS:
        model_dir = make_moe_model(tmp_path, kind)
        spec = read_spec(model_dir)
        hf = moe_hf_model(kind)
        projections = sum(
            p.numel()
            for n, p in hf.named_parameters()
            if "norm" not in n and "embed" not in n and "lm_head" not in n and "bias" not in n
        )
        assert spec.projection_params == projections, kind


def test_spec_reads_the_moe_switches(tmp_path):
    qwen2 = read_spec(make_moe_model(tmp_path, "qwen2-moe"))
    assert (qwen2.num_experts, qwen2.experts_per_token, qwen2.expert_size) == (8, 2, 32)
    assert qwen2.dense_layers == (1,) and qwen2.shared_expert_size == 48
    assert qwen2.attention_bias and not qwen2.o_bias and not qwen2.norm_topk
    assert [qwen2.is_moe_layer(i) for i in range(2)] == [True, False]
    mixtral = read_spec(make_moe_model(tmp_path, "mixtral"))
    assert mixtral.norm_topk and mixtral.expert_size == 48 and mixtral.dense_layers == ()
    assert mixtral.lora_targets == ("q", "k", "v", "o", "router", "expert_gate_up", "expert_down")
    olmoe = read_spec(make_moe_model(tmp_path, "olmoe"))
    assert olmoe.qk_norm_whole and olmoe.qk_norm and not olmoe.norm_topk


def test_tensor_parallel_cuts_the_experts_or_names_the_model(tmp_path):
    qwen3 = read_spec(make_moe_model(tmp_path, "qwen3-moe"))
    shard = qwen3.shard(2)
    assert (shard.expert_size, shard.intermediate_size, shard.num_heads) == (16, 48, 2)
    with pytest.raises(ModelError, match="experts' intermediate size 32"):
        qwen3.shard(64)
    olmoe = read_spec(make_moe_model(tmp_path, "olmoe"))
    with pytest.raises(ModelError, match="tensor_parallel 2 is not supported for OlmoeForCausalLM"):
        olmoe.shard(2)
    assert str(tmp_path) in str(pytest.raises(ModelError, olmoe.shard, 2).value)


@pytest.mark.parametrize("kind", ["qwen2-moe", "mixtral"])
def test_moe_under_tensor_parallel_two(tmp_path, kind):
    """Two gloo ranks, each with half of every expert's intermediate size (and of the shared
    expert and the dense layer), the router whole: the tokens of transformers + PEFT."""
    model_dir = make_moe_model(tmp_path, kind, seed=4)
    adapters = make_attention_adapters(model_dir, tmp_path / "adapters")
    rows = make_rows(12, VOCAB, list(adapters), seed=5)
    expected = reference(model_dir, adapters, rows)
    results, engine = run(
        model_dir,
        adapters,
        rows,
        tensor_parallel=2,
        num_pages=8000,
        max_num_batched_tokens=64,
        cpu_threads=1,
    )
    try:
        assert engine.tp is not None and engine.tp.size == 2
        assert_parity(results, expected)
    finally:
        engine.close()


def test_fp8_weights_are_refused_for_moe(tmp_path):
    model_dir = make_moe_model(tmp_path, "mixtral")
    with pytest.raises(ModelError, match="fp8 weights are not supported for MixtralForCausalLM"):
        Engine(model_dir, config=EngineConfig(device="cpu", dtype="float32", weights="fp8"))


def test_router_weights_follow_each_models_normalization():
    """Mixtral renormalizes the top-k softmax weights; Qwen without ``norm_topk_prob`` keeps
    them as they are."""
    from slora_batch.engine.models.moe import route

    h = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    router = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    probs = torch.softmax(h @ router.T, dim=-1)
    w, ids = route(h, router, 2, norm_topk=False)
    assert torch.allclose(w, probs.gather(1, ids.long()))
    assert ids.dtype == torch.int32 and (w.sum(-1) < 1).all()
    w_norm, ids_norm = route(h, router, 2, norm_topk=True)
    assert torch.equal(ids, ids_norm) and torch.allclose(w_norm.sum(-1), torch.ones(5))


def test_moe_scores_equal_transformers_peft(moe_case):
    """Scored rows (log-likelihood of a continuation), prefix caching on: transformers + PEFT's
    log-probs."""
    import random

    from test_scoring import peft_model, reference_logprobs

    kind, model_dir, adapters, _, _ = moe_case
    rng = random.Random(3)
    names = [None, *adapters]
    rows = []
    for i in range(10):
        context = [rng.randrange(3, VOCAB) for _ in range(rng.choice([3, 9, 20]))]
        stem = context[: rng.choice([0, 4])]
        cont = [rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 4, 9]))]
        rows.append(
            Request(
                id=i,
                adapter=names[i % len(names)],
                prompt_token_ids=stem + context,
                continuation_token_ids=cont,
            )
        )
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        num_pages=20000,
        max_num_batched_tokens=24,
        prefix_caching=True,
        prefix_block_tokens=4,
    )
    results = {r.id: r for r in Engine(model_dir, adapters=adapters, config=config).generate(rows)}
    model = peft_model(model_dir, adapters)
    for row in rows:
        ctx, cont = row.prompt_token_ids, row.continuation_token_ids
        logp = reference_logprobs(model, row.adapter, ctx + cont)
        want = [float(logp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont)]
        assert results[row.id].token_logprobs == pytest.approx(want, abs=1e-4), (kind, row.id)


def test_spec_sizes_for_memory_match_the_dense_formula_and_grow_with_experts():
    """``projection_params`` of a dense model is the per-layer attention and 3 x hidden x
    intermediate that weight sizing counts; ``mlp_step_width`` of a dense model is 6 x
    intermediate, of an MoE model at least its K activations and K weighted outputs a token."""
    from factory import tiny_spec

    dense = tiny_spec()
    h, i = dense.hidden_size, dense.intermediate_size
    attention = h * (dense.q_dim + 2 * dense.kv_dim) + dense.q_dim * h
    assert dense.projection_params == dense.num_layers * (attention + 3 * h * i)
    assert dense.mlp_step_width == 6 * i
    moe = tiny_spec(num_experts=64, experts_per_token=8, expert_size=32, intermediate_size=32)
    assert moe.mlp_step_width >= 8 * (32 + 64) > 6 * 32
    assert moe.projection_params > dense.projection_params
