"""Choose EPLB's window size, step interval and redundant experts for a recorded workload.

The tuner replays the trace (:mod:`moe_eplb.eplb.replay.simulator`) for every candidate of a grid
``window x interval x redundancy`` and ranks candidates by a **drift-robust score**. What it searches
and decides by (``segments``, ``tie_tolerance``, ``max_redundancy_levels``, ``prior_margin``,
``min_gain``, ``screen_layers``, ``finalists``, ``workers``, below) are the fields of one
:class:`~moe_eplb.eplb.tuning.options.TuneOptions`:

- the history is cut into ``segments`` contiguous pieces (default up to 6, equal in buckets);
- each candidate's predicted throughput is computed on each piece;
- the score is the mean of the worst half of the pieces (CVaR-50 over time). A configuration that
  is great on average but falls over when the domain mix shifts scores low; ties (within
  ``tie_tolerance``) go to the higher full-history mean.

The grid: the window and interval ladders (``DEFAULT_WINDOWS``, ``DEFAULT_INTERVALS``) cut to the
bounds (the bounds' ends are added), and every redundancy that vLLM accepts
(``(E + R) % ep == 0``, R <= 1023) within the bounds and the memory budget, thinned evenly to at
most ``max_redundancy_levels`` values (smallest and largest kept). vLLM's defaults
(1000/3000/0), the seed's hand-picked 3000/1000/8 and ``current`` are always evaluated when they
are valid and within bounds and budget.

Without parameter ranges (the point estimate alone), known configurations are the prior: a
searched configuration is picked only when its score beats
the best of vLLM's defaults, the seed's 3000/1000/8 and ``current`` (when valid and in bounds) by
``prior_margin`` consistently: the lower bound (mean - 1 standard error) of its paired
per-segment gain over that configuration must exceed ``prior_margin``, so one lucky stretch of
history cannot buy a change. Leaving ``current`` costs a restart, so the tuner recommends a change
only when the pick's score beats current's by more than ``min_gain + restart_s / horizon_s`` (see
:class:`~moe_eplb.eplb.replay.costmodel.CostModel`); otherwise it recommends keeping ``current``.

With parameter ranges (``robust``, from the calibration) the decision is minimax regret: the pick is
the candidate with the smallest largest regret over the ranges' scenarios, a change charged the
restart, and it replaces ``current`` when it beats it by the threshold at the point estimate. No
rule asks a searched configuration to beat a known one in every scenario. When the choice hinges on
a parameter whose range is a prior, ``TuneResult.explore`` makes the case for a trial on one replica
(:func:`_explore` when ``current`` is kept, :func:`_explore_change` for a change; :func:`trial_cost`).

Screening: all candidates are first replayed on every k-th MoE layer (about ``screen_layers``),
then the ``finalists`` best plus the known configurations on all layers; the finalists' exact
scores decide. See docs/tuner.md.

Speed: every rearrangement of every candidate needs a policy call. They are collected first,
deduplicated by ``(window start, window end, R)`` (e.g. interval 5000's rearrangements are a subset
of interval 1000's), run in batches (the policy is vectorised over windows x layers), optionally in
worker processes (``workers > 1`` uses spawned processes: scripts need the usual
``if __name__ == "__main__":`` guard), and each candidate's replay then reads the cache.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from moe_eplb.api.knobs import SEED_CONFIG, VLLM_DEFAULTS, Bounds, Knobs
from moe_eplb.contracts import vllm_facts
from moe_eplb.eplb.replay.costmodel import CostModel
from moe_eplb.eplb.replay.simulator import Replay, SimError, SimResult, Topology
from moe_eplb.eplb.tuning.exploration import Exploration
from moe_eplb.eplb.tuning.options import (
    DEFAULT_INTERVALS,
    DEFAULT_TRIAL_SECONDS,
    DEFAULT_WINDOWS,
    MIN_TUNE_BUCKETS,
    MIN_TUNE_STEPS,
    TuneOptions,
)
from moe_eplb.eplb.tuning.overlap import EPLB_OFF, EplbOff, advise
from moe_eplb.eplb.tuning.robust import EXPERIMENT, TIGHTEN_BY_TRIAL, Robustness, ScenarioScores, max_regret
from moe_eplb.eplb.workload.trace import LoadTrace

__all__ = [
    "Bounds",
    "Knobs",
    "TuneError",
    "Candidate",
    "TuneResult",
    "TuneOptions",
    "tune",
    "VLLM_DEFAULTS",
    "SEED_CONFIG",
    "DEFAULT_WINDOWS",
    "DEFAULT_INTERVALS",
    "DEFAULT_TRIAL_SECONDS",
    "MIN_TUNE_STEPS",
    "EPLB_OFF",
]

MAX_REDUNDANT = vllm_facts.MAX_REDUNDANT_EXPERTS


class TuneError(ValueError):
    """Constraints or inputs the tuner cannot satisfy; the message names which one and why."""




@dataclass(frozen=True)
class Candidate:
    """One evaluated configuration: its replay and its scores."""

    knobs: Knobs | EplbOff
    result: SimResult
    segment_throughput: np.ndarray
    score: float  # drift-robust (CVaR-50 over segments)
    mean: float  # full-history predicted relative throughput

    def to_dict(self, rank: int | None = None, *, series: bool = False) -> dict:
        out = {
            **self.knobs.to_dict(),
            "enabled": self.knobs is not EPLB_OFF,
            "score": self.score,
            "predicted_throughput": self.mean,
            "balancedness": self.result.balancedness,
            "rearrangements": self.result.rearrangements,
            "experts_moved": self.result.experts_moved,
            "segment_throughput": [float(x) for x in self.segment_throughput],
            "breakdown": self.result.throughput.to_dict(),
        }
        if rank is not None:
            out = {"rank": rank, **out}
        if series:
            out["balancedness_over_time"] = self.result.to_dict()["balancedness_over_time"]
        return out


@dataclass
class TuneResult:
    """What :func:`tune` found. ``candidates`` is ranked best first."""

    recommendation: Knobs
    decision: str  # "keep" or "change"
    reason: str
    best: Candidate
    chosen: Candidate
    candidates: list[Candidate]
    no_eplb: SimResult
    no_eplb_segments: np.ndarray
    defaults: Candidate | None
    current: Candidate | None
    threshold: float
    segment_edges: np.ndarray
    topology: Topology
    cost: CostModel
    seconds: float = 0.0
    policy_windows: int = 0
    stats: dict = field(default_factory=dict)
    robust: dict | None = None  # the robust decision's report (_robust_decide), when ranges were given
    explore: Exploration | None = None  # a case for a trial on part of the replicas (eplb.tuning.exploration)
    #: False: the pick is EPLB off (``spec.eplb.enabled: false``); ``recommendation`` and ``chosen``
    #: are then the best EPLB-on setting (what to run where EPLB may not be turned off), ``decision`` /
    #: ``reason`` the verdict on turning it off, ``on_decision`` / ``on_reason`` the one with EPLB on
    enabled: bool = True
    off: Candidate | None = None  # EPLB off, replayed (when the search considered it)
    on_decision: str | None = None
    on_reason: str | None = None
    #: is EPLB worth it: the mode (off, rearrange_only, balance), by how much, what would change it
    advice: dict = field(default_factory=dict)
    #: vLLM's fewest redundant experts for the shape and EP size (``(ep - E % ep) % ep``)
    redundancy_floor: int = 0

    @property
    def mode(self) -> str:
        """``off`` (EPLB off), ``rearrange_only`` (EPLB on with the fewest redundant experts vLLM
        accepts: it only reshuffles experts) or ``balance`` (EPLB on with redundant experts)."""
        if not self.enabled:
            return "off"
        return "rearrange_only" if self.recommendation.num_redundant_experts <= self.redundancy_floor else "balance"

    @property
    def pick(self) -> Candidate:
        """The recommended candidate: EPLB off's where it is the pick, else ``chosen``."""
        return self.off if not self.enabled and self.off is not None else self.chosen

    def gain_over(self, other: Candidate | None) -> float | None:
        if other is None or other.score <= 0:
            return None
        return self.pick.score / other.score - 1.0

    def gain_over_no_eplb(self) -> float | None:
        no_score = float(_cvar(self.no_eplb_segments))
        return self.pick.score / no_score - 1.0 if no_score > 0 else None

    def headline_gain(self) -> tuple[float | None, str | None]:
        """The predicted gain over the running configuration, else over vLLM's defaults, else
        over no EPLB, and which one: ``(gain, "current"|"vllm_defaults"|"no_eplb")``."""
        for ref, gain in (("current", self.gain_over(self.current)),
                          ("vllm_defaults", self.gain_over(self.defaults)),
                          ("no_eplb", self.gain_over_no_eplb())):
            if gain is not None:
                return gain, ref
        return None, None

    def to_dict(self, *, series: bool = False) -> dict:
        ch = self.chosen
        no_score = float(_cvar(self.no_eplb_segments))
        pk = self.pick
        rec = {
            **self.recommendation.to_dict(),
            "enabled": self.enabled,
            "mode": self.mode,
            "decision": self.decision,
            "reason": self.reason,
            "predicted_throughput": pk.mean,
            "score": pk.score,
            "balancedness": pk.result.balancedness,
            "gain_vs_no_eplb": self.gain_over_no_eplb(),
            "gain_vs_vllm_defaults": self.gain_over(self.defaults),
            "gain_vs_current": self.gain_over(self.current),
            "change_threshold": self.threshold,
        }
        rec["predicted_gain"], rec["predicted_gain_vs"] = self.headline_gain()
        rec["breakdown"] = pk.result.throughput.to_dict()
        if not self.enabled:
            rec["eplb_on"] = {"decision": self.on_decision, "reason": self.on_reason, "score": ch.score,
                              "predicted_throughput": ch.mean}
        rec["advice"] = self.advice
        if self.robust is not None:
            for key in ("max_regret", "worst_case_gain_vs_current", "limiting_parameter"):
                rec[key] = self.robust.get(key)
        rec["explore"] = None if self.explore is None else {
            "candidate": self.explore.candidate.label, "knobs": self.explore.candidate.to_dict(),
            "parameter": self.explore.parameter, "regret_at_stake": self.explore.regret_at_stake,
            "trial_cost": self.explore.trial_cost, "reason": self.explore.reason}
        if self.cost.kv_demand is not None:
            rec["memory"] = self.cost.memory(ch.result.throughput.redundant_bytes_per_gpu)
        baselines = {
            "no_eplb": {
                "score": no_score,
                "predicted_throughput": self.no_eplb.throughput.relative,
                "balancedness": self.no_eplb.balancedness,
                "breakdown": self.no_eplb.throughput.to_dict(),
            },
            "vllm_defaults": self.defaults.to_dict() if self.defaults else None,
            "current": self.current.to_dict() if self.current else None,
            "eplb_off": self.off.to_dict() if self.off else None,
        }
        out = {
            "recommendation": rec,
            "candidates": [c.to_dict(i + 1, series=series) for i, c in enumerate(self.candidates)],
            "baselines": baselines,
            "topology": self.topology.to_dict(),
            "cost_model": self.cost.to_dict(),
            "segments": [int(x) for x in self.segment_edges],
            "search": {"candidates": len(self.candidates), "policy_windows": self.policy_windows,
                       "seconds": round(self.seconds, 3), **self.stats},
        }
        if self.robust is not None:
            out["robust"] = self.robust
        return out


