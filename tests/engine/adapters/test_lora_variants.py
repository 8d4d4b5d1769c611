"""PEFT LoRA variants end to end: the engine's greedy tokens equal transformers + PEFT in fp32 on
the CPU, each variant alone (beside base rows) and all of them mixed with plain LoRA in one
batch, on a Llama with tied embeddings and on Qwen2 (biased q, k, v); and the refusals that stay
name the adapter and the key."""

from __future__ import annotations

import json

import pytest
import torch
from factory import (
    ALL,
    make_adapter,
    make_model,
    make_rows,
    randomize_heads,
    reference,
    reference_each,
)

from slora_batch import Engine, EngineConfig, Request
from slora_batch.engine.adapters.store import AdapterError, parse_adapter
from slora_batch.engine.models.spec import TARGETS, read_spec

VOCAB = 300
FAMILIES = ("gqa", "qwen2")  # the factory's Llama with tied embeddings, and Qwen2

# name -> (rank, targets, alpha, rslora, extra LoraConfig fields)
VARIANTS = {
    "patterns": (
        4,
        ALL,
        8,
        False,
        dict(
            rank_pattern={"q_proj": 2, "model.layers.1.mlp.down_proj": 6},
            alpha_pattern={"v_proj": 3, "model.layers.0.self_attn.o_proj": 16},
        ),
    ),
    "patterns-rs": (8, ["q_proj", "k_proj", "up_proj"], 4, True, dict(rank_pattern={"k_proj": 2})),
    "subset": (
        3,
        ["q_proj", "k_proj", "gate_proj", "o_proj"],
        6,
        False,
        dict(layers_to_transform=[1], layers_pattern="layers", rank_pattern={"o_proj": 5}),
    ),
    "regex": (2, r".*layers\.0\.self_attn\.(q|v)_proj", 4, False, {}),
    "bias": (
        4,
        ["q_proj", "v_proj", "o_proj", "down_proj"],
        8,
        False,
        dict(lora_bias=True, rank_pattern={"o_proj": 2}),
    ),
    "bias-subset": (
        2,
        ["k_proj", "up_proj"],
        2,
        True,
        dict(lora_bias=True, layers_to_transform=0),
    ),
    "dora": (4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], 8, False,
             dict(use_dora=True)),
    "dora-patterns": (8, ALL, 4, False, dict(use_dora=True, rank_pattern={"v_proj": 2},
                                             alpha_pattern={"down_proj": 16})),
    "dora-subset": (3, ["q_proj", "up_proj"], 6, True, dict(use_dora=True, layers_to_transform=[1])),
}  # fmt: skip
PLAIN = {"plain": (8, ["q_proj", "v_proj", "down_proj"], 16, False, {})}
TP_VARIANTS = (
    "patterns",
    "subset",
    "bias",
    "dora-subset",
)  # dora-subset: q, up  # the variants a tensor-parallel run covers


def build(root, family: str, variants: dict) -> tuple:
    model_dir = make_model(root, family)
    adapters = {
        name: make_adapter(model_dir, root / name, r, t, a, rs, seed=i + 1, **extra)
        for i, (name, (r, t, a, rs, extra)) in enumerate({**variants, **PLAIN}.items())
    }
    for i, (name, (*_, extra)) in enumerate(variants.items()):
        if extra.get("use_dora"):
            perturb_magnitudes(adapters[name], seed=i)
    return model_dir, adapters


def perturb_magnitudes(path, seed: int) -> None:
    """DoRA's magnitudes m moved off PEFT's start (the base weight's row norms) by up to 30%, as
    training moves them: g = m / ||W + s B A|| then differs from 1 on its own account too."""
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(path / "adapter_model.safetensors")
    for key, tensor in tensors.items():
        if "lora_magnitude_vector" in key:
            tensors[key] = tensor * (0.7 + 0.6 * torch.rand(tensor.shape, generator=gen))
    save_file(tensors, path / "adapter_model.safetensors")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    return build(tmp_path_factory.mktemp(request.param), request.param, VARIANTS)


def run(model_dir, adapters, rows, broken=(), **knobs) -> dict:
    """The engine's tokens per row; ``broken``: the adapters it must refuse (and their rows'
    errors), beside ``adapters``."""
    config = EngineConfig(
        device="cpu", dtype="float32", num_pages=3000, max_num_batched_tokens=64, **knobs
    )
    engine = Engine(model_dir, adapters={**adapters, **dict(broken)}, config=config)
    try:
        assert sorted(engine.broken) == sorted(name for name, _ in broken)
        results = {r.id: r for r in engine.generate(Request(**row) for row in rows)}
    finally:
        engine.close()
    assert all(r.error is None for r in results.values()), [r.error for r in results.values()]
    return {i: r.token_ids for i, r in results.items()}


