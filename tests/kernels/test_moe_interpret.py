"""The fused MoE kernels (kernels/moe.py) against their torch twin (``ref.fused_moe``) on the
CPU, in Triton's interpreter; ``moe_align``'s segments, which need no kernel, in this process.

As in test_kernels_interpret.py, the interpreted tests run in a child process started with
TRITON_INTERPRET=1 (Triton picks interpreting or compiling when a kernel module is imported);
``TRITON_INTERPRET=1 pytest tests/kernels/test_moe_interpret.py`` runs them in-process. Tiny
shapes whose sizes are no multiple of the tiles, routing that is uniform, skewed onto one expert,
or leaves experts out ("no expert" ids, -1), decode and prefill block sizes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from interpreter import INTERPRETED, run_interpreted

from slora_kernels import ref

TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2)}

if not INTERPRETED:

    @pytest.mark.slow
    def test_moe_kernels_in_interpreter():
        out = run_interpreted(f"{__file__}::TestMoeInterpreted")
        assert " passed" in out and "skipped" not in out, out[-2000:]


def routing(
    num_tokens: int, num_experts: int, top_k: int, popularity: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, K] fp32, topk_ids [T, K] int32) as a router gives them: "uniform"
    (random logits), "skewed" (expert 0 in nearly every token's top-k, the others rare), "gaps"
    (uniform, with a third of the slots "no expert", -1)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if popularity == "skewed":
        logits[:, 0] += 6.0
        logits[:, 1:] -= 2.0 * torch.arange(1, num_experts)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    ids = ids.to(torch.int32)
    if popularity == "gaps":
        ids[torch.rand(ids.shape, generator=gen) < 1 / 3] = -1
    return weights.contiguous(), ids.contiguous()


def experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    return gate_up.to(dtype), down.to(dtype)


# ------------------------------------------------------------------ moe_align, in this process


@pytest.mark.parametrize("popularity", ["uniform", "skewed", "gaps"])
@pytest.mark.parametrize(("num_tokens", "top_k", "block_m"), [(1, 2, 16), (37, 2, 4), (50, 4, 16)])
def test_moe_align_gives_each_expert_whole_blocks(num_tokens, top_k, block_m, popularity):
    """Every slot of an expert lies in that expert's blocks, once; padding is N; blocks past the
    segments have expert -1; "no expert" slots appear nowhere."""
    from slora_kernels.moe import moe_align

    num_experts = 8
    _, ids = routing(num_tokens, num_experts, top_k, popularity, seed=num_tokens)
    n = ids.numel()
    sorted_slots, block_expert = moe_align(ids, num_experts, block_m)
    assert sorted_slots.dtype == block_expert.dtype == torch.int32
    assert block_expert.numel() == -(-n // block_m) + min(num_experts, n)
    assert sorted_slots.numel() == block_expert.numel() * block_m
    flat = ids.reshape(-1)
    blocks = sorted_slots.view(-1, block_m)
    seen = []
    for b, expert in enumerate(block_expert.tolist()):
        slots = [s for s in blocks[b].tolist() if s != n]
        if expert < 0:
            assert not slots, (b, slots)
            continue
        assert slots and all(int(flat[s]) == expert for s in slots), (b, expert, slots)
        assert slots == sorted(slots)
        seen += slots
    assert sorted(seen) == [s for s in range(n) if int(flat[s]) >= 0]
    used = [e for e in block_expert.tolist() if e >= 0]
    assert used == sorted(used)  # segments in expert order, then the unused blocks


def test_moe_align_example():
    from slora_kernels.moe import moe_align

    sorted_slots, block_expert = moe_align(torch.tensor([[2, 0], [0, 1], [1, 2]]), 3, 4)
    assert sorted_slots.tolist()[:12] == [1, 2, 6, 6, 3, 4, 6, 6, 0, 5, 6, 6]
    assert set(sorted_slots.tolist()[12:]) == {6}
    assert block_expert.tolist() == [0, 1, 2, -1, -1]


def test_twin_skips_no_expert_slots_and_weights_each_expert():
    """``ref.fused_moe``: a token whose slots are all -1 gets zeros; one expert at weight w is w
    times that expert's SwiGLU MLP."""
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    gate_up, down = experts(4, 16, 8, torch.float32, seed=1)
    ids = torch.tensor([[-1, -1], [2, -1], [2, 3]], dtype=torch.int32)
    weights = torch.tensor([[0.5, 0.5], [0.25, 0.75], [0.25, 0.75]])
    out = ref.fused_moe(x, gate_up, down, weights, ids)
    assert torch.equal(out[0], torch.zeros(16))

    def mlp(t: int, e: int) -> torch.Tensor:
        return torch.nn.functional.linear(ref.silu_mul(x[t : t + 1] @ gate_up[e].T), down[e])

    torch.testing.assert_close(out[1:2], 0.25 * mlp(1, 2))
    torch.testing.assert_close(out[2:3], 0.25 * mlp(2, 2) + 0.75 * mlp(2, 3))