def _cvar(values: np.ndarray) -> float:
    """Mean of the worst half (rounded up) of the values."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    k = max(1, math.ceil(len(v) / 2))
    return float(v[:k].mean())


def _gain_lower_bound(c: Candidate, anchor: Candidate) -> float:
    """Lower bound (mean - 1 standard error) of c's paired per-segment relative gain over
    ``anchor``: large only when c is better through most of the history, not thanks to one
    lucky stretch."""
    gains = c.segment_throughput / np.maximum(anchor.segment_throughput, 1e-12) - 1.0
    if gains.size < 2:
        return float(gains.mean())
    return float(gains.mean() - gains.std(ddof=1) / math.sqrt(gains.size))


def segment_edges(num_buckets: int, segments: int) -> np.ndarray:
    """Bucket indices cutting ``[0, T)`` into ``min(segments, T)`` near-equal contiguous pieces."""
    k = max(1, min(segments, num_buckets))
    return np.unique(np.linspace(0, num_buckets, k + 1).round().astype(np.int64))


def _ladder(name: str, ladder: tuple[int, ...], bound: tuple[int | None, int | None]) -> list[int]:
    lo, hi = bound
    lo_v = lo if lo is not None else min(ladder)
    hi_v = hi if hi is not None else max(ladder)
    values = {v for v in ladder if lo_v <= v <= hi_v}
    values |= {v for v in (lo, hi) if v is not None}
    if not values:
        raise TuneError(f"bounds.{name}: {lo_v}:{hi_v} leaves no value to try")
    return sorted(values)


def _redundancy_levels(
    num_layers: int,
    num_experts: int,
    topology: Topology,
    bound: tuple[int | None, int | None],
    memory_budget_bytes: float | None,
    bytes_per_expert: float | None,
    max_levels: int,
) -> tuple[list[int], list[int], float | None]:
    """(levels to search, every allowed R, per-R bytes per GPU or None). Raises TuneError naming
    the constraint that leaves nothing."""
    ep = topology.ep_size
    lo = bound[0] if bound[0] is not None else 0
    hi = bound[1] if bound[1] is not None else max(min(num_experts // 2, 2 * ep), lo)
    hi = min(hi, MAX_REDUNDANT)
    in_bounds = list(range(lo, hi + 1))
    if not in_bounds:
        raise TuneError(f"bounds.redundant: {lo}:{hi} is empty (vLLM allows at most {MAX_REDUNDANT})")
    divisible = [r for r in in_bounds if (num_experts + r) % ep == 0]
    if not divisible:
        smallest = (ep - num_experts % ep) % ep
        raise TuneError(
            f"bounds.redundant: no R in {lo}:{hi} makes (E + R) = ({num_experts} + R) divisible "
            f"by ep_size {ep}; valid values are {smallest}, {smallest + ep}, {smallest + 2 * ep}, ..."
        )
    valid = []
    for r in divisible:
        try:
            topology.check(num_experts, r)
            valid.append(r)
        except SimError as exc:
            last_error = exc
    if not valid:
        raise TuneError(f"topology: {last_error}")
    per_r = None
    if memory_budget_bytes is not None:
        if bytes_per_expert is None:
            raise TuneError(
                "bytes_per_expert: a memory budget needs the size of one expert of one MoE layer "
                f"(unknown for a {num_layers} x {num_experts} model); pass --bytes-per-expert"
            )
        per_r = num_layers * bytes_per_expert / ep  # bytes per GPU per redundant expert
        fits = [r for r in valid if r * per_r <= memory_budget_bytes]
        if not fits:
            need = valid[0] * per_r
            raise TuneError(
                f"memory_budget: {memory_budget_bytes:.4g} bytes per GPU is less than the "
                f"{need:.4g} bytes the smallest valid redundancy (R={valid[0]}) needs "
                f"({num_layers} layers x {bytes_per_expert:.4g} B x {valid[0]} / ep {ep})"
            )
        valid = fits
    if len(valid) <= max_levels:
        levels = valid
    else:
        pick = np.linspace(0, len(valid) - 1, max_levels).round().astype(int)
        levels = sorted({valid[i] for i in pick})
    return levels, valid, per_r


@dataclass
class _Search:
    """One search in progress: the grid (phase 1), its replays and evaluated candidates (phase 2)."""

    trace: LoadTrace
    topology: Topology
    cost: CostModel
    bounds: Bounds
    current: Knobs | None
    edges: np.ndarray
    r_levels: list[int]
    r_valid: list[int]
    grid: list[Knobs] = field(default_factory=list)
    progress: Callable[[int, int], None] | None = None
    # filled by phase 2
    candidates: list[Candidate] = field(default_factory=list)  # ranked, grid only
    exact: dict[Knobs, Candidate] = field(default_factory=dict)  # replayed on every layer
    extra: dict[Knobs, Candidate] = field(default_factory=dict)  # known configurations outside the grid
    policy_windows: int = 0
    stride: int = 1
    workers: int = 1
    robust: Robustness | None = None
    allow_off: bool = False  # EPLB off is an option of the decision (``tune(allow_off=...)``)
    off: Candidate | None = None  # EPLB off replayed (when an option, or what runs now)
    #: changes of window and interval alone are applied live (no restart): charged nothing beyond
    #: their rearrangements, which the score already holds (see :meth:`charge`)
    live: bool = False

    def charge(self, k: Knobs) -> float:
        """The share of throughput a change to ``k`` costs: a restart's (``restart_s / horizon_s``),
        or nothing when it can be applied live (``live``: only window and interval differ, EPLB on both
        sides: turning EPLB on or off is a restart)."""
        if (self.live and self.current is not None and EPLB_OFF not in (k, self.current)
                and k.num_redundant_experts == self.current.num_redundant_experts):
            return 0.0
        return self.cost.restart_s / self.cost.horizon_s

    def scenario_scores(self) -> ScenarioScores:
        """A fresh scorer of candidates under the robust search's scenarios."""
        return ScenarioScores(self.robust.scenarios(self.cost), self.trace.bucket_steps, self.edges,
                              self.topology.ep_size, self.trace.num_layers, self.trace.num_experts)

    @property
    def known(self) -> list[Knobs]:
        """vLLM's defaults, the seed's settings and the running ones (the prior)."""
        return [k for k in (VLLM_DEFAULTS, SEED_CONFIG, self.current) if k is not None]

    def allowed(self, k: Knobs | EplbOff) -> bool:
        """Whether ``k`` is a searched EPLB-on setting (valid redundancy, within the bounds)."""
        return k is not EPLB_OFF and k.num_redundant_experts in self.r_valid and self.bounds.allows(k)

    def runnable(self, k: Knobs | EplbOff) -> bool:
        if k is EPLB_OFF:
            return True
        try:
            self.topology.check(self.trace.num_experts, k.num_redundant_experts)
            return True
        except SimError:
            return False

    def candidate(self, k: Knobs | EplbOff) -> Candidate | None:
        if k is EPLB_OFF:
            return self.off
        return self.exact.get(k) or self.extra.get(k)


