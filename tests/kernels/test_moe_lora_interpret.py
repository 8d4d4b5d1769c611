"""The expert LoRA kernels (kernels/moe_lora.py) against their torch twin
(``ref.fused_moe_lora``) on the CPU, in Triton's interpreter; the twin itself against each
token's merged expert weights, in this process.

As in test_moe_interpret.py, the interpreted tests run in a child process started with
TRITON_INTERPRET=1; ``TRITON_INTERPRET=1 pytest tests/kernels/test_moe_lora_interpret.py`` runs
them in-process. Cases: mixed ranks per adapter and target (1 to 64, gate_up and down apart),
an adapter without expert targets, tokens without adapter, adapter popularity uniform or skewed
onto one adapter, routing uniform, skewed onto one expert or with "no expert" slots, pages at
random places of the pool and a page size no power of two.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from interpreter import INTERPRETED, run_interpreted
from test_moe_interpret import experts, routing

from slora_kernels import ref
from slora_kernels.meta import LoraMeta

TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2)}
NUM_TARGETS = 12  # slot_offsets' width: every LoRA target of the engine
TARGETS = (10, 11)  # expert gate_up, expert down

if not INTERPRETED:

    @pytest.mark.slow
    def test_moe_lora_kernels_in_interpreter():
        out = run_interpreted(f"{__file__}::TestMoeLoraInterpreted")
        assert " passed" in out and "skipped" not in out, out[-2000:]


@dataclass
class ExpertCase:
    """A pool holding some adapters' expert factors, their tables, and the factors themselves
    (per slot and target: A [E, r, d_in] and B^T [E, r, d_out], None when absent)."""

    pool: torch.Tensor
    meta: LoraMeta
    factors: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor] | None]

    def to(self, device: str) -> ExpertCase:
        tables = ("b_slot", "token_order", "seg1_start", "seg_slot", "slot_rank", "slot_scale")
        tables += ("slot_pages", "slot_offsets")
        meta = replace(self.meta, **{name: getattr(self.meta, name).to(device) for name in tables})
        return ExpertCase(self.pool.to(device), meta, self.factors)


def expert_case(
    ranks: list[tuple[int, int]],
    b_slot: torch.Tensor,
    dims: tuple[int, int],
    num_experts: int,
    page: int,
    dtype: torch.dtype,
    seed: int,
) -> ExpertCase:
    """Adapters in slots 0.. of ranks ``ranks`` [(gate_up's, down's)], 0: no such target; each
    target's A rows of every expert, then its B^T rows, row by row in whole pages placed at
    random in the pool, as the store lays them out (``adapters.store.to_pages``)."""
    gen = torch.Generator().manual_seed(seed)
    factors = {
        (slot, target): random_factor(num_experts, rank, target, dims, dtype, gen)
        for slot, pair in enumerate(ranks)
        for target, rank in zip(TARGETS, pair, strict=True)
    }
    counts = [
        sum(
            f.shape[0] * f.shape[1] * per(f.shape[2], page)
            for t in TARGETS
            for f in factors[slot, t] or ()
        )
        for slot in range(len(ranks))
    ]
    total = sum(counts) + 17
    pool = torch.randn(total, page, generator=gen).to(dtype)  # unused pages hold noise
    free = torch.randperm(total, generator=gen)
    slot_pages = torch.full((len(ranks), max(counts) + 3), -1, dtype=torch.int32)  # wider
    slot_offsets = torch.full((len(ranks), NUM_TARGETS, 2), -1, dtype=torch.int32)
    taken = 0
    for slot in range(len(ranks)):
        cursor = 0
        for target in TARGETS:
            for which, factor in enumerate(factors[slot, target] or ()):
                slot_offsets[slot, target, which] = cursor
                ids = place(factor.reshape(-1, factor.shape[-1]), pool, free[taken:])
                slot_pages[slot, cursor : cursor + ids.numel()] = ids
                cursor, taken = cursor + ids.numel(), taken + ids.numel()
    meta = LoraMeta(
        b_slot=b_slot.to(torch.int32),
        token_order=torch.zeros(b_slot.shape[0], dtype=torch.int32),
        seg1_start=torch.zeros(1, dtype=torch.int32),
        seg_slot=torch.zeros(0, dtype=torch.int32),
        slot_rank=torch.ones(len(ranks), dtype=torch.int32),
        slot_scale=torch.ones(len(ranks), dtype=torch.float32),
        slot_pages=slot_pages,
        slot_offsets=slot_offsets,
        max_rank=1,
        targets=TARGETS,
    )
    return ExpertCase(pool, meta, factors)


def random_factor(num_experts, rank, target, dims, dtype, gen):
    """(A [E, r, d_in], B^T [E, r, d_out]) of an expert target, or None for rank 0."""
    if not rank:
        return None
    hidden, inter = dims
    d_in, d_out = (hidden, 2 * inter) if target == TARGETS[0] else (inter, hidden)
    a = torch.randn(num_experts, rank, d_in, generator=gen) * d_in**-0.5
    b_t = torch.randn(num_experts, rank, d_out, generator=gen) * 0.5 * rank**-0.5
    return a.to(dtype), b_t.to(dtype)


def place(rows: torch.Tensor, pool: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
    """Writes ``rows`` [n, width] row by row into the first free pages of ``pool``, each row
    zero padded to whole pages; returns those pages in order."""
    page = pool.shape[1]
    n, width = rows.shape
    padded = torch.zeros(n, per(width, page) * page, dtype=pool.dtype)
    padded[:, :width] = rows
    ids = free[: padded.numel() // page]
    pool[ids] = padded.view(-1, page)
    return ids.to(torch.int32)


def per(width: int, page: int) -> int:
    return -(-width // page)


def adapter_slots(num_tokens: int, num_adapters: int, popularity: str, seed: int) -> torch.Tensor:
    """b_slot [T]: every fourth token on the base model (-1); the others uniform over the
    adapters, or "skewed": nearly all on adapter 0."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, num_adapters, (num_tokens,), generator=gen)
    if popularity == "skewed":
        slots[torch.rand(num_tokens, generator=gen) < 0.85] = 0
    slots[::4] = -1
    return slots.to(torch.int32)


