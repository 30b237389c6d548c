"""Exact per-bucket increments of counters from their raw samples (pure NumPy, no I/O).

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
* two consecutive samples further apart than ``max_gap`` with a rising value and no restart: the
  load happened somewhere in between and cannot be put in a bucket: :class:`GapError`.
"""

from __future__ import annotations

import numpy as np


class GapError(ValueError):
    """A series has a hole that makes per-bucket attribution ambiguous."""


def bucket_of(grid: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """Bucket index of each sample time (``grid[k] < t <= grid[k+1]`` -> k; -1 or T outside)."""
    return np.searchsorted(grid, ts, side="left") - 1


def sample_increments(
    grid: np.ndarray,
    ts: np.ndarray,
    vs: np.ndarray,
    start_times: np.ndarray | None = None,
    joined_from_zero: bool = True,
    max_gap: float | None = None,
) -> np.ndarray:
    """Per-bucket increments ``[T]`` of one counter from its raw samples ``ts``/``vs`` ``[n]``
    (sorted by time). ``start_times`` ``[n]``: the pod's exporter start time at each sample (NaN
    where unknown)."""
    return sample_increments_matrix(grid, ts, np.asarray(vs, np.float64)[None, :], start_times,
                                    joined_from_zero, max_gap)[0]


def sample_increments_matrix(
    grid: np.ndarray,
    ts: np.ndarray,
    values: np.ndarray,
    start_times: np.ndarray | None = None,
    joined_from_zero: bool = True,
    max_gap: float | None = None,
) -> np.ndarray:
    """:func:`sample_increments` for S counters scraped together (one pod: same sample times).

    ``ts`` [n] sorted, ``values`` [S, n], ``start_times`` [n] -> increments [S, T]."""
    grid = np.asarray(grid, np.float64)
    T = grid.shape[0] - 1
    V = np.asarray(values, np.float64)
    S = V.shape[0]
    out = np.zeros((S, T))
    ts = np.asarray(ts, np.float64)
    if ts.size == 0 or S == 0:
        return out
    st = np.full(ts.shape, np.nan) if start_times is None else np.asarray(start_times, np.float64)
    b = bucket_of(grid, ts)
    if 0 <= b[0] < T:  # first sample: a pod that joined inside the grid started from zero
        joined = st[0] > grid[0] if not np.isnan(st[0]) else joined_from_zero
        if joined:
            out[:, b[0]] += V[:, 0]
    if ts.size > 1:
        d = np.diff(V, axis=1)  # [S, n-1]
        pod_restart = np.abs(np.diff(st)) > 1e-6  # [n-1]; NaN comparisons are False
        restarted = (d < 0) | pod_restart[None, :]
        inc = np.where(restarted, V[:, 1:], d)
        inside = (b[1:] >= 0) & (b[1:] < T)
        if max_gap is not None:
            gap = ((np.diff(ts) > max_gap) & inside)[None, :] & ~restarted & (d > 0)
            if gap.any():
                i, j = np.argwhere(gap)[0]
                raise GapError(f"no samples between t={ts[j]:.3f} and t={ts[j + 1]:.3f} while the counter rose "
                               f"by {d[i, j]:g}; the load cannot be placed in a bucket")
        cols = np.flatnonzero(inside)
        if cols.size:
            # sum the increments of samples that fall in the same bucket
            np.add.at(out.T, b[1:][cols], inc[:, cols].T)
    return out