def _rank_key(tie_tolerance: float) -> Callable[[Candidate], tuple]:
    return lambda c: (-round(c.score / tie_tolerance), -c.mean)


def _prepare(trace: LoadTrace, ep_size: int, num_nodes: int, num_groups: int, memory_budget_bytes: float | None,
             bytes_per_expert: float | None, cost: CostModel, min_steps: int) -> tuple[Topology, CostModel]:
    """Phase 0: check the arguments and that there is enough data; the cost model with the expert size given."""
    if not isinstance(trace, LoadTrace):
        raise TuneError(f"trace: expected a LoadTrace, got {type(trace).__name__}")
    if trace.num_buckets < MIN_TUNE_BUCKETS or trace.total_steps < min_steps:
        raise TuneError(f"trace: {trace.num_buckets} bucket(s) and {trace.total_steps} engine steps are too little to "
                        f"tune on: at least {MIN_TUNE_BUCKETS} buckets and {min_steps} engine steps (below that the "
                        "operator reports InsufficientData); record a longer trace")
    try:
        topology = Topology(ep_size, num_nodes, num_groups)
    except SimError as exc:
        raise TuneError(str(exc)) from None
    if memory_budget_bytes is not None and not memory_budget_bytes >= 0:
        raise TuneError(f"memory_budget: must be >= 0 bytes, got {memory_budget_bytes}")
    if bytes_per_expert is not None:
        if not bytes_per_expert >= 0:
            raise TuneError(f"bytes_per_expert: must be >= 0, got {bytes_per_expert}")
        cost = replace(cost, bytes_per_expert=float(bytes_per_expert))
    return topology, cost


