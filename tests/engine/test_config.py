"""Settings: one place for defaults, validation naming the key and the value."""

import pytest

from slora_batch.engine.config import ConfigError, EngineConfig, SamplingConfig, from_dict


def test_defaults_are_valid():
    assert EngineConfig().max_adapters_per_batch <= EngineConfig().max_resident_adapters
    assert SamplingConfig().temperature == 0.0


@pytest.mark.parametrize(
    "knobs, words",
    [
        (
            {"max_adapters_per_batch": 64, "max_resident_adapters": 32},
            r"max_adapters_per_batch \(64\)",
        ),
        ({"memory_fraction": 0}, "memory_fraction"),
        ({"dtype": "int8"}, "dtype must be"),
        ({"cpu_threads": 0}, "cpu_threads must be an integer >= 1"),
        ({"host_cache_bytes": 0}, "host_cache_bytes"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
    ],
)
def test_engine_config_rejects(knobs, words):
    with pytest.raises(ConfigError, match=words):
        EngineConfig(**knobs)


@pytest.mark.parametrize(
    "knobs, words",
    [({"top_p": 0}, "top_p"), ({"max_new_tokens": 0}, "max_new_tokens"), ({"stop": [""]}, "stop")],
)
def test_sampling_config_rejects(knobs, words):
    with pytest.raises(ConfigError, match=words):
        SamplingConfig(**knobs)


def test_from_dict_names_unknown_key_and_place():
    with pytest.raises(ConfigError, match="job 'x' engine: unknown key 'max_seqs'"):
        from_dict(EngineConfig, {"max_seqs": 4}, "job 'x' engine")
    assert SamplingConfig(stop="###").stop == ["###"]
