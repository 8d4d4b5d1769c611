"""PEFT adapters: refusals name the adapter and the reason; the store loads lazily."""

from __future__ import annotations

import json

import pytest
import torch
from factory import make_adapter, make_model
from safetensors.torch import load_file, save_file

from slora_batch import Engine, EngineConfig, Request
from slora_batch.engine.adapters.store import AdapterError, AdapterStore, parse_adapter
from slora_batch.engine.models.spec import read_spec


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m"), "gqa")


@pytest.fixture(scope="module")
def spec(model_dir):
    return read_spec(model_dir)


def adapter(model_dir, tmp_path, name="a", **extra):
    targets = extra.pop("targets", ["q_proj", "v_proj"])
    return make_adapter(
        model_dir, tmp_path / name, rank=4, targets=targets, alpha=8, rslora=False, seed=0, **extra
    )


def refused(name, path, spec) -> str:
    with pytest.raises(AdapterError) as err:
        parse_adapter(name, path, spec)
    message = str(err.value)
    assert repr(name) in message and str(path) in message
    return message


def test_good_adapter_parsed(model_dir, spec, tmp_path):
    info = parse_adapter(
        "good", adapter(model_dir, tmp_path, targets=["q_proj", "down_proj"]), spec
    )
    assert (info.rank, info.alpha, info.targets) == (4, 8.0, ("q", "down"))
    assert info.scale == 2.0
    assert spec.adapter_pages(4, info.targets) == 4 * (2 + 2 + 3 + 2)  # rows of 64, 64, 96, 64 / 32


def test_rslora_scale(model_dir, spec, tmp_path):
    path = make_adapter(
        model_dir, tmp_path / "rs", rank=16, targets=["k_proj"], alpha=8, rslora=True, seed=0
    )
    assert parse_adapter("rs", path, spec).scale == 8 / 4


def test_refuses_dora_without_its_magnitudes(model_dir, spec, tmp_path):
    path = adapter(model_dir, tmp_path, "dora")
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    assert "DoRA" in refused("dora", path, spec)


def test_refuses_modules_to_save_of_other_modules(model_dir, spec, tmp_path):
    """Saved copies of embed_tokens and lm_head run (``test_saved_modules``), of the final norm
    not."""
    path = adapter(model_dir, tmp_path, "mts", modules_to_save=["norm"])
    assert "modules_to_save 'norm' is not supported" in refused("mts", path, spec)


def test_refuses_tied_embedding_adapters(model_dir, spec, tmp_path):
    """LoRA on embed_tokens runs (``test_embedding_lora``); PEFT's ensure_weight_tying, which
    ties an lm_head LoRA to it, does not."""
    path = adapter(model_dir, tmp_path, "emb", targets=["embed_tokens", "q_proj"])
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["ensure_weight_tying"] = True
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    assert "ensure_weight_tying" in refused("emb", path, spec)


def test_refuses_lm_head_weights_even_if_config_is_silent(model_dir, spec, tmp_path):
    path = adapter(model_dir, tmp_path, "head")
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "v_proj"]
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(path / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.ones(4, 64)
    save_file(tensors, path / "adapter_model.safetensors")
    assert "lm_head" in refused("head", path, spec)


def test_refuses_wrong_shape(model_dir, spec, tmp_path):
    path = adapter(model_dir, tmp_path, "shape")
    tensors = load_file(path / "adapter_model.safetensors")
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key] = torch.ones(4, 48)
    save_file(tensors, path / "adapter_model.safetensors")
    message = refused("shape", path, spec)
    assert "[4, 48]" in message and "[4, 64]" in message


def test_refuses_wrong_rank_in_config(model_dir, spec, tmp_path):
    path = adapter(model_dir, tmp_path, "rank")
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["r"] = 8
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    assert "shape" in refused("rank", path, spec)