def _build_grid(search: _Search, windows: tuple[int, ...], intervals: tuple[int, ...]) -> None:
    """Phase 1: window x interval x redundancy, plus the known configurations that are allowed."""
    win_values = _ladder("window", tuple(windows), search.bounds.window)
    int_values = _ladder("interval", tuple(intervals), search.bounds.interval)
    grid = [Knobs(w, i, r) for w in win_values for i in int_values for r in search.r_levels]
    for k in search.known:
        if search.allowed(k) and k not in grid:
            grid.append(k)
    search.grid = grid


def _replay(search: _Search, stride: int) -> Replay:
    try:
        return Replay(search.trace, search.topology, search.cost, layer_stride=stride)
    except SimError as exc:
        raise TuneError(str(exc)) from None


def _window_keys(replay: Replay, knobs: list[Knobs]) -> set[tuple[int, int, int]]:
    return {(s_, e_, k.num_redundant_experts) for k in knobs for s_, e_ in replay.windows(k)}


def _score(search: _Search, replay: Replay, knobs: list[Knobs], done0: int, total: int) -> tuple[list[Candidate], int]:
    """Replay ``knobs`` (policy calls batched and cached first); (candidates, policy windows run)."""
    keys = _window_keys(replay, knobs)
    progress = search.progress

    def policy_progress(done: int, _total: int) -> None:
        if progress is not None:
            progress(done0 + done, total)

    replay.prepare(keys, workers=search.workers, progress=policy_progress)
    out = []
    for n, k in enumerate(knobs):
        res = replay.run(k)
        seg = res.segment_throughput(search.edges)
        out.append(Candidate(k, res, seg, _cvar(seg), res.throughput.relative))
        if progress is not None:
            progress(done0 + len(keys) + n + 1, total)
    return out, len(keys)


def _evaluate(search: _Search, full: Replay, screen_layers: int | None, finalists: int, tie_tolerance: float) -> None:
    """Phase 2: score the grid. With screening, every candidate on every k-th layer first, then the
    ``finalists`` best and the known configurations on all layers; the exact scores rank them."""
    rank_key = _rank_key(tie_tolerance)
    L = search.trace.num_layers
    extra_runs = [k for k in (VLLM_DEFAULTS, search.current)
                  if k is not None and k is not EPLB_OFF and k not in search.grid and search.runnable(k)]
    if search.allow_off or search.current is EPLB_OFF:  # vLLM without EPLB: one dense replay
        res = full.run_static()
        seg = res.segment_throughput(search.edges)
        search.off = Candidate(EPLB_OFF, res, seg, _cvar(seg), res.throughput.relative)
    stride = max(1, math.ceil(L / screen_layers)) if screen_layers else 1
    screen = stride > 1 and len(search.grid) > finalists
    search.stride = stride if screen else 1
    if screen:
        coarse = _replay(search, stride)
        total = len(_window_keys(coarse, search.grid)) + len(search.grid) + (finalists + len(extra_runs)) * 40
        screened, keys1 = _score(search, coarse, search.grid, 0, total)  # stage 2 size above is a guess
        screened.sort(key=rank_key)
        top = [c.knobs for c in screened[:finalists]]
        top += [k for k in dict.fromkeys(search.known) if k in search.grid and k not in top]  # once each
        if search.robust is not None:  # and the candidates that hold up best over the parameter ranges
            ss = search.scenario_scores()
            keys = [c.knobs for c in screened]
            for c in screened:
                ss.score(c.knobs, c.result)
            order = np.argsort(max_regret(ss.matrix(keys)), kind="stable")
            top += [k for k in (keys[i] for i in order[:search.robust.finalists]) if k not in top]
        stage2 = top + extra_runs
        total = keys1 + len(search.grid) + len(_window_keys(full, stage2)) + len(stage2)
        exact, keys2 = _score(search, full, stage2, keys1 + len(search.grid), total)
        search.exact = {c.knobs: c for c in exact}
        finals = sorted((c for c in exact if c.knobs in search.grid), key=rank_key)
        search.candidates = finals + [c for c in screened if c.knobs not in search.exact]
        search.extra = {c.knobs: c for c in exact if c.knobs not in search.grid}
        search.policy_windows = keys1 + keys2
    else:
        runs = search.grid + extra_runs
        total = len(_window_keys(full, runs)) + len(runs)
        scored, search.policy_windows = _score(search, full, runs, 0, total)
        search.candidates = sorted((c for c in scored if c.knobs in search.grid), key=rank_key)
        search.exact = {c.knobs: c for c in scored}
        search.extra = {c.knobs: c for c in scored if c.knobs not in search.grid}


