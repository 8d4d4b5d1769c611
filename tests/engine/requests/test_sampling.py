"""Sampling: greedy, temperature, top-k, top-p; noise keyed by (seed, row id, step) only."""

import torch

from slora_batch.engine.requests.sampling import SamplingBatch, noise_key, sample, uniform_noise


def batch(rows):
    return SamplingBatch.build(rows, torch.device("cpu"))


def test_noise_key_stable_and_distinct():
    assert noise_key(0, 7) == noise_key(0, 7)
    assert len({noise_key(0, 7), noise_key(1, 7), noise_key(0, 8), noise_key(0, "7")}) == 4
    assert 0 <= noise_key(123, "x") < 2**63


def test_noise_is_pure_function_of_key_step_index():
    key = torch.tensor([5, 5, 9])
    step = torch.tensor([0, 0, 3])
    u = uniform_noise(key, step, 1000)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.03
    single = uniform_noise(torch.tensor([9]), torch.tensor([3]), 1000)
    assert torch.equal(single[0], u[2])


def test_greedy_rows_take_argmax():
    logits = torch.randn(3, 50)
    out = sample(logits, batch([(0.0, 0, 1.0, 1, 0)] * 3))
    assert torch.equal(out, logits.argmax(-1))


def test_row_independent_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 200)
    rows = [(0.8, 0, 1.0, 11, 2), (1.0, 20, 0.9, 12, 0), (0.0, 0, 1.0, 13, 5), (1.3, 5, 0.5, 14, 1)]
    together = sample(logits, batch(rows))
    for i, row in enumerate(rows):
        assert int(sample(logits[i : i + 1], batch([row]))) == int(together[i])


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, -1.0]]).repeat(400, 1)
    keys = list(range(400))
    topk = sample(logits, batch([(2.0, 2, 1.0, k, 0) for k in keys]))
    assert set(topk.tolist()) == {0, 1}
    probs = torch.softmax(logits[0], -1)  # 0.66, 0.24, 0.09, ...
    topp = sample(logits, batch([(1.0, 0, float(probs[0] + 0.01), k, 0) for k in keys]))
    assert set(topp.tolist()) == {0, 1}
    free = sample(logits, batch([(1.0, 0, 1.0, k, 0) for k in keys]))
    assert len(set(free.tolist())) >= 4


def test_temperature_draws_follow_softmax():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(4000, 1)
    out = sample(logits, batch([(1.0, 0, 1.0, k, 0) for k in range(4000)]))
    freq = torch.bincount(out, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)
