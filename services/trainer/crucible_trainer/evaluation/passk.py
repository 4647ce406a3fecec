"""pass@k with the unbiased estimator of Chen et al. (2021): 1 - C(n-c, k) / C(n, k)."""

from __future__ import annotations

from collections.abc import Iterable


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of `k` samples drawn from `n` (of which `c` are correct) passes.

    Computed as the numerically stable product 1 - prod_{i=n-c+1}^{n} (1 - k/i); exactly 1.0 when
    fewer than `k` samples fail (every draw of `k` contains a correct one).

    >>> pass_at_k(10, 0, 1), round(pass_at_k(10, 3, 1), 6), pass_at_k(10, 9, 5)
    (0.0, 0.3, 1.0)
    >>> round(pass_at_k(10, 3, 5), 6)  # 1 - C(7,5)/C(10,5) = 1 - 21/252
    0.916667
    """
    if n < 1 or k < 1:
        raise ValueError(f"need n >= 1 and k >= 1, got n={n}, k={k}")
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if k > n:
        raise ValueError(f"k={k} exceeds the n={n} samples drawn")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float | None:
    """Mean pass@k over problems given as (n, c), skipping those with fewer than `k` samples.

    None when no problem has `k` samples.
    """
    values = [pass_at_k(n, c, k) for n, c in counts if n >= k]
    return sum(values) / len(values) if values else None
