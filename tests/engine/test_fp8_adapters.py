"""``adapter_dtype: fp8`` end to end on CPU (the torch twins dequantize e4m3 rows): the engine
equals the model-dtype engine fed each adapter's weights rounded through e4m3, token for token
and logprob for logprob in fp32; an adapter takes fewer pages, so more stay resident in one
pool; DoRA adapters become error rows."""

from __future__ import annotations

import random

import pytest
import torch
from factory import ADAPTERS, make_adapter, make_adapters, make_model, make_rows
from safetensors.torch import load_file, save_file

from slora_batch import Engine, EngineConfig, Request
from slora_batch.engine.adapters.residency import AdapterResidency
from slora_batch.engine.adapters.store import AdapterStore
from slora_batch.engine.config import ConfigError
from slora_batch.engine.models.spec import read_spec
from slora_batch.engine.pool import PagePool, PoolExhausted
from slora_kernels import lora_fp8

VOCAB = 300
# A pool that holds the first four of ADAPTERS in fp32 (7 + 87 + 112 + 464 pages; the fifth, of
# rank 64, takes 1152) and all six in fp8 (537 pages in all).
POOL_PAGES, FULL_RESIDENT = 1200, 4


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-adapters")
    model_dir = make_model(root, "gqa")
    adapters = make_adapters(model_dir, root / "adapters")
    rounded = {
        name: fp8_round_trip(path, root / "rounded" / name) for name, path in adapters.items()
    }
    rows = make_rows(18, VOCAB, list(adapters), seed=4)
    rng = random.Random(2)
    for i in range(6):  # scored rows: a logprob for each continuation token
        rows.append(
            dict(
                id=f"s{i}",
                adapter=list(adapters)[i],
                continuation_token_ids=[rng.randrange(3, VOCAB) for _ in range(4)],
                prompt_token_ids=[rng.randrange(3, VOCAB) for _ in range(7 + i)],
            )
        )
    return model_dir, adapters, rounded, rows


def fp8_round_trip(src, dst):
    """A copy of PEFT adapter ``src`` whose A rows and B^T rows (B's columns) are their e4m3
    round trip with a scale per row, in fp32: what fp8 storage computes with."""
    tensors = load_file(src / "adapter_model.safetensors")
    for key, tensor in tensors.items():
        if "lora_A" in key:
            tensors[key] = lora_fp8.round_trip(tensor)
        elif "lora_B" in key:
            tensors[key] = lora_fp8.round_trip(tensor.T).T.contiguous()
    dst.mkdir(parents=True)
    save_file(tensors, dst / "adapter_model.safetensors")
    (dst / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    return dst


def run(model_dir, adapters, rows, **knobs):
    config = EngineConfig(
        device="cpu", dtype="float32", backend="torch", max_num_batched_tokens=64, **knobs
    )
    engine = Engine(model_dir, adapters=adapters, config=config)
    results = {r.id: r for r in engine.generate(Request(**row) for row in rows)}
    engine.close()
    assert all(r.error is None for r in results.values()), [r.error for r in results.values()]
    return results


# Two engines' fp32 log-probs of the same rows agree to float rounding, not bit for bit: when
# the adapter loader thread finishes decides which rows share a step, and so the matmuls' shapes
LOGPROB_ATOL = 1e-4


def logprob_gap(a, b) -> float:
    """The largest |difference| between two runs' log-probs, row by row (0 for none)."""
    gaps = [
        max(
            (abs(x - y) for x, y in zip(ra.token_logprobs, b[key].token_logprobs, strict=True)),
            default=0.0,
        )
        for key, ra in a.items()
        if ra.token_logprobs is not None
    ]
    return max(gaps, default=0.0)


def test_fp8_engine_equals_the_engine_on_round_tripped_weights(case):
    """fp8 storage changes only the weights' rounding: every token equals the fp32 engine's on
    adapters whose weights went through e4m3, and every logprob up to float rounding; both
    differ from the fp32 engine's on the weights as they are (the rounding is there)."""
    model_dir, adapters, rounded, rows = case
    fp8 = run(model_dir, adapters, rows, adapter_dtype="fp8")
    same = run(model_dir, rounded, rows)
    assert {k: r.token_ids for k, r in fp8.items()} == {k: r.token_ids for k, r in same.items()}
    assert logprob_gap(fp8, same) < LOGPROB_ATOL, logprob_gap(fp8, same)
    exact = run(model_dir, adapters, rows)
    assert logprob_gap(fp8, exact) > 100 * LOGPROB_ATOL, logprob_gap(fp8, exact)


def resident_count(model_dir, adapters, fp8: bool, pages: int) -> tuple[int, dict[str, int]]:
    """How many of ``adapters`` one pool of ``pages`` holds at once, loaded in order, and each
    adapter's page count; the pool's pages in use equal the counts' sum."""
    spec = read_spec(model_dir)
    store = AdapterStore(spec, adapters, fp8=fp8)
    pool = PagePool(pages, spec.page_size, spec.num_layers)
    residency = AdapterResidency(pool, store, len(adapters), torch.device("cpu"))
    held = []
    for name in adapters:
        try:
            residency.acquire(name)
        except PoolExhausted:
            break
        held.append(name)
    assert pool.num_used == sum(store.pages(name) for name in held)
    return len(held), {name: store.pages(name) for name in adapters}


def test_fp8_adapters_take_fewer_pages_and_more_stay_resident(case):
    """On fp32 pages of 32 elements a page holds 4 e4m3 sub-pages of 32: a factor of rank r on
    rows of w takes ceil(r * ceil(w / 32) / 4) pages where fp32 takes r * ceil(w / 32), and
    its scales ceil(r / 32) pages (at rank 1 the scale pages make it 8 pages to fp32's 7)."""
    model_dir, adapters, _, _ = case
    spec = read_spec(model_dir)
    full, full_pages = resident_count(model_dir, adapters, fp8=False, pages=POOL_PAGES)
    small, fp8_pages = resident_count(model_dir, adapters, fp8=True, pages=POOL_PAGES)
    for name, rank, targets, _, _ in ADAPTERS:
        expected = 0
        for module in targets:
            d_in, d_out = spec.target_dims(module.split("_")[0])
            dims = (d_in, d_out)
            expected += sum(lora_fp8.factor_pages(rank, w, spec.page_size, 4) for w in dims)
        assert fp8_pages[name] == expected, name
    assert 3 * sum(fp8_pages.values()) < sum(full_pages.values()), (fp8_pages, full_pages)
    assert (full, small) == (FULL_RESIDENT, len(ADAPTERS))


def test_dora_adapters_are_refused_with_fp8(case, tmp_path):
    model_dir, adapters, _, _ = case
    dora = make_adapter(
        model_dir, tmp_path / "dora", 4, ["q_proj"], 8, False, seed=9, use_dora=True
    )
    spec = read_spec(model_dir)
    store = AdapterStore(spec, {"dora": dora, "plain": adapters["r8-attn"]}, fp8=True)
    _, broken = store.check_all()
    assert list(broken) == ["dora"] and "adapter_dtype fp8" in str(broken["dora"])
    assert AdapterStore(spec, {"dora": dora}).check_all()[1] == {}


def test_adapter_dtype_is_checked():
    assert EngineConfig().adapter_dtype == "auto"
    with pytest.raises(ConfigError, match="adapter_dtype must be auto or fp8"):
        EngineConfig(adapter_dtype="fp16")
