"""A chi-square goodness-of-fit test with no SciPy: pooled cells, Wilson–Hilferty quantile."""

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
    big = {k: p for k, p in expected_probs.items() if p * n >= min_expected}
    small_p = sum(p for k, p in expected_probs.items() if k not in big)
    cells = [(observed.get(k, 0), p * n) for k, p in big.items()]
    if small_p * n > 0:
        cells.append((sum(c for k, c in observed.items() if k not in big), small_p * n))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return stat, chi_square_critical(max(len(cells) - 1, 1))