def merged(case: ExpertCase, x, gate_up, down, weights, ids) -> torch.Tensor:
    """Each token through its experts with its adapter's delta merged into their weights,
    in fp64: what the twin computes, without pages."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        s = int(case.meta.b_slot[t])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            w_gu, w_d = gate_up[e].double(), down[e].double()
            if s >= 0 and case.factors[s, TARGETS[0]] is not None:
                a, b_t = case.factors[s, TARGETS[0]]
                w_gu = w_gu + b_t[e].double().T @ a[e].double()
            if s >= 0 and case.factors[s, TARGETS[1]] is not None:
                a, b_t = case.factors[s, TARGETS[1]]
                w_d = w_d + b_t[e].double().T @ a[e].double()
            g, u = (x[t].double() @ w_gu.T).chunk(2)
            out[t] += float(weights[t, j]) * ((torch.nn.functional.silu(g) * u) @ w_d.T)
    return out


# (tokens, experts, top-k, hidden, inter, page, routing, adapter popularity). The shrinks run a
# program per slot, so each case has the fewest slots its block size allows: "block-64" puts
# 65 tokens on both of 2 experts, 65 slots each (over 64 an expert: 64-row blocks), a full block
# and one of a single row.
CASES = {
    "decode": (5, 8, 2, 64, 48, 16, "uniform", "uniform"),
    "prefill-skewed": (37, 4, 2, 72, 40, 48, "skewed", "skewed"),
    "gaps": (16, 4, 2, 64, 48, 32, "gaps", "uniform"),
    "block-64": (65, 2, 2, 40, 24, 16, "uniform", "skewed"),
    "top-1": (9, 4, 1, 64, 32, 32, "skewed", "uniform"),
}
# Ranks per adapter slot: (gate_up's, down's), 1 to 64 (the shrink takes ranks in blocks of 16:
# one block, a part of one, four, and four and a part); slot 3 has no expert target at all.
RANKS = [(3, 1), (16, 17), (2, 0), (0, 0), (0, 5), (64, 33)]


def test_cases_take_each_block_size():
    """The cases reach the GEMMs' 16-, 32- and 64-row blocks (``moe.block_m_for``)."""
    from slora_kernels.moe import block_m_for

    sizes = {name: block_m_for(t * k, e) for name, (t, e, k, *_) in CASES.items()}
    assert set(sizes.values()) == {16, 32, 64}, sizes


def case_inputs(name: str, dtype: torch.dtype):
    num_tokens, num_experts, top_k, hidden, inter, page, popularity, adapters = CASES[name]
    seed = len(name)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)
    gate_up, down = experts(num_experts, hidden, inter, dtype, seed)
    weights, ids = routing(num_tokens, num_experts, top_k, popularity, seed)
    b_slot = adapter_slots(num_tokens, len(RANKS), adapters, seed)
    case = expert_case(RANKS, b_slot, (hidden, inter), num_experts, page, dtype, seed)
    return case, (x, gate_up, down, weights, ids)


