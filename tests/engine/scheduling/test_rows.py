"""The row table: what a decode step is built from equals a build from each sequence's own
fields, step after step, across preemptions, prefix-cache hits, scored rows, n > 1 samples and
overlapped steps; and a CUDA graph's page table written only where rows changed equals the
whole table."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from factory import gqa_with_adapters

import slora_batch.engine.engine as engine_module
from slora_batch import Engine, EngineConfig, Request
from slora_batch.engine.execution import batch as batch_module
from slora_batch.engine.execution.runner import ModelRunner
from slora_batch.engine.scheduling import scheduler as scheduler_module
from slora_batch.engine.scheduling.rows import RowTable
from slora_batch.engine.scheduling.scheduler import ScheduledStep

VOCAB = 300


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return gqa_with_adapters(tmp_path_factory.mktemp("rows"), 3)


def requests(count: int, seed: int) -> list[Request]:
    """Shared prompt heads (prefix-cache hits), sampled and greedy rows, n = 2, scored rows,
    rows with logprobs."""
    rng = random.Random(seed)
    head = [rng.randrange(3, VOCAB) for _ in range(20)]
    out = []
    for i in range(count):
        prompt = head[: rng.choice([0, 17, 20])] + [rng.randrange(3, VOCAB) for _ in range(3)]
        kind = rng.random()
        extra = {}
        if kind < 0.15:
            extra = dict(continuation_token_ids=[rng.randrange(3, VOCAB) for _ in range(3)])
        elif kind < 0.3:
            extra = dict(n=2)
        elif i % 5 == 0:  # rows reading logprobs back (the table counts them)
            extra = dict(logprobs=2)
        out.append(
            Request(
                id=i,
                adapter=rng.choice([None, "a0", "a1", "a2"]),
                prompt_token_ids=prompt,
                max_new_tokens=rng.randrange(1, 12),
                ignore_eos=True,
                temperature=rng.choice([0.0, 0.9]),
                **extra,
            )
        )
    return out


def check_table(sched) -> None:
    """Every running sequence has a row, rows are dense, and each row holds its sequence's
    fixed fields and its pages (-1 past them)."""
    table = sched.rows
    assert set(table.seqs) == set(sched.running) and len(table.seqs) == len(sched.running)
    for row, seq in enumerate(table.seqs):
        assert seq.row == row and seq.table is table
        assert table.keys[row] == (seq.order, seq.preemptions)
        assert table.b_slot[row] == seq.slot and table.b_noise[row] == seq.key
        assert table.b_temperature[row] == np.float32(seq.temperature)
        assert (table.pages[row, seq.num_paged :] == -1).all()
        assert seq.num_paged >= seq.num_computed
        assert table.b_max_new[row] == seq.max_new_tokens
        assert table.b_prompt_len[row] == len(seq.prompt_ids)
        assert table.b_watched[row] == (seq.detok is not None or seq.grammar is not None)
        # the per-step state the row holds for its sequence: within its bounds, and its
        # outputs the row's own (a moved row brings them along)
        assert 0 <= seq.pending <= 2 and seq.num_drawn <= seq.max_new_tokens
        assert seq.num_computed <= seq.num_tokens
        assert seq.output_ids == table.out[row, : table.b_outputs[row]].tolist()
    tenures = table.b_tenure[: len(table.seqs)]
    assert np.unique(tenures).size == tenures.size and (tenures >= 0).all()
    assert (table.pages[len(table.seqs) :] == -1).all()
    assert table.logprobs == sum(s.logprobs is not None for s in table.seqs)
    assert table.scored == sum(not s.draws for s in table.seqs)
    assert sched.waiting.by_adapter == Counter(s.adapter or None for s in sched.waiting)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_decode_steps_from_the_table_equal_a_build_from_the_rows(tiny, monkeypatch, overlap, seed):
    model_dir, adapters = tiny
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        max_num_seqs=8,
        num_pages=150,
        overlap=overlap,
        cuda_graphs=False,
        prefix_block_tokens=4,
        admit_batch=2,
    )
    engine = Engine(model_dir, adapters=adapters, config=config)
    # The graphs' page table alone, on the CPU: a built ModelRunner captures its CUDA graphs on
    # a GPU, so nothing public writes that table here; ``_fill_pages`` is what a replay reads.
    graphs = ModelRunner.__new__(ModelRunner)
    graphs.device, graphs.max_model_len = torch.device("cpu"), engine.max_model_len
    graphs.graph_table(16)
    plan, checked = batch_module.plan_step, []

    def checked_plan(step: ScheduledStep):
        check_table(engine.scheduler)
        host = plan(step)
        if step.rows is not None:
            rebuilt = batch_module.plan_step(ScheduledStep(step.seqs, step.num_new))
            for name in (
                "input_ids",
                "positions",
                "out_pages",
                "b1_start",
                "b_seq_len",
                "b_slot",
                "logits_index",
                "prev_rows",
            ):
                mine, theirs = getattr(host, name), getattr(rebuilt, name)
                assert (mine is None) == (theirs is None), name
                assert mine is None or np.array_equal(mine, theirs), name
            assert host.logit_rows == rebuilt.logit_rows and host.seq_keys == rebuilt.seq_keys
            assert np.array_equal(host.page_table, rebuilt.page_table)
            checked.append(len(step.seqs))
        if host.decode_only and host.score_index is None:  # what a graph would replay
            graphs._fill_pages(host)
            for b, length in enumerate(host.b_seq_len):
                table = graphs._graph_page_table[b, :length].numpy()
                assert np.array_equal(table, host.page_table[b, :length])
        return host

    read_back, moved = scheduler_module.read_back, []

    def checked_read_back(table, drawn, tokens, b_eos, eos, mark=None):
        """Where a table step's rows are at read back, by the leaves since its launch, against
        the sequences' own rows: the same sequence, or one that left (and may sit again)."""
        if mark is not None:
            b_row = table.rows_since(mark, len(drawn))
            for seq, row in zip(drawn, b_row.tolist(), strict=True):
                assert table.seqs[row] is seq if row >= 0 else seq.row < 0 or seq.table is table
            moved.append(len(table.moves) - (mark - table.moves_base))
        return read_back(table, drawn, tokens, b_eos, eos, mark)

    monkeypatch.setattr(engine_module, "plan_step", checked_plan)
    monkeypatch.setattr(scheduler_module, "read_back", checked_read_back)
    work = requests(40, seed)
    results = {r.id: r for r in engine.generate(work)}
    assert len(results) == len(work) and all(r.finish_reason != "error" for r in results.values())
    for request in work:  # no token lost or doubled through the table (ignore_eos: all drawn)
        if request.continuation_token_ids is None:
            assert len(results[request.id].token_ids) == request.max_new_tokens
    assert engine.scheduler.preemptions > 0 and engine.counters.prefix_hit_tokens > 0
    assert sum(checked) > 50  # decode rows went through the table
    assert len(moved) > 10 and sum(moved) > 10  # table steps read back after rows left
    assert not engine.scheduler.rows.seqs
    engine.close()


def test_rows_since_follows_the_leaves_after_a_mark(tiny):
    """Rows [A, B, C, D] at the mark; B leaves (D moves to row 1), D leaves (C moves to row 1),
    E joins (row 2): A at 0, B gone, C at 1, D gone. Trimmed to a later mark, the earlier
    leaves are forgotten."""
    model_dir, adapters = tiny
    engine = Engine(model_dir, adapters=adapters, config=EngineConfig(device="cpu", num_pages=400))
    table = RowTable()
    seqs = [engine.prepare(Request(id=i, prompt_token_ids=[5, 6, 7])) for i in range(5)]
    for seq in seqs[:4]:
        table.join(seq)
    mark = table.mark()
    table.leave(seqs[1])
    table.leave(seqs[3])
    table.join(seqs[4])
    assert table.rows_since(mark, 4).tolist() == [0, -1, 1, -1]
    assert [s.row for s in seqs] == [0, -1, 1, -1, 2]
    later = table.mark()
    table.leave(seqs[0])  # E (row 2) moves to row 0
    assert table.rows_since(later, 3).tolist() == [-1, 1, 0]
    table.trim(later)
    assert table.moves == [(0, 2)] and table.rows_since(later, 3).tolist() == [-1, 1, 0]
    engine.close()
