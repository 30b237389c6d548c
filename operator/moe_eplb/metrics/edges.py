"""The expert load of *regular* pods read as sums at the bucket edges (pure, no I/O).

Reading every raw sample of every expert counter is exact but heavy: a DeepSeek-V3 replica group
over 4 pods has 59 392 expert-token series, 7.2 million raw samples in the operator's 30 min
window at the PodMonitor's 15 s scrapes. Most of it is not needed. For a counter with no reset and
no scrape gap, the raw rule (each increment in the bucket of its later sample,
:mod:`moe_eplb.metrics.increments`) telescopes: the increments of bucket k add up to

    value(last sample <= grid[k+1]) - value(last sample <= grid[k])

-- and "the last sample at or before t" is exactly what Prometheus evaluates an instant vector to
(within its 5 min lookback). So for pods whose counters are *regular* over the window, one range
query ``sum by (model_name, layer, expert) (moe_eplb_expert_tokens_total{<regular pods>})`` with
``step = bucket`` from ``grid[0]`` to ``grid[-1]`` gives the same per-bucket load, summed over those
pods on the server: L x E series of T + 1 points instead of pods x L x E series of every scrape
(about 15x fewer numbers for that group). Pods that are not regular (restarted, joined or left in
the window, scrape gaps) are read raw, through the exact rules, and added.

A pod is **regular** (:func:`regular_pods`) when its step counter, read raw anyway, shows: a
sample at or before ``grid[0]`` (the baseline) and one in the last ``max_gap`` before ``grid[-1]``;
no two samples further apart than the gap rule's ``max_gap`` (nothing to spread) nor than 80 % of the
lookback; a value that never drops and an exporter start time that never changes (no restart).
All counters of a pod are scraped together, so its expert counters share this.

Prometheus answers an instant vector with nothing for a series whose newest sample is a staleness
marker, and it writes one for every series of a target whose scrape failed: one failed scrape of
one pod just before an edge would drop that pod from the sum there. So the range queries ask for
``last_over_time(<series>[reach])`` -- the last real sample within ``reach`` of each edge (range
selectors skip staleness markers) -- where ``reach`` (:func:`edge_reach`) is, over every edge and
regular pod, how far back that pod's last sample at or before the edge lies: exactly the sample the
raw rule takes, whatever a failed scrape wrote after it.

Nothing is taken on trust: :func:`check_edges` compares the same range query of the *step* counter
of those pods with their raw step increments (exact, whole numbers) and checks that every pod and
layer has a constant number of expert series at every edge (no series appeared, vanished or went
stale). Any disagreement -- a pod that went stale, a sample ingested between two queries, a
Prometheus with a shorter lookback -- and the reader reads everything raw instead (reason in
``trace.meta["read"]``). The result is the same trace either way; only the work differs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from moe_eplb.contracts import metric_names
from moe_eplb.metrics.grid import LOOKBACK_SECONDS, edge_matrix, max_gap_for, starts_at
from moe_eplb.metrics.increments import counter_increments, values_at_edges
from moe_eplb.metrics.series import Series

#: The label the range queries select pods by. (Regular pods are scraped at most 80 % of
#: Prometheus' lookback, ``LOOKBACK_SECONDS``, apart; a Prometheus with a shorter lookback fails
#: :func:`check_edges` and is read raw.)
POD = "pod"


@dataclass(frozen=True)
class EdgeLoad:
    """The regular pods' expert load, as the range queries answered it.

    Attributes:
        sums: one series per ``(model_name, layer, expert)``: the sum over the regular pods of the
            expert counter at each of the T + 1 grid edges.
        counts: one series per (pod, layer, model): how many expert series the pod has at each edge
            (its labels are a pod's labels plus ``layer``, as the raw series' pod key reads them).
        pods: the regular pods' names.
        reach: the range of the queries' ``last_over_time`` (:func:`edge_reach`), for the other
            families read the same way.
    """

    sums: list[Series]
    counts: list[Series]
    pods: frozenset[str]
    reach: float = LOOKBACK_SECONDS  # the queries' last_over_time range (:func:`edge_reach`)


def regular_pods(engine_steps: Sequence[Series], start_times: Iterable[Series], grid: np.ndarray,
                 lookback: float = LOOKBACK_SECONDS) -> frozenset[str]:
    """Names (``pod`` label) of the pods whose counters are regular over ``grid`` (see the module
    docstring; :func:`irregular` says why the others are not)."""
    return frozenset(name for name, why in irregular(engine_steps, start_times, grid, lookback).items() if why is None)


def irregular(engine_steps: Sequence[Series], start_times: Iterable[Series], grid: np.ndarray,
              lookback: float = LOOKBACK_SECONDS) -> dict[str, str | None]:
    """``{pod name: why its counters are not regular over grid, or None}`` from the pods' step
    counters' raw samples with baselines and their exporter start times. A pod name carried by
    more than one series identity (two scrape jobs, two models) is regular only if each is; a
    series without a ``pod`` label makes every pod irregular (the range queries select pods by
    that label)."""
    grid = np.asarray(grid, np.float64)
    bucket = float(grid[1] - grid[0])
    starts = {s.pod: s for s in start_times}
    verdict: dict[str, str | None] = {}
    for s in engine_steps:
        name = s.labels.get(POD)
        if not name:
            return {str(dict(s.labels)): f"a {metric_names.ENGINE_STEPS} series has no pod label"}
        verdict[name] = verdict.get(name) or _why_irregular(s, starts.get(s.pod), grid, bucket, lookback)
    return verdict


def _why_irregular(s: Series, start: Series | None, grid: np.ndarray, bucket: float, lookback: float) -> str | None:
    ts, vs = s.ts, s.vs
    if start is None or not start.vs.size:
        return "no exporter start time"
    if ts.size < 2 or ts[0] > grid[0]:
        return "no sample at or before the window's start (it joined, or its series are new)"
    max_gap = max_gap_for(ts, bucket)
    if ts[-1] <= grid[-1] - max_gap:
        return f"no sample in the last {max_gap:g}s of the window (it left)"
    widest = float(np.diff(ts).max())
    if widest > min(max_gap, 0.8 * lookback):
        return f"missed scrapes ({widest:g}s between two samples)"
    if np.any(np.diff(vs) < 0) or np.ptp(start.vs) > 1e-6:
        return "restarted"
    return None


def edge_reach(engine_steps: Sequence[Series], pods: Iterable[str], grid: np.ndarray,
               lookback: float = LOOKBACK_SECONDS) -> float:
    """Seconds back from a bucket edge that reach every regular pod's last sample at or before it
    (its raw step samples with the baseline; all its counters are scraped together), over all edges
    of ``grid``: the range of the edge queries' ``last_over_time`` (see the module docstring). At
    most ``lookback``, Prometheus' own reach for an instant vector; at least a millisecond."""
    grid = np.asarray(grid, np.float64)
    wanted = set(pods)
    lag = 0.0
    for s in engine_steps:
        if s.labels.get(POD) not in wanted or not s.ts.size:
            continue
        idx = np.searchsorted(s.ts, grid, side="right") - 1
        if np.any(idx < 0):  # an edge before the pod's first sample: the instant vector's own reach
            return lookback
        lag = max(lag, float((grid - s.ts[idx]).max()))
    return float(min(lookback, max(lag, 0.0) + 1e-3))


