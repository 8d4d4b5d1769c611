"""Scoring and logprobs against transformers + PEFT in fp32: continuation log-probabilities on
MHA, GQA and Qwen2 with mixed-rank adapters and MLP targets, in chunked prefill steps mixed with
generated rows; choices joined into one row; generation logprobs equal to the log-softmax of
``generate(output_scores=True)``; bad scoring rows become error rows."""

from __future__ import annotations

import random

import pytest
import torch
from factory import make_adapters, make_model

from slora_batch import Engine, EngineConfig, Request

VOCAB = 300
KNOBS = dict(device="cpu", dtype="float32", num_pages=4000, cpu_threads=1)


@pytest.fixture(scope="module", params=("mha", "gqa", "qwen2"))
def case(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"score-{request.param}")
    model_dir = make_model(root, request.param)
    adapters = make_adapters(model_dir, root / "adapters")
    return request.param, model_dir, adapters, peft_model(model_dir, adapters)


def peft_model(model_dir, adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


def reference_logprobs(model, adapter, ids: list[int]) -> torch.Tensor:
    """log-softmax [len(ids), vocab] of transformers + PEFT over the whole sequence."""
    tokens = torch.tensor([ids])
    with torch.no_grad():
        if adapter:
            model.set_adapter(adapter)
            logits = model(input_ids=tokens).logits
        else:
            with model.disable_adapter():
                logits = model(input_ids=tokens).logits
    return torch.log_softmax(logits[0].float(), dim=-1)


def scored_rows(adapters, n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    names = [None, *adapters]
    rows = []
    for i in range(n):
        context = [rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 4, 13, 30, 45]))]
        if i % 3 == 2:
            stem = [rng.randrange(3, VOCAB) for _ in range(rng.choice([0, 2, 5]))]  # shared
            choices = [stem + [rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 2, 7]))]
                       for _ in range(rng.choice([2, 4]))]  # fmt: skip
            rows.append(Request(id=f"c{i}", adapter=names[i % len(names)],
                                prompt_token_ids=context, choices_token_ids=choices,
                                answer=rng.randrange(len(choices))))  # fmt: skip
        else:
            cont = [rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 3, 9, 20]))]
            rows.append(Request(id=f"s{i}", adapter=names[i % len(names)],
                                prompt_token_ids=context, continuation_token_ids=cont))  # fmt: skip
    return rows


def check_continuation(model, adapter, context, cont, logprobs, is_greedy) -> None:
    logp = reference_logprobs(model, adapter, context + cont)
    n = len(context)
    want = [logp[n - 1 + j, t].item() for j, t in enumerate(cont)]
    assert logprobs == pytest.approx(want, abs=1e-4)
    greedy = all(int(logp[n - 1 + j].argmax()) == t for j, t in enumerate(cont))
    assert is_greedy == greedy


def test_scores_match_peft_in_chunks_beside_generated_rows(case):
    """A token budget of 16 cuts contexts and continuations across steps, and generated rows
    run in the same steps; every score and every generated token is PEFT's."""
    _, model_dir, adapters, model = case
    rows = scored_rows(adapters, 18, seed=1)
    generated = [
        Request(
            id=f"g{i}",
            adapter=list(adapters)[i],
            max_new_tokens=6,
            prompt_token_ids=[5 + i, 17, 42 + i, 9],
        )  # fmt: skip
        for i in range(4)
    ]
    engine = Engine(model_dir, adapters=adapters,
                    config=EngineConfig(**KNOBS, max_num_batched_tokens=16,
                                      prefix_block_tokens=4))  # fmt: skip
    results = {r.id: r for r in engine.generate([*rows[:9], *generated, *rows[9:]])}
    assert len(results) == len(rows) + len(generated)
    assert not [r.error for r in results.values() if r.error]
    for row in rows:
        got = results[row.id]
        assert got.finish_reason == "score" and got.prompt_tokens == len(row.prompt_token_ids)
        if row.continuation_token_ids is not None:
            check_continuation(model, row.adapter, row.prompt_token_ids,
                               row.continuation_token_ids, got.token_logprobs, got.is_greedy)  # fmt: skip
            assert got.logprob == pytest.approx(sum(got.token_logprobs), abs=1e-9)
            assert got.continuation_tokens == len(row.continuation_token_ids)
            continue
        sums = []
        for k, choice in enumerate(row.choices_token_ids):
            logp = reference_logprobs(model, row.adapter, row.prompt_token_ids + choice)
            n = len(row.prompt_token_ids)
            sums.append(sum(logp[n - 1 + j, t].item() for j, t in enumerate(choice)))
            greedy = all(int(logp[n - 1 + j].argmax()) == t for j, t in enumerate(choice))
            assert got.choice_greedy[k] == greedy
        assert got.choice_logprobs == pytest.approx(sums, abs=1e-4)
        assert got.choice_tokens == [len(c) for c in row.choices_token_ids]
        assert got.best_choice == max(range(len(sums)), key=sums.__getitem__)
        means = [s / len(c) for s, c in zip(sums, row.choices_token_ids, strict=True)]
        assert got.best_choice_norm == max(range(len(means)), key=means.__getitem__)
        assert got.correct == (got.best_choice == row.answer)
    # the choices of a row after the first start past its context's cached blocks
    assert engine.counters.prefix_hit_tokens > 0
    for row in generated:  # greedy generation in the same batches
        logp_ids = row.prompt_token_ids
        tokens = results[row.id].token_ids
        for token in tokens:
            logp = reference_logprobs(model, row.adapter, logp_ids)
            assert int(logp[-1].argmax()) == token
            logp_ids = logp_ids + [token]


