"""Shared fixtures. The sample model is converted at most once per test session."""

from pathlib import Path

import pytest

from slora_batch.engine.models.sample_model import SAMPLE_MODEL_ALIAS, resolve_model


@pytest.fixture(scope="session")
def sample_model_dir() -> Path:
    """The converted sample model directory (fp32 safetensors + tokenizer).

    Uses the normal cache (`$SLORA_BATCH_CACHE` or `~/.cache/slora-batch`): the first session on a
    machine converts the GGUF (tens of seconds), later ones reuse it. Point `$SLORA_BATCH_CACHE` at an
    empty directory to exercise the conversion itself.
    """
    return resolve_model(SAMPLE_MODEL_ALIAS)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run only where CUDA is available (the device machine). Under
    pytest-xdist (``-n 2 --dist loadgroup``, the default in pyproject.toml) the Ray tests share
    one worker: each starts a local cluster sized to the machine, two at once would starve; the
    lm-eval tests share another, which builds their session's model and adapters once."""
    import torch

    for item in items:
        ray_test = "_ray_" in item.name  # a Ray run outside tests/ray (test_manifest's)
        if (
            ray_test
            or "tests/ray/" in item.nodeid.replace("\\", "/")
            or item.nodeid.startswith("ray/")
        ):
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif "tests/eval/" in item.nodeid.replace("\\", "/") or item.nodeid.startswith("eval/"):
            item.add_marker(pytest.mark.xdist_group("eval"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