@pytest.mark.parametrize("name", ["decode", "gaps", "top-1"])
def test_twin_is_each_tokens_merged_experts(name):
    """``ref.fused_moe_lora`` equals each token's experts with its adapter's delta merged in
    (fp32 against fp64), and ``ref.fused_moe`` where no token has an adapter."""
    case, (x, gate_up, down, weights, ids) = case_inputs(name, torch.float32)
    out = ref.fused_moe_lora(x, gate_up, down, weights, ids, case.pool, case.meta, TARGETS)
    expected = merged(case, x, gate_up, down, weights, ids)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)
    base = ref.fused_moe(x, gate_up, down, weights, ids)
    assert not torch.allclose(out, base, atol=1e-3)  # the adapters change the output
    case.meta.b_slot.fill_(-1)
    out = ref.fused_moe_lora(x, gate_up, down, weights, ids, case.pool, case.meta, TARGETS)
    assert torch.equal(out, base)


def test_gather_expert_rows_finds_each_experts_rows():
    case, (x, gate_up, *_) = case_inputs("decode", torch.float32)
    hidden, two_inter = x.shape[1], gate_up.shape[1]
    for (slot, target), factor in case.factors.items():
        if factor is None:
            continue
        dims = (hidden, two_inter) if target == TARGETS[0] else (two_inter // 2, hidden)
        for e in (0, 7):
            for which in (0, 1):
                rows = ref.gather_expert_rows(case.pool, case.meta, slot, target, which, e, dims, 8)
                assert torch.equal(rows, factor[which][e]), (slot, target, e, which)


@pytest.fixture(scope="module")
def moe_lora_kernels():
    """kernels/moe_lora.py, imported only once the process is known to interpret."""
    from slora_kernels import moe_lora, triton_ops

    return moe_lora, triton_ops


class TestMoeLoraInterpreted:
    """Run in the interpreter child process (see the module docstring)."""

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
    @pytest.mark.parametrize("name", list(CASES))
    def test_fused_moe_lora_matches_twin(self, moe_lora_kernels, name, dtype):
        moe_lora, _ = moe_lora_kernels
        case, args = case_inputs(name, dtype)
        mine = moe_lora.fused_moe_lora(*args, case.pool, case.meta, TARGETS)
        expected = ref.fused_moe_lora(*args, case.pool, case.meta, TARGETS)
        assert mine.dtype == dtype and mine.shape == args[0].shape
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(mine, expected, rtol=rtol, atol=atol)
        base = ref.fused_moe(*args)
        assert (expected.float() - base.float()).abs().amax() > 0.05  # the LoRA counts

    def test_engine_on_triton_kernels_gives_the_torch_backends_tokens(self, tmp_path):
        """A tiny Qwen3-MoE with expert adapters of both formats, the router's and attention
        LoRA, on the Triton backend (every kernel interpreted): the torch backend's tokens."""
        from factory import make_adapter
        from moe_factory import make_expert_adapter, make_moe_model, write_per_expert_adapter

        from slora_batch import Engine, EngineConfig, Request

        model_dir = make_moe_model(tmp_path, "qwen3-moe", seed=5)
        adapters = {
            "fused": make_expert_adapter(model_dir, tmp_path / "f", 3, 6, 1, modules=["q_proj"]),
            "per-expert": write_per_expert_adapter(model_dir, tmp_path / "p", 2, 4, 2, router=True),
            "attention": make_adapter(model_dir, tmp_path / "a", 4, ["v_proj"], 4, False, seed=3),
        }
        names = ["fused", "per-expert", None, "attention", "fused", "per-expert"]
        rows = [
            Request(
                id=i, adapter=name, prompt_token_ids=[5 + i, 9, 11][: 1 + i % 3], max_new_tokens=3
            )
            for i, name in enumerate(names)
        ]
        tokens = {}
        for backend in ("torch", "triton"):
            config = EngineConfig(device="cpu", dtype="float32", backend=backend, num_pages=4000)
            engine = Engine(model_dir, adapters=adapters, config=config)
            results = list(engine.generate(rows))
            assert all(r.error is None for r in results), [r.error for r in results]
            tokens[backend] = {r.id: r.token_ids for r in results}
        assert tokens["triton"] == tokens["torch"]

    def test_triton_ops_fused_moe_lora_is_the_kernel(self, moe_lora_kernels):
        moe_lora, triton_ops = moe_lora_kernels
        assert triton_ops.fused_moe_lora is moe_lora.fused_moe_lora


if not INTERPRETED:  # the child process runs these
    del TestMoeLoraInterpreted