def assert_parity(model_dir, adapters, names, rows_count, seed, **knobs) -> None:
    """Rows on ``names`` (every fifth on the base model) give PEFT's tokens."""
    used = {name: adapters[name] for name in names}
    rows = make_rows(rows_count, VOCAB, names, seed=seed)
    got, want = run(model_dir, used, rows, **knobs), reference(model_dir, used, rows)
    wrong = {i: (got[i], w) for i, w in want.items() if got[i] != w}
    assert not wrong, f"{len(wrong)} rows differ from transformers + PEFT: {wrong}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_alone_matches_peft(family, variant):
    model_dir, adapters = family
    assert_parity(model_dir, adapters, [variant], 8, seed=len(variant))


def test_variants_mixed_with_plain_lora_match_peft(family):
    model_dir, adapters = family
    assert_parity(model_dir, adapters, [*VARIANTS, *PLAIN], 20, seed=3)


# LoRA on the embedding and the output layer, and a trained copy of the output layer (beside
# LoRA on the embedding): the kinds test_embedding_lora and test_saved_modules cover alone
HEADS = {
    "head-lora": (4, ["embed_tokens", "lm_head", "q_proj"], 8, False, {}),
    "saved-head": (3, ["embed_tokens", "v_proj"], 6, False, dict(modules_to_save=["lm_head"])),
}


def test_every_kind_mixed_in_one_batch_matches_peft(family, tmp_path):
    """Per-module ranks, a layer subset, lora_B's bias, DoRA, LoRA on embed_tokens and lm_head
    and a trained lm_head in one batch with plain LoRA and base rows: PEFT's tokens (a
    PeftModel per adapter: PEFT loads no LoRA on a module another loaded adapter saves)."""
    model_dir, adapters = family
    used = {name: adapters[name] for name in ("patterns", "subset", "bias", "dora-patterns")}
    for i, (name, (r, t, a, rs, extra)) in enumerate(HEADS.items()):
        made = make_adapter(model_dir, tmp_path / name, r, t, a, rs, seed=40 + i, **extra)
        used[name] = randomize_heads(made, seed=i)
    used.update((name, adapters[name]) for name in PLAIN)
    rows = make_rows(24, VOCAB, list(used), seed=9)
    got, want = run(model_dir, used, rows), reference_each(model_dir, used, rows)
    wrong = {i: (got[i], w) for i, w in want.items() if got[i] != w}
    assert not wrong, f"{len(wrong)} rows differ from transformers + PEFT: {wrong}"
    assert {row["adapter"] for row in rows} == {None, *used}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2"], indirect=True)
def test_variants_under_tensor_parallelism_match_peft(family):
    """Two ranks (gloo), each holding half of every adapter: the module ranks, the layer
    subsets and lora_B's bias (cut along d_out as B is) like plain LoRA; DoRA on
    column-parallel targets, each rank's magnitudes from its rows of W and the whole A, and
    refused on o and down (row-parallel), naming them. On Qwen2 (GQA, q/k/v biases, an untied
    head): the cuts do not depend on the family otherwise."""
    model_dir, adapters = family
    names = list(TP_VARIANTS) + list(PLAIN)
    knobs = dict(tensor_parallel=2, cpu_threads=1, broken=[("dora", adapters["dora"])])
    assert_parity(model_dir, adapters, names, 12, seed=5, **knobs)
    spec = read_spec(model_dir)
    from slora_batch.engine.adapters.store import AdapterStore

    store = AdapterStore(spec, {"dora": adapters["dora"]}, shard=(1, 2))
    _, broken = store.check_all()
    assert "DoRA on the row-parallel o and down is not supported under tensor_parallel 2" in (
        str(broken["dora"])
    )


def test_module_ranks_and_scales_per_layer(family):
    """rank_pattern and alpha_pattern per module, as PEFT picks them; a layer that
    layers_to_transform leaves out has rank 0 and takes no compute, the target's rows take its
    largest rank in pages."""
    model_dir, adapters = family
    spec = read_spec(model_dir)
    info = parse_adapter("patterns", adapters["patterns"], spec)
    assert info.module_ranks("q", 2) == ((2, 2), (4.0, 4.0))
    assert info.module_ranks("down", 2) == ((4, 6), (2.0, 8 / 6))
    assert info.module_ranks("v", 2) == ((4, 4), (0.75, 0.75))
    assert info.module_ranks("o", 2) == ((4, 4), (4.0, 2.0))
    assert info.max_rank == 6
    rs = parse_adapter("patterns-rs", adapters["patterns-rs"], spec)
    assert rs.module_ranks("k", 2) == ((2, 2), (4 / 2**0.5,) * 2)
    subset = parse_adapter("subset", adapters["subset"], spec)
    assert subset.module_ranks("q", 2) == ((0, 3), (0.0, 2.0))
    assert subset.module_ranks("o", 2) == ((0, 5), (0.0, 6 / 5))
    regex = parse_adapter("regex", adapters["regex"], spec)
    assert regex.targets == ("q", "v") and regex.module_ranks("v", 2)[0] == (2, 0)
    bias = parse_adapter("bias", adapters["bias"], spec)
    assert bias.lora_bias and not info.lora_bias


