"""benchmarks/moe_bounds.py: the adapters' pool bytes, and the floor schedule's behaviour on
hand-made rows (the full workload takes a minute: run the script)."""

import pytest
import torch

from benchmarks.moe_bounds import PRESET, AdapterBytes, Card, Setting, adapter_bytes, simulate
from slora_batch.bench.model import build_model

GIB = 1 << 30


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-bounds")
    return build_model(PRESET, torch.device("cpu"), torch.bfloat16, root, 0, hf=False)


def run(model, rows, names, sizes, pool_gib=20.0, max_rows=1024, max_adapters=256):
    setting = Setting.of(model, Card(pool_gib * GIB), max_rows, max_adapters)
    return simulate(setting, rows, names, sizes)


def test_adapter_bytes_are_the_pools_pages(model):
    """The sizes benchmarks/README.md gives: 0.62 and 1.24 GiB for experts at ranks 8 and 16."""
    spec = model.spec
    assert adapter_bytes(spec, 8, True).total(spec) / GIB == pytest.approx(0.62, abs=0.01)
    assert adapter_bytes(spec, 16, True).total(spec) / GIB == pytest.approx(1.24, abs=0.01)
    attention = adapter_bytes(spec, 8, False)
    assert attention.expert == 0 and attention.total(spec) == attention.read(spec, 5)
    # an expert adapter's step reads only the experts its tokens reach
    experts = adapter_bytes(spec, 8, True)
    assert experts.read(spec, 1) < experts.read(spec, 20) < experts.total(spec)


def test_adapters_cost_their_bytes_and_their_room(model):
    rows = [(100 + 7 * i, 20 + i % 5) for i in range(64)]
    base = run(model, rows, [None] * 64, {})
    names = [f"a{i // 2:04d}" for i in range(64)]
    free = run(model, rows, names, dict.fromkeys(names, AdapterBytes(0, 0)))
    assert free == base  # adapters of no bytes: the base model's schedule and floor
    heavy = dict.fromkeys(names, adapter_bytes(model.spec, 16, True))
    seconds, tokens, steps = run(model, rows, names, heavy)
    assert tokens == base[1] and seconds > base[0]
    assert steps > base[2]  # 20 GiB hold 16 such adapters: fewer rows at once
    capped = run(model, rows, names, dict.fromkeys(names, AdapterBytes(0, 0)), max_adapters=4)
    assert capped[2] > base[2] and capped[1] == base[1]


def test_a_row_that_never_fits_is_an_error(model):
    with pytest.raises(RuntimeError, match="does not fit"):
        run(model, [(10, 2)], ["a0000"], {"a0000": adapter_bytes(model.spec, 16, True)}, 1.0)
