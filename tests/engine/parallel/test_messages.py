"""The driver's and workers' messages cross a process boundary: each kind pickles and comes back
with its fields (a class defined where pickle cannot find it, or a field that does not pickle,
fails here rather than in a worker)."""

from __future__ import annotations

import pickle

from slora_batch import Request
from slora_batch.engine.counters import EngineCounters
from slora_batch.engine.parallel import messages
from slora_batch.engine.parallel.messages import (
    Abort,
    Alive,
    Done,
    End,
    Failed,
    Log,
    Ready,
    RowResult,
    Rows,
)
from slora_batch.engine.requests.request import Result


def test_every_message_kind_pickles_with_its_fields():
    counters = EngineCounters()
    counters.steps = 7
    result = Result(id=3, adapter="a", text="hi", token_ids=[5, 6], finish_reason="length")
    sent = [
        Rows(2, [Request(id=1, adapter="a", prompt="x"), Request(id=2, prompt_token_ids=[4])]),
        End(2),
        Abort(1),
        Ready("cpu", "float32", counters, ["a", "b"], 16),
        RowResult(2, result, counters),
        RowResult(2, result, None),
        Done(2, counters),
        Failed("ValueError: bad", ValueError("bad")),
        Log({"name": "slora_batch", "levelno": 20, "levelname": "INFO", "msg": "hello"}),
        Alive("running steps", 12),
    ]
    kinds = {type(m) for m in sent}
    assert kinds == set(messages.ToDriver.__args__) | set(messages.ToWorker.__args__)
    for message in sent:
        back = pickle.loads(pickle.dumps(message))
        assert type(back) is type(message)
        assert back._fields == message._fields
    rows = pickle.loads(pickle.dumps(sent[0]))
    assert [(r.id, r.adapter, r.prompt, r.prompt_token_ids) for r in rows.requests] == [
        (1, "a", "x", None),
        (2, None, None, [4]),
    ]
    ready = pickle.loads(pickle.dumps(sent[3]))
    assert (ready.dtype, ready.adapters, ready.lookahead, ready.counters.steps) == (
        "float32",
        ["a", "b"],
        16,
        7,
    )
    got = pickle.loads(pickle.dumps(sent[4]))
    assert (got.stream, got.result, got.counters.steps) == (2, result, 7)
    failed = pickle.loads(pickle.dumps(sent[7]))
    assert isinstance(failed.error, ValueError) and str(failed.error) == "bad"
    assert pickle.loads(pickle.dumps(sent[9])) == ("running steps", 12)