def test_bias_rows_sit_beside_b(family):
    """lora_B's bias takes one more row of d_out after each target's B^T rows, at the layer's
    own values; a layer the adapter leaves out holds zeros there."""
    from safetensors.torch import load_file

    from slora_batch.engine.adapters.store import AdapterStore

    model_dir, adapters = family
    store = AdapterStore(read_spec(model_dir), {"b": adapters["bias-subset"]})
    paged = store.paged("b")
    spec, page = store.spec, store.page_spec.page_size
    tensors = load_file(adapters["bias-subset"] / "adapter_model.safetensors")
    for target, module in (("k", "self_attn.k_proj"), ("up", "mlp.up_proj")):
        index = TARGETS.index(target)
        start = int(paged.vectors[index, 0])
        d_out = spec.target_dims(target)[1]
        assert start == int(paged.offsets[index, 1]) + 2 * -(-d_out // page)  # after B^T
        assert int(paged.vectors[index, 1]) == -1  # no DoRA rows
        rows = paged.data[:, start : start + -(-d_out // page)].reshape(spec.num_layers, -1)
        want = tensors[f"base_model.model.model.layers.0.{module}.lora_B.bias"]
        assert torch.equal(rows[0, :d_out], want) and not rows[1].any()


def edit_config(path, **fields) -> None:
    config_path = path / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **fields}))


def refused(name, path, spec) -> str:
    with pytest.raises(AdapterError) as err:
        parse_adapter(name, path, spec)
    message = str(err.value)
    assert repr(name) in message and str(path) in message
    return message


