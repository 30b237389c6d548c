"""Per-bucket increments of counters from their raw samples (pure NumPy, no I/O).

Why not PromQL ``increase()``: it extrapolates to the window edges, so its per-bucket values are
neither whole numbers nor exact; and why not sampling the counter at bucket edges: the last samples
of a pod that dies between two edges would be lost. Here each increment between two consecutive
raw samples of a series is put in the bucket that contains the *later* sample: every routed token
lands in exactly one bucket (the first scrape that saw it), none is lost or counted twice.

Buckets: ``grid`` [T+1] edges; bucket k holds samples with ``grid[k] < t <= grid[k+1]``. Samples at
or before ``grid[0]`` are baselines only.

Rules, per series (one counter of one pod):

* the exporter's start time (``moe_eplb_exporter_start_time_seconds``, scraped with the counter)
  changed, or the value dropped: the pod restarted, the increment is the new value;
* the first sample lies inside the grid and the pod started after ``grid[0]`` (or its start time is
  unknown and ``joined_from_zero``): the pod joined, the increment is the first value;
* a series that stops (pod left) just adds nothing more;
* **scrape gaps**: two consecutive samples ``t1 < t2`` further apart than ``max_gap`` with no
  restart between them (one or more scrapes were missed). The load happened somewhere in
  ``(t1, t2]`` and the samples cannot say where, so it is spread over the buckets that interval
  overlaps, in proportion to the overlap: bucket k gets
  ``increment * |(t1, t2] ∩ (grid[k], grid[k+1]]| / (t2 - t1)``. This assumes the counter rose at a
  uniform rate during the gap -- the same assumption the simulator makes about the steps inside one
  bucket. The part of the interval outside the grid is outside the window and is not counted. The
  spread share is returned separately (:attr:`Increments.interpolated`) so that the caller can tell
  exact load from estimated load and refuse a window that is mostly estimated. The rule depends only
  on the two sample times, so all counters of one pod scraped together (engine steps and expert
  tokens) are spread the same way.

Where no gap exceeds ``max_gap`` (or ``max_gap`` is None) the result is exact: whole numbers in,
whole numbers out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Increments:
    """Per-bucket increments of S counters scraped together.

    Attributes:
        values: float64 ``[S, T]``, the increments per bucket, spread gap load included.
        interpolated: float64 ``[S, T]``, the part of ``values`` that was spread over a scrape gap
            (zero where the data is complete).
        gaps: ``(t1, t2)`` sample times (unix s) of each gap longer than ``max_gap`` that overlaps
            the grid, in time order (whether or not the counters rose during it).
    """

    values: np.ndarray
    interpolated: np.ndarray
    gaps: tuple[tuple[float, float], ...] = ()


def bucket_of(grid: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """Bucket index of each sample time (``grid[k] < t <= grid[k+1]`` -> k; -1 or T outside)."""
    return np.searchsorted(grid, ts, side="left") - 1


def values_at_edges(grid: np.ndarray, ts: np.ndarray, vs: np.ndarray) -> np.ndarray:
    """``[T+1]``: a range query's points (``ts``, ``vs``, evaluated at the grid edges) placed on
    ``grid``; NaN at an edge without a point."""
    grid = np.asarray(grid, np.float64)
    out = np.full(grid.shape[0], np.nan)
    if ts.size:
        idx = np.clip(np.searchsorted(grid, ts - 1e-3), 0, grid.shape[0] - 1)
        hit = np.abs(grid[idx] - ts) < 1e-3
        out[idx[hit]] = vs[hit]
    return out


def overlap_weights(grid: np.ndarray, t1: np.ndarray, t2: np.ndarray) -> np.ndarray:
    """``[G, T]``: the share of each interval ``(t1[g], t2[g]]`` (``t1 < t2``, unix s) that lies in
    bucket k of ``grid`` [T+1]. A row sums to the share of its interval inside the grid (<= 1)."""
    grid = np.asarray(grid, np.float64)
    t1 = np.asarray(t1, np.float64)[:, None]
    t2 = np.asarray(t2, np.float64)[:, None]
    lo = np.maximum(grid[None, :-1], t1)
    hi = np.minimum(grid[None, 1:], t2)
    return np.clip(hi - lo, 0.0, None) / (t2 - t1)


def counter_increments(
    grid: np.ndarray,
    ts: np.ndarray,
    values: np.ndarray,
    start_times: np.ndarray | None = None,
    joined_from_zero: bool = True,
    max_gap: float | None = None,
) -> Increments:
    """Increments of S counters scraped together, with the share spread over scrape gaps.

    ``grid`` [T+1] bucket edges (unix s), ``ts`` [n] sample times sorted, ``values`` [S, n] counter
    values, ``start_times`` [n] the pod's exporter start time per sample (NaN where unknown),
    ``max_gap`` seconds (None: never spread, every increment goes to its later sample's bucket)."""
    grid = np.asarray(grid, np.float64)
    T = grid.shape[0] - 1
    V = np.asarray(values, np.float64)
    S = V.shape[0]
    out = np.zeros((S, T))
    spread = np.zeros((S, T))
    ts = np.asarray(ts, np.float64)
    if ts.size == 0 or S == 0:
        return Increments(out, spread)
    st = np.full(ts.shape, np.nan) if start_times is None else np.asarray(start_times, np.float64)
    b = bucket_of(grid, ts)
    if 0 <= b[0] < T:  # first sample: a pod that joined inside the grid started from zero
        joined = st[0] > grid[0] if not np.isnan(st[0]) else joined_from_zero
        if joined:
            out[:, b[0]] += V[:, 0]
    gaps: tuple[tuple[float, float], ...] = ()
    if ts.size > 1:
        d = np.diff(V, axis=1)  # [S, n-1]
        pod_restart = np.abs(np.diff(st)) > 1e-6  # [n-1]; NaN comparisons are False
        restarted = (d < 0) | pod_restart[None, :]
        inc = np.where(restarted, V[:, 1:], d)
        inside = (b[1:] >= 0) & (b[1:] < T)
        gap_cols = np.zeros(ts.size - 1, bool)
        if max_gap is not None:
            gap_cols = (np.diff(ts) > max_gap) & ~pod_restart
        if gap_cols.any():
            cols = np.flatnonzero(gap_cols)
            w = overlap_weights(grid, ts[cols], ts[cols + 1])  # [G, T]
            touching = w.sum(axis=1) > 0
            gaps = tuple((float(ts[j]), float(ts[j + 1])) for j in cols[touching])
            # a counter that restarted inside the gap keeps the restart rule (its new value, in
            # the later sample's bucket); the others are spread by time overlap
            amount = np.where(restarted[:, cols], 0.0, inc[:, cols])  # [S, G]
            spread = amount @ w
            out += spread
            plain = np.ones_like(restarted)
            plain[:, cols] = restarted[:, cols]
        else:
            plain = None
        keep = np.flatnonzero(inside)
        if keep.size:
            # sum the increments of samples that fall in the same bucket
            contrib = inc[:, keep] if plain is None else np.where(plain[:, keep], inc[:, keep], 0.0)
            np.add.at(out.T, b[1:][keep], contrib.T)
    return Increments(out, spread, gaps)
