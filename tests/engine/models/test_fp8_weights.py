"""FP8 weights on CPU, where the fp8 product is emulated exactly: the engine's W8A8
projections equal transformers + PEFT with the same W8A8 base layers and LoRA on the unquantized
input; FP8 checkpoints (compressed-tensors per channel, HF block-wise) load to the same model as
quantizing on the fly; bad settings are refused by name."""

from __future__ import annotations

import json
import random

import pytest
import torch
from factory import make_adapters, make_model
from safetensors.torch import load_file, save_file
from test_scoring import peft_model

from slora_batch import Engine, EngineConfig, Request
from slora_batch.engine.config import ConfigError
from slora_batch.engine.models.quant import (
    FP8_MAX,
    Fp8Weight,
    dequantize_blocks,
    linear,
    quantize_rows,
)
from slora_batch.engine.models.spec import ModelError, read_spec

VOCAB = 300
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    model_dir = make_model(root, "gqa")
    return model_dir, make_adapters(model_dir, root / "adapters")


def scored_rows(adapters, n=16, seed=0) -> list[Request]:
    rng = random.Random(seed)
    names = [None, *adapters]
    return [Request(id=i, adapter=names[i % len(names)],
                    prompt_token_ids=[rng.randrange(3, VOCAB) for _ in range(rng.choice([4, 20, 45]))],
                    continuation_token_ids=[rng.randrange(3, VOCAB) for _ in range(6)])
            for i in range(n)]  # fmt: skip


def engine_logprobs(model_dir, adapters, rows, **knobs) -> dict:
    engine = Engine(model_dir, adapters=adapters,
                    config=EngineConfig(device="cpu", dtype="float32", num_pages=6000, **knobs))  # fmt: skip
    results = {r.id: r for r in engine.generate(rows)}
    assert not [r.error for r in results.values() if r.error]
    return {i: r.token_logprobs for i, r in results.items()}


def test_quantize_is_within_half_an_e4m3_step_per_channel():
    w = torch.randn(48, 80, generator=torch.Generator().manual_seed(0)) * torch.rand(48, 1) * 3
    q = Fp8Weight.quantize(w)
    assert q.weight.dtype == torch.float8_e4m3fn and q.scale.shape == (48,)
    assert torch.allclose(q.weight.float().abs().amax(1), torch.full((48,), FP8_MAX))
    err = (q.dequantize(torch.float32) - w).abs()
    # e4m3 keeps 3 mantissa bits: a value's rounding error is at most 2^-4 of its magnitude,
    # or half the subnormal step near 0
    bound = torch.maximum(w.abs() * 2**-4, q.scale[:, None] * 2**-10)
    assert (err <= bound + 1e-7).all()
    x = torch.randn(5, 80)
    exact, got = x @ w.t(), linear(x, q)
    emulated = (quantize_rows(x)[0].float() * quantize_rows(x)[1]) @ q.dequantize(torch.float32).t()
    assert torch.allclose(got, emulated, atol=1e-5)  # the W8A8 product, exactly
    assert 1e-4 < float((got - exact).norm() / exact.norm()) < 0.1


def test_fp8_engine_equals_transformers_peft_with_w8a8_base_layers(tiny):
    """Every base projection W8A8 (per-channel weights, per-token activations), LoRA on the
    unquantized input: the scores of transformers + PEFT with its base layers so replaced."""
    model_dir, adapters = tiny
    rows = scored_rows(adapters)
    got = engine_logprobs(model_dir, adapters, rows, weights="fp8")
    exact = engine_logprobs(model_dir, adapters, rows)
    model = peft_model(model_dir, adapters)
    bases = PROJECTIONS + tuple(f"{p}.base_layer" for p in PROJECTIONS)  # PEFT wraps targets
    for name, module in model.named_modules():
        if name.endswith(bases) and isinstance(module, torch.nn.Linear):
            weight = Fp8Weight.quantize(module.weight.detach())
            module.forward = lambda x, w=weight, b=module.bias: linear(x, w, b)
    deltas = []
    for row in rows:
        ids = torch.tensor([row.prompt_token_ids + row.continuation_token_ids])
        with torch.no_grad():
            if row.adapter:
                model.set_adapter(row.adapter)
                logits = model(input_ids=ids).logits[0]
            else:
                with model.disable_adapter():
                    logits = model(input_ids=ids).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        n = len(row.prompt_token_ids)
        want = [float(logp[n - 1 + j, t]) for j, t in enumerate(row.continuation_token_ids)]
        assert got[row.id] == pytest.approx(want, abs=1e-4), row.id
        deltas += [abs(a - b) for a, b in zip(got[row.id], exact[row.id], strict=True)]
    assert max(deltas) > 1e-4  # fp8 changed the scores, so the check above can fail


