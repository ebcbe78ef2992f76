"""Statistics of the paper: sign test over discordant pairs and the exact paired test."""

from __future__ import annotations

from math import comb


def sign_test_p(a: int, b: int) -> float:
    """Two-sided sign test over ``a + b`` discordant pairs (``a`` one way, ``b`` the other)."""
    n = a + b
    if n == 0:
        return 1.0
    k = min(a, b)
    tail = sum(comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def exact_paired_p(only_x: int, only_y: int) -> float:
    """Two-sided exact paired (McNemar) test on binary outcomes; the discordant pairs decide it."""
    return sign_test_p(only_x, only_y)
