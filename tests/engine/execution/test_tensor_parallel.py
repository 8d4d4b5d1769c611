"""S-LoRA tensor parallelism on cpu (gloo, 2 processes): the greedy tokens of transformers + PEFT
and of one device, on MHA, GQA and Qwen2 with mixed ranks and MLP targets; under a pool small
enough to evict adapters and preempt rows; each rank holding half of every adapter; a rank that
dies named by the engine."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from factory import make_adapters, make_model, make_rows, reference, tiny_spec

from slora_batch import Engine, EngineConfig, Request
from slora_batch.engine.adapters.store import AdapterStore, load_weights, shard_adapter
from slora_batch.engine.config import ConfigError
from slora_batch.engine.models.shard import vocab_shard
from slora_batch.engine.models.spec import ModelError

ROWS = 24
VOCAB = 300
KNOBS = dict(device="cpu", dtype="float32", max_num_batched_tokens=64, cpu_threads=1)


def generate(model_dir, adapters, rows, **knobs) -> tuple[dict, Engine]:
    config = EngineConfig(**{**KNOBS, **knobs})
    engine = Engine(model_dir, adapters=adapters, config=config)
    results = {r.id: r for r in engine.generate(Request(**row) for row in rows)}
    assert not [r.error for r in results.values() if r.error]
    return {i: r.token_ids for i, r in results.items()}, engine


@pytest.fixture(scope="module", params=("mha", "gqa", "qwen2"))
def case(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"tp-{request.param}")
    model_dir = make_model(root, request.param)
    adapters = make_adapters(model_dir, root / "adapters")
    rows = make_rows(ROWS, VOCAB, list(adapters), seed=7)
    return request.param, model_dir, adapters, rows, reference(model_dir, adapters, rows)


def test_tp2_matches_peft_and_one_device(case):
    kind, model_dir, adapters, rows, expected = case
    tokens, engine = generate(model_dir, adapters, rows, tensor_parallel=2, num_pages=4000)
    try:
        assert engine.tp is not None and engine.tp.size == 2
        wrong = {i: (tokens[i], want) for i, want in expected.items() if tokens[i] != want}
        assert not wrong, f"{kind}: {len(wrong)} rows differ from transformers + PEFT: {wrong}"
        # The pool is the shard's: a page holds half of a token's K (or V).
        assert engine.pool.page_size == engine.spec.kv_dim // 2
    finally:
        engine.close()
    if kind == "gqa":  # the one-device engine on the same rows, side by side
        single, one = generate(model_dir, adapters, rows, num_pages=4000)
        one.close()
        assert single == tokens


def test_tp2_evicts_and_preempts_like_one_device(case):
    """A pool that fits the rank-64 adapter and a few rows: rank 0's evictions, reloads and
    preemptions reach the other rank in order, and the tokens stay those of PEFT."""
    kind, model_dir, adapters, rows, expected = case
    if kind != "qwen2":
        pytest.skip("one model is enough for the pressure test")
    knobs = dict(tensor_parallel=2, num_pages=1400, max_num_batched_tokens=48,
                 max_adapters_per_batch=3)  # fmt: skip
    tokens, engine = generate(model_dir, adapters, rows, **knobs)
    try:
        counters = engine.counters
        assert counters.adapter_evictions > 0, "the pool never evicted an adapter"
        assert counters.preemptions > 0, "no row was preempted"
        wrong = {i: (tokens[i], want) for i, want in expected.items() if tokens[i] != want}
        assert not wrong, f"{len(wrong)} rows differ under pressure: {wrong}"
    finally:
        engine.close()


def test_each_rank_holds_half_of_every_adapter(case, tmp_path):
    kind, model_dir, adapters, _, _ = case
    if kind != "mha":
        pytest.skip("one model is enough")
    from slora_batch.engine.models.spec import read_spec

    spec = read_spec(model_dir)
    whole = AdapterStore(spec, adapters)
    halves = [AdapterStore(spec, adapters, shard=(rank, 2)) for rank in (0, 1)]
    for name in adapters:
        full, parts = whole.paged(name), [h.paged(name) for h in halves]
        assert all(p.nbytes * 2 == full.nbytes for p in parts), name
        # The two shards put together are the adapter: A's input rows, B's output columns.
        info = whole.info(name)
        weights = load_weights(info, spec)
        cuts = [shard_adapter(weights, rank, 2) for rank in (0, 1)]
        for target in info.targets:
            a = torch.cat([c.a[target] for c in cuts], dim=2)
            b = torch.cat([c.b_t[target] for c in cuts], dim=2)
            assert torch.equal(a, weights.a[target]) and torch.equal(b, weights.b_t[target])


def test_vocab_shard_pads_to_a_multiple():
    head = torch.arange(10.0).view(5, 2)
    parts = [vocab_shard(head, rank, 2) for rank in (0, 1)]
    assert [p.shape[0] for p in parts] == [3, 3]
    assert torch.equal(torch.cat(parts)[:5], head) and not parts[1][2].any()


def test_a_model_that_does_not_divide_is_refused_with_numbers():
    with pytest.raises(ModelError, match="tensor_parallel 4 must divide the KV heads 2"):
        tiny_spec().shard(4)
    with pytest.raises(ConfigError, match="tensor_parallel must be an integer >= 1"):
        EngineConfig(tensor_parallel=0)
    with pytest.raises(ConfigError, match="names one GPU"):
        EngineConfig(device="cuda:1", tensor_parallel=2)


def test_a_dead_rank_is_named(tmp_path):
    model_dir = make_model(tmp_path, "gqa")
    adapters = make_adapters(model_dir, tmp_path / "adapters")
    rows = make_rows(4, VOCAB, list(adapters), seed=3)
    config = EngineConfig(**KNOBS, num_pages=2000, tensor_parallel=2)
    engine = Engine(model_dir, adapters=adapters, config=config)
    try:
        assert len(list(engine.generate(Request(**row) for row in rows))) == 4
        worker = engine.tp.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 \(pid \d+\) exited"):
            list(engine.generate(Request(**row) for row in rows))
    finally:
        engine.close()


def test_two_data_parallel_groups_of_two_ranks(case):
    """data_parallel 2 x tensor_parallel 2: four processes, the tokens of PEFT."""
    kind, model_dir, adapters, rows, expected = case
    if kind != "gqa":
        pytest.skip("one model is enough")
    from slora_batch.engine.parallel.data_parallel import DataParallelEngine

    config = EngineConfig(**KNOBS, num_pages=3000, data_parallel=2, tensor_parallel=2,
                          lookahead=16)  # fmt: skip
    with DataParallelEngine(model_dir, adapters, config) as engine:
        results = {r.id: r for r in engine.generate(Request(**row) for row in rows)}
        assert not [r.error for r in results.values() if r.error]
        tokens = {i: r.token_ids for i, r in results.items()}
        assert tokens == expected
        assert all(w.rows > 0 for w in engine.workers), "a group got no rows"


def test_worker_slots_group_devices(monkeypatch):
    from slora_batch.engine.parallel import dp_worker

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    slots = dp_worker.worker_slots(EngineConfig(gpus="all", tensor_parallel=2))
    assert [(s.device, s.visible) for s in slots] == [("cuda:0-1", "4,5"), ("cuda:2-3", "6,7")]
    with pytest.raises(ConfigError, match="data_parallel 3 x tensor_parallel 2 needs 6 CUDA"):
        dp_worker.worker_slots(EngineConfig(data_parallel=3, tensor_parallel=2))


def test_page_tables_travel_as_the_entries_each_sequence_added():
    """Rank 0 sends each sequence's new page-table entries; a worker rebuilds every step's table
    exactly, through growth, a preemption (a new key) and a key forgotten and sent again."""
    import dataclasses
    import pickle

    import numpy as np

    from slora_batch.engine.execution.batch import HostStep
    from slora_batch.engine.execution.tp import PageTableReceiver, PageTableSender

    rng = np.random.default_rng(0)
    sender, receiver = PageTableSender(), PageTableReceiver()
    sender.FORGET_STEPS = 3
    pages = {key: rng.integers(0, 10_000, size=(300, 2), dtype=np.int32) for key in range(6)}
    lengths = dict.fromkeys(range(6), 0)
    for step in range(40):
        keys = [k for k in range(6) if (step + k) % 5 or step < 3]  # some skip some steps
        if step == 20:  # key 2 preempted: a new key, its pages from scratch
            pages[2 + 100] = rng.integers(0, 10_000, size=(300, 2), dtype=np.int32)
            lengths[2 + 100] = 0
        keys = [k + 100 if k == 2 and step >= 20 else k for k in keys]
        for k in keys:
            lengths[k] += 40 if lengths[k] == 0 else 1  # a prefill, then decodes
        seq_lens = np.array([lengths[k] for k in keys], dtype=np.int32)
        width = int(seq_lens.max()) + 1
        table = np.full((len(keys), width, 2), -1, dtype=np.int32)
        for b, k in enumerate(keys):
            table[b, : lengths[k]] = pages[k][: lengths[k]]
        host = HostStep(input_ids=np.zeros(len(keys), np.int64), positions=seq_lens - 1,
                        out_pages=table[np.arange(len(keys)), seq_lens - 1],
                        b1_start=np.arange(len(keys) + 1, dtype=np.int32), b_seq_len=seq_lens,
                        page_table=table, b_slot=np.full(len(keys), -1), logits_index=np.arange(1),
                        logit_rows=[0], max_new=1, seq_keys=[(k, 0) for k in keys])  # fmt: skip
        message = pickle.loads(pickle.dumps(sender.encode(host)))
        rebuilt = receiver.decode(*message)
        np.testing.assert_array_equal(rebuilt.page_table, table)
        assert dataclasses.replace(rebuilt, page_table=None).seq_keys == host.seq_keys
        if step > 5:  # a decode step sends a page pair per sequence, not the table
            assert sum(entries.shape[0] for _, _, entries in message[2]) <= len(keys) + 40
    assert len(receiver.tables) <= 6


def test_a_step_that_raised_on_rank_0_refuses_the_next_generate(tmp_path):
    """Rank 0's forward raises after the step went to rank 1, which then waits in a collective
    rank 0 never joins: the engine stops its ranks and refuses further use by name, instead of
    pairing the next step's collectives with that one."""
    model_dir = make_model(tmp_path, "gqa")
    rows = [{"id": i, "prompt_token_ids": [5 + i, 6, 7], "max_new_tokens": 4} for i in range(4)]
    config = EngineConfig(**KNOBS, num_pages=2000, tensor_parallel=2, worker_timeout_s=60)
    engine = Engine(model_dir, config=config)
    try:
        rank = engine.tp.processes[0]

        def broken(host, prev_tokens=None):
            raise ValueError("device lost")

        engine.runner.runner.forward = broken
        with pytest.raises(RuntimeError, match="ValueError: device lost"):
            list(engine.generate(Request(**row) for row in rows))
        rank.join(10)
        assert not rank.is_alive(), "rank 1 still runs, waiting in a collective"
        with pytest.raises(RuntimeError, match="cannot be used again: its step 1 raised"):
            engine.generate(Request(**row) for row in rows)
    finally:
        engine.close()


