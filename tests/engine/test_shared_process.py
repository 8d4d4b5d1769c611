"""Engines that share a process: a new engine that does not fit beside the live ones fails
before it allocates, naming them; close() and ``with Engine(...)`` give their memory back.

On the CPU nothing counts device memory, so these tests hand the engine a memory report
(``memory.device_memory``) in which the live engines' holdings are what is used."""

from __future__ import annotations

import gc

import pytest
import torch
from factory import gqa_with_adapters

from slora_batch import DeviceMemoryError, Engine, EngineConfig, Request
from slora_batch.engine.execution import live_engines, memory, parts
from slora_batch.engine.models.spec import read_spec

ROW = Request(id=0, adapter="a0", prompt_token_ids=[5, 6, 7], max_new_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return gqa_with_adapters(tmp_path_factory.mktemp("shared"), 1)


def cpu_engine(tiny) -> Engine:
    model_dir, adapters = tiny
    config = EngineConfig(device="cpu", dtype="float32", num_pages=2000, max_num_seqs=4)
    return Engine(model_dir, adapters=adapters, config=config)


@pytest.fixture
def card(monkeypatch):
    """A fake card of ``card["total"]`` bytes whose used memory is what live engines hold; it
    counts the models loaded."""
    state = {"total": 1 << 40, "loads": 0}

    def device_memory(device):
        used = sum(h.bytes for h in live_engines.holders(device))
        return state["total"] - used, state["total"]

    real_load = parts.load_model

    def load_model(*args, **kwargs):
        state["loads"] += 1
        return real_load(*args, **kwargs)

    monkeypatch.setattr(memory, "device_memory", device_memory)
    monkeypatch.setattr(parts, "load_model", load_model)
    return state


def test_a_second_engine_that_does_not_fit_names_the_first_then_fits_after_close(tiny, card):
    first = cpu_engine(tiny)
    assert live_engines.holders(first.device) == [
        live_engines.Holding(str(tiny[0]), "cpu", first.held_bytes)
    ]
    card["total"] = first.held_bytes * 3 // 2  # room for one engine, not two
    with pytest.raises(DeviceMemoryError) as raised:
        cpu_engine(tiny)
    message = str(raised.value)
    assert card["loads"] == 1  # refused before loading weights
    assert (
        f"the engine for model {str(tiny[0])!r} does not fit on cpu: it needs at least" in message
    )
    gib = f"{first.held_bytes / 2**30:.2f} GiB"
    assert f"1 other engine of this process on cpu: {str(tiny[0])!r} holds {gib}" in message
    assert "eng.close()" in message and "with Engine(...) as eng:" in message
    assert isinstance(raised.value, torch.OutOfMemoryError)  # caught where CUDA's is

    first.close()
    assert live_engines.holders(first.device) == []
    second = cpu_engine(tiny)
    assert [r.completion_tokens for r in second.generate([ROW])] == [2]
    second.close()
    second.close()  # twice: nothing more to do


def test_a_with_block_releases_the_engine(tiny, card):
    with cpu_engine(tiny) as engine:
        assert [r.completion_tokens for r in engine.generate([ROW])] == [2]
        assert len(live_engines.holders(engine.device)) == 1
    assert live_engines.holders(engine.device) == []
    assert not hasattr(engine, "pool") and not hasattr(engine, "model")
    with pytest.raises(RuntimeError, match="this engine cannot be used again: it was closed"):
        engine.generate([ROW])


def test_close_ends_a_generate_in_use(tiny, card):
    engine = cpu_engine(tiny)
    iterator = engine.generate([ROW, ROW])
    next(iterator)
    engine.close()
    assert list(iterator) == []


def test_a_dropped_engine_leaves_even_inside_a_reference_cycle(tiny, card):
    engine = cpu_engine(tiny)
    engine.itself = engine  # only gc frees it
    device = engine.device
    del engine
    assert len(list(live_engines._LIVE.values())) == 1
    assert live_engines.holders(device) == []  # collected first


def test_out_of_memory_while_loading_becomes_the_clear_error(tiny, card, monkeypatch):
    first = cpu_engine(tiny)

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 6.94 GiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 2.81 GiB is free. Including non-PyTorch memory, ..."
        )

    monkeypatch.setattr(parts, "load_model", oom)
    with pytest.raises(DeviceMemoryError) as raised:
        cpu_engine(tiny)
    message = str(raised.value)
    assert "out of memory while loading it (Tried to allocate 6.94 GiB)" in message
    assert f"{str(tiny[0])!r} holds {first.held_bytes / 2**30:.2f} GiB" in message
    # CUDA's error is not shown, and its frames hold no tensors while the error is kept
    assert raised.value.__suppress_context__
    frames, tb = [], raised.value.__context__.__traceback__
    while tb is not None:
        frames, tb = [*frames, tb.tb_frame], tb.tb_next
    built = [f for f in frames if f.f_code.co_name == "build_parts"]
    assert built and all(not f.f_locals for f in built)
    first.close()


# The real case, on a CUDA card: a notebook's loop that rebinds ``eng``.


def cuda_engine(tiny, pool_bytes: int | None) -> Engine:
    """``pool_bytes``: a fixed pool of that size; None: a third of free memory (the GPU tests'
    other workers share the card)."""
    model_dir, adapters = tiny
    knobs = {"memory_fraction": 0.3}
    if pool_bytes is not None:
        knobs = {"num_pages": pool_bytes // memory.page_bytes(read_spec(model_dir), torch.bfloat16)}
    config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=16, **knobs)
    return Engine(model_dir, adapters=adapters, config=config)


@pytest.mark.gpu
def test_engines_rebound_in_a_loop_fit_beside_each_other_when_sized_from_free_memory(tiny):
    for _ in range(5):
        eng = cuda_engine(tiny, None)
        assert [r.completion_tokens for r in eng.generate([ROW])] == [2]
    del eng
    gc.collect()


@pytest.mark.gpu
def test_engines_rebound_in_a_loop_fail_with_the_clear_error_or_all_run_with_close(tiny):
    pool_bytes = int(0.6 * memory.device_memory(torch.device("cuda"))[0])  # one fits, not two
    failed = []
    for i in range(5):
        try:
            eng = cuda_engine(tiny, pool_bytes)
        except DeviceMemoryError as exc:
            failed.append(i)
            assert f"{str(tiny[0])!r} holds" in str(exc) and "eng.close()" in str(exc)
            continue
        assert [r.completion_tokens for r in eng.generate([ROW])] == [2]
    assert failed == [1, 2, 3, 4]  # the first engine stays bound to eng
    eng.close()
    for _ in range(5):
        eng = cuda_engine(tiny, pool_bytes)
        assert [r.completion_tokens for r in eng.generate([ROW])] == [2]
        eng.close()


@pytest.mark.parametrize("kind", ["gqa", "mha"])  # tied and untied embeddings
def test_the_weights_estimate_is_a_close_lower_bound(tmp_path, kind):
    from factory import make_model

    from slora_batch.engine.models.loader import load_tensors

    model_dir = make_model(tmp_path, kind)
    actual = sum(t.numel() * 2 for t in load_tensors(model_dir).values())  # in bf16
    estimate = memory.weight_bytes(read_spec(model_dir), torch.bfloat16)
    assert 0.95 * actual <= estimate <= actual
