"""Shared fixtures. The sample model is converted at most once per test session."""

from pathlib import Path

import pytest

from slora_batch.sample_model import SAMPLE_MODEL_ALIAS, resolve_model


@pytest.fixture(scope="session")
def sample_model_dir() -> Path:
    """The converted sample model directory (fp32 safetensors + tokenizer).

    Uses the normal cache (`$SLORA_BATCH_CACHE` or `~/.cache/slora-batch`): the first session on a
    machine converts the GGUF (tens of seconds), later ones reuse it. Point `$SLORA_BATCH_CACHE` at an
    empty directory to exercise the conversion itself.
    """
    return resolve_model(SAMPLE_MODEL_ALIAS)
