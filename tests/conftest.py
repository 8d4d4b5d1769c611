"""Shared fixtures. The sample model is converted at most once per test session."""

import gc
import sys
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


def xdist_group(nodeid: str) -> str | None:
    """A test's pytest-xdist group: "ray" for the Ray tests (they share one local cluster, which a
    second worker would start again, and the CLI test starts one sized to the machine: two at
    once would starve), "eval" for the lm-eval tests (which build their session's model and
    adapters once), the model of a GPU model case, None for the rest."""
    path, name = nodeid.replace("\\", "/"), nodeid.rsplit("::", 1)[-1]
    if "_ray_" in name or "tests/ray/" in path or path.startswith("ray/"):
        return "ray"  # "_ray_": a Ray run outside tests/ray (test_manifest's)
    if "tests/eval/" in path or path.startswith("eval/"):
        return "eval"
    module = path.split("::", 1)[0]
    if module.endswith(MODEL_CASE_MODULES) and "[" in name:
        return f"gpu-model::{model_case(name)}"
    if module.endswith(WHOLE_MODULES):
        return module
    if module.endswith(PARAM_MODULES) and "[" in name:
        return f"{module}::{name[name.index('[') + 1 :].split('-')[0].rstrip(']')}"
    return None


# CPU test modules whose module-scoped fixture builds models and their transformers + PEFT
# references: per model parameter (the first part of a test's id, ``[gqa-bmm]``: ``gqa``) or
# once for the module. Their tests of one model share a worker, which builds it once; split
# between the two workers each built it.
PARAM_MODULES = (
    "engine/test_parity.py",
    "engine/models/test_families.py",
    "engine/models/test_moe_lora.py",
    "engine/models/test_moe_families.py",
    "engine/adapters/test_lora_variants.py",
    "engine/execution/test_tensor_parallel.py",
    "engine/requests/test_scoring.py",
)
WHOLE_MODULES = ("engine/parallel/test_data_parallel.py",)


# GPU test modules whose module-scoped fixture builds a model per parameter: under xdist (the
# device runs the GPU tests on several workers) a model's tests share one worker, so each
# module builds it once and two workers never hold the largest one (llama2-7b: about 30 GiB
# with its PEFT reference) at the same time.
MODEL_CASE_MODULES = ("test_engine_gpu.py", "test_fp8_kv_gpu.py")


def model_case(name: str) -> str:
    """The model parameter of a test id: ``test_x[llama2-7b-graphs]`` -> ``llama2-7b``."""
    case = name[name.index("[") + 1 : name.rindex("]")]
    for mode in ("-graphs", "-eager"):
        case = case.removesuffix(mode)
    return case


def pytest_configure(config):
    """An xdist worker's own torch ops (the transformers + PEFT references) run on one thread:
    the suite's workers take the machine's cores, and OpenMP threads spin while they wait, so
    two threads a worker on two cores stall each other and any busy neighbour."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run only where CUDA is available (the device machine). Under
    pytest-xdist (``-n 2 --dist loadgroup``, the default in pyproject.toml) each group of
    ``xdist_group`` shares one worker. The Ray group is ``slow`` (engine actors start, are killed
    and restarted). The slow tests go first (a stable sort): the workers take the long ones
    while many short ones are left to even out their ends."""
    import torch

    for item in items:
        group = xdist_group(item.nodeid)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        if group == "ray":
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent on the GPU machine
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` whose groups the controller reads from the node ids (``xdist_group``).
    xdist 3.8 carries a group's mark to the controller as a node id suffix, which pytest 9.2's
    structured node ids drop (pytest-xdist issue 1386): the marks alone grouped nothing, and the
    Ray tests ran on both workers at once."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class PathGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid) or super()._split_scope(nodeid)

    return PathGroups(config, log)


@pytest.fixture(autouse=True)
def _release_cuda_cache():
    """After each test on a CUDA machine, the caching allocator's unused blocks go back to the
    card: the device runs the GPU tests on several workers that share its memory."""
    yield
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


_FROZEN_AT = [0]  # len(sys.modules) at the last gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _freeze_what_is_imported():
    """Before each test module, when libraries were imported since the last time (transformers,
    PEFT, lm-eval, Ray...: tens of thousands of objects), the garbage is collected and every
    object left is frozen out of the collector's reach (``gc.freeze``): a full collection (every
    ``Engine.close`` makes one, so does Python itself now and then) then walks only what the
    tests made since, 0.01 s instead of 0.1-0.3 s in a worker that imported the whole suite.
    Frozen objects are still freed when their last reference goes; only cycles among them stay."""
    if len(sys.modules) > _FROZEN_AT[0] + 20:
        gc.collect()
        gc.freeze()
        _FROZEN_AT[0] = len(sys.modules)
    yield