def edge_values(s: Series, grid: np.ndarray) -> np.ndarray:
    """A range-query series' values at the T + 1 grid edges (NaN where it has no point)."""
    return values_at_edges(grid, s.ts, s.vs)


def check_edges(pods: frozenset[str], engine_steps: Sequence[Series], start_times: Iterable[Series],
                step_sums: Sequence[Series], counts: Sequence[Series], grid: np.ndarray) -> str | None:
    """Why the range queries of the regular ``pods`` cannot stand for their raw samples, or None
    when they can: :func:`check_steps` and :func:`check_counts` (of the expert family)."""
    return check_steps(pods, engine_steps, start_times, step_sums, grid) or check_counts(pods, counts, grid)


def check_steps(pods: frozenset[str], engine_steps: Sequence[Series], start_times: Iterable[Series],
                step_sums: Sequence[Series], grid: np.ndarray) -> str | None:
    """Why the summed step counter of the regular ``pods`` at the edges does not give each bucket
    exactly their raw step increments (a pod stale or missing at an edge, another pod answering),
    or None."""
    grid = np.asarray(grid, np.float64)
    bucket = float(grid[1] - grid[0])
    starts = {s.pod: s for s in start_times}
    raw = np.zeros(grid.shape[0] - 1)
    for s in engine_steps:
        if s.labels.get(POD) in pods:
            st = starts[s.pod]
            inc = counter_increments(grid, s.ts, s.vs[None, :], starts_at(st, s.ts), max_gap=max_gap_for(s.ts, bucket))
            raw += inc.values[0]
    if len(step_sums) != 1:
        return f"the summed step counter came back as {len(step_sums)} series"
    summed = edge_values(step_sums[0], grid)
    if np.isnan(summed).any():
        return f"the summed step counter has no value at {int(np.isnan(summed).sum())} bucket edge(s)"
    off = ~np.isclose(np.diff(summed), raw, rtol=0, atol=1e-6 * max(1.0, float(np.abs(raw).max())))
    if off.any():
        k = int(np.flatnonzero(off)[0])
        return (f"bucket {k}: the step counter summed at the edges rose by {np.diff(summed)[k]:g}, its raw samples "
                f"by {raw[k]:g}")
    return None


