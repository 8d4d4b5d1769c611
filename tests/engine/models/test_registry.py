"""The model families by ``architectures``: every architecture the spec reader accepts has a
family, and a model whose architecture has none is refused by name."""

from __future__ import annotations

import pytest
from factory import tiny_spec

from slora_batch.engine.models.decoder import DecoderModel
from slora_batch.engine.models.registry import FAMILIES, model_class
from slora_batch.engine.models.spec import SUPPORTED_ARCHITECTURES, ModelError


def test_every_supported_architecture_has_a_family():
    assert set(FAMILIES) == set(SUPPORTED_ARCHITECTURES)
    for arch in SUPPORTED_ARCHITECTURES:
        assert issubclass(model_class(tiny_spec(architecture=arch)), DecoderModel)


def test_unregistered_architecture_is_named():
    with pytest.raises(ModelError, match="'GemmaForCausalLM'.*'tiny'|'tiny'.*'GemmaForCausalLM'"):
        model_class(tiny_spec(architecture="GemmaForCausalLM"))


@pytest.mark.parametrize(
    ("arch", "module", "other"),
    [("LlamaForCausalLM", "qkv_proj", "q_proj"), ("Phi3ForCausalLM", "q_proj", "qkv_proj")],
)
def test_an_adapter_for_another_family_is_refused_by_module(tmp_path, arch, module, other):
    """Phi-3's adapters target the fused modules, every other family's the split ones: an
    adapter of the other kind is refused naming its module and the model's own."""
    import json

    import torch
    from safetensors.torch import save_file

    from slora_batch.engine.adapters.adapter_files import AdapterError, parse_adapter

    spec = tiny_spec(architecture=arch, fused_projections=arch.startswith("Phi3"))
    d_in, d_out = 64, 64
    prefix = f"base_model.model.model.layers.0.self_attn.{module}"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(2, d_in),
               f"{prefix}.lora_B.weight": torch.zeros(d_out, 2)},
              tmp_path / "adapter_model.safetensors")  # fmt: skip
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    with pytest.raises(AdapterError, match=f"targets {module}.*{arch}.*{other}"):
        parse_adapter("other", tmp_path, spec)