def _pick(search: _Search, prior_margin: float) -> tuple[Candidate, str]:
    """Phase 3, the prior: well-known configurations (vLLM's defaults, the seed's, the running one)
    win unless a searched one beats the best of them consistently by more than ``prior_margin``."""
    best = search.candidates[0]
    anchors = [c for c in (search.candidate(k) for k in search.known) if c is not None and search.allowed(c.knobs)]
    if not anchors:
        return best, f"best drift-robust score ({best.score:.4f}) of {len(search.candidates)} candidates"
    anchor = max(anchors, key=lambda c: (c.score, c.mean))
    note = (f"{anchor.knobs.label} (a known configuration): no searched configuration beats it "
            f"consistently by more than {prior_margin:.2%} per time segment "
            f"(best searched {best.knobs.label}: score {best.score:.4f} vs {anchor.score:.4f})")
    for c in search.candidates:
        if c.knobs == anchor.knobs:
            break  # everything below ranks lower than the anchor itself
        if c.knobs not in search.exact:
            continue  # screened only: not a finalist
        if c.score > anchor.score and _gain_lower_bound(c, anchor) > prior_margin:
            return c, (f"{c.knobs.label}: best drift-robust score ({c.score:.4f}) that beats "
                       f"the best known configuration {anchor.knobs.label} "
                       f"({anchor.score:.4f}) consistently: paired per-segment gain "
                       f"{_gain_lower_bound(c, anchor):+.2%} (mean - 1 s.e.) > {prior_margin:.2%}")
    return anchor, note


def _pick_off(search: _Search, pick: Candidate, note: str, prior_margin: float) -> tuple[Candidate, str]:
    """Phase 3 for EPLB off (point estimate): off replaces the pick when it is an option and beats the
    pick as a searched configuration must beat a known one -- consistently, by more than
    ``prior_margin`` per time segment (:func:`_gain_lower_bound`)."""
    off = search.off
    if not search.allow_off or off is None or pick.knobs is EPLB_OFF or off.score <= pick.score:
        return pick, note
    lower = _gain_lower_bound(off, pick)
    if lower <= prior_margin:
        return pick, note + (f"; EPLB off scores {off.score:.4f} but does not beat {pick.knobs.label} "
                             f"consistently ({lower:+.2%} per segment, mean - 1 s.e.)")
    return off, (f"EPLB off: its drift-robust score ({off.score:.4f}) beats {pick.knobs.label} ({pick.score:.4f}), "
                 f"the best EPLB-on setting, consistently: paired per-segment gain {lower:+.2%} (mean - 1 s.e.) "
                 f"> {prior_margin:.2%}")


def _decide(search: _Search, pick: Candidate, pick_note: str, threshold: float,
            min_gain: float) -> tuple[str, Candidate, str, Candidate | None]:
    """Phase 4: keep the running configuration unless the pick beats it by more than the
    threshold that pays for a restart. Returns (decision, chosen, reason, current's candidate)."""
    current, cost = search.current, search.cost
    cur = search.candidate(current) if current is not None and search.runnable(current) else None
    if current is None:
        return "change", pick, f"no current configuration given; {pick_note}", None
    if cur is None:
        return "change", pick, (f"current {current.label} is not a configuration vLLM accepts here "
                                f"((E + R) % ep != 0 or topology), so a change is required; {pick_note}"), None
    gain = pick.score / cur.score - 1.0 if cur.score > 0 else math.inf
    if pick.knobs == cur.knobs:
        return "keep", cur, f"current configuration is the pick: {pick_note}", cur
    if getattr(search, "live", False) and search.charge(pick.knobs) == 0.0:
        threshold = min_gain  # applied live: no restart to pay for
    if gain > threshold:
        return "change", pick, (f"{pick_note}; predicted gain {gain:+.2%} over current beats the threshold "
                                f"{threshold:.2%} (min_gain {min_gain:.2%} + restart {cost.restart_s:.0f} s "
                                f"/ horizon {cost.horizon_s:.0f} s)"), cur
    return "keep", cur, (f"{pick.knobs.label} would gain only {gain:+.2%} over current, below the "
                         f"threshold {threshold:.2%} that pays for a restart"), cur


def _robust_decide(search: _Search, prior_margin: float, min_gain: float, threshold: float, tie_tolerance: float,
                   replicas: int = 1, trial_seconds: float = DEFAULT_TRIAL_SECONDS,
                   ) -> tuple[str, Candidate, str, Candidate | None, dict, Exploration | None]:
    """Phases 3-4 over parameter ranges (minimax regret): every exact candidate (the finalists, the
    known configurations, current) is scored in every scenario (:mod:`moe_eplb.eplb.tuning.robust`), a change
    charged the restart (``restart_s / horizon_s`` of its throughput). The pick has the smallest largest
    regret; candidates within ``max(prior_margin, min_gain)`` of it (the model's error margin) are
    ties, which go to the running configuration, then a known one (vLLM's defaults, the seed's), then
    the best point estimate (:func:`_minimax_order`). A change to the pick
    is recommended when it beats current by more than ``threshold`` at the point estimate; otherwise
    current is kept, and :func:`_explore` says whether a trial on part of the replicas pays. A change
    that hinges on a prior range and may lose more than a trial costs is proposed as a trial first
    (:func:`_explore_change`).
    Returns (decision, chosen, reason, current's candidate, report, exploration or None)."""
    ss = search.scenario_scores()
    current = search.current
    cur = search.candidate(current) if current is not None and search.runnable(current) else None
    options = [c for k, c in search.exact.items() if search.allowed(k) or (cur is not None and k == current)]
    if search.off is not None and (search.allow_off or current is EPLB_OFF):
        options.append(search.off)
    keys = [c.knobs for c in options]
    for c in options:
        ss.score(c.knobs, c.result)
    M = ss.matrix(keys)
    restart = search.cost.restart_s / search.cost.horizon_s
    charged = M * np.array([1.0 if (cur is not None and k == current) or cur is None else 1.0 - search.charge(k)
                            for k in keys])[:, None]
    reg = max_regret(charged)
    band = max(prior_margin, min_gain)
    order = _minimax_order(keys, M, reg, search.known, current, band, tie_tolerance)
    pick_i, i_min = order[0], int(np.argmin(reg))
    note = (f"{keys[pick_i].label}: smallest largest regret ({reg[pick_i]:.2%}, a change charged the restart's "
            f"{restart:.2%}) over {len(ss.scen)} scenarios of the parameter ranges, among {len(options)} finalists")
    if reg[pick_i] > reg[i_min] + 1e-12:
        note = (f"{keys[pick_i].label}: largest regret {reg[pick_i]:.2%} (a change charged the restart's {restart:.2%}) "
                f"over {len(ss.scen)} scenarios of the parameter ranges, within the model's error margin {band:.2%} of "
                f"the smallest ({reg[i_min]:.2%}, {keys[i_min].label}), among {len(options)} finalists; a tie goes to "
                f"the running, then a known configuration")
    decision, chosen, reason, worst = _robust_verdict(search, options, keys, M, reg, ss, pick_i, cur, note, threshold)
    contender = options[int(np.argmax(M[:, 0]))]
    if contender.knobs == chosen.knobs:
        others = [options[i] for i in order if options[i].knobs != chosen.knobs]
        contender = others[0] if others else None
    limiting = _limiting(search, chosen, contender)
    name = limiting.get("limiting_parameter")
    if name is not None and search.robust.ranges[name].source == EXPERIMENT:
        reason += f"; the range of {name} was learned from an experiment ({search.robust.ranges[name].note})"
    explore = None
    if EPLB_OFF in (current, chosen.knobs):
        pass  # a trial runs EPLB settings on one replica against the others: not EPLB off
    elif decision == "keep" and cur is not None:
        explore = _explore(search, options, keys, M, keys.index(current), replicas, trial_seconds)
    elif cur is not None and name is not None and search.robust.ranges[name].source == "prior":
        explore = _explore_change(search, keys, M, reg, keys.index(chosen.knobs), keys.index(current), name,
                                  replicas, trial_seconds)
    report = {"criterion": "max_regret", "scenarios": len(ss.scen), "restart_charge": restart,
              "parameters": {n: r.to_dict() for n, r in search.robust.ranges.items()},
              "max_regret": float(reg[keys.index(chosen.knobs)]) if chosen.knobs in keys else None,
              "current_max_regret": float(reg[keys.index(current)]) if cur is not None else None,
              "worst_case_gain_vs_current": worst,
              "point_estimate_pick": keys[int(np.argmax(M[:, 0]))].label,
              "contender": None if contender is None else contender.knobs.label, **limiting,
              "learned": [n for n, r in search.robust.ranges.items() if r.source == EXPERIMENT],
              "finalists": [{**k.to_dict(), "point_score": float(M[i, 0]), "worst_score": float(M[i].min()),
                             "max_regret": float(reg[i])} for i, k in ((i, keys[i]) for i in order)]}
    return decision, chosen, reason, cur, report, explore