def quantized_checkpoint(model_dir, out, kind: str) -> None:
    """``model_dir`` rewritten as an FP8 checkpoint: compressed-tensors per channel, or HF fp8
    block-wise with 32 x 32 blocks."""
    out.mkdir()
    tensors = load_file(str(model_dir / "model.safetensors"))
    cfg = json.loads((model_dir / "config.json").read_text())
    quantized = {}
    for name, t in tensors.items():
        if not name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):
            quantized[name] = t
            continue
        if kind == "channel":
            q = Fp8Weight.quantize(t)
            quantized[name], quantized[name + "_scale"] = q.weight, q.scale[:, None]
        else:
            blocks = t.float().unflatten(0, (-1, 32)).unflatten(2, (-1, 32))  # [r, 32, c, 32]
            scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [r, c]
            q = (blocks / scale[:, None, :, None]).flatten(2).flatten(0, 1)
            quantized[name] = q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            quantized[name + "_scale_inv"] = scale
    if kind == "channel":
        weights = {"type": "float", "num_bits": 8, "strategy": "channel"}
        cfg["quantization_config"] = {"quant_method": "compressed-tensors",
                                      "format": "float-quantized",
                                      "config_groups": {"group_0": {"weights": weights}}}  # fmt: skip
    else:
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [32, 32]}  # fmt: skip
    save_file(quantized, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("kind", ["channel", "block"])
def test_fp8_checkpoints_load_to_the_on_the_fly_model(tiny, tmp_path, kind):
    """A compressed-tensors checkpoint is the on-the-fly quantization byte for byte; a block-wise
    one is its blocks dequantized, then quantized per channel like any bf16 checkpoint."""
    model_dir, adapters = tiny
    ckpt = tmp_path / f"fp8-{kind}"
    quantized_checkpoint(model_dir, ckpt, kind)
    assert read_spec(ckpt).quantization["kind"] == kind
    rows = scored_rows(adapters, n=8, seed=1)
    got = engine_logprobs(ckpt, adapters, rows)
    source = model_dir
    if kind == "block":  # the same values in fp32, quantized on the fly
        source = tmp_path / "dequantized"
        source.mkdir()
        tensors = load_file(str(ckpt / "model.safetensors"))
        plain = {n: t for n, t in tensors.items() if not n.endswith("_scale_inv")}
        for name in plain:
            if name + "_scale_inv" in tensors:
                plain[name] = dequantize_blocks(tensors[name], tensors[name + "_scale_inv"],
                                                (32, 32)).contiguous()  # fmt: skip
        save_file(plain, str(source / "model.safetensors"))
        cfg = json.loads((ckpt / "config.json").read_text())
        del cfg["quantization_config"]
        (source / "config.json").write_text(json.dumps(cfg))
    want = engine_logprobs(source, adapters, rows, weights="fp8")
    for row in rows:
        assert got[row.id] == pytest.approx(want[row.id], abs=1e-6), row.id


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quantization 'gptq'"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
         "dynamic activations"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups":
          {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "group"}}}},
         "strategy channel or tensor"),
    ],
)  # fmt: skip
def test_unsupported_checkpoint_formats_are_refused_by_name(tiny, tmp_path, quant, message):
    model_dir, _ = tiny
    cfg = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    with pytest.raises(ModelError, match=message):
        read_spec(tmp_path)


def test_bad_weights_setting_is_refused():
    with pytest.raises(ConfigError, match="weights must be auto or fp8, got 'int4'"):
        EngineConfig(weights="int4")