# ------------------------------------------------------------------------- interpreted kernels

# (tokens, experts, top-k, hidden, inter, popularity): decode (block 16), prefill with 32- and
# 64-row blocks, hidden and inter off the 64-wide tiles, k = 1 and every expert in the top-k.
MOE_CASES = {
    "decode": (3, 8, 2, 64, 48, "uniform"),
    "prefill-skewed": (37, 4, 2, 72, 40, "skewed"),
    "prefill-gaps": (40, 4, 2, 64, 48, "gaps"),
    "block-64": (150, 4, 2, 40, 24, "uniform"),
    "top-1": (9, 4, 1, 64, 32, "skewed"),
    "all-experts": (6, 4, 4, 48, 80, "uniform"),
}


@pytest.fixture(scope="module")
def moe_kernels():
    """kernels/moe.py, imported only once the process is known to interpret."""
    from slora_kernels import moe, triton_ops

    return moe, triton_ops


class TestMoeInterpreted:
    """Run in the interpreter child process (see the module docstring)."""

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
    @pytest.mark.parametrize("case", list(MOE_CASES))
    def test_fused_moe_matches_twin(self, moe_kernels, case, dtype):
        moe, _ = moe_kernels
        num_tokens, num_experts, top_k, hidden, inter, popularity = MOE_CASES[case]
        seed = len(case)
        x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed))
        x = x.to(dtype)
        gate_up, down = experts(num_experts, hidden, inter, dtype, seed)
        weights, ids = routing(num_tokens, num_experts, top_k, popularity, seed)
        mine = moe.fused_moe(x, gate_up, down, weights, ids)
        expected = ref.fused_moe(x, gate_up, down, weights, ids)
        assert mine.dtype == dtype and mine.shape == (num_tokens, hidden)
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(mine, expected, rtol=rtol, atol=atol)
        assert expected.abs().amax() > 0.1  # the case computes something

    def test_triton_ops_fused_moe_is_the_kernel(self, moe_kernels):
        moe, triton_ops = moe_kernels
        assert triton_ops.fused_moe is moe.fused_moe

    @pytest.mark.parametrize("kind", ["mixed", "decode"])
    def test_moe_model_forward_matches_torch_backend(self, moe_kernels, kind):
        """A tiny MoE model's forward (attention LoRA, routing, both kernels) on the Triton
        backend equals the torch backend."""
        from test_kernels_interpret import MODEL_STEPS, model_step

        _, triton_ops = moe_kernels
        model = tiny_moe_model()
        step, pool, lora_pool = model_step(MODEL_STEPS[kind], seed=len(kind))
        ref_pool = copy.deepcopy(pool)
        logits = model.forward(step, pool, triton_ops, lora_pool)
        expected = model.forward(step, ref_pool, ref, lora_pool)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def tiny_moe_model():
    """test_kernels_interpret's tiny model (2 layers, GQA 4/2, head_dim 16) with a mixture of 4
    experts (top-2, renormalized) in layer 0 and a shared expert beside them in layer 1."""
    from factory import tiny_spec

    from slora_batch.engine.models.llama import LayerWeights, LlamaModel
    from slora_batch.engine.models.moe import MoeWeights, SharedExpert

    spec = tiny_spec(num_experts=4, experts_per_token=2, expert_size=32, norm_topk=True)
    gen = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * shape[-1] ** -0.5

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(64, generator=gen)

    def moe(shared: bool) -> MoeWeights:
        gate = SharedExpert(w(96, 64), w(64, 48), w(1, 64)) if shared else None
        return MoeWeights(3 * w(4, 64), w(4, 64, 64), w(4, 64, 32), 2, not shared, gate)

    layers = [
        LayerWeights(norm(), w(128, 64), None, w(64, 64), None, norm(), None, None, moe=moe(i))
        for i in (False, True)
    ]
    return LlamaModel(spec, torch.randn(50, 64, generator=gen), layers, norm(), w(50, 64), 128)


if not INTERPRETED:  # the child process runs these
    del TestMoeInterpreted
