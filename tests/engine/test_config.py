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
        ({"data_parallel": 0}, "data_parallel must be an integer >= 1"),
        ({"data_parallel": True}, "data_parallel must be an integer >= 1"),
        ({"gpus": "some"}, "gpus must be all or null"),
        ({"gpus": "all", "data_parallel": 2}, "do not also set data_parallel"),
        ({"gpus": "all", "device": "cpu"}, "gpus: all needs CUDA devices"),
        ({"data_parallel": 2, "device": "cuda:1"}, "device cuda:1 names one GPU"),
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


def test_worker_slots_on_cpu():
    """data_parallel on cpu: processes sharing the cores; gpus: all needs CUDA devices."""
    import torch

    from slora_batch.engine.parallel.data_parallel import worker_slots

    if torch.cuda.is_available():
        pytest.skip("the cpu case")
    slots = worker_slots(EngineConfig(data_parallel=3))
    assert [(s.index, s.device, s.visible) for s in slots] == [(i, "cpu", None) for i in range(3)]
    with pytest.raises(ConfigError, match="engine.gpus is 'all' but no CUDA device is visible"):
        worker_slots(EngineConfig(gpus="all"))
    with pytest.raises(ConfigError, match="no CUDA device is available"):
        worker_slots(EngineConfig(device="cuda", data_parallel=2))
