"""A chi-square goodness-of-fit test with no SciPy: pooled cells, Wilson–Hilferty quantile; and its power."""

from __future__ import annotations

from collections import Counter

import numpy as np

Z_999 = 3.0902  # standard normal quantile at 1 - 1e-3


def chi_square_critical(df: int, z: float = Z_999) -> float:
    """Upper quantile of chi-square(df) (Wilson & Hilferty 1931); accurate to ~1% for df >= 3."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * np.sqrt(h)) ** 3


def chi_square(observed: Counter, expected_probs: dict, min_expected: float = 5.0) -> tuple[float, float]:
    """Chi-square statistic of ``observed`` counts against ``expected_probs``, and its 0.999 critical value.

    Cells with expected count below ``min_expected`` are pooled into one cell. Any
    observation outside the support of ``expected_probs`` makes the statistic infinite.
    """
    n = sum(observed.values())
    if any(expected_probs.get(k, 0.0) == 0.0 for k in observed):
        return float("inf"), 0.0
    cells = _cells(expected_probs, n, min_expected)
    counts = [sum(observed.get(k, 0) for k in keys) for keys, _ in cells]
    stat = sum((o - e) ** 2 / e for o, (_, e) in zip(counts, cells))
    return stat, chi_square_critical(max(len(cells) - 1, 1))


def rejection_rate(true_probs: dict, expected_probs: dict, n: int, trials: int = 20000, seed: int = 0,
                   min_expected: float = 5.0) -> float:
    """How often ``chi_square`` rejects ``expected_probs`` (statistic above its critical value) for
    ``n`` samples drawn from ``true_probs``: the test's power against that distribution, estimated from
    ``trials`` seeded multinomial draws (a draw outside the support of ``expected_probs`` is rejected,
    as ``chi_square`` does)."""
    cells = _cells(expected_probs, n, min_expected)
    inside = [sum(true_probs.get(k, 0.0) for k in keys) for keys, _ in cells]
    probs = np.array([*inside, max(0.0, 1.0 - sum(inside))])
    draws = np.random.default_rng(seed).multinomial(n, probs / probs.sum(), size=trials)
    expected = np.array([e for _, e in cells])
    stat = ((draws[:, :-1] - expected) ** 2 / expected).sum(axis=1)
    rejected = (stat > chi_square_critical(max(len(cells) - 1, 1))) | (draws[:, -1] > 0)
    return float(rejected.mean())


def _cells(expected_probs: dict, n: int, min_expected: float) -> list[tuple[list, float]]:
    """The test's cells for ``n`` samples: (keys, expected count), one per key expected ``min_expected`` times
    or more, and one pooling the rest."""
    big = [(k, p) for k, p in expected_probs.items() if p * n >= min_expected]
    cells = [([k], p * n) for k, p in big]
    small = [k for k, p in expected_probs.items() if p * n < min_expected]
    small_n = sum(expected_probs[k] for k in small) * n
    if small_n > 0:
        cells.append((small, small_n))
    return cells
