"""Per-step tensors: positions, page tables, LoRA segments and the targets a step needs."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import torch
from test_scheduler import make, seq

from slora_batch.engine.execution.batch import (
    HostStep,
    lora_segments,
    plan_step,
    position_segments,
    tiled_tokens,
    upload,
)
from slora_batch.engine.execution.runner import ModelRunner
from slora_batch.engine.scheduling.scheduler import ScheduledStep
from slora_kernels.lora_paths import position_segments as device_position_segments
from slora_kernels.meta import LoraMeta


def test_plan_and_upload_a_mixed_step():
    sched, _, residency = make(1000, {"x": 2}, max_num_batched_tokens=64)
    decode, prefill = seq(3, "x", max_new=5), seq(6, None)
    sched.add(decode)
    step = sched.schedule()
    decode.num_computed = 3
    decode.output_ids = [9]  # seated: the row holds its outputs
    sched.add(prefill)
    step = sched.schedule()
    host = plan_step(step)
    assert host.positions.tolist() == [3, 0, 1, 2, 3, 4, 5]
    assert host.b1_start.tolist() == [0, 1, 7] and host.b_seq_len.tolist() == [4, 6]
    assert host.input_ids.tolist() == [9, 1, 1, 1, 1, 1, 1]
    assert host.logits_index.tolist() == [0, 6] and host.logit_rows == [0, 1]
    assert np.array_equal(host.page_table[0, :4], decode.pages[:4])
    assert (host.page_table[0, 4:] == -1).all()
    slot = residency.slot("x")
    assert host.b_slot.tolist() == [slot] + [-1] * 6
    step_input = upload(host, residency, torch.device("cpu"))
    meta = step_input.lora
    assert meta.max_rank == 2 and meta.targets == (0,)  # the fake adapters target q only
    assert meta.seg_slot.tolist() == [slot] and meta.seg1_start.tolist() == [0, 1]
    # the leading decode row takes the decode kernel, the prefill row the prefill kernel
    assert host.decode_rows == 1
    d, decode_meta, prefill_meta = step_input.attn_split
    assert d == 1 and decode_meta.b_seq_len.tolist() == [4] and decode_meta.max_new == 1
    assert prefill_meta.b1_start.tolist() == [0, 6] and prefill_meta.b_seq_len.tolist() == [6]
    assert torch.equal(prefill_meta.page_table, step_input.attn.page_table[1:])
    assert host.page_table.shape[1] % 2 == 0  # any row of the table starts 16-byte aligned
    assert prefill_meta.page_table.data_ptr() % 16 == 0


def test_base_only_step_has_no_lora_meta():
    sched, _, residency = make(1000)
    sched.add(seq(4))
    step_input = upload(plan_step(sched.schedule()), residency, torch.device("cpu"))
    assert step_input.lora is None


def test_segments_sort_stably_with_base_last_and_pad():
    order, starts, slots = lora_segments(np.array([3, -1, 1, 3, -1, 1, 1]), pad_to=4)
    assert order.tolist() == [2, 5, 6, 0, 3, 1, 4]
    assert starts.tolist() == [0, 3, 5, 5, 5] and slots.tolist() == [1, 3, -1, -1]


def test_long_segments_first_for_the_tiled_kernels():
    """With vector_max, segments longer than it lead token_order (each part by slot), so the
    tiled kernels' tokens are a prefix of tiled_tokens positions; the segments stay the same."""
    order, starts, slots = lora_segments(np.array([5, 2, 2, 2, -1, 1]), vector_max=2)
    assert order.tolist() == [1, 2, 3, 5, 0, 4]
    assert starts.tolist() == [0, 3, 4, 5] and slots.tolist() == [2, 1, 5]
    assert tiled_tokens(starts, 2) == 3
    gen = np.random.default_rng(1)
    for _ in range(30):
        b_slot = gen.integers(-1, 5, size=int(gen.integers(1, 60)))
        b_slot[gen.random(b_slot.size) < 0.3] = int(gen.integers(5, 9))  # one long segment
        order, starts, slots = lora_segments(b_slot, vector_max=3)
        plain_order, plain_starts, plain_slots = lora_segments(b_slot)
        lengths = np.diff(starts)
        long = lengths > 3
        assert not (long[1:] & ~long[:-1]).any()  # long segments, then short ones
        assert sorted(slots.tolist()) == sorted(plain_slots.tolist())
        assert sorted(order.tolist()) == list(range(b_slot.size))
        for seg, slot in enumerate(slots.tolist()):  # each segment holds exactly its slot's tokens
            tokens = order[starts[seg] : starts[seg + 1]]
            assert (b_slot[tokens] == slot).all() and tokens.size == (b_slot == slot).sum()
            assert (np.diff(tokens) > 0).all()  # stable
        assert (b_slot[order[starts[-1] :]] == -1).all()
        assert tiled_tokens(starts, 3) == int(lengths[long].sum())


