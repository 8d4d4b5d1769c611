"""Per-step tensors: positions, page tables, LoRA segments and the targets a step needs."""

import numpy as np
import torch
from test_scheduler import make, seq

from slora_batch.batch import lora_segments, plan_step, upload


def test_plan_and_upload_a_mixed_step():
    sched, _, residency = make(1000, {"x": 2}, max_num_batched_tokens=64)
    decode, prefill = seq(3, "x", max_new=5), seq(6, None)
    sched.add(decode)
    step = sched.schedule()
    decode.num_computed = 3
    decode.output_ids.append(9)
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


def test_base_only_step_has_no_lora_meta():
    sched, _, residency = make(1000)
    sched.add(seq(4))
    step_input = upload(plan_step(sched.schedule()), residency, torch.device("cpu"))
    assert step_input.lora is None


def test_segments_sort_stably_with_base_last_and_pad():
    order, starts, slots = lora_segments(np.array([3, -1, 1, 3, -1, 1, 1]), pad_to=4)
    assert order.tolist() == [2, 5, 6, 0, 3, 1, 4]
    assert starts.tolist() == [0, 3, 5, 5, 5] and slots.tolist() == [1, 3, -1, -1]


def test_decode_step_with_a_one_token_prefill_chunk():
    """With a budget of 2 tokens, a decode and a 1-token prefill chunk share a step: only the
    decode draws a token."""
    sched, _, residency = make(1000, max_num_batched_tokens=2)
    decode, prefill = seq(1, max_new=5), seq(3)
    sched.add(decode)
    sched.schedule()
    decode.num_computed = 1
    decode.output_ids.append(9)
    sched.add(prefill)
    step = sched.schedule()
    assert step.num_new == [1, 1]
    host = plan_step(step)
    assert host.decode_only and host.logit_rows == [0, -1] and host.logits_index.tolist() == [0]
    assert host.input_ids.tolist() == [9, 1] and host.positions.tolist() == [1, 0]
    assert host.out_pages.tolist() == [decode.pages[1].tolist(), prefill.pages[0].tolist()]
