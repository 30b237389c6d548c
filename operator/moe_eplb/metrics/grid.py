"""The bucket grid of a load read and the helpers on it (pure, no I/O).

A read's buckets are ``grid`` [T+1] edges (unix s, multiples of the bucket length); bucket k holds
samples with ``grid[k] < t <= grid[k+1]`` (:mod:`moe_eplb.metrics.increments`). The raw read
(:mod:`moe_eplb.metrics.assemble`), the edge path (:mod:`moe_eplb.metrics.edges`) and the telemetry
(:mod:`moe_eplb.metrics.telemetry_keys`) all place their series on it with these helpers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from moe_eplb.metrics.errors import INSUFFICIENT_DATA, LoadReadError
from moe_eplb.metrics.increments import values_at_edges
from moe_eplb.metrics.series import Series

#: Prometheus' default ``--query.lookback-delta``: an instant vector (and a gauge here) is the newest
#: sample at most this old.
LOOKBACK_SECONDS = 300.0


def grid_for(now: float, window_seconds: float, bucket_seconds: float) -> np.ndarray:
    """``T + 1`` grid times (unix s), multiples of ``bucket_seconds``, the last one <= ``now``."""
    if not bucket_seconds > 0:
        raise LoadReadError(INSUFFICIENT_DATA, f"bucket_seconds must be > 0, got {bucket_seconds}")
    buckets = int(window_seconds // bucket_seconds)
    if buckets < 1:
        raise LoadReadError(INSUFFICIENT_DATA, f"window {window_seconds}s is shorter than one bucket "
                            f"({bucket_seconds}s)")
    end = math.floor(now / bucket_seconds) * bucket_seconds
    return end - bucket_seconds * np.arange(buckets, -1, -1, dtype=np.float64)


def max_gap_for(ts: np.ndarray, bucket_seconds: float) -> float:
    """Seconds between two samples of a series beyond which scrapes were missed: the larger of one
    bucket and three times the series' usual (median) scrape interval. ``ts`` [n] sorted."""
    spacing = float(np.median(np.diff(ts))) if ts.size > 2 else 0.0
    return max(bucket_seconds, 3 * spacing)


def starts_at(start: Series, ts: np.ndarray) -> np.ndarray:
    """An exporter start-time series' value at each sample time ``ts`` of the same pod (scraped
    together, so at the same timestamps); NaN where it has none."""
    out = np.full(ts.shape, np.nan)
    if start.ts.size:
        idx = np.clip(np.searchsorted(start.ts, ts), 0, start.ts.size - 1)
        hit = np.abs(start.ts[idx] - ts) < 1e-3
        out[hit] = start.vs[idx[hit]]
    return out


def edge_matrix(series: Sequence[Series], grid: np.ndarray) -> np.ndarray:
    """``[N, T+1]``: range-query series (evaluated at the grid edges) placed on ``grid``, NaN at an
    edge without a point. In one step when every series has a point at every edge (the usual
    answer), else series by series."""
    grid = np.asarray(grid, np.float64)
    if not series:
        return np.zeros((0, grid.shape[0]))
    if all(s.ts.size == grid.shape[0] for s in series):
        ts = np.stack([s.ts for s in series])
        if np.all(np.abs(ts - grid[None, :]) < 1e-3):
            return np.stack([s.vs for s in series])
    return np.stack([values_at_edges(grid, s.ts, s.vs) for s in series])