def test_refusals_name_the_adapter_and_the_key(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = make_model(tmp_path, "gqa")
    spec = read_spec(model_dir)
    extra = dict(layers_to_transform=[1], layers_pattern="layers")
    path = make_adapter(model_dir, tmp_path / "gpt2", 2, ["q_proj"], 4, False, 0, **extra)
    edit_config(path, layers_pattern="h")
    assert "layers_pattern 'h' matches no layer name in 'model.layers.1.self_attn.q_proj'" in (
        refused("gpt2", path, spec)
    )
    edit_config(path, layers_pattern="layers", layers_to_transform=[0])
    message = refused("gpt2", path, spec)
    assert "target q has 2 of 2 factors in layers [1]" in message
    assert "layers_to_transform [0]" in message
    edit_config(path, layers_to_transform="1")
    assert "layers_to_transform '1' is not a layer index" in refused("gpt2", path, spec)
    path = make_adapter(model_dir, tmp_path / "pat", 2, ["q_proj"], 4, False, 0)
    edit_config(path, rank_pattern={"model.layers.1.self_attn.q_proj": 4})
    message = refused("pat", path, spec)
    assert "layers.1.self_attn.q_proj.lora_A.weight' has shape [2, 64]" in message
    assert "needs [4, 64]" in message and "rank 4: rank_pattern" in message
    path = make_adapter(model_dir, tmp_path / "bias", 2, ["q_proj"], 4, False, 0, lora_bias=True)
    edit_config(path, lora_bias=False)
    assert "q_proj.lora_B.bias' is lora_B's bias, and the config's lora_bias is false" in (
        refused("bias", path, spec)
    )
    edit_config(path, lora_bias=True)
    tensors = load_file(path / "adapter_model.safetensors")
    del tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.bias"]
    save_file(tensors, path / "adapter_model.safetensors")
    assert "target q has 5 of 6 factors" in refused("bias", path, spec)
    path = make_adapter(model_dir, tmp_path / "dora", 2, ["q_proj"], 4, False, 0, use_dora=True)
    tensors = load_file(path / "adapter_model.safetensors")
    del tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"]
    save_file(tensors, path / "adapter_model.safetensors")
    message = refused("dora", path, spec)
    assert "target q has 5 of 6 factors in layers [0, 1] (every layer needs lora_A, lora_B" in (
        message
    )
    assert "lora_magnitude_vector (DoRA's magnitude)" in message
    edit_config(path, lora_bias=True)
    assert "DoRA with lora_bias is not supported" in refused("dora", path, spec)
    path = make_adapter(model_dir, tmp_path / "all", 2, ["q_proj"], 4, False, 0, bias="all")
    assert "bias 'all' is not supported: the base model's biases" in refused("all", path, spec)


def test_validate_reports_each_kind(family, capsys):
    """The report ``validate`` prints counts the adapters of each kind (``AdapterInfo.kind``)
    when some are not plain LoRA."""
    from slora_batch.console import print_report
    from slora_batch.engine.adapters.store import check_adapters
    from slora_batch.jobs.validate import ValidationReport

    model_dir, adapters = family
    spec = read_spec(model_dir)
    names = ["plain", "patterns", "bias", "dora", "dora-subset"]
    infos, broken = check_adapters(spec, {name: adapters[name] for name in names})
    assert not broken and [i.kind for i in infos if i.name in ("bias", "dora")] == [
        "LoRA + bias",
        "DoRA",
    ]
    report = ValidationReport(job="j", model=str(model_dir), spec=spec, adapters=infos,
                              files=[], rows_total=0, sweep=None, rows_checked=0, problems=[],
                              notes=[], broken={}, id_type="int64")  # fmt: skip
    print_report(report)
    assert "5 adapters, ranks [3, 4, 8]; 2 DoRA, 2 LoRA, 1 LoRA + bias" in capsys.readouterr().out


def test_dora_on_fp8_weights_norms_the_dequantized_weight(family):
    """With the base projections in FP8 (``weights: fp8``, emulated on the CPU) DoRA's g is
    m / ||W + s B A|| of the dequantized W, per output channel, in the pool beside B's rows."""
    from slora_batch.engine.adapters.residency import page_rows
    from slora_batch.engine.models.layers import target_weight
    from slora_batch.engine.models.quant import Fp8Weight

    model_dir, adapters = family
    config = EngineConfig(device="cpu", dtype="float32", num_pages=3000, weights="fp8")
    engine = Engine(model_dir, adapters={"dora": adapters["dora"]}, config=config)
    rows = make_rows(3, VOCAB, ["dora"], seed=1)[1:]
    assert all(r.error is None for r in engine.generate(Request(**row) for row in rows))
    model, residency = engine.runner.model, engine.residency
    assert isinstance(model.layers[1].qkv, Fp8Weight)
    slot, q = residency.slot("dora"), TARGETS.index("q")
    pages = torch.as_tensor(residency.slot_pages[slot]).long()
    data = engine.lora_pool.data[:, pages]  # the adapter's pages, in its page order
    info = residency.store.info("dora")
    a, b_t = (page_rows(data, int(residency.slot_offsets[slot, q, i]), 4, 64) for i in (0, 1))
    g = page_rows(data, int(residency.slot_vectors[slot, q, 1]), 2, 64)[1, 0]
    w, _ = target_weight(model, 1, "q")
    assert torch.equal(w, model.layers[1].qkv.dequantize(torch.float32)[:64])
    m = load_magnitude(adapters["dora"], "layers.1.self_attn.q_proj")
    want = m / (w + info.scale * b_t[1].T @ a[1]).norm(dim=1)
    torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
    engine.close()


def load_magnitude(path, module: str) -> torch.Tensor:
    from safetensors.torch import load_file

    tensors = load_file(path / "adapter_model.safetensors")
    return next(v for k, v in tensors.items() if module in k and "magnitude" in k)


def test_variants_on_fused_modules_match_peft(tmp_path):
    """Phi-3's fused qkv_proj and gate_up_proj: DoRA's g over the fused output (q | k | v
    rows of the fused weight), lora_B's bias over it, a rank per module and a layer subset,
    mixed with base rows."""
    from transformers import AutoModelForCausalLM, Phi3Config

    config = Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.2,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0,
                        tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "m")
    model_dir = tmp_path / "m"
    variants = {
        "dora": (4, ["qkv_proj", "gate_up_proj", "o_proj"], 8, False,
                 dict(use_dora=True, rank_pattern={"gate_up_proj": 2})),
        "bias": (3, ["qkv_proj", "down_proj"], 6, False,
                 dict(lora_bias=True, layers_to_transform=[1])),
    }  # fmt: skip
    adapters = {
        name: make_adapter(model_dir, tmp_path / name, r, t, a, rs, seed=i + 1, **extra)
        for i, (name, (r, t, a, rs, extra)) in enumerate(variants.items())
    }
    perturb_magnitudes(adapters["dora"], seed=0)
    assert_parity(model_dir, adapters, list(adapters), 12, seed=2)
