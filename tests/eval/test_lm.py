"""The ``slora-batch`` lm-eval model against lm-eval's own ``hf`` model with ``peft=``: the
same metrics and, request by request, loglikelihoods within 1e-4 and the same generations."""

from __future__ import annotations

import functools
import math

import pytest
from conftest import TASKS

lm_eval = pytest.importorskip("lm_eval")
TOL = 1e-4


def evaluate(model: str, model_args: str, tasks_dir) -> dict:
    from lm_eval.tasks import TaskManager

    # the local tasks alone: lm-eval's built-in index (14,000 files) took 5-10 s a call
    local = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=TASKS, batch_size=1, bootstrap_iters=0,
        task_manager=local, log_samples=True,
    )  # fmt: skip


@functools.cache  # test_sweep.py compares the sweep's results for "b" with this test's reference
def hf_reference(model_dir, adapter_dir, tasks_dir) -> dict:
    """lm-eval's ``hf`` model (with ``peft=`` where ``adapter_dir`` is given) on the tasks, once
    per session: a caller reads it and changes nothing."""
    peft = f",peft={adapter_dir}" if adapter_dir else ""
    return evaluate("hf", f"pretrained={model_dir}{peft},dtype=float32,device=cpu", tasks_dir)


def flat(value):
    """A sample's responses as a flat list of floats, bools and strings."""
    if isinstance(value, list | tuple):
        return [x for item in value for x in flat(item)]
    return [value]


def assert_same(ours: dict, ref: dict) -> None:
    for task in TASKS:
        for key, value in ref["results"][task].items():
            if "_stderr" in key or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            assert math.isclose(ours["results"][task][key], value, rel_tol=1e-5), (task, key)
        by_doc = {s["doc_id"]: s for s in ours["samples"][task]}
        assert len(by_doc) == len(ref["samples"][task])
        for sample in ref["samples"][task]:
            got, want = flat(by_doc[sample["doc_id"]]["resps"]), flat(sample["resps"])
            assert len(got) == len(want), (task, sample["doc_id"])
            for g, w in zip(got, want, strict=True):
                if isinstance(w, float):
                    assert abs(g - w) <= TOL, (task, sample["doc_id"], g, w)
                else:
                    assert g == w, (task, sample["doc_id"], g, w)


@pytest.mark.parametrize("adapter", ["b"])  # the base model: test_sweep.py compares it
def test_slora_batch_model_equals_hf_with_peft(eval_setup, adapter):
    import slora_batch.eval.lm  # noqa: F401  (registers "slora-batch")

    model_dir, adapters, tasks_dir = eval_setup
    ours = evaluate(
        "slora-batch",
        f"pretrained={model_dir},adapters={adapters},adapter={adapter or ''},"
        "dtype=float32,device=cpu,num_pages=16384",
        tasks_dir,
    )
    ref = hf_reference(model_dir, adapters / adapter if adapter else None, tasks_dir)
    assert_same(ours, ref)
    assert any(len(s["resps"][0]) for s in ours["samples"]["tiny_gen"])


def test_requests_past_the_context_equal_hf(eval_setup):
    """A context of 12 tokens on both sides (``max_model_len`` here, ``max_length`` there):
    the multiple-choice contexts lose their oldest tokens, the long rolling documents span
    several windows and the generations' contexts are cut, exactly as in ``hf``: the engine
    scores max_length + 1 tokens a pass, as HFLM does."""
    import slora_batch.eval.lm  # noqa: F401

    model_dir, adapters, tasks_dir = eval_setup
    ours = evaluate(
        "slora-batch",
        f"pretrained={model_dir},adapters={adapters},adapter=a,dtype=float32,device=cpu,"
        "num_pages=16384,max_model_len=12",
        tasks_dir,
    )
    ref = evaluate("hf", f"pretrained={model_dir},peft={adapters / 'a'},dtype=float32,"
                   "device=cpu,max_length=12", tasks_dir)  # fmt: skip
    assert_same(ours, ref)
    from slora_batch.engine.requests.tokens import load_tokenizer
    from slora_batch.eval.encoding import Encoder

    encoder = Encoder(load_tokenizer(model_dir), 12)  # what was compared: truncation, windows
    docs = [s["doc"] for s in ref["samples"]["tiny_ppl"]]
    assert max(len(encoder.rolling(doc["text"])) for doc in docs) >= 3
    pairs = [args for s in ref["samples"]["tiny_mc"] for args in s["arguments"]]
    assert any(sum(map(len, encoder.pair(*args))) == 13 for args in pairs)  # cut to 13
