"""Scored rows with the prefix cache on and off: identical log-probabilities.

A scored row's prompt is context + continuation, and the position that predicts the first
continuation token is the context's last one, so a row must compute at least from there: a
cached block that spans the context's end (choices sharing leading tokens, a repeated row, a
preempted row coming back to blocks another row cached) must not let it start past it. Random
contexts and continuations with deliberately shared leading tokens and repeated rows, on the base
model and two adapters, beside a few generated rows, in a pool small enough to preempt; every
token log-probability, choice sum and greedy flag is the cache-off run's, for blocks of 4, 8 and
16 tokens, and the cache-on run's scores are transformers + PEFT's.
"""

from __future__ import annotations

import random

import pytest
from factory import make_adapter, make_model
from test_scoring import peft_model, reference_logprobs

from slora_batch import Engine, EngineConfig, Request

VOCAB = 300
KNOBS = dict(
    device="cpu", dtype="float32", cpu_threads=1, max_num_batched_tokens=16, max_num_seqs=6
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("score-prefix")
    model_dir = make_model(root, "mha", seed=3)
    adapters = {
        "a": make_adapter(
            model_dir,
            root / "a",
            rank=4,
            targets=["q_proj", "v_proj", "up_proj"],
            alpha=8,
            rslora=False,
            seed=1,
        ),
        "b": make_adapter(
            model_dir,
            root / "b",
            rank=2,
            targets=["k_proj", "o_proj"],
            alpha=4,
            rslora=False,
            seed=2,
        ),
    }
    return model_dir, adapters, peft_model(model_dir, adapters)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def random_rows(seed: int) -> list[Request]:
    """Scored rows whose choices share leading tokens, rows repeated whole (same context and
    continuation), contexts shared between rows with continuations that start alike, and a few
    generated rows that grow while the scored ones run."""
    rng = random.Random(seed)
    rows: list[Request] = []
    for i in range(14):
        adapter = [None, "a", "b"][i % 3]
        context = tokens(rng, rng.choice([3, 7, 14, 17, 20, 31]))
        stem = tokens(rng, rng.choice([1, 2, 5, 9]))  # shared leading tokens of the choices
        choices = [stem + tokens(rng, rng.choice([1, 3, 6])) for _ in range(rng.choice([2, 3]))]
        rows.append(
            Request(
                id=f"c{i}",
                adapter=adapter,
                prompt_token_ids=context,
                choices_token_ids=choices,
                answer=0,
            )
        )
        cont = stem + tokens(rng, rng.choice([4, 11, 20]))
        for copy in range(rng.choice([1, 2, 3])):  # the same row again: every block cached
            rows.append(
                Request(
                    id=f"s{i}-{copy}",
                    adapter=adapter,
                    prompt_token_ids=context,
                    continuation_token_ids=cont,
                )
            )
        if i % 2 == 0:
            rows.append(
                Request(
                    id=f"g{i}",
                    adapter=adapter,
                    prompt_token_ids=context + stem,
                    max_new_tokens=24,
                    ignore_eos=True,
                )
            )
    rng.shuffle(rows)
    return rows


def run(model_dir, adapters, rows, **knobs) -> tuple[dict, Engine]:
    engine = Engine(model_dir, adapters=adapters, config=EngineConfig(**{**KNOBS, **knobs}))
    results = {r.id: r for r in engine.generate(rows)}
    assert len(results) == len(rows)
    assert not [r.error for r in results.values() if r.error]
    return results, engine


def scores(result) -> list:
    """A result's scores, flat: choice sums, greedy flags and the best choice; or token
    log-probabilities, their sum and the greedy flag; or a generated row's tokens."""
    if result.choice_logprobs is not None:
        return [*result.choice_logprobs, *result.choice_greedy, result.best_choice]
    if result.token_logprobs is not None:
        return [*result.token_logprobs, result.logprob, result.is_greedy]
    return list(result.token_ids)


def test_repro_shared_choice_stems_and_repeated_rows(tiny):
    """The issue's case: a 14-token context with three choices sharing their first two tokens,
    and two rows with the same 20-token context and continuation, one row at a time."""
    model_dir, adapters, model = tiny
    rng = random.Random(7)
    context, stem = tokens(rng, 14), tokens(rng, 2)
    choices = [stem + tokens(rng, 3) for _ in range(3)]
    long_context, cont = tokens(rng, 20), tokens(rng, 20)
    rows = [
        Request(id="choices", prompt_token_ids=context, choices_token_ids=choices),
        Request(id="first", prompt_token_ids=long_context, continuation_token_ids=cont),
        Request(id="again", prompt_token_ids=long_context, continuation_token_ids=cont),
    ]
    off, _ = run(model_dir, adapters, rows, prefix_caching=False, max_num_seqs=1, num_pages=4000)
    on, engine = run(
        model_dir, adapters, rows, prefix_block_tokens=4, max_num_seqs=1, num_pages=4000
    )
    assert engine.counters.prefix_hit_tokens > 0
    for row in rows:
        assert scores(on[row.id]) == pytest.approx(scores(off[row.id]), abs=1e-5), row.id
    logp = reference_logprobs(model, None, long_context + cont)
    want = [logp[19 + j, t].item() for j, t in enumerate(cont)]
    assert on["again"].token_logprobs == pytest.approx(want, abs=1e-4)
    assert 0.0 not in on["again"].token_logprobs


@pytest.mark.parametrize("block", [4, 8, 16])
def test_scores_with_the_cache_on_are_the_cache_off_scores(tiny, block):
    model_dir, adapters, model = tiny
    rows = random_rows(seed=block)
    off, _ = run(model_dir, adapters, rows, prefix_caching=False, num_pages=100_000)
    on, engine = run(model_dir, adapters, rows, prefix_block_tokens=block, num_pages=180)
    counters = engine.counters
    assert counters.prefix_hit_tokens > 0 and counters.preemptions > 0
    for row in rows:  # a row's total is an fp32 sum (to -156 here): a few ulps of it apart
        assert scores(on[row.id]) == pytest.approx(scores(off[row.id]), rel=4e-7, abs=1e-5), row.id
    for row in rows:  # and PEFT's, token by token
        got = on[row.id]
        if row.continuation_token_ids is None:
            continue
        ctx, cont = row.prompt_token_ids, row.continuation_token_ids
        logp = reference_logprobs(model, row.adapter, ctx + cont)
        want = [logp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont)]
        assert got.token_logprobs == pytest.approx(want, abs=1e-4), row.id