def _minimax_order(keys: list[Knobs], M: np.ndarray, reg: np.ndarray, known: list[Knobs], current: Knobs | None,
                   band: float, tie_tolerance: float) -> list[int]:
    """Indices of ``keys`` best first: smallest largest regret; within ``band`` of the smallest (the
    model's error margin: such differences are ties) the running configuration, then a known one
    (vLLM's defaults, the seed's), each by its own largest regret, then the higher point-estimate
    score. A tie band, not a veto: a searched configuration that lowers the largest regret by more
    than the band is the pick whatever it loses in some scenario."""
    band = max(band, tie_tolerance)
    best = float(reg.min())

    def key(i: int) -> tuple:
        tied = reg[i] <= best + band
        rank = 0 if keys[i] == current else 1 if keys[i] in known else 2
        return (0, rank, float(reg[i]), -M[i, 0]) if tied else (1, round(reg[i] / tie_tolerance), -M[i, 0])

    return sorted(range(len(keys)), key=key)


def _robust_verdict(search: _Search, options: list[Candidate], keys: list[Knobs], M: np.ndarray, reg: np.ndarray,
                    ss: ScenarioScores, pick_i: int, cur: Candidate | None, note: str,
                    threshold: float) -> tuple[str, Candidate, str, float | None]:
    """Change to the pick or keep current: (decision, chosen, reason, worst-case gain over current)."""
    current, pick = search.current, options[pick_i]
    if current is None:
        return "change", pick, f"no current configuration given; {note}", None
    if cur is None:
        return "change", pick, (f"current {current.label} is not a configuration vLLM accepts here "
                                f"((E + R) % ep != 0 or topology), so a change is required; {note}"), None
    if pick.knobs == current:
        return "keep", cur, f"current configuration is the pick: {note}", 0.0
    i_cur = keys.index(current)
    ratio = M[pick_i] / np.maximum(M[i_cur], 1e-12)
    worst = float(ratio.min() - 1.0)
    at = _values_text(ss.scen[int(ratio.argmin())].values)
    gains = (f"{ratio[0] - 1:+.2%} over current at the point estimate, {worst:+.2%} at worst ({at}); largest "
             f"regret {reg[pick_i]:.2%} against {reg[i_cur]:.2%} for keeping {current.label}")
    if getattr(search, "live", False) and search.charge(pick.knobs) == 0.0:
        # applied live: no restart to pay for
        threshold, gains = threshold - search.cost.restart_s / search.cost.horizon_s, gains + " (applied live)"
    if ratio[0] - 1.0 > threshold:
        return "change", pick, f"{note}; {gains}", worst
    return "keep", cur, (f"{pick.knobs.label} would gain {gains}, but at the point estimate not more than "
                         f"the threshold {threshold:.2%}"), worst


def trial_cost(restart: float, worst_loss: float, replicas: int, trial_seconds: float, horizon_s: float) -> float:
    """What a trial of a candidate on one of ``replicas`` replicas costs, as a fraction of the
    deployment's throughput over the horizon: the trial replica's restart, ``restart / replicas``
    (``restart = restart_s / horizon_s``), plus its exposure to the candidate's worst case,
    ``worst_loss * min(trial_seconds, horizon_s) / horizon_s / replicas`` (``worst_loss``: the
    candidate's largest relative shortfall against the running setting over the parameter ranges,
    0 when it never loses). Restoring the trial replica after a discarded trial is a second restart
    of it only when the trial loses, which the exposure term already bounds."""
    share = 1.0 / max(1, replicas)
    return restart * share + max(0.0, worst_loss) * min(trial_seconds, horizon_s) / horizon_s * share