def test_refuses_missing_layers(model_dir, spec, tmp_path):
    path = adapter(model_dir, tmp_path, "layers")
    tensors = {
        k: v
        for k, v in load_file(path / "adapter_model.safetensors").items()
        if "layers.1." not in k
    }
    save_file(tensors, path / "adapter_model.safetensors")
    assert "every layer" in refused("layers", path, spec)


@pytest.mark.parametrize("missing", ["adapter_config.json", "adapter_model.safetensors"])
def test_refuses_missing_file(model_dir, spec, tmp_path, missing):
    path = adapter(model_dir, tmp_path, "miss")
    (path / missing).unlink()
    assert f"missing {missing}" in refused("miss", path, spec)


def test_refuses_missing_directory(spec, tmp_path):
    assert "no such adapter directory" in refused("ghost", tmp_path / "ghost", spec)


@pytest.mark.parametrize("broken", ["adapter_config.json", "adapter_model.safetensors"])
def test_refuses_unreadable_file(model_dir, spec, tmp_path, broken):
    path = adapter(model_dir, tmp_path, "junk")
    (path / broken).write_bytes(b"\x00not what it should be")
    assert "unreadable" in refused("junk", path, spec)


def test_broken_adapter_costs_only_its_own_rows(model_dir, tmp_path):
    """An adapter with modules_to_save of the norm, one without weights and a hidden folder beside a good
    adapter: the bad ones' rows are error rows naming the adapter and the reason, the good
    one's rows run, and the hidden folder is no adapter at all."""
    root = tmp_path / "adapters"
    adapter(model_dir, root, "good")
    adapter(model_dir, root, "dora", modules_to_save=["norm"])
    (adapter(model_dir, root, "noweights") / "adapter_model.safetensors").unlink()
    (root / ".ipynb_checkpoints").mkdir()
    engine = Engine(model_dir, adapters=root, config=EngineConfig(device="cpu", num_pages=400))
    assert engine.adapter_names == ["good"] and sorted(engine.broken) == ["dora", "noweights"]
    requests = [
        Request(id=i, adapter=a, prompt_token_ids=[3, 4, 5], max_new_tokens=2, source=f"f line {i}")
        for i, a in enumerate(["dora", "good", "noweights", "goood", None])
    ]
    results = {r.id: r for r in engine.generate(requests)}
    assert results[0].finish_reason == "error" and "'dora'" in results[0].error
    assert "modules_to_save" in results[0].error and results[0].error.startswith("f line 0: row 0")
    assert results[2].finish_reason == "error" and "missing adapter_model" in results[2].error
    assert "nearest: good" in results[3].error  # an unknown name gets the nearest known ones
    assert results[1].finish_reason == "length" and results[4].finish_reason == "length"


def test_store_lazy_bounded_and_paged(model_dir, spec, tmp_path):
    paths = {f"a{i}": adapter(model_dir, tmp_path, f"a{i}") for i in range(3)}
    store = AdapterStore(spec, tmp_path, cache_bytes=1)
    assert store.names == ["a0", "a1", "a2"] and store.disk_loads == 0
    paged = store.paged("a0")
    # q: A rows of 64 (2 pages each), B^T rows of 64 (2 pages); v: A rows 64 (2), B^T rows 32 (1)
    assert paged.data.shape == (spec.num_layers, 4 * (2 + 2 + 2 + 1), spec.page_size)
    assert paged.offsets[0].tolist() == [0, 8] and paged.offsets[2].tolist() == [16, 24]
    assert paged.offsets[1].tolist() == [-1, -1]
    ref = load_file(paths["a0"] / "adapter_model.safetensors")
    b_v = next(v for k, v in ref.items() if "layers.1.self_attn.v_proj.lora_B" in k)  # [32, 4]
    assert torch.equal(paged.data[1, 24:28], b_v.t())
    a_q = next(v for k, v in ref.items() if "layers.0.self_attn.q_proj.lora_A" in k)  # [4, 64]
    assert torch.equal(paged.data[0, 0:8].reshape(4, 64), a_q)
    store.paged("a1")
    store.paged("a0")  # evicted by the 1-byte budget: read again
    assert store.disk_loads == 3
    with pytest.raises(KeyError, match="unknown adapter 'zz'"):
        store.info("zz")


