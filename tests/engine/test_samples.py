"""n samples per row: each sample seeded on its own (the same tokens in any batch), the first
sample's prompt blocks shared by the others through the prefix cache, sample_indices for a
resumed row, bad n an error row."""

from __future__ import annotations

import pytest
from factory import make_adapters, make_model

from slora_batch import Engine, EngineConfig, Request, SamplingConfig

KNOBS = dict(device="cpu", dtype="float32", cpu_threads=1, num_pages=4000)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("samples")
    model_dir = make_model(root, "gqa")
    return model_dir, make_adapters(model_dir, root / "adapters")


def run(tiny, requests, **knobs):
    model_dir, adapters = tiny
    engine = Engine(model_dir, adapters=adapters, config=EngineConfig(**{**KNOBS, **knobs}))
    results = list(engine.generate(requests))
    return results, engine


def sampled(i, adapter, **fields):
    prompt = [3 + (i * 7 + j) % 290 for j in range(37)]
    return Request(id=i, adapter=adapter, prompt_token_ids=prompt, max_new_tokens=8,
                   temperature=1.0, seed=5, ignore_eos=True, **fields)  # fmt: skip


def test_n_samples_share_the_prompt_and_do_not_depend_on_the_batch(tiny):
    names = list(tiny[1])
    rows = [sampled(i, names[i % 3], n=4) for i in range(3)]
    results, engine = run(tiny, rows)
    by_key = {(r.id, r.sample_index): r.token_ids for r in results}
    assert sorted(by_key) == [(i, k) for i in range(3) for k in range(4)]
    for i in range(3):  # four samples of one prompt at temperature 1 differ
        assert len({tuple(by_key[i, k]) for k in range(4)}) > 1
    # 37-token prompts: 2 full blocks, found by samples 1-3 of each row
    assert engine.counters.prefix_hit_tokens == 3 * 3 * 32
    # alone, one at a time, or as the only sample asked for: the same tokens
    for i in range(3):
        for k in (0, 2):
            alone, _ = run(tiny, [sampled(i, names[i % 3], n=4, sample_indices=[k])],
                           max_num_seqs=1)  # fmt: skip
            assert [(r.sample_index, r.token_ids) for r in alone] == [(k, by_key[i, k])]
    # sample 0 of n is the row as it was without n
    single, _ = run(tiny, [sampled(0, names[0])])
    assert single[0].token_ids == by_key[0, 0] and single[0].sample_index == 0


def test_n_from_the_engine_sampling_default(tiny):
    model_dir, adapters = tiny
    engine = Engine(model_dir, adapters=adapters, config=EngineConfig(**KNOBS),
                    sampling=SamplingConfig(n=3, temperature=0.7, max_new_tokens=4))  # fmt: skip
    scored = Request(id="s", prompt_token_ids=[5, 6, 7], continuation_token_ids=[8, 9])
    results = list(engine.generate([Request(id="a", prompt_token_ids=[5, 6, 7, 8]), scored]))
    assert sorted(r.sample_index for r in results if r.id == "a") == [0, 1, 2]
    # the default n is for generated rows: a scored row is scored once
    [score] = [r for r in results if r.id == "s"]
    assert score.finish_reason == "score" and len(score.token_logprobs) == 2, score.error


def test_an_int_id_and_its_text_draw_the_same_samples(tiny):
    """7 and "7" are one id (resume, a string id column): every sample draws alike."""
    names = list(tiny[1])
    rows = [sampled(7, names[0], n=3), Request(**{**vars(sampled(7, names[0], n=3)), "id": "7"})]
    results, _ = run(tiny, rows)
    by_id = {(r.id, r.sample_index): r.token_ids for r in results}
    assert len(by_id) == 6
    for k in range(3):
        assert by_id[7, k] == by_id["7", k]
    assert len({tuple(by_id[7, k]) for k in range(3)}) > 1


def test_bad_n_is_an_error_row(tiny):
    rows = [
        sampled(1, None, n=0),
        sampled(2, None, n=2, sample_indices=[2]),
        Request(id=3, prompt_token_ids=[4, 5], continuation_token_ids=[6], n=2),
    ]
    results = {r.id: r for r in run(tiny, rows)[0]}
    assert "n must be an integer from 1 to 256, got 0" in results[1].error
    assert "sample_indices [2] are not in 0..1" in results[2].error
    assert "n is for generated rows, not scored ones (the row asks n=2)" in results[3].error
