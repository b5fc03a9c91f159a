"""Rank bands: rows that their 95% intervals cannot order share a band.

Leaderboard rows are made on different machines, and the same code on another CPU moves a method's normalized
return by about one seed-spread: an order between rows whose intervals overlap is noise. Within one like-with-like
group, rows whose intervals overlap, directly or through a chain of overlapping intervals (the connected components
of the interval-overlap graph), share a band, so no overlapping pair is ever ordered. Band 1 holds the highest
interval; bands are numbered down from there. Intervals are closed: two that touch overlap.

The sweep: sort by upper end, highest first; a row starts a new band when its upper end lies below the lowest
lower end of the band so far, else it joins the band (and may lower that floor). Every later row's upper end is
lower still, so it can overlap no earlier band: the bands are exactly the components.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def rank_bands(aggregate: Sequence[float], low: Sequence[float], high: Sequence[float],
               ranked: Sequence[bool] | None = None) -> list[int | None]:
    """Per row, its band (1 = top); None for a row that is not ranked or lacks a finite value or interval."""
    n = len(aggregate)
    if len(low) != n or len(high) != n or (ranked is not None and len(ranked) != n):
        raise ValueError("rank_bands: aggregate, low, high (and ranked) must have one value per row")
    values = [(float(a), float(lo), float(hi)) for a, lo, hi in zip(aggregate, low, high)]
    keep = [i for i, v in enumerate(values)
            if (ranked is None or ranked[i]) and all(math.isfinite(x) for x in v)]
    for i in keep:
        if values[i][1] > values[i][2]:
            raise ValueError(f"rank_bands: row {i} has its interval's low end {values[i][1]} above its high end "
                             f"{values[i][2]}")
    bands: list[int | None] = [None] * n
    band, floor = 0, math.inf
    for i in sorted(keep, key=lambda i: (-values[i][2], -values[i][0], i)):
        _, lo, hi = values[i]
        if hi < floor:  # below every interval of the band so far: a new band
            band, floor = band + 1, lo
        else:
            floor = min(floor, lo)
        bands[i] = band
    return bands
