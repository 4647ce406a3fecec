"""The unbiased pass@k estimator against hand-computed values."""

from __future__ import annotations

from math import comb

import pytest
from crucible_trainer.evaluation import mean_pass_at_k, pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (1, 0, 1, 0.0),
        (1, 1, 1, 1.0),
        (10, 0, 10, 0.0),
        (10, 3, 1, 0.3),  # c / n
        (10, 5, 2, 1 - 10 / 45),  # 1 - C(5,2)/C(10,2)
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (5, 1, 2, 1 - 6 / 10),  # 1 - C(4,2)/C(5,2)
        (20, 2, 10, 1 - comb(18, 10) / comb(20, 10)),
        (200, 13, 100, 1 - comb(187, 100) / comb(200, 100)),
    ],
)
def test_pass_at_k_hand_computed(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(10, 9, 2), (10, 10, 1), (10, 6, 5), (3, 1, 3), (4, 2, 3)])
def test_fewer_failures_than_k_is_certain(n: int, c: int, k: int) -> None:
    # n - c < k: every draw of k samples contains a correct one.
    assert n - c < k
    assert pass_at_k(n, c, k) == 1.0


def test_pass_at_k_grows_with_k() -> None:
    values = [pass_at_k(10, 2, k) for k in range(1, 11)]
    assert values == sorted(values)
    assert values[-1] == 1.0


@pytest.mark.parametrize(("n", "c", "k"), [(0, 0, 1), (5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_invalid_arguments(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_mean_over_problems_skips_those_with_too_few_samples() -> None:
    counts = [(10, 3), (10, 0), (2, 2)]
    assert mean_pass_at_k(counts, 1) == pytest.approx((0.3 + 0.0 + 1.0) / 3)
    assert mean_pass_at_k(counts, 5) == pytest.approx((1 - 21 / 252 + 0.0) / 2)
    assert mean_pass_at_k(counts, 11) is None