def test_generation_logprobs_match_generate_output_scores(case):
    kind, model_dir, adapters, model = case
    if kind != "gqa":
        pytest.skip("one model is enough")
    names = list(adapters)
    rows = [
        Request(
            id=i,
            adapter=names[i] if i else None,
            prompt_token_ids=[4, 50 + i, 7, 99],
            max_new_tokens=5,
            ignore_eos=True,
            logprobs=[3, 0, 20][i],
        )  # fmt: skip
        for i in range(3)
    ]
    engine = Engine(model_dir, adapters=adapters, config=EngineConfig(**KNOBS))
    results = {r.id: r for r in engine.generate(rows)}
    for row in rows:
        ids = torch.tensor([row.prompt_token_ids])
        kwargs = dict(max_new_tokens=5, do_sample=False, output_scores=True,
                      return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
                      attention_mask=torch.ones_like(ids))  # fmt: skip
        with torch.no_grad():
            if row.adapter:
                model.set_adapter(row.adapter)
                out = model.generate(input_ids=ids, **kwargs)
            else:
                with model.disable_adapter():
                    out = model.generate(input_ids=ids, **kwargs)
        got = results[row.id].logprobs
        assert len(got) == 5 == len(out.scores)
        for entry, scores, token in zip(got, out.scores, out.sequences[0, 4:].tolist(),
                                        strict=True):  # fmt: skip
            logp = torch.log_softmax(scores[0].float(), dim=-1)
            assert entry["token_id"] == token
            assert entry["logprob"] == pytest.approx(logp[token].item(), abs=1e-4)
            values, top = logp.topk(row.logprobs)
            assert [t["token_id"] for t in entry["top"]] == top.tolist()
            assert [t["logprob"] for t in entry["top"]] == pytest.approx(values.tolist(), abs=1e-4)
    assert all(not entry["top"] for entry in results[1].logprobs)  # logprobs 0: the token's own


def test_bad_scoring_rows_are_error_rows_naming_the_reason(case):
    kind, model_dir, adapters, _ = case
    if kind != "mha":
        pytest.skip("one model is enough")
    config = EngineConfig(**{**KNOBS, "max_model_len": 64})
    engine = Engine(model_dir, adapters=adapters, config=config)
    ctx = [5, 6, 7]
    bad = {
        "empty": Request(id="empty", prompt_token_ids=ctx, continuation_token_ids=[]),
        "not-list": Request(id="not-list", prompt_token_ids=ctx, choices_token_ids="abc"),
        "text-no-tokenizer": Request(
            id="text-no-tokenizer", prompt_token_ids=ctx, choices=["a", "b"]
        ),  # fmt: skip
        "not-strings": Request(id="not-strings", prompt_token_ids=ctx, choices=["a", 3]),
        "empty-choice": Request(id="empty-choice", prompt_token_ids=ctx, choices=["a", ""]),
        "past": Request(id="past", prompt_token_ids=[5] * 40, continuation_token_ids=[6] * 30),
        "answer": Request(
            id="answer", prompt_token_ids=ctx, choices_token_ids=[[4], [5]], answer=2
        ),  # fmt: skip
        "answer-cont": Request(
            id="answer-cont", prompt_token_ids=ctx, continuation_token_ids=[4], answer=1
        ),  # fmt: skip
        "logprobs": Request(id="logprobs", prompt_token_ids=ctx, logprobs=21),
        "logprobs-scored": Request(
            id="logprobs-scored", prompt_token_ids=ctx, continuation_token_ids=[4], logprobs=2
        ),  # fmt: skip
    }
    good = Request(id="good", prompt_token_ids=ctx, continuation_token_ids=[8, 9])
    results = {r.id: r for r in engine.generate([*bad.values(), good])}
    messages = {
        "empty": "continuation 0 has no tokens",
        "not-list": "choices_token_ids must be a non-empty list",
        "text-no-tokenizer": "no tokenizer: pass continuation_token_ids",
        "not-strings": "choice 1 must be a string, got int",
        "empty-choice": "choice 1 is empty",
        "past": "context of 40 tokens + continuation of 30 tokens does not fit the context of 64",
        "answer": "answer 2 is not a choice index (0 to 1)",
        "answer-cont": "answer on a continuation row must be 0 (correct then says whether the "
        "continuation is the model's greedy one), got 1",
        "logprobs": "logprobs must be an integer from 0 to 20, got 21",
        "logprobs-scored": "logprobs is for generated rows",
    }
    for name, message in messages.items():
        result = results[name]
        assert result.finish_reason == "error" and message in result.error, (name, result.error)
        assert f"row {name!r}" in result.error
    assert results["good"].finish_reason == "score" and len(results["good"].token_logprobs) == 2


