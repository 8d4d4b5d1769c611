"""Model configs: what is read, and what is refused by name."""

import json

import pytest

from slora_batch.engine.models.spec import ModelError, read_spec


def write(tmp_path, **cfg):
    base = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    (tmp_path / "config.json").write_text(json.dumps({**base, **cfg}))
    return tmp_path


def test_reads_llama_with_gqa(tmp_path):
    spec = read_spec(write(tmp_path, rope_theta=5e5, tie_word_embeddings=True))
    assert (spec.head_dim, spec.kv_dim, spec.page_size, spec.rope_theta) == (16, 32, 32, 5e5)
    assert spec.tie_word_embeddings and spec.rope_scaling is None
    assert spec.target_dims("down") == (96, 64) and spec.target_dims("k") == (64, 32)
    assert spec.adapter_pages(3, ("q", "down")) == 3 * ((2 + 2) + (3 + 2))


def test_transformers5_rope_parameters(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    spec = read_spec(write(tmp_path, rope_parameters=rope))
    assert spec.rope_theta == 5e5 and spec.rope_scaling["rope_type"] == "llama3"


@pytest.mark.parametrize(
    "cfg, words",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "'GPT2LMHeadModel' is not supported"),
        ({"architectures": ["DeepseekV3ForCausalLM"]}, "'DeepseekV3ForCausalLM' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_refused_by_name(tmp_path, cfg, words):
    with pytest.raises(ModelError, match=words) as err:
        read_spec(write(tmp_path, **cfg))
    assert str(tmp_path) in str(err.value)


def test_mistral_window_masks_every_layer_and_keeps_the_context(tmp_path):
    spec = read_spec(write(tmp_path, architectures=["MistralForCausalLM"], sliding_window=64))
    assert spec.max_context == spec.max_position_embeddings
    assert spec.layer_windows == (64,) * spec.num_layers


@pytest.mark.parametrize(
    ("arch", "extra", "windows"),
    [
        ("Gemma2ForCausalLM", {}, (64, 0, 64, 0)),  # the older config: even layers local
        ("Gemma3ForCausalLM", {"sliding_window_pattern": 2}, (64, 0, 64, 0)),
        ("Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": 3}, (0, 0, 0, 64)),
        ("Qwen2ForCausalLM", {"use_sliding_window": False}, ()),
        ("LlamaForCausalLM", {"layer_types": ["full_attention"] * 4}, ()),
    ],
)
def test_window_layers_as_transformers_derives_them(tmp_path, arch, extra, windows):
    cfg = dict(architectures=[arch], sliding_window=64, num_hidden_layers=4, **extra)
    assert read_spec(write(tmp_path, **cfg)).layer_windows == windows


def test_gemma3_older_config_reads_the_local_rope_base(tmp_path):
    spec = read_spec(write(tmp_path, architectures=["Gemma3ForCausalLM"], rope_theta=1e6,
                           rope_local_base_freq=1e4, query_pre_attn_scalar=256,
                           rope_scaling={"rope_type": "linear", "factor": 8.0}))  # fmt: skip
    assert spec.rope_theta == 1e6 and spec.rope_scaling["factor"] == 8.0
    assert spec.local_rope == {"rope_theta": 1e4, "scaling": None}
    assert spec.query_scale == 256**-0.5 and spec.qk_norm and spec.gemma_norms


def test_missing_config(tmp_path):
    with pytest.raises(ModelError, match="cannot read config.json"):
        read_spec(tmp_path)
