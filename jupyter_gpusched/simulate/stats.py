"""Percentiles as the replay reports them."""

from __future__ import annotations


def percentile(values: list[float] | tuple[float, ...], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks (as numpy)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
