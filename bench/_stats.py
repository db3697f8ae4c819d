"""The one definition of a percentile (and a median) for every benchmark in bench/.

Before this module each benchmark had its own `pct`, with four rank rules
(`int(q * n)`, `round(q * (n - 1))`, `round(p * n + 0.5) - 1`, `ceil(p * n) - 1`),
fractions in some and percents in others, so the p50 of 4 samples was the
2nd sample in one benchmark and the 3rd in another. Every bench script imports from
here; crabd never does (nothing imports bench).

Percentile: **nearest rank**. The p-th percentile of n samples is the
smallest sample such that at least p % of the samples are at or below it:
sorted, the one at 1-based rank ceil(p / 100 * n), and the smallest sample for
p = 0. It is always one of the samples (never an interpolation), so a p99
latency is a latency that happened; with fewer than 100 samples p99 is the
maximum, which is what a tail of a small sample honestly is.

Median: the middle sample, or the mean of the two middle ones for an even
count (`statistics.median`). It is used for "the typical run of N rounds",
where averaging the middle pair of 2 or 4 rounds is the usual reading; it is
not `percentile(xs, 50)`, which for an even count is the lower middle sample.
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable

__all__ = ["percentile", "quantiles", "median"]


def percentile(xs: Iterable[float], p: float, ndigits: int | None = None) -> float | None:
    """The nearest-rank `p`-th percentile (p in 0..100) of `xs`; None for no
    samples. `ndigits`: round the result (None: the sample as it is)."""
    s = sorted(xs)
    if not s:
        return None
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is not in 0..100")
    v = s[max(0, math.ceil(p / 100 * len(s)) - 1)]
    return v if ndigits is None else round(v, ndigits)


def quantiles(xs: Iterable[float], ps: Iterable[float] = (50, 99), ndigits: int | None = 3) -> dict[str, float | None]:
    """{"p50": .., "p99": ..} (keys `p<p>`) of `xs`, nearest rank, rounded to `ndigits`."""
    s = sorted(xs)
    return {f"p{p:g}": percentile(s, p, ndigits) for p in ps}


def median(xs: Iterable[float]) -> float:
    """The median (`statistics.median`: the mean of the two middle samples for an even count)."""
    return statistics.median(list(xs))