def test_ranks_exit_when_the_driver_is_killed(tmp_path):
    """A driver killed while rank 1 waits in a collective (rank 0 stuck before joining it):
    rank 1 exits within seconds, not after the collective's timeout."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    model_dir = make_model(tmp_path, "gqa")
    script = tmp_path / "driver.py"
    script.write_text(
        "import sys, time\n"
        "from slora_batch import Engine, EngineConfig, Request\n"
        "if __name__ == '__main__':\n"
        f"    config = EngineConfig(**{KNOBS!r}, num_pages=2000, tensor_parallel=2)\n"
        f"    engine = Engine({str(model_dir)!r}, config=config)\n"
        "    def stuck(host, prev_tokens=None):\n"
        "        print(engine.tp.processes[0].pid, flush=True)\n"
        "        time.sleep(600)\n"
        "    engine.runner.runner.forward = stuck\n"
        "    list(engine.generate([Request(id=0, prompt_token_ids=[5, 6, 7])]))\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    driver = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        rank = int(driver.stdout.readline())
        time.sleep(1.0)  # rank 1 now waits in the step's first collective
        assert os.path.exists(f"/proc/{rank}")
        driver.kill()
        driver.wait(30)
        deadline = time.monotonic() + 30  # the collective's own timeout is 300 s
        while os.path.exists(f"/proc/{rank}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{rank}"), f"rank 1 (pid {rank}) outlived the driver"
    finally:
        driver.kill()
