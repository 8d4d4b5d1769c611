"""LoRA on the experts and the router on a GPU (run on the device machine): the Triton backend,
with decode steps captured in CUDA graphs, gives in fp32 the tokens the CPU engine gives (the
torch twins, which test_moe_lora.py holds to transformers + PEFT), expert adapters of both
formats, attention adapters and base rows mixed.

Run: ``.venv/bin/python -m pytest -q -m gpu tests/engine/models/test_moe_lora_engine_gpu.py``.
"""

from __future__ import annotations

import pytest
from factory import make_rows
from moe_factory import VOCAB, expert_adapters, make_moe_model

from slora_batch import Engine, EngineConfig, Request

pytestmark = pytest.mark.gpu


def tokens(model_dir, adapters, rows, **knobs) -> dict:
    engine = Engine(model_dir, adapters=adapters, config=EngineConfig(dtype="float32", **knobs))
    results = {r.id: r for r in engine.generate(Request(**row) for row in rows)}
    assert all(r.error is None for r in results.values()), [r.error for r in results.values()]
    return {i: r.token_ids for i, r in results.items()}


@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral"])
def test_triton_and_cuda_graphs_give_the_cpu_tokens(tmp_path, kind):
    model_dir = make_moe_model(tmp_path, kind, seed=3)
    adapters = expert_adapters(model_dir, tmp_path / "adapters", kind)
    rows = make_rows(24, VOCAB, list(adapters), seed=2)
    knobs = dict(num_pages=20000, max_num_batched_tokens=64, max_num_seqs=16)
    cpu = tokens(model_dir, adapters, rows, device="cpu", **knobs)
    gpu = tokens(model_dir, adapters, rows, device="cuda", cuda_graphs=True, **knobs)
    wrong = {i: (gpu[i], want) for i, want in cpu.items() if gpu[i] != want}
    assert not wrong, f"{len(wrong)} rows differ from the CPU engine: {wrong}"
