"""Scoring each adapter as soon as its rows are in (``eval/scoring.py``) and in the scoring
process (``eval/worker.py``): the same outputs as scoring every adapter at the end from all its
rows, whichever adapters the process answered, on random rows and orders."""

from __future__ import annotations

import json
import logging
import random
from types import SimpleNamespace

import pytest

from slora_batch.eval.scoring import AdapterScoring


class FakeWorker:
    """Answers the adapters ``answers`` picks (a scoring process that died, or was not ready,
    answers only some), some of them with an error."""

    def __init__(self, score, rng: random.Random) -> None:
        self.score, self.rng, self.submitted = score, rng, []

    def submit(self, adapter, rows) -> None:
        self.submitted.append((adapter, dict(rows)))

    def collect(self, adapters):
        assert sorted(map(str, adapters)) == sorted(str(a) for a, _ in self.submitted)
        answers = {}
        for adapter, rows in self.submitted:
            if self.rng.random() < 0.6:
                try:
                    answers[adapter] = (self.score(adapter, rows), None)
                except ValueError as exc:
                    answers[adapter] = (None, exc)
        return answers


def score(adapter, rows):
    """A stand-in for lm-eval: a digest of every row it was given."""
    if adapter == "bad":
        raise ValueError("bad adapter")
    return sorted((key, row["logprob"], row["is_greedy"]) for key, row in rows.items())


@pytest.mark.parametrize("seed", range(20))
def test_outputs_equal_scoring_everything_at_the_end(seed):
    """Random adapters and rows, results in adapter-major order with neighbours interleaved
    (rows finish out of order), some rows committed by an earlier run (a resume), with and
    without a worker that answers some: ``finish`` returns, in the adapters' order, what
    scoring each adapter at the end from all its rows returns, and raises the first failure."""
    rng = random.Random(seed)
    adapters = [None, *rng.sample(["a", "b", "c", "d", "bad"], rng.randint(0, 5))]
    ids = [f"row{i}" for i in range(rng.randint(1, 12))]
    every = {a: {i: {"logprob": -rng.random(), "is_greedy": rng.random() < 0.5,
                     "token_ids": [], "error": None} for i in ids} for a in adapters}  # fmt: skip
    earlier = {a for a in adapters if rng.random() < 0.3}  # some rows in parts already
    parts = {a: {} for a in adapters}
    stream = []
    for adapter in adapters:
        for i in ids:
            if adapter in earlier and rng.random() < 0.5:
                parts[adapter][i] = every[adapter][i]
            else:
                stream.append((adapter, i))
    for k in range(len(stream) - 1):  # neighbours swap: results finish out of order
        if rng.random() < 0.3:
            stream[k], stream[k + 1] = stream[k + 1], stream[k]

    def read():
        return {a: {**parts[a], **{i: every[a][i] for i in ids if (a, i) in stream}}
                for a in adapters}  # fmt: skip

    for worker in (None, FakeWorker(score, rng)):
        scoring = AdapterScoring(len(ids), score, worker)
        for adapter, i in stream:
            fields = every[adapter][i]
            scoring.add(SimpleNamespace(id=i, adapter=adapter or "", logprob=fields["logprob"],
                                        is_greedy=fields["is_greedy"], token_ids=[],
                                        error=None))  # fmt: skip
        if "bad" in adapters:
            with pytest.raises(ValueError, match="bad adapter"):
                scoring.finish(adapters, read)
            continue
        got = scoring.finish(adapters, read)
        assert list(got) == adapters
        assert got == {a: score(a, every[a]) for a in adapters}


def random_rows(encoder, requests, rng: random.Random) -> dict:
    """Random results for every engine row of ``requests``: what an adapter's run could give."""
    from slora_batch.eval.rows import request_rows

    rows = {}
    for request_type, args in requests:
        for row in request_rows(encoder, request_type, args):
            tokens = [rng.randint(3, 400) for _ in range(rng.randint(0, 6))]
            rows[row["id"]] = {"logprob": -rng.random() * 20, "is_greedy": rng.random() < 0.4,
                               "token_ids": tokens, "error": None}  # fmt: skip
    return rows


def test_scoring_process_equals_scoring_here(tmp_path, eval_setup, caplog):
    """The scoring process (its own tasks, built there) gives each adapter the results rows
    and the JSON that scoring in the job's process gives, on random rows of all three task
    kinds; collect stops a process that is not ready at once, answering nothing."""
    from slora_batch.engine.models.spec import read_spec
    from slora_batch.engine.requests.tokens import load_tokenizer
    from slora_batch.eval.encoding import Encoder
    from slora_batch.eval.report import BASE_NAME, RESULTS_DIR
    from slora_batch.eval.tasks import adapter_scorer, build_requests, load_tasks
    from slora_batch.eval.worker import ScoringProcess
    from slora_batch.jobs.eval_keys import EvalConfig

    model_dir, _, tasks_dir = eval_setup
    config = EvalConfig(tasks=["tiny_mc", "tiny_gen", "tiny_ppl"], include_path=str(tasks_dir),
                        bootstrap_iters=0)  # fmt: skip
    max_length = read_spec(model_dir).max_context
    encoder = Encoder(load_tokenizer(model_dir), max_length, config.max_gen_toks)
    loaded = load_tasks(config)
    requests = build_requests(loaded, config.limit)
    here = adapter_scorer(config, encoder, loaded)
    rng = random.Random(0)
    adapters = [None, "a", "b"]
    rows = {a: random_rows(encoder, requests, rng) for a in adapters}

    hasty = ScoringProcess(config, str(model_dir), max_length, tmp_path / "hasty")
    hasty.submit("a", rows["a"])
    assert hasty.collect(["a"]) == {} and hasty.process.poll() is not None
    # its feeder is done: a send still in flight would land in the next process's pipe
    assert not hasty._feeder.is_alive()

    worker = ScoringProcess(config, str(model_dir), max_length, tmp_path)
    for adapter in adapters:
        worker.submit(adapter, rows[adapter])
    while not all(a in worker.answers for a in adapters):
        assert worker._drain(wait=True), worker.failure()
    worker._queue.put(None)  # the end collect asks for, seen before collect reads: a process
    worker.process.wait(timeout=120)  # that answered everything and ended is no failure
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slora_batch.eval.worker"):
        answers = worker.collect(adapters)
    said = [r.getMessage() for r in caplog.records if r.name == "slora_batch.eval.worker"]
    assert not said, said
    assert set(answers) == set(adapters)
    for adapter in adapters:
        scored, error = answers[adapter]
        assert error is None, error
        want = here(adapter, rows[adapter])
        assert scored.rows == want.rows and scored.text is None
        written = (tmp_path / RESULTS_DIR / f"{adapter or BASE_NAME}.json").read_bytes()
        assert written == want.text and json.loads(written)["results"]