def test_position_segments_find_each_blocks_first_segment():
    """pos_seg[i] is the first segment ending after sorted position i (S past the adapter
    tokens, padding segments included): what the tiled kernels' blocks read instead of searching,
    built on the host for eager steps and on the device by the launcher otherwise."""
    assert position_segments(np.array([0, 2, 3]), 5).tolist() == [0, 0, 1, 2, 2]
    gen = np.random.default_rng(0)
    for _ in range(20):
        b_slot = gen.integers(-1, 6, size=int(gen.integers(1, 40)))
        _, starts, slots = lora_segments(b_slot, pad_to=8)
        host = position_segments(starts, b_slot.size)
        search = [next((s for s in range(len(slots)) if starts[s + 1] > i), len(slots))
                  for i in range(b_slot.size)]  # fmt: skip
        assert host.tolist() == search
        meta = LoraMeta(*(torch.from_numpy(a.astype(np.int32)) for a in (b_slot, b_slot, starts,
                        slots)), *(torch.zeros(1),) * 4, max_rank=1)  # fmt: skip
        assert device_position_segments(meta, b_slot.size).tolist() == search
        assert meta.pos_seg is None  # built for the call, never kept in meta


def test_decode_step_with_a_one_token_prefill_chunk():
    """With a budget of 2 tokens, a decode and a 1-token prefill chunk share a step: only the
    decode draws a token."""
    sched, _, residency = make(1000, max_num_batched_tokens=2)
    decode, prefill = seq(1, max_new=5), seq(3)
    sched.add(decode)
    sched.schedule()
    decode.num_computed = 1
    decode.output_ids = [9]  # seated: the row holds its outputs
    sched.add(prefill)
    step = sched.schedule()
    assert step.num_new == [1, 1]
    host = plan_step(step)
    assert host.decode_only and host.logit_rows == [0, -1] and host.logits_index.tolist() == [0]
    assert host.input_ids.tolist() == [9, 1] and host.positions.tolist() == [1, 0]
    assert host.out_pages.tolist() == [decode.pages[1].tolist(), prefill.pages[0].tolist()]


def test_decode_graph_kernel_choice():
    """Decode steps replay the tiled-LoRA graph when adapters have several tokens each."""
    from slora_batch.engine.execution.runner import TILED_TOKENS_PER_ADAPTER, tiled_decode

    few = np.repeat(np.arange(8), 32)  # 256 tokens on 8 adapters
    many = np.arange(256) % 200  # 256 tokens on 200 adapters
    assert tiled_decode(few) and not tiled_decode(many)
    assert not tiled_decode(np.full(16, -1))  # base rows only: no LoRA at all
    edge = np.concatenate([np.repeat([3, 5], TILED_TOKENS_PER_ADAPTER), np.full(40, -1)])
    assert tiled_decode(edge) and not tiled_decode(edge[1:])