def _explore(search: _Search, options: list[Candidate], keys: list[Knobs], M: np.ndarray, i_cur: int,
             replicas: int, trial_seconds: float) -> Exploration | None:
    """The case for a trial when current is kept: for each other candidate, the **regret at stake**
    ``max over scenarios (score x (1 - restart) / current's score - 1)`` (what keeping the running
    setting may lose across the ranges against it, restart charged) and its :func:`trial_cost`. The
    candidate with the largest stake net of cost, among those whose stake exceeds the cost, is tried
    when the parameter that limits its comparison with current (:func:`_limiting`) has a **prior**
    range (the calibration could not pin it; a measured or learned range is not explored again)."""
    cost = search.cost
    restart = cost.restart_s / cost.horizon_s
    ratio = M / np.maximum(M[i_cur], 1e-12)[None, :]
    stake = (ratio * (1.0 - restart)).max(axis=1) - 1.0
    worst_loss = -(ratio.min(axis=1) - 1.0)
    tc = np.array([trial_cost(restart, float(w), replicas, trial_seconds, cost.horizon_s) for w in worst_loss])
    order = [i for i in np.argsort(-(stake - tc)) if i != i_cur and stake[i] > tc[i] and keys[i] is not EPLB_OFF]
    cur = options[i_cur]
    for i in order[:3]:
        lim = _limiting(search, cur, options[i])
        name = lim.get("limiting_parameter")
        if name is None or search.robust.ranges[name].source != "prior":
            continue
        r = search.robust.ranges[name]
        reason = (f"keeping {cur.knobs.label} may lose {stake[i]:.2%} against {keys[i].label} across the prior "
                  f"range {r.low:.3g}-{r.high:.3g} of {name} (restart charged); a trial on 1 of {replicas} "
                  f"replica(s) for {trial_seconds:.0f} s costs {tc[i]:.2%} (restart {restart / max(1, replicas):.2%}"
                  f" + exposure to its worst case {-worst_loss[i]:+.2%}); it measures {TIGHTEN_BY_TRIAL.get(name, name)}")
        return Exploration(keys[i], name, float(stake[i]), float(tc[i]), reason)
    return None


def _explore_change(search: _Search, keys: list[Knobs], M: np.ndarray, reg: np.ndarray, i_pick: int, i_cur: int,
                    name: str, replicas: int, trial_seconds: float) -> Exploration | None:
    """The case for trying a change on one replica before all: the choice hinges on ``name`` (a prior
    range) and the **regret at stake**, the pick's own largest regret (restart charged: what the change
    may lose across the ranges, keeping current included), exceeds its :func:`trial_cost`."""
    cost = search.cost
    restart = cost.restart_s / cost.horizon_s
    worst_loss = -float((M[i_pick] / np.maximum(M[i_cur], 1e-12)).min() - 1.0)
    tc = trial_cost(restart, worst_loss, replicas, trial_seconds, cost.horizon_s)
    stake = float(reg[i_pick])
    if stake <= tc:
        return None
    r = search.robust.ranges[name]
    reason = (f"the change to {keys[i_pick].label} may lose {stake:.2%} across the prior range {r.low:.3g}-{r.high:.3g} "
              f"of {name} (restart charged); a trial on 1 of {replicas} replica(s) for {trial_seconds:.0f} s costs "
              f"{tc:.2%}; it measures {TIGHTEN_BY_TRIAL.get(name, name)}")
    return Exploration(keys[i_pick], name, stake, float(tc), reason)


def _values_text(values: dict) -> str:
    return ", ".join(f"{k}={v:.3g}" for k, v in values.items()) or "point estimate"


def _limiting(search: _Search, chosen: Candidate, contender: Candidate | None) -> dict:
    """Which parameter's range stands between ``chosen`` and ``contender`` (the point estimate's pick,
    or the runner-up): the one whose pinning to its point estimate moves the contender's worst-case
    gain over the choice the most; and what telemetry would tighten it."""
    from moe_eplb.eplb.tuning.robust import TIGHTEN, ScenarioScores

    if contender is None:
        return {"limiting_parameter": None, "limiting_effect": 0.0, "tighten": None}

    def worst_gain(pinned: str | None) -> float:
        ss = ScenarioScores(search.robust.scenarios(search.cost, pinned), search.trace.bucket_steps, search.edges,
                            search.topology.ep_size, search.trace.num_layers, search.trace.num_experts)
        return float((ss.score(0, contender.result) / np.maximum(ss.score(1, chosen.result), 1e-12)).min() - 1.0)

    full = worst_gain(None)
    effects = {n: worst_gain(n) - full for n, r in search.robust.ranges.items() if r.width > 0}
    if not effects or max(effects.values()) <= 1e-6:
        return {"limiting_parameter": None, "limiting_effect": 0.0, "contender_worst_case_gain": full,
                "tighten": None}
    name = max(effects, key=effects.get)
    return {"limiting_parameter": name, "limiting_effect": effects[name], "contender_worst_case_gain": full,
            "tighten": TIGHTEN.get(name)}


