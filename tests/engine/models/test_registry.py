"""The model families by ``architectures``: every architecture the spec reader accepts has a
family, and a model whose architecture has none is refused by name."""

from __future__ import annotations

import pytest
from factory import tiny_spec

from slora_batch.engine.models.llama import LlamaModel
from slora_batch.engine.models.registry import FAMILIES, model_class
from slora_batch.engine.models.spec import SUPPORTED_ARCHITECTURES, ModelError


def test_every_supported_architecture_has_a_family():
    assert set(FAMILIES) == set(SUPPORTED_ARCHITECTURES)
    for arch in SUPPORTED_ARCHITECTURES:
        assert model_class(tiny_spec(architecture=arch)) is LlamaModel


def test_unregistered_architecture_is_named():
    with pytest.raises(ModelError, match="'GemmaForCausalLM'.*'tiny'|'tiny'.*'GemmaForCausalLM'"):
        model_class(tiny_spec(architecture="GemmaForCausalLM"))
