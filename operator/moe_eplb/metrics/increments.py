"""Exact per-bucket increments of counters sampled on a time grid (pure NumPy, no I/O).

Why not PromQL ``increase()``: it extrapolates to the window edges, so its per-bucket values are
neither whole numbers nor exact, and a bucket boundary between two scrapes loses or double-counts
part of the load. Here a counter's value at grid time ``g_i`` is its last scraped value at or before
``g_i`` (what a Prometheus range query of the raw counter returns, or a direct scrape), and bucket
``k`` gets ``value(g_{k+1}) - value(g_k)``: every routed token lands in exactly one bucket.

Rules, per series (one counter of one pod):

* a drop in value is a counter reset (the pod restarted): the bucket gets the new value;
* a series first seen after the start of the grid is a pod that joined: it started at 0, so the
  bucket where it appears gets its first value (``joined_from_zero``), unless told otherwise;
* a series that stops is a pod that left: no more increments;
* a series that stops and comes back *higher* than it left cannot be told apart from a scrape gap
  that hides when the load happened: :class:`GapError`.
"""

from __future__ import annotations

import numpy as np


class GapError(ValueError):
    """A series has a hole in the middle that makes per-bucket attribution ambiguous."""


def on_grid(grid: np.ndarray, ts: np.ndarray, vs: np.ndarray, tol: float = 1e-3) -> np.ndarray:
    """Values at each grid time (NaN where the series has no point there). ``grid`` [G], ``ts``/``vs`` [n]."""
    out = np.full(grid.shape[0], np.nan)
    if ts.size == 0:
        return out
    idx = np.searchsorted(grid, ts)
    idx_c = np.clip(idx, 0, grid.shape[0] - 1)
    ok = np.abs(grid[idx_c] - ts) <= tol
    out[idx_c[ok]] = vs[ok]
    return out


def increments(values: np.ndarray, joined_from_zero: bool = True) -> np.ndarray:
    """Per-bucket increments ``[G-1]`` of one counter given its values ``[G]`` on the grid (NaN = no
    sample). Raises :class:`GapError` for an ambiguous hole (see module docstring)."""
    v = np.asarray(values, np.float64)
    out = np.zeros(max(v.shape[0] - 1, 0))
    idx = np.flatnonzero(~np.isnan(v))
    if idx.size == 0:
        return out
    pv = v[idx]
    if idx[0] > 0 and joined_from_zero:
        out[idx[0] - 1] = pv[0]
    if idx.size > 1:
        d = np.diff(pv)
        reset = d < 0
        gap = (np.diff(idx) > 1) & ~reset
        if gap.any():
            j = int(np.argmax(gap))
            raise GapError(f"no samples between grid points {idx[j]} and {idx[j + 1]}, and the counter did not reset")
        out[idx[1:] - 1] = np.where(reset, pv[1:], d)
    return out