def graph_runner(bucket: int) -> ModelRunner:
    """A runner's decode-graph inputs alone, on the CPU: its tiled and vector graphs' static
    inputs at ``bucket``, without a model."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.device, runner.max_model_len = torch.device("cpu"), 32
    runner.scratch, runner.max_rank, runner.targets = np.array([0, 1]), 8, (0, 1, 2, 3)
    table = torch.zeros(1)
    runner.residency = SimpleNamespace(dev_rank=table, dev_scale=table, dev_pages=table,
                                       dev_offsets=table, dev_layer_rank=table,
                                       dev_layer_scale=table, dev_vectors=table,
                                       store=SimpleNamespace(fp8=False))  # fmt: skip
    runner.graph_table(bucket)
    return runner


def test_graph_inputs_from_one_staged_copy_equal_a_rebuild():
    """Each step's packed copy leaves in a graph's static inputs what ``lora_segments`` (padded
    to the bucket), ``position_segments`` and the step's rows say, padding rows past the batch,
    the previous step's tokens gathered where prev_rows points (at some rows, or at every row);
    steps alternate the two staged sets and the tiled and vector graphs. Each graph's pos_seg
    is the staged one, refilled every step, never one the launchers built (a warm-up before
    capture would otherwise fix the warm-up's segments into the graph, and every replay would
    skip its adapters)."""
    bucket, gen = 16, np.random.default_rng(4)
    runner = graph_runner(bucket)
    statics = {tiled: runner._static_input(bucket, tiled) for tiled in (False, True)}
    prev_tokens = torch.arange(100, 100 + bucket)
    for step in range(12):
        batch = int(gen.integers(1, bucket + 1))
        b_slot = gen.integers(-1, 6, size=batch)
        if step % 3 == 0:
            b_slot[:] = 2  # one long segment
        lens = gen.integers(1, 20, size=batch).astype(np.int32)
        # odd steps gather previous tokens: some rows' ids from the host, or (every fourth
        # step from the second) none, the one-gather path
        low = 0 if step % 4 == 1 else -1
        prev = gen.integers(low, bucket, size=batch) if step % 2 else None
        host = HostStep(input_ids=gen.integers(0, 50, batch), positions=lens - 1,
                        out_pages=gen.integers(0, 99, (batch, 2)).astype(np.int32),
                        b1_start=np.arange(batch + 1, dtype=np.int32), b_seq_len=lens,
                        page_table=gen.integers(0, 99, (batch, 20, 2)).astype(np.int32),
                        b_slot=b_slot, logits_index=np.arange(batch),
                        logit_rows=list(range(batch)), max_new=1, prev_rows=prev)  # fmt: skip
        tiled = step % 4 < 2
        static = statics[tiled]
        runner._fill(host, bucket, tiled, prev_tokens)
        padded = np.concatenate([b_slot, np.full(bucket - batch, -1)])
        order, starts, slots = lora_segments(padded, pad_to=bucket)
        lora = static.lora
        assert lora.b_slot.tolist() == padded.tolist()
        assert lora.token_order.tolist() == order.tolist()
        assert lora.seg1_start.tolist() == starts.tolist()
        assert lora.seg_slot.tolist() == slots.tolist()
        # both graphs read the staged pos_seg (the vector graph's aligned steps run the tiled
        # kernels), refilled every step; the launchers' own build of it agrees and is not kept
        assert lora.pos_seg.tolist() == position_segments(starts, bucket).tolist()
        unstaged = dataclasses.replace(lora, pos_seg=None)
        built = device_position_segments(unstaged, bucket)
        assert built.tolist() == position_segments(starts, bucket).tolist()
        assert unstaged.pos_seg is None
        ids = host.input_ids.copy()
        if prev is not None:
            ids[prev >= 0] = 100 + prev[prev >= 0]
        assert static.input_ids.tolist() == ids.tolist() + [0] * (bucket - batch)
        assert static.positions.tolist() == host.positions.tolist() + [0] * (bucket - batch)
        assert static.attn.b_seq_len.tolist() == lens.tolist() + [1] * (bucket - batch)
        pages = static.out_pages.numpy()
        assert np.array_equal(pages[:batch], host.out_pages) and (pages[batch:] == [0, 1]).all()
        table = static.attn.page_table.numpy()
        for b in range(batch):
            assert np.array_equal(table[b, : lens[b]], host.page_table[b, : lens[b]])
        assert (table[batch:, 0] == [0, 1]).all()


def test_decode_plan_matches_each_rows_own_fields():
    """A decode step planned in one pass (random contexts, pending tokens, adapter slots and a
    one-token prefill chunk that draws nothing) holds, row by row, what each sequence says."""
    rng = np.random.default_rng(3)
    seqs = []
    for i in range(40):
        s = seq(int(rng.integers(1, 30)), max_new=50)
        s.output_ids = rng.integers(3, 99, int(rng.integers(0, 20))).tolist()
        s.pending = int(rng.integers(0, 2)) if s.output_ids else 0
        s.last_row = int(rng.integers(0, 40))
        s.num_computed = s.num_tokens - 1 - (i % 7 == 0)  # every 7th: a prefill cut short
        s.add_pages(rng.permutation(10_000)[: 2 * (s.num_computed + 1)].reshape(-1, 2))
        s.slot = int(rng.integers(-1, 8))
        s.order, s.preemptions = i, int(rng.integers(0, 3))
        seqs.append(s)
    step = ScheduledStep(seqs, [1] * len(seqs))
    host = plan_step(step)
    ends = [s.num_computed + 1 == s.num_tokens for s in seqs]
    assert host.logits_index.tolist() == [b for b, e in enumerate(ends) if e]
    assert host.logit_rows == [sum(ends[:b]) if e else -1 for b, e in enumerate(ends)]
    assert host.seq_keys == [(s.order, s.preemptions) for s in seqs]
    assert host.b_slot.tolist() == [s.slot for s in seqs]
    assert host.b1_start.tolist() == list(range(len(seqs) + 1))
    assert host.prev_rows.tolist() == [s.last_row if s.pending else -1 for s in seqs]
    for b, s in enumerate(seqs):
        p = s.num_computed
        assert host.positions[b] == p and host.b_seq_len[b] == p + 1
        assert host.input_ids[b] == (0 if s.pending else s.token(p))
        assert (host.page_table[b, : p + 1] == s.pages[: p + 1]).all()
        assert (host.page_table[b, p + 1 :] == -1).all()
        assert (host.out_pages[b] == s.pages[p]).all()