@pytest.mark.parametrize("stack", [True, False])
def test_pages_hold_each_factor_once_and_zeros_past_its_width(
    model_dir, spec, tmp_path, monkeypatch, stack
):
    """``to_pages`` writes every factor straight into its buffer, from stacked factors or per
    layer (the store's unsharded reads): the layout of padding each row to whole pages, the pad
    tails zero even in a buffer that held garbage."""
    from slora_batch.engine.adapters.store import TARGETS, load_weights, to_pages

    path = adapter(model_dir, tmp_path, targets=["q_proj", "v_proj", "down_proj"])
    info = parse_adapter("a", path, spec)
    weights = load_weights(info, spec, stack=stack)
    page = 24  # no width (64, 32, 96) fills whole pages
    real_empty = torch.empty

    def garbage(*shape, dtype=None, pin_memory=False):
        return real_empty(*shape, dtype=dtype).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", garbage)
    paged = to_pages(info, weights, page, torch.float32)
    monkeypatch.undo()
    stacked = load_weights(info, spec)
    want, offsets = [], []
    for target in TARGETS:
        if target not in info.targets:
            offsets.append([-1, -1])
            continue
        pair = []
        for rows in (stacked.a[target], stacked.b_t[target]):
            layers, rank, width = rows.shape
            per_row = -(-width // page)
            padded = torch.zeros(layers, rank, per_row * page)
            padded[:, :, :width] = rows
            pair.append(sum(w.shape[1] for w in want))
            want.append(padded.view(layers, rank * per_row, page))
        offsets.append(pair)
    assert torch.equal(paged.data, torch.cat(want, dim=1))
    assert paged.offsets.tolist() == offsets


def test_a_missing_layer_is_named_when_the_weights_are_read(model_dir, spec, tmp_path):
    from slora_batch.engine.adapters.store import load_weights

    path = adapter(model_dir, tmp_path)
    info = parse_adapter("a", path, spec)
    weights = load_file(path / "adapter_model.safetensors")
    save_file({k: v for k, v in weights.items() if "layers.1.self_attn.v_proj" not in k},
              path / "adapter_model.safetensors")  # fmt: skip
    with pytest.raises(AdapterError, match=r"no lora_A weights of v in layers \[1\]"):
        load_weights(info, spec, stack=False)


def test_pages_copied_a_layer_at_a_time_land_as_one_copy_does(model_dir, tmp_path, monkeypatch):
    """An adapter goes to the pool in chunks of layers (no staging buffer of a 1 GB expert
    adapter's size on the device): copied one layer at a time, its pages and the tokens they
    make are the same as copied whole."""
    from slora_batch.engine.adapters import residency

    root = tmp_path / "adapters"
    adapter(model_dir, root, "a", targets=["q_proj", "v_proj", "down_proj"])
    requests = [Request(id=i, adapter="a", prompt_token_ids=[3, 4 + i, 5], max_new_tokens=4)
                for i in range(3)]  # fmt: skip

    def run():
        engine = Engine(model_dir, adapters=root, config=EngineConfig(device="cpu", num_pages=400))
        tokens = {r.id: r.token_ids for r in engine.generate(requests)}
        entry = engine.residency._resident["a"]
        return tokens, engine.residency.pool.data[:, entry.pages].clone()

    whole_tokens, whole_pages = run()
    layer = whole_pages[0].numel() * whole_pages.element_size()
    monkeypatch.setattr(residency, "COPY_CHUNK_BYTES", layer)  # one layer a chunk
    tokens, pages = run()
    assert tokens == whole_tokens and torch.equal(pages, whole_pages)
    assert pages.abs().sum() > 0
