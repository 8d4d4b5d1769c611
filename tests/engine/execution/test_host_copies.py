"""Preparing a step never waits for the device (run on the device machine).

The engine schedules and prepares step N+1 while step N runs. A CUDA copy from pageable host
memory, or a Python number assigned into a device tensor, waits for the work queued before it:
one such call in that path holds the host until step N is done. Each check keeps the stream
busy with a sleep kernel and asserts the sleep is still running when the host call returns.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from factory import make_adapters, make_model, make_rows

from slora_batch import Engine, EngineConfig, Request
from slora_batch.engine.device import copy_in, to_device
from slora_batch.engine.requests.sampling import SamplingBatch
from slora_kernels.builds import BuildLog

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 300_000_000  # about 150 ms at the H200's clock; a step's host work is a few ms


def busy() -> torch.cuda.Event:
    """Queues a sleep on the current stream; its event completes when the sleep does."""
    torch.cuda._sleep(SLEEP_CYCLES)
    return torch.cuda.current_stream().record_event()


def test_host_arrays_reach_the_device_without_waiting_for_it():
    device = torch.device("cuda")
    dst = torch.zeros(4, 3, dtype=torch.int32, device=device)
    running = busy()
    ids = to_device(np.arange(12).reshape(4, 3)[:, ::2], device, torch.int32)  # strided
    floats = to_device([0.5, 1.5], device, torch.float32)
    copy_in(dst, np.arange(12, dtype=np.int64).reshape(4, 3))  # int64 into int32
    params = SamplingBatch.build([1.0, 0.0], [5, 0], [0.9, 1.0], [7, 8], [3, 0], device)
    assert not running.query(), "a host-to-device copy waited for the work queued before it"
    torch.cuda.synchronize()
    assert ids.tolist() == [[0, 2], [3, 5], [6, 8], [9, 11]]
    assert floats.tolist() == [0.5, 1.5]
    assert dst.tolist() == np.arange(12).reshape(4, 3).tolist()
    assert params.top_k.tolist() == [5, 0] and params.step.tolist() == [3, 0]


def _requests(vocab: int, adapters: list[str]) -> list[Request]:
    """Greedy, sampled (n = 2), logprob and scored rows over more adapters than fit at once."""
    rows = []
    for i, row in enumerate(make_rows(24, vocab, adapters, seed=3)):
        more = {1: dict(temperature=0.8, n=2), 2: dict(logprobs=3)}.get(i % 4, {})
        rows.append(Request(**row, **more))
    for i, adapter in enumerate(adapters):
        rows.append(Request(id=f"c{i}", adapter=adapter, prompt_token_ids=[5, 6, 7, 8] * 5,
                            continuation_token_ids=[9, 10, 11]))  # fmt: skip
        rows.append(Request(id=f"m{i}", adapter=adapter, prompt_token_ids=[12, 13] * 9,
                            choices_token_ids=[[14], [15, 16], [17, 18, 19]]))  # fmt: skip
    return rows


def test_each_step_is_prepared_while_the_one_before_runs(tmp_path):
    """Adapters evicted and loaded between steps (2 slots, 6 adapters), CUDA-graph decode steps,
    eager prefill, sampling, logprobs and scoring: each step's launch queues a sleep first;
    scheduling, prefetching and launching return with the latest sleep still running."""
    model_dir = make_model(tmp_path, "gqa")
    adapters = make_adapters(model_dir, tmp_path / "adapters")
    config = EngineConfig(device="cuda", max_resident_adapters=2, max_adapters_per_batch=2,
                          max_num_seqs=8, lookahead=64)  # fmt: skip
    # The first engine builds the Triton kernels the steps use; the watched one starts from
    # the same state (nothing resident), so its steps take the same shapes and build nothing.
    first = list(Engine(model_dir, adapters=adapters, config=config).generate(
        _requests(300, list(adapters))))  # fmt: skip
    assert not [r.error for r in first if r.error]
    engine = Engine(model_dir, adapters=adapters, config=config)
    sleeps, waits, calls = [], [], []

    def watched(name, method, sleep_first=False):
        def call(*args, **kwargs):
            if sleep_first:  # the step's work queues behind a sleep
                sleeps.append(busy())
            pending = bool(sleeps) and not sleeps[-1].query()
            with BuildLog() as builds:
                out = method(*args, **kwargs)
            calls.append(name)
            if pending and sleeps[-1].query():
                built = f", {builds.count} Triton builds {builds.names}" if builds.count else ""
                waits.append(f"{name} (call {len(calls)}{built})")
            return out

        return call

    engine.runner.forward = watched("forward", engine.runner.forward, sleep_first=True)
    engine.scheduler.schedule = watched("schedule", engine.scheduler.schedule)
    engine.prefetcher.prefetch = watched("prefetch", engine.prefetcher.prefetch)
    engine.prefetcher.load_ahead = watched("load_ahead", engine.prefetcher.load_ahead)
    results = list(engine.generate(_requests(300, list(adapters))))
    assert sorted(map(_key, results)) == sorted(map(_key, first))
    assert not [r.error for r in results if r.error]
    assert calls.count("forward") > 10 and calls.count("schedule") > 10
    assert engine.residency.evictions > 0
    assert not waits, f"these waited for the device ({len(calls)} calls in all): {waits}"


def _key(result) -> tuple[str, int]:
    return str(result.id), result.sample_index or 0
