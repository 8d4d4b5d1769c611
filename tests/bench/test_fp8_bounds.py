"""benchmarks/fp8_bounds.py: the greedy comparison, the relative bound, and a random test model
measured end to end (a few rows)."""

import pytest

from benchmarks.fp8_bounds import GREEDY_TOKENS, add_case_args, bounds, random_case, same_greedy


def test_same_greedy_compares_the_first_tokens_and_says_where_rows_part():
    want = {0: list(range(40)), 1: [5, 6, 7], 2: [1, 2, 3, 4]}
    got = {0: list(range(GREEDY_TOKENS)) + [99] * 8, 1: [5, 6], 2: [1, 9, 3, 4]}
    same = same_greedy(got, want)
    assert same["rows"] == 3 and same["same"] == pytest.approx(1 / 3)
    assert same["first_difference"] == {"1": 2, "2": 1}  # row 1 stopped early, row 2 parted


def test_the_delta_bound_is_relative_to_bf16s_own():
    greedy = {"same": 0.9}
    checks = bounds({"fp8": {"mean_abs_delta": 0.1}, "bf16": {"mean_abs_delta": 0.04}}, greedy)
    assert [c["pass"] for c in checks] == [True, True] and checks[0]["value"] == pytest.approx(2.5)
    checks = bounds({"fp8": {"mean_abs_delta": 0.11}, "bf16": {"mean_abs_delta": 0.04}},
                    {"same": 0.89})  # fmt: skip
    assert [c["pass"] for c in checks] == [False, False]


@pytest.mark.slow
def test_a_random_model_is_measured_in_every_precision():
    case = random_case("gqa", rows=6, device="cpu")
    assert case["greedy"]["rows"] == 6
    assert case["tokens"] == 6 * GREEDY_TOKENS  # fp32's outputs scored, EOS ignored
    assert case["bf16_delta"] > 0 and case["fp8_delta"] > 0
    assert len(case["checks"]) == 2


def test_the_default_kinds_are_the_factorys():
    """Every default random model is one the test factory builds (its kinds changed once, and
    the scripts' defaults named a kind it no longer had)."""
    import argparse

    from factory import KINDS, model_config

    parser = argparse.ArgumentParser()
    add_case_args(parser)
    kinds = parser.parse_args([]).kinds.split(",")
    assert kinds == list(KINDS)
    for kind in kinds:
        model_config(kind)
