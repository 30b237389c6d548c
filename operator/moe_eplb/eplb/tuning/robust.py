"""Decisions that hold when a cost cannot be measured: parameter ranges, scenarios, max regret.

The calibration (:mod:`moe_eplb.eplb.tuning.calibrate`) pins some cost-model parameters and leaves others
to a range (their uncertainty, or a documented prior range where the telemetry cannot tell). The
tuner then scores every finalist under every **scenario** -- each corner of the box of ranges (a
parameter at its low or high end) plus the point estimate -- and picks the candidate whose **largest
regret** (how far below the best candidate of the same scenario it falls, a change charged the
restart) is smallest (minimax regret). A change is recommended when the pick beats the running
configuration by the restart threshold at the point estimate; no scenario holds a veto. A range
narrowed by an experiment (:mod:`moe_eplb.eplb.tuning.learn`) has ``source`` :data:`EXPERIMENT`.

Re-scoring needs no new replay: a candidate's predicted throughput per time segment is

    seg = ideal / (ideal (1 - f) + f * ideal_x_imbalance + ideal * overlap_loss(cost) + overhead(cost))
          * memory_factor(cost, R)

(the overlap loss only for an EPLB-on replay: :attr:`~moe_eplb.eplb.replay.costmodel.CostModel.overlap_loss`)

so each replay is reduced once to per-segment sums (:func:`terms_of`) and every scenario is a few
array operations (:func:`scenario_segments`). Pure: numbers in, numbers out.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from moe_eplb.eplb.replay.costmodel import CostModel

__all__ = ["EXPERIMENT", "TIGHTEN_BY_TRIAL",
           "Range", "Terms", "terms_of", "scenario_segments", "Scenario", "scenarios", "TIGHTEN", "Robustness",
           "ScenarioScores"]

#: What telemetry tightens each parameter's range (shown in the report).
TIGHTEN = {
    "moe_time_share": "step_seconds and rank_load over a stretch whose served imbalance varies "
                      "(a restart, a change of the traffic mix, a rarely-rearranging config)",
    "sync_stall_s": "rearrangement durations (moe_eplb_rearrangement_duration_seconds) in sync mode",
    "async_s_per_moved_byte": "step_seconds around more rearrangements, with the expert size (--bytes-per-expert)",
    "kv_throughput_elasticity": "kv_cache_usage (vllm:kv_cache_usage_perc) with preemptions and waiting requests",
    "kv_batch_elasticity": "throughput while the KV cache is full with preemptions, at two cache sizes "
                           "(e.g. before and after a redundancy change)",
    "kv_full_usage": "kv_cache_usage together with preemptions (the usage at which vLLM starts to preempt)",
    "prefix_working_set": "prefix_cache_hit_rate over buckets whose free KV cache differs (varying usage), "
                          "or at a second cache size",
    "prefix_hit_max": "vLLM's prefix-cache counters (vllm:prefix_cache_queries / _hits) and cache_config_info",
    "prefix_prefill_share": "step_seconds against prefix_cache_queries (the time a prompt token costs)",
    "overlap_hidden": "EPLB-on against EPLB-off step times at comparable batches: two periods (before and after "
                      "spec.eplb.enabled changed) or two arms",
}

#: ``Range.source`` of a range narrowed by an experiment's arms (:func:`moe_eplb.eplb.tuning.learn.learn`).
EXPERIMENT = "experiment"

#: What a trial against the running setting measures of each parameter (the exploration's reason).
TIGHTEN_BY_TRIAL = {
    "moe_time_share": "the MoE share from the two arms' step times against their served balancedness",
    "prefix_working_set": "the prefix cache's working set from the arms' hit rates at two KV cache sizes",
    "prefix_hit_max": "the prefix cache's reach from the arms' hit rates at two KV cache sizes",
    "overlap_hidden": "the shared-expert overlap EPLB costs, from an EPLB-off arm's step time against an EPLB-on one",
}


@dataclass(frozen=True)
class Range:
    """A cost-model parameter the decision is robust over: its point estimate ``value`` and the range
    ``low``-``high`` (``source``: ``measured``, its uncertainty; ``prior``, a documented range;
    ``experiment``, a prior narrowed by an experiment)."""

    name: str
    value: float
    low: float
    high: float
    source: str
    note: str = ""

    @property
    def width(self) -> float:
        return self.high - self.low

    def to_dict(self) -> dict:
        return {"value": self.value, "low": self.low, "high": self.high, "source": self.source,
                "note": self.note, "tighten": TIGHTEN.get(self.name, "")}


@dataclass(frozen=True)
class Scenario:
    """One point of the parameter box: the values that differ from the point estimate, and the
    cost model there."""

    values: dict
    cost: CostModel


def scenarios(cost: CostModel, ranges: dict[str, Range], cost_at: Callable[[CostModel, dict], CostModel] | None = None,
              pinned: str | None = None) -> list[Scenario]:
    """The point estimate first, then every corner of the ranges (``pinned`` held at its value).
    ``cost_at(cost, values)`` builds a scenario's cost model (default: the fields replaced), so a
    calibration can couple parameters (the prefix hit max follows the working set)."""
    build = cost_at or (lambda c, v: replace(c, **v))
    point = {n: r.value for n, r in ranges.items() if getattr(cost, n) != r.value}
    names = [n for n, r in ranges.items() if r.width > 0 and n != pinned]
    out = [Scenario(point, build(cost, point) if point else cost)]
    for corner in itertools.product(*[(ranges[n].low, ranges[n].high) for n in names]):
        values = {**point, **dict(zip(names, corner))}
        out.append(Scenario(values, build(cost, values)))
    return out


@dataclass(frozen=True)
class Terms:
    """A replay reduced to what the cost parameters act on, per time segment: ``ideal`` seconds,
    ``ideal_x`` (ideal x served imbalance), rearrangement ``count`` and ``moved`` replicas; and the
    redundant bytes per GPU."""

    ideal: np.ndarray
    ideal_x: np.ndarray
    count: np.ndarray
    moved: np.ndarray
    redundant_bytes: float
    eplb: bool = True  # an EPLB-on replay (pays the shared-expert overlap loss); False: vLLM without EPLB


def terms_of(result, bucket_steps: np.ndarray, edges: np.ndarray) -> Terms:
    """:class:`Terms` of a :class:`~moe_eplb.eplb.replay.simulator.SimResult` on the trace with
    ``bucket_steps`` cut at bucket ``edges``."""
    T = len(bucket_steps)
    ideal = np.asarray(result.bucket_ideal_s, np.float64)
    bal = np.asarray(result.balancedness_over_time, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(np.isfinite(bal) & (bal > 0), 1.0 / bal, 1.0)
    S = np.concatenate([[0], np.cumsum(np.asarray(bucket_steps, np.int64))])
    count, moved = np.zeros(T), np.zeros(T)
    ks = np.asarray(result.rearrangement_steps, np.int64)
    if ks.size:
        b = np.clip(np.searchsorted(S, ks, side="right") - 1, 0, T - 1)
        np.add.at(count, b, 1.0)
        np.add.at(moved, b, np.asarray(result.moved_per_rearrangement, np.float64))
    starts = np.asarray(edges[:-1], np.intp)
    seg = lambda a: np.add.reduceat(a, starts)  # noqa: E731
    return Terms(seg(ideal), seg(ideal * ratio), seg(count), seg(moved), float(result.throughput.redundant_bytes_per_gpu),
                 eplb=result.mode == "eplb")


def scenario_segments(terms: Terms, cost: CostModel, ep_size: int, num_layers: int, num_experts: int,
                      memo: dict | None = None) -> np.ndarray:
    """Per-segment relative throughput of the replay under ``cost`` (``memo`` caches the memory
    factor by (cost, redundant bytes))."""
    f = cost.moe_time_share
    over = cost.overhead_seconds(terms.count, terms.moved, ep_size, num_layers, num_experts)
    time = terms.ideal * (1.0 - f) + f * terms.ideal_x + over
    if terms.eplb and cost.overlap_dropped:
        time = time + terms.ideal * cost.overlap_loss
    key = (id(cost), terms.redundant_bytes)
    if memo is not None and key in memo:
        kv = memo[key]
    else:
        kv = cost.kv_factor(terms.redundant_bytes)
        if memo is not None:
            memo[key] = kv
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(time > 0, terms.ideal / time, 1.0) * kv


def cvar(values: np.ndarray) -> float:
    """Mean of the worst half (rounded up) of the values (the tuner's drift-robust score)."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    k = max(1, math.ceil(len(v) / 2))
    return float(v[:k].mean())


@dataclass(frozen=True)
class Robustness:
    """What a robust search holds over: the ranges (by cost-model field) and how a scenario's cost
    model is built from the values (:meth:`moe_eplb.eplb.tuning.calibrate.Calibration.cost_at`)."""

    ranges: dict[str, Range]
    cost_at: Callable[[CostModel, dict], CostModel] | None = None
    finalists: int = 6  # candidates added to the finalists by their max regret on the screen

    def scenarios(self, cost: CostModel, pinned: str | None = None) -> list[Scenario]:
        return scenarios(cost, self.ranges, self.cost_at, pinned)


class ScenarioScores:
    """Scores (CVaR over segments) of candidates under a list of scenarios: ``score(key, result)``
    caches each candidate's row; ``matrix(keys)`` is ``[candidates, scenarios]``."""

    def __init__(self, scen: list[Scenario], bucket_steps: np.ndarray, edges: np.ndarray, ep_size: int,
                 num_layers: int, num_experts: int) -> None:
        self.scen, self.steps, self.edges = scen, bucket_steps, edges
        self.shape = (ep_size, num_layers, num_experts)
        self.rows: dict = {}
        self._memo: dict = {}

    def score(self, key, result) -> np.ndarray:
        if key not in self.rows:
            t = terms_of(result, self.steps, self.edges)
            self.rows[key] = np.array([cvar(scenario_segments(t, s.cost, *self.shape, memo=self._memo))
                                       for s in self.scen])
        return self.rows[key]

    def matrix(self, keys) -> np.ndarray:
        return np.stack([self.rows[k] for k in keys])


def max_regret(matrix: np.ndarray) -> np.ndarray:
    """``[candidates]`` largest relative shortfall against the best candidate of each scenario."""
    best = matrix.max(axis=0, keepdims=True)
    return (best / np.maximum(matrix, 1e-12) - 1.0).max(axis=1)