def check_counts(pods: frozenset[str], counts: Sequence[Series], grid: np.ndarray, family: str = "expert") -> str | None:
    """Why the per-(pod, layer) series counts of a family (``count without (<per-series label>)``
    at the edges) show that its sums cannot stand for the raw increments, or None: every count
    must be the same at every edge (no series created, gone or stale within the window), for
    exactly the regular ``pods``."""
    seen = set()
    for c in counts:
        seen.add(c.labels.get(POD))
        v = edge_values(c, grid)
        if np.isnan(v).any() or np.ptp(v) > 0:
            return (f"pod {c.labels.get(POD)} layer {c.labels.get(metric_names.LABEL_LAYER)}: the number of {family} "
                    "series changed within the window")
    if seen != set(pods):
        return f"the {family} series came from pods {sorted(map(str, seen))[:5]}, expected {sorted(pods)[:5]}"
    return None


def check_sums(sums: Sequence[Series], grid: np.ndarray) -> str | None:
    """Why the summed expert counters cannot stand for the raw increments (a missing edge, a drop),
    or None."""
    m = edge_matrix(sums, grid)
    missing = np.isnan(m).sum(axis=1)
    if missing.any():
        i = int(np.flatnonzero(missing)[0])
        return f"series {dict(sums[i].labels)} has no value at {int(missing[i])} bucket edge(s)"
    drops = np.flatnonzero((np.diff(m, axis=1) < 0).any(axis=1))
    if drops.size:
        return f"series {dict(sums[int(drops[0])].labels)} drops between two bucket edges"
    return None


def points_per_layer(counts: Sequence[Series], edges: int) -> dict[str, float]:
    """Points the summed query returns per layer (``{layer: distinct experts x edges}``), from the
    per-pod counts: the most experts any pod has in a (model, layer), summed over models."""
    most: dict[tuple, float] = {}
    for c in counts:
        key = (c.labels.get(metric_names.LABEL_MODEL), c.labels.get(metric_names.LABEL_LAYER, ""))
        most[key] = max(most.get(key, 0.0), float(np.nanmax(c.vs)) if c.vs.size else 0.0)
    out: dict[str, float] = {}
    for (_, layer), n in most.items():
        out[layer] = out.get(layer, 0.0) + n * edges
    return out
