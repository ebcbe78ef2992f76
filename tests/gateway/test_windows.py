"""The sliding windows' sums kept between calls equal the sums over every bucket, whatever the calls' order."""

from __future__ import annotations

import random

from kvgate.gateway.windows import UsageWindows


def _summed(w: UsageWindows, now: float, span_s: float) -> tuple[int, int, int, int]:
    """The window's totals as a scan of every bucket computes them."""
    since = now - span_s
    out = [0, 0, 0, 0]
    for start, *sums in w._buckets:
        if start + w.bucket_s > since:
            for i, x in enumerate(sums):
                out[i] += int(x)
    return out[0], out[1], out[2], out[3]


def test_kept_sums_equal_a_full_scan() -> None:
    rng = random.Random(7)
    for bucket_s, horizon_s in ((5.0, 300.0), (1.0, 30.0), (0.25, 2.0)):
        w = UsageWindows(bucket_s, horizon_s)
        now = rng.uniform(0, 1000)
        for _ in range(4000):
            now += rng.choice((0.0, 0.001, 0.3, 1.7, bucket_s, 7.3, 40.0)) * rng.random()
            if rng.random() < 0.7:
                w.add(now, rng.randrange(0, 200_000), rng.choice((None, rng.randrange(0, 100_000))))
            for span in (60.0, 300.0, bucket_s, 3.3):
                at = now + rng.choice((0.0, 0.0, 0.5, 12.0))
                assert w.totals(at, span) == _summed(w, at, span)
        assert w.totals(now, 60.0) == _summed(w, now, 60.0)


def test_a_window_past_every_bucket_is_empty() -> None:
    w = UsageWindows()
    assert w.totals(10.0, 60.0) == (0, 0, 0, 0)
    w.add(10.0, 100, 40)
    assert w.totals(10.0, 60.0) == (1, 100, 100, 40)
    assert w.totals(500.0, 60.0) == (0, 0, 0, 0)
    assert w.hit_ratio(10.0, 60.0) == 0.4