def test_a_scored_row_of_one_token_past_the_context_fits_and_equals_peft(case):
    """A scored row is fed every token but its last (no position predicts from it): a context
    and continuation of max_model_len + 1 tokens fit, as in transformers' scoring (lm-eval's
    ``hf`` scores such pairs), and score as PEFT does, in chunks, with choices that share the
    context's cached blocks and a one-token continuation after a context of max_model_len;
    max_model_len + 2 is an error row. The engine computes one token fewer per continuation."""
    kind, model_dir, adapters, model = case
    if kind != "gqa":
        pytest.skip("one model is enough")
    limit, names = 48, [None, *adapters]
    rng = random.Random(11)
    rows = []
    for i in range(6):
        n = rng.randint(1, limit)
        context = [rng.randrange(3, VOCAB) for _ in range(n)]
        tail = [rng.randrange(3, VOCAB) for _ in range(limit + 1 - n)]  # limit + 1 in all
        if i % 2:
            other = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, limit + 1 - n))]
            rows.append(Request(id=f"c{i}", adapter=names[i % len(names)],
                                prompt_token_ids=context, choices_token_ids=[tail, other]))  # fmt: skip
        else:
            rows.append(Request(id=f"s{i}", adapter=names[i % len(names)],
                                prompt_token_ids=context, continuation_token_ids=tail))  # fmt: skip
    full = [rng.randrange(3, VOCAB) for _ in range(limit)]
    rows.append(Request(id="one", adapter=names[1], prompt_token_ids=full,
                        continuation_token_ids=[7]))  # fmt: skip
    rows.append(Request(id="over", prompt_token_ids=full, continuation_token_ids=[7, 8]))
    engine = Engine(model_dir, adapters=adapters,
                    config=EngineConfig(**KNOBS, max_model_len=limit, max_num_batched_tokens=20,
                                        prefix_block_tokens=4))  # fmt: skip
    results = {r.id: r for r in engine.generate(rows)}
    over = results.pop("over")
    assert over.finish_reason == "error" and f"at most {limit + 1} in all" in over.error
    for row in rows[:-1]:
        got = results[row.id]
        assert got.error is None, got.error
        conts = row.choices_token_ids or [row.continuation_token_ids]
        for k, cont in enumerate(conts):
            logp = reference_logprobs(model, row.adapter, row.prompt_token_ids + cont)
            n = len(row.prompt_token_ids)
            want = [logp[n - 1 + j, t].item() for j, t in enumerate(cont)]
            scores = got.token_logprobs if row.choices_token_ids is None else None
            if scores is not None:
                assert scores == pytest.approx(want, abs=1e-4), row.id
                greedy = all(int(logp[n - 1 + j].argmax()) == t for j, t in enumerate(cont))
                assert got.is_greedy == greedy
            else:
                assert got.choice_logprobs[k] == pytest.approx(sum(want), abs=1e-4), row.id
    assert engine.counters.prefix_hit_tokens > 0  # the second choices past the cached context
    fed = sum(len(r.prompt_token_ids) + len(c) - 1 for r in rows[:-1]
              for c in (r.choices_token_ids or [r.continuation_token_ids]))  # fmt: skip
    c = engine.counters  # (a one-token chunk counts as a decode token)
    assert c.prefill_tokens + c.decode_tokens == fed - c.prefix_hit_tokens


def test_scores_under_tensor_parallelism(case):
    kind, model_dir, adapters, model = case
    if kind != "qwen2":
        pytest.skip("one model is enough")
    rows = scored_rows(adapters, 9, seed=5)
    config = EngineConfig(**KNOBS, tensor_parallel=2, max_num_batched_tokens=24)
    engine = Engine(model_dir, adapters=adapters, config=config)
    try:
        results = {r.id: r for r in engine.generate(rows)}
    finally:
        engine.close()
    for row in rows:
        got = results[row.id]
        assert got.error is None, got.error
        if row.continuation_token_ids is not None:
            check_continuation(model, row.adapter, row.prompt_token_ids,
                               row.continuation_token_ids, got.token_logprobs, got.is_greedy)  # fmt: skip