def tune(
    trace: LoadTrace,
    options: TuneOptions,
    *,
    current: Knobs | None = None,
    cost: CostModel = CostModel(),
    robust: Robustness | None = None,
    progress=None,
    current_enabled: bool = True,
) -> TuneResult:
    """Search window x interval x redundancy for the best drift-robust predicted throughput.

    Phases: check the arguments (:func:`_prepare`, :func:`_new_search`), build the grid
    (:func:`_build_grid`), score it (:func:`_evaluate`, screened), apply the prior of known
    configurations (:func:`_pick`), decide whether leaving the running configuration pays for a
    restart (:func:`_decide`), and assemble the result (:func:`_result`).

    Args:
        trace: the recorded load (history).
        options: the deployment, the search and the decision rules
            (:class:`~moe_eplb.eplb.tuning.options.TuneOptions`, each field documented there).
        current: the running configuration; the tuner only recommends leaving it when the gain
            beats ``options.min_gain + cost.restart_s / cost.horizon_s``.
        cost: the throughput model.
        robust: parameter ranges (:class:`~moe_eplb.eplb.tuning.robust.Robustness`, e.g.
            ``Calibration.robustness()``): the pick is the finalist with the smallest largest regret
            over every corner of the ranges (a change charged the restart), and a change from
            ``current`` is recommended when the pick beats it by the threshold at the point estimate
            (:func:`_robust_decide`); when current is kept, ``TuneResult.explore`` says whether a
            trial pays (:func:`_explore`). None: the point estimate ``cost`` decides (:func:`_pick`,
            :func:`_decide`).
        progress: ``progress(done, total)`` callback, called as policy batches and replays finish.
        current_enabled: False when EPLB runs off now (``current``'s knobs then do not run; the trace
            came from an observe-only period); turning it on is then the change a restart must pay.

    Raises:
        TuneError: naming the constraint (bounds, budget, divisibility, topology) that excludes
            every candidate, or a bad argument.
    """
    t0 = time.perf_counter()
    o = options
    if not isinstance(o, TuneOptions):
        raise TuneError(f"options: expected TuneOptions, got {type(o).__name__}")
    if o.overlap is not None:
        cost = o.overlap.apply(cost)
    topology, cost = _prepare(trace, o.ep_size, o.num_nodes, o.num_groups, o.memory_budget_bytes, o.bytes_per_expert,
                              cost, o.min_steps)
    search = _new_search(trace, topology, cost, o.bounds, current, o.memory_budget_bytes, o.max_redundancy_levels,
                         o.segments, progress, o.workers, robust)
    search.allow_off = o.allow_off
    search.live = o.live
    if not current_enabled:
        search.current = EPLB_OFF
    _build_grid(search, o.windows, o.intervals)
    full = _replay(search, 1)
    _evaluate(search, full, o.screen_layers, o.finalists, o.tie_tolerance)
    t_policy = time.perf_counter() - t0
    threshold = cost.change_threshold(o.min_gain)
    args = (o.prior_margin, o.min_gain, threshold, o.tie_tolerance, o.replicas, o.trial_seconds)
    decision, chosen, reason, cur, robust_report, explore = _decide_any(search, *args)
    on = None
    if chosen.knobs is EPLB_OFF:  # and where EPLB must stay on: the same decision without the off option
        on = _decide_any(search, *args, on_only=True)
    result = _result(search, full, decision, chosen if on is None else on[1], reason, cur, threshold,
                     robust_report, t0, t_policy)
    result.explore = explore
    if on is not None:
        result.enabled, result.on_decision, result.on_reason = False, on[0], on[2]
    exact = list(search.exact.values())
    scen = search.robust.scenarios(cost) if search.robust is not None else None  # [0]: the ranges' point
    result.advice = advise(pick=result.pick, chosen_on=result.chosen, off=search.off, exact=exact,
                           cost=scen[0].cost if scen else cost,
                           bucket_steps=trace.bucket_steps, edges=search.edges,
                           shape=(topology.ep_size, trace.num_layers, trace.num_experts), context=o.overlap,
                           redundancy_floor=result.redundancy_floor,
                           hidden_range_=_range_of(search.robust, "overlap_hidden"),
                           scenario_costs=[sc.cost for sc in scen] if scen else None)
    return result


def _range_of(robust: Robustness | None, name: str) -> tuple[float, float] | None:
    r = robust.ranges.get(name) if robust is not None else None
    return (r.low, r.high) if r is not None else None


def _decide_any(search: _Search, prior_margin: float, min_gain: float, threshold: float, tie_tolerance: float,
                replicas: int, trial_seconds: float, *, on_only: bool = False):
    """Phases 3-4 by the robust rule or the point estimate: ``(decision, chosen, reason, current's
    candidate, robust report or None, exploration or None)``. ``on_only``: without the EPLB-off option
    (where EPLB runs off now: as if nothing ran, so the best EPLB-on setting is a change)."""
    saved = search.allow_off, search.current
    if on_only:
        search.allow_off = False
        if search.current is EPLB_OFF:
            search.current = None
    try:
        if search.robust is not None:
            return _robust_decide(search, prior_margin, min_gain, threshold, tie_tolerance, replicas, trial_seconds)
        pick, pick_note = _pick(search, prior_margin)
        pick, pick_note = _pick_off(search, pick, pick_note, prior_margin)
        return (*_decide(search, pick, pick_note, threshold, min_gain), None, None)
    finally:
        search.allow_off, search.current = saved


def _new_search(trace: LoadTrace, topology: Topology, cost: CostModel, bounds: Bounds, current: Knobs | None,
                memory_budget_bytes: float | None, max_redundancy_levels: int, segments: int, progress,
                workers: int | None, robust: Robustness | None) -> _Search:
    """Phase 0, second half: the redundancy levels the budget and vLLM allow, and the search state."""
    L, E = trace.num_layers, trace.num_experts
    try:
        topology.check_experts(E)
    except SimError as exc:
        raise TuneError(str(exc)) from None
    r_levels, r_valid, _per_r = _redundancy_levels(L, E, topology, bounds.redundant, memory_budget_bytes,
                                                   cost.resolve_bytes_per_expert(L, E), max_redundancy_levels)
    return _Search(trace, topology, cost, bounds, current, segment_edges(trace.num_buckets, segments),
                   r_levels, r_valid, progress=progress, workers=workers if workers is not None else 1,
                   robust=robust if robust is not None and robust.ranges else None)


def _result(search: _Search, full: Replay, decision: str, chosen: Candidate, reason: str, cur: Candidate | None,
            threshold: float, robust_report, t0: float, t_policy: float) -> TuneResult:
    """Phase 4: the result, with vLLM without EPLB replayed as the floor."""
    topology, cost = search.topology, search.cost
    no_eplb = search.off.result if search.off is not None else full.run_static()
    return TuneResult(
        recommendation=chosen.knobs,
        decision=decision,
        reason=reason,
        best=search.candidates[0],
        chosen=chosen,
        candidates=search.candidates,
        no_eplb=no_eplb,
        no_eplb_segments=no_eplb.segment_throughput(search.edges),
        defaults=search.candidate(VLLM_DEFAULTS),
        current=cur,
        threshold=threshold,
        segment_edges=search.edges,
        topology=topology,
        cost=cost,
        seconds=time.perf_counter() - t0,
        policy_windows=search.policy_windows,
        stats={"evaluate_seconds": round(t_policy, 3), "workers": search.workers,
               "redundancy_levels": search.r_levels, "screen_layer_stride": search.stride,
               "finalists": len(search.exact) - len(search.extra) if search.stride > 1 else len(search.candidates)},
        robust=robust_report,
        off=search.off,
        redundancy_floor=vllm_facts.smallest_valid_redundant(search.trace.num_experts, topology.ep_size),
    )
