"""Sampling: greedy, temperature, top-k, top-p; noise keyed by (seed, row id, step) only."""

import hashlib

import torch

from slora_batch.engine.requests.sampling import SamplingBatch, noise_key, sample, uniform_noise


def batch(rows):
    return SamplingBatch.build(*zip(*rows, strict=True), torch.device("cpu"))


def test_noise_key_stable_and_distinct():
    assert noise_key(0, 7) == noise_key(0, 7)
    keys = {
        noise_key(0, 7),
        noise_key(1, 7),
        noise_key(0, 8),
        noise_key(0, 7, 1),
        noise_key(0, 7, 2),
    }
    assert len(keys) == 5
    assert 0 <= noise_key(123, "x") < 2**63


def test_noise_key_reads_the_id_as_its_canonical_text():
    """7 and "7" are one id for resume and in a string id column: they draw alike, every
    sample; an int id's keys are those it had before ids were read as text."""
    for seed in (0, 5):
        for k in (0, 1, 3):
            assert noise_key(seed, 7, k) == noise_key(seed, "7", k)
        assert noise_key(seed, -12, 2) == noise_key(seed, "-12", 2)
        assert noise_key(seed, "x") != noise_key(seed, "x", 1) != noise_key(seed, "y", 1)

    def before(seed, row_id):  # the key's formula when an id was hashed with its type
        text = f"{seed}\x00{type(row_id).__name__}\x00{row_id}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & (2**63 - 1)

    assert noise_key(3, 7) == before(3, 7) and noise_key(3, 7, 2) == before(3, (7, 2))


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
