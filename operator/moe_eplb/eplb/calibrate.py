"""Fit the cost model (:mod:`moe_eplb.eplb.costmodel`) to a deployment's own telemetry.

A trace with telemetry (:class:`~moe_eplb.eplb.trace.Telemetry`: step times, the load each EP rank
served, KV-cache usage, preemptions, waiting requests, rearrangement durations, the running EPLB
settings) tells what the constants of the cost model only assume. :func:`calibrate` measures:

``moe_time_share`` f and ``seconds_per_step`` s0 -- step time against the imbalance served.
    With ``n_b`` steps, ``tok_b`` routed tokens per step (load summed over experts, mean over
    layers, divided by steps) and the served imbalance ``x_b = sum_l max_rank / sum_l mean_rank``
    of ``rank_load`` in bucket b, the model is

        step_b = (c0 + c1 * tok_b / tok_mean) * ((1 - f) + f * x_b) + d * k_b / n_b   [+ noise]

    ``c0 + c1 * tok / tok_mean`` is the balanced step time (affine in the batch: a fixed part per
    step and a part per token), ``k_b`` the rearrangements observed in the bucket and ``d`` the
    seconds each one costs. In sync mode the measured durations are subtracted from the bucket's
    time first (``step_b - stall_b / n_b``) and ``d`` is not fitted; in async mode ``d`` is fitted
    (the durations say how long copies ran, not what they cost). Residuals are relative (noise is
    taken as proportional to step time) and the fit is robust (``scipy.optimize.least_squares``
    with the soft-L1 loss scaled to the residuals' MAD, so a few outlier buckets -- a GC pause, a
    burst of long prefills -- do not pull it). Uncertainty: the Gauss-Newton covariance of the
    inlier buckets (|residual| <= 3 robust sigma) times the robust residual variance.
    ``seconds_per_step`` is the balanced step time at the step-weighted mean batch.
    Refused (the default is kept, and the note says why) with fewer than :data:`MIN_FIT_BUCKETS`
    usable buckets, when the served imbalance spans less than :data:`MIN_IMBALANCE_SPREAD`
    (5th to 95th percentile), or when the fitted share's uncertainty exceeds
    :data:`MAX_SHARE_UNCERTAINTY`.

``sync_stall_s`` -- the median measured duration (sync mode), uncertainty the standard error of
    the median (1.2533 x 1.4826 x MAD / sqrt(n)); at least :data:`MIN_REARRANGEMENTS` needed.

``async_s_per_moved_byte`` -- async mode: ``d`` above divided by the bytes one GPU receives per
    rearrangement, from a replay of the recorded configuration over the trace
    (:class:`~moe_eplb.eplb.simulator.Replay`; needs the expert size).

``kv_throughput_elasticity`` -- the share of buckets in which the KV cache is the bottleneck,
    times :data:`FULL_KV_ELASTICITY` (1: losing x of the cache loses x of the throughput, batch
    size is capped by the cache). A bucket is KV-bound when its mean usage is at least
    :data:`KV_FULL_USAGE` and requests were preempted or waiting (usage alone when neither series
    was recorded). A cache that is not full costs nothing to shrink a little: elasticity 0.
    Uncertainty: the binomial standard error, at least ``1 / n`` in variance. Buckets without a
    usage sample (no engine ran) are left out.

``kv_cache_bytes_per_gpu`` -- the recorded value, plus the bytes the running redundancy takes
    (the cost model's parameter is the cache without redundant experts).

Every parameter carries ``source`` ``measured`` or ``default`` (the given cost model's value) and
an uncertainty (None for defaults). :meth:`Calibration.apply` returns the cost model with the
measured values. Pure: arrays in, numbers out (the async replay runs the policy in-process).
Assumptions and limits: docs/tuner.md ("Calibration").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from moe_eplb.eplb.costmodel import CostModel
from moe_eplb.eplb.exploration import LearnedRange
from moe_eplb.eplb.trace import LoadTrace, Telemetry

__all__ = [
    "MEASURED",
    "DEFAULT",
    "PARAMETERS",
    "CalibrationError",
    "Parameter",
    "Calibration",
    "StepFit",
    "fit_step_model",
    "fit_sync_stall",
    "kv_pressure",
    "calibrate",
    "with_learned",
]

MEASURED, DEFAULT = "measured", "default"
#: The calibrated cost-model fields (``CostModel`` attribute names), in report order.
PARAMETERS = ("moe_time_share", "seconds_per_step", "sync_stall_s", "async_s_per_moved_byte",
              "kv_throughput_elasticity", "kv_cache_bytes_per_gpu")

#: Fewest buckets (with steps, a step time and load) the step-time fit runs on.
MIN_FIT_BUCKETS = 20
#: Narrowest served-imbalance range (5th to 95th percentile) the share is fitted on.
MIN_IMBALANCE_SPREAD = 0.02
#: A fitted share less certain than this (one standard error) is not used.
MAX_SHARE_UNCERTAINTY = 0.1
#: Fewest observed rearrangements a rearrangement cost is measured from.
MIN_REARRANGEMENTS = 3
#: Mean KV-cache usage from which a bucket can be KV-bound.
KV_FULL_USAGE = 0.9
#: Elasticity when the KV cache is always the bottleneck.
FULL_KV_ELASTICITY = 1.0


class CalibrationError(ValueError):
    """A trace that cannot be calibrated on; the message names the key and the fix."""


@dataclass(frozen=True)
class Parameter:
    """One calibrated parameter: its value, one standard error (None for a default), its source
    (``measured`` or ``default``) and a note (how it was measured, or why the default stays)."""

    value: float
    uncertainty: float | None
    source: str
    note: str = ""

    def to_dict(self) -> dict:
        return {"value": self.value, "uncertainty": self.uncertainty, "source": self.source, "note": self.note}


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` found: every name of :data:`PARAMETERS`, the recorded mode
    (``use_async``, None when not recorded) and the fit's diagnostics."""

    parameters: dict[str, Parameter]
    use_async: bool | None = None
    fit: dict = field(default_factory=dict)
    #: the ranges a robust decision holds over (:mod:`moe_eplb.eplb.robust`), by cost-model field
    ranges: dict = field(default_factory=dict)
    #: the memory model fitted on KV usage and the prefix cache, or None without KV usage
    memory: MemoryFit | None = None

    @property
    def measured(self) -> tuple[str, ...]:
        """Names of the measured parameters."""
        return tuple(n for n, p in self.parameters.items() if p.source == MEASURED)

    def apply(self, cost: CostModel) -> CostModel:
        """``cost`` with the measured values (and the recorded async/sync mode) in place."""
        changes = {n: self.parameters[n].value for n in self.measured}
        if self.use_async is not None:
            changes["use_async"] = self.use_async
        if self.memory is not None:
            changes.update(self.memory.values)
        return replace(cost, **changes)

    def cost_at(self, cost: CostModel, values: dict) -> CostModel:
        """``cost`` with ``values`` (a scenario of :attr:`ranges`) in place; a working set without
        its own hit max takes the one that reproduces the observed hit rate."""
        values = dict(values)
        m = self.memory
        if (m is not None and m.prefix_measured and m.hit_rate and "prefix_working_set" in values
                and "prefix_hit_max" not in values):
            values["prefix_hit_max"] = _hit_max(m.hit_rate, m.free, values["prefix_working_set"])
        return replace(cost, **values)

    def robustness(self):
        """The ranges a tuner decision should hold over (:class:`moe_eplb.eplb.robust.Robustness`)."""
        from moe_eplb.eplb.robust import Robustness

        return Robustness(self.ranges, self.cost_at)

    def to_dict(self) -> dict:
        return {
            "parameters": {n: p.to_dict() for n, p in self.parameters.items()},
            "measured": list(self.measured),
            "use_async": self.use_async,
            "fit": self.fit,
            "ranges": {n: r.to_dict() for n, r in self.ranges.items()},
            "memory": None if self.memory is None else {
                "values": {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.memory.values.items()},
                "prefix_hit_rate": self.memory.hit_rate, "free_cache": self.memory.free,
                "prefix_working_set_se": self.memory.working_set_se,
                "prefix_measured": self.memory.prefix_measured, "notes": self.memory.notes},
        }


# --------------------------------------------------------------------------------------------------
# step time against served imbalance
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepFit:
    """The step-time model fitted (see the module docstring). ``share``/``share_se`` is f (None
    when refused, then ``reason`` says why), ``seconds_per_step``/``seconds_per_step_se`` the
    balanced step time at the step-weighted mean batch, ``rearrangement_s``/``rearrangement_se``
    the seconds one rearrangement costs (None unless fitted), ``sigma`` the robust relative
    residual scale, ``buckets`` the buckets used and ``outliers`` those beyond 3 sigma."""

    share: float | None
    share_se: float | None
    seconds_per_step: float | None
    seconds_per_step_se: float | None
    rearrangement_s: float | None
    rearrangement_se: float | None
    sigma: float
    buckets: int
    outliers: int
    imbalance_range: tuple[float, float]
    reason: str = ""
    coefficients: tuple[float, float, float, float] | None = None  # (c0, c1, tok_mean, f used)
    refused_share: tuple[float, float] | None = None  # (f, se) of a fit refused as too uncertain

    def predict(self, tokens_per_step: np.ndarray, imbalance: np.ndarray) -> np.ndarray:
        """Step time (s) the fitted model predicts without rearrangements."""
        c0, c1, tok_mean, f = self.coefficients
        return (c0 + c1 * np.asarray(tokens_per_step) / tok_mean) * (1.0 + f * (np.asarray(imbalance) - 1.0))


def _robust_sigma(r: np.ndarray) -> float:
    return float(1.4826 * np.median(np.abs(r - np.median(r)))) or float(np.std(r)) or 1e-6


def fit_step_model(step_seconds: np.ndarray, steps: np.ndarray, tokens_per_step: np.ndarray,
                   imbalance: np.ndarray, rearrangements: np.ndarray | None = None, *,
                   default_share: float = 0.35) -> StepFit:
    """Fit ``step = (c0 + c1 tok/tok_mean) ((1 - f) + f x) + d k / n`` (all arrays ``[B]`` over
    buckets with steps: ``step_seconds`` s, ``steps`` n, ``tokens_per_step`` tok, served
    ``imbalance`` x >= 1, ``rearrangements`` k per bucket or None for no d term).

    With too few buckets or too narrow an imbalance range, f is held at ``default_share`` (and the
    reason given) while the balanced step time is still fitted."""

    y = np.asarray(step_seconds, np.float64)
    n = np.asarray(steps, np.float64)
    tok = np.asarray(tokens_per_step, np.float64)
    x = np.asarray(imbalance, np.float64)
    B = y.size
    lo, hi = (float(np.percentile(x, 5)), float(np.percentile(x, 95))) if B else (math.nan, math.nan)
    if B < MIN_FIT_BUCKETS:
        return StepFit(None, None, None, None, None, None, math.nan, B, 0, (lo, hi),
                       f"{B} usable buckets (with steps, a step time and load); need {MIN_FIT_BUCKETS}")
    tok_mean = float(np.average(tok, weights=n)) or 1.0
    t = tok / tok_mean
    k_over_n = None if rearrangements is None else np.asarray(rearrangements, np.float64) / n
    fit_d = k_over_n is not None and np.count_nonzero(k_over_n) >= MIN_REARRANGEMENTS
    reason = ""
    fit_f = True
    if hi - lo < MIN_IMBALANCE_SPREAD:
        fit_f = False
        reason = (f"the served imbalance spans only {lo:.3f}-{hi:.3f} (5th-95th percentile, spread {hi - lo:.3f} "
                  f"< {MIN_IMBALANCE_SPREAD}): step time cannot be told apart from noise; record a longer or "
                  "more varied window (e.g. across a rearrangement or a change of the traffic mix)")

    est = _least_squares(y, n, t, x, k_over_n if fit_d else None, fit_f, default_share)
    refused = None
    if not fit_f and hi - lo > 0:  # no point value, but the free fit still bounds the share
        free = _least_squares(y, n, t, x, k_over_n if fit_d else None, True, default_share)
        refused = (free["f"], free["f_se"])
    if fit_f and est["f_se"] > MAX_SHARE_UNCERTAINTY:
        reason = (f"the fitted share {est['f']:.3f} +/- {est['f_se']:.3f} is too uncertain (> {MAX_SHARE_UNCERTAINTY}): "
                  f"step-time noise {est['sigma']:.1%} against served imbalance {lo:.3f}-{hi:.3f}; record longer")
        fit_f = False
        refused = (est["f"], est["f_se"])
        est = _least_squares(y, n, t, x, k_over_n if fit_d else None, False, default_share)
    return StepFit(est["f"] if fit_f else None, est["f_se"] if fit_f else None, est["s0"], est["s0_se"],
                   est.get("d"), est.get("d_se"), est["sigma"], B, est["outliers"], (lo, hi), reason,
                   (est["c0"], est["c1"], tok_mean, est["f"]), refused)


def _least_squares(y: np.ndarray, n: np.ndarray, t: np.ndarray, x: np.ndarray, k_over_n: np.ndarray | None,
                   fit_f: bool, default_share: float) -> dict:
    """One robust fit of the step model (see :func:`fit_step_model`); f held at ``default_share``
    unless ``fit_f``, no d term when ``k_over_n`` is None. Returns the estimates and standard errors."""
    from scipy.optimize import least_squares

    B = y.size
    fit_d = k_over_n is not None
    names = ["c0", "c1"] + (["f"] if fit_f else []) + (["d"] if fit_d else [])

    def unpack(p):
        v = dict(zip(names, p))
        return v["c0"], v["c1"], v.get("f", default_share), v.get("d", 0.0)

    def model(p):
        c0, c1, f, d = unpack(p)
        s0 = c0 + c1 * t
        m = s0 * (1.0 + f * (x - 1.0))
        return m + d * k_over_n if fit_d else m

    def resid(p):
        return (model(p) - y) / y

    def jac(p):
        c0, c1, f, d = unpack(p)
        g = 1.0 + f * (x - 1.0)
        cols = [g, t * g]
        if fit_f:
            cols.append((c0 + c1 * t) * (x - 1.0))
        if fit_d:
            cols.append(k_over_n)
        return np.stack(cols, axis=1) / y[:, None]

    # start: a plain least-squares line through step / ((1 - f0) + f0 x)
    g0 = 1.0 + default_share * (x - 1.0)
    A = np.stack([np.ones(B), t], axis=1)
    c_start, *_ = np.linalg.lstsq(A, y / g0, rcond=None)
    c_start = np.maximum(c_start, [1e-9, 0.0])
    if c_start.sum() <= 0:
        c_start = np.array([float(np.median(y)), 0.0])
    p0 = list(c_start) + ([default_share] if fit_f else []) + ([0.0] if fit_d else [])
    lb = [0.0, 0.0] + ([0.0] if fit_f else []) + ([0.0] if fit_d else [])
    ub = [np.inf, np.inf] + ([1.0] if fit_f else []) + ([np.inf] if fit_d else [])
    p0 = np.clip(p0, np.array(lb) + 1e-12, np.where(np.isfinite(ub), np.array(ub) - 1e-12, np.inf))
    first = least_squares(resid, p0, jac=jac, bounds=(lb, ub), loss="linear", method="trf")
    sigma = _robust_sigma(first.fun)
    res = least_squares(resid, first.x, jac=jac, bounds=(lb, ub), loss="soft_l1", f_scale=sigma, method="trf")
    r = res.fun
    sigma = _robust_sigma(r)
    inl = np.abs(r) <= 3.0 * sigma
    J = jac(res.x)[inl]
    cov = np.linalg.pinv(J.T @ J) * sigma**2
    c0, c1, f, d = unpack(res.x)
    idx = {nm: i for i, nm in enumerate(names)}
    grad = np.zeros(len(names))
    grad[idx["c0"]], grad[idx["c1"]] = 1.0, float(np.average(t, weights=n))
    f_se = float(math.sqrt(max(cov[idx["f"], idx["f"]], 0.0))) if fit_f else 0.0
    out = {"c0": float(c0), "c1": float(c1), "f": float(f), "f_se": f_se,
           "s0": float(c0 + c1 * grad[idx["c1"]]), "s0_se": float(math.sqrt(max(grad @ cov @ grad, 0.0))),
           "sigma": sigma, "outliers": int(np.count_nonzero(~inl))}
    if fit_d:
        out["d"], out["d_se"] = float(d), float(math.sqrt(max(cov[idx["d"], idx["d"]], 0.0)))
    return out



# --------------------------------------------------------------------------------------------------
# rearrangements and KV cache
# --------------------------------------------------------------------------------------------------


def fit_sync_stall(seconds: np.ndarray) -> tuple[float, float] | None:
    """``(median, standard error of the median)`` of measured sync rearrangement durations
    (seconds), or None with fewer than :data:`MIN_REARRANGEMENTS`."""
    s = np.asarray(seconds, np.float64)
    if s.size < MIN_REARRANGEMENTS:
        return None
    med = float(np.median(s))
    mad = float(np.median(np.abs(s - med)))
    return med, 1.2533 * 1.4826 * mad / math.sqrt(s.size)


def _kv_bound(usage: np.ndarray, preemptions: np.ndarray | None, waiting: np.ndarray | None) -> np.ndarray:
    """``[T]`` buckets whose KV cache is the bottleneck (see :func:`kv_pressure`)."""
    u = np.asarray(usage, np.float64)
    full = np.where(np.isfinite(u), u, 0.0) >= KV_FULL_USAGE
    if preemptions is not None or waiting is not None:
        queue = np.zeros(u.shape, bool)
        if preemptions is not None:
            queue |= np.asarray(preemptions) > 0
        if waiting is not None:
            queue |= np.nan_to_num(np.asarray(waiting, np.float64)) >= 0.5
        full &= queue
    return full


def kv_pressure(usage: np.ndarray, preemptions: np.ndarray | None, waiting: np.ndarray | None
                ) -> tuple[float, float, float]:
    """``(elasticity, standard error, KV-bound share of buckets)`` from per-bucket mean usage
    ``[T]`` (0..1), preemptions ``[T]`` and mean waiting requests ``[T]`` (either may be None).

    A bucket is KV-bound when usage >= :data:`KV_FULL_USAGE` and some request was preempted or
    waiting (usage alone when neither series exists); the elasticity is the KV-bound share times
    :data:`FULL_KV_ELASTICITY`."""
    u = np.asarray(usage, np.float64)
    seen = np.isfinite(u)  # buckets where an engine ran
    full = _kv_bound(u, preemptions, waiting)
    u, full = u[seen], full[seen]
    n = max(u.size, 1)
    share = float(full.mean()) if u.size else 0.0
    se = math.sqrt(max(share * (1 - share), 1.0 / n) / n)
    return FULL_KV_ELASTICITY * share, FULL_KV_ELASTICITY * se, share


def _moved_bytes_per_rearrangement(trace: LoadTrace, tel: Telemetry, cost: CostModel, num_nodes: int,
                                   num_groups: int) -> tuple[float | None, str]:
    """Mean bytes one GPU receives per rearrangement of the recorded configuration, from a replay of
    the trace (the first rearrangement, out of vLLM's start-up placement, left out when there are
    more); (None, why) when it cannot be known."""
    from moe_eplb.eplb.simulator import Replay, SimError, Topology

    L, E = trace.num_layers, trace.num_experts
    per_expert = cost.resolve_bytes_per_expert(L, E)
    if per_expert is None:
        return None, f"the expert size of a {L} x {E} model is unknown (pass --bytes-per-expert)"
    if tel.config is None or tel.ep_size is None:
        return None, "no recorded config (with ep_size) to replay"
    try:
        res = Replay(trace, Topology(tel.ep_size, num_nodes, num_groups), cost).run(tel.config.knobs)
    except SimError as exc:
        return None, f"the recorded config cannot be replayed: {exc}"
    moved = res.moved_per_rearrangement.astype(np.float64)
    if moved.size > 1:
        moved = moved[1:]
    if moved.size == 0 or moved.mean() <= 0:
        return None, "the replay of the recorded config moves no expert"
    return float(moved.mean()) * per_expert / tel.ep_size, ""


def _with_rearrangement_cost(fit: StepFit, step: np.ndarray, n: np.ndarray, tok: np.ndarray, imb: np.ndarray,
                             count: np.ndarray, ok: np.ndarray) -> StepFit:
    """``fit`` (made on buckets without a rearrangement) with the seconds one rearrangement costs:
    the step model refitted on every bucket with a term per rearrangement, the share held at
    ``fit``'s (``d`` of :func:`fit_step_model`)."""
    if np.count_nonzero(ok & (count > 0)) < MIN_REARRANGEMENTS:
        return fit
    c0, c1, tok_mean, f = fit.coefficients
    est = _least_squares(step[ok], n[ok], tok[ok] / tok_mean, imb[ok], count[ok] / n[ok], False, f)
    return replace(fit, rearrangement_s=est["d"], rearrangement_se=est["d_se"])


def _tokens_per_step(trace: LoadTrace) -> np.ndarray:
    routed = trace.load.sum(axis=2).mean(axis=1)  # [T] (token, top-k slot) pairs per layer
    steps = trace.bucket_steps.astype(np.float64)
    return np.divide(routed, steps, out=np.zeros_like(routed), where=steps > 0)


def calibrate(trace: LoadTrace, *, cost: CostModel = CostModel(), num_nodes: int = 1,
              num_groups: int = 1, learned: Sequence[LearnedRange] = ()) -> Calibration:
    """Measure the cost model's parameters from ``trace.telemetry`` (see the module docstring).

    ``cost`` supplies the defaults (and the expert size, for the async rearrangement cost and the
    KV cache taken by the running redundancy); ``num_nodes``/``num_groups`` the topology of the
    replay the async cost needs. ``learned``: ranges earlier experiments narrowed
    (:func:`moe_eplb.eplb.learn.learn`, kept in ``status.autotune.learned``); each parameter's range
    is intersected with them (:func:`with_learned`) and ``fit["learned"]`` says so.

    Raises:
        CalibrationError: the trace has no telemetry at all.
    """
    tel = trace.telemetry
    if tel is None:
        from moe_eplb.contracts.trace_format import TELEMETRY_KEYS

        raise CalibrationError(f"trace: has none of the telemetry keys ({', '.join(TELEMETRY_KEYS)}); record it "
                               "with the operator's reader or the exporter's trace capture (docs/traces.md)")
    params: dict[str, Parameter] = {}

    def default(name: str, why: str) -> None:
        value = getattr(cost, name)
        if name == "seconds_per_step" and value is None:  # what the simulator uses: from the trace
            value = cost.step_seconds(trace.bucket_seconds, trace.total_steps / trace.num_buckets)
            why += "; bucket_seconds / steps per bucket"
        params[name] = Parameter(float(value), None, DEFAULT, why)

    use_async = tel.config.use_async if tel.config is not None else None
    mode_async = cost.use_async if use_async is None else use_async
    fit_info: dict = {"buckets": trace.num_buckets,
                      "mode": ("async" if mode_async else "sync") + (" (recorded)" if use_async is not None
                                                                     else " (not recorded: the cost model's)")}

    # the steps: step time against served imbalance, the rearrangement cost, the KV cache and memory
    counts = tel.rearrangements_per_bucket(trace.num_buckets)
    step_fit = _fit_step_time(trace, tel, cost, counts, mode_async, params, default, fit_info)
    _fit_rearrangement_cost(trace, tel, cost, counts, mode_async, step_fit, num_nodes, num_groups,
                            params, default, fit_info)
    cal = _kv_and_memory(trace, cost, params, default, fit_info, step_fit, mode_async, use_async)
    return with_learned(cal, learned) if learned else cal


def with_learned(cal: Calibration, learned: Sequence[LearnedRange]) -> Calibration:
    """``cal`` with each learned range intersected with the calibration's range of its parameter
    (the arms' range alone where the two miss each other: the experiment is the more direct
    measurement). The range's ``source`` becomes ``experiment``; its point estimate is the
    calibration's value where that lies inside and was measured, else the middle of the range.
    ``fit["learned"]`` lists what was applied (or why not: a parameter this calibration has no
    range for)."""
    from moe_eplb.eplb.robust import EXPERIMENT, Range

    ranges, notes = dict(cal.ranges), []
    for lr in learned:
        r = ranges.get(lr.parameter)
        if r is None:
            notes.append({"parameter": lr.parameter, "source": lr.source, "applied": False,
                          "note": "no range of this parameter in this calibration"})
            continue
        lo, hi = max(r.low, lr.low), min(r.high, lr.high)
        if lo >= hi:
            lo, hi = lr.low, lr.high
        value = r.value if r.source == MEASURED and lo <= r.value <= hi else 0.5 * (lo + hi)
        note = f"{lo:.3g}-{hi:.3g} learned by {lr.source} (was {r.low:.3g}-{r.high:.3g}, {r.source})"
        ranges[lr.parameter] = Range(lr.parameter, float(value), float(lo), float(hi), EXPERIMENT, note)
        notes.append({"parameter": lr.parameter, "source": lr.source, "applied": True, "low": lo, "high": hi,
                      "was": [r.low, r.high], "was_source": r.source})
    return replace(cal, ranges=ranges, fit={**cal.fit, "learned": notes})


#: rearrangements and stall seconds per bucket (:meth:`Telemetry.rearrangements_per_bucket`), or None
_Counts = tuple[np.ndarray, np.ndarray] | None


def _fit_step_time(trace: LoadTrace, tel: Telemetry, cost: CostModel, counts: _Counts, mode_async: bool,
                   params: dict, default: Callable[[str, str], None], fit_info: dict) -> StepFit | None:
    """Step 1 of :func:`calibrate`: the step time against the served imbalance (the MoE time share
    and the balanced step time); None when the trace lacks the step times or the rank loads."""
    if tel.step_seconds is None or tel.rank_load is None:
        missing = " and ".join(k for k in ("step_seconds", "rank_load") if getattr(tel, k) is None)
        why = f"needs step_seconds and rank_load; the trace has no {missing}"
        default("moe_time_share", why)
        default("seconds_per_step", why)
        return None
    imb = tel.served_imbalance()
    step = tel.step_seconds.copy()
    n = trace.bucket_steps.astype(np.float64)
    tok = _tokens_per_step(trace)
    ok = (n > 0) & np.isfinite(step) & (step > 0) & np.isfinite(imb)
    use, k = ok, None
    if counts is not None:
        # A bucket that spans a rearrangement served two placements: its summed rank load hides
        # part of the imbalance its steps saw. Fit on the buckets without one when enough remain.
        clean = ok & (counts[0] == 0)
        if clean.sum() >= MIN_FIT_BUCKETS:
            use = clean
        elif mode_async:
            k = counts[0]
        if not mode_async:  # a sync stall happens inside an engine step: out of the bucket's mean
            step = step - np.divide(counts[1], n, out=np.zeros_like(step), where=n > 0)
    step_fit = fit_step_model(step[use], n[use], tok[use], imb[use], None if k is None else k[use],
                              default_share=cost.moe_time_share)
    if counts is not None and mode_async and use is not ok and step_fit.coefficients is not None:
        step_fit = _with_rearrangement_cost(step_fit, step, n, tok, imb, counts[0], ok)
    if step_fit.refused_share is not None:
        fit_info["refused_share"] = list(step_fit.refused_share)
    fit_info.update({"step_buckets": step_fit.buckets, "outlier_buckets": step_fit.outliers,
                     "residual_sigma": step_fit.sigma,
                     "served_imbalance_p5_p95": list(step_fit.imbalance_range),
                     "buckets_with_rearrangement_left_out": bool(use is not ok)})
    if step_fit.share is not None:
        params["moe_time_share"] = Parameter(step_fit.share, step_fit.share_se, MEASURED,
                                             f"step time against served imbalance {step_fit.imbalance_range[0]:.3f}-"
                                             f"{step_fit.imbalance_range[1]:.3f} over {step_fit.buckets} buckets "
                                             f"(robust fit, residual {step_fit.sigma:.1%})")
    else:
        default("moe_time_share", step_fit.reason)
    if step_fit.seconds_per_step is not None:
        params["seconds_per_step"] = Parameter(
            step_fit.seconds_per_step, step_fit.seconds_per_step_se, MEASURED,
            "balanced step time at the mean batch" + ("" if step_fit.share is not None
                                                     else f" (with the default share {cost.moe_time_share})"))
    else:
        default("seconds_per_step", step_fit.reason)
    return step_fit


def _fit_rearrangement_cost(trace: LoadTrace, tel: Telemetry, cost: CostModel, counts: _Counts, mode_async: bool,
                            step_fit: StepFit | None, num_nodes: int, num_groups: int, params: dict,
                            default: Callable[[str, str], None], fit_info: dict) -> None:
    """Step 2 of :func:`calibrate`: what a rearrangement costs -- the stall of a sync one (the median
    of the measured stalls), or the step time an async one loses per byte moved (from the step fit)."""
    if counts is None:
        why = "the trace has no rearrangements"
        default("sync_stall_s", why)
        default("async_s_per_moved_byte", why)
    elif not mode_async:
        default("async_s_per_moved_byte", "sync mode: not used")
        fitted = fit_sync_stall([e.seconds for e in tel.rearrangements or ()])
        if fitted is None:
            default("sync_stall_s", f"{len(tel.rearrangements or ())} rearrangements observed; "
                                    f"need {MIN_REARRANGEMENTS}")
        else:
            params["sync_stall_s"] = Parameter(fitted[0], fitted[1], MEASURED,
                                               f"median of {len(tel.rearrangements)} measured stalls")
    else:
        default("sync_stall_s", "async mode: not used")
        if step_fit is None or step_fit.rearrangement_s is None:
            why = ("needs step_seconds and rank_load" if step_fit is None
                   else f"fewer than {MIN_REARRANGEMENTS} buckets with a rearrangement, or the step fit was refused")
            default("async_s_per_moved_byte", why)
        else:
            per_gpu, why = _moved_bytes_per_rearrangement(trace, tel, cost, num_nodes, num_groups)
            fit_info["rearrangement_seconds_lost"] = step_fit.rearrangement_s
            if per_gpu is None:
                default("async_s_per_moved_byte", why)
            else:
                fit_info["moved_bytes_per_gpu_per_rearrangement"] = per_gpu
                params["async_s_per_moved_byte"] = Parameter(
                    step_fit.rearrangement_s / per_gpu, (step_fit.rearrangement_se or 0.0) / per_gpu, MEASURED,
                    f"{step_fit.rearrangement_s:.3g} s of step time lost per rearrangement over "
                    f"{per_gpu / 1e6:.3g} MB received per GPU (replay of the recorded config)")


def _kv_and_memory(trace: LoadTrace, cost: CostModel, params: dict, default, fit_info: dict, step_fit: StepFit | None,
                   mode_async: bool, use_async: bool | None) -> Calibration:
    """The KV parameters (elasticity, cache size), the memory model and the ranges; the finished
    :class:`Calibration` (``default(name, why)`` records a default, as in :func:`calibrate`)."""
    tel = trace.telemetry
    if tel.kv_cache_usage is None:
        default("kv_throughput_elasticity", "the trace has no kv_cache_usage")
    else:
        e, se, share = kv_pressure(tel.kv_cache_usage, tel.preemptions, tel.requests_waiting)
        signals = " and ".join(k for k in ("preemptions", "requests_waiting") if getattr(tel, k) is not None)
        fit_info["kv_bound_share"] = share
        params["kv_throughput_elasticity"] = Parameter(
            e, se, MEASURED,
            f"KV cache the bottleneck in {share:.0%} of {trace.num_buckets} buckets (usage >= {KV_FULL_USAGE}"
            + (f" with {signals})" if signals else "; no preemption or queue series recorded)"))
    if tel.kv_cache_bytes_per_gpu is None:
        default("kv_cache_bytes_per_gpu", "the trace has no kv_cache_bytes_per_gpu")
    else:
        kv = tel.kv_cache_bytes_per_gpu
        note = "recorded"
        if tel.config is not None and tel.config.knobs.num_redundant_experts and tel.ep_size:
            extra = cost.redundant_bytes_per_gpu(trace.num_layers, trace.num_experts,
                                                 tel.config.knobs.num_redundant_experts, tel.ep_size)
            if extra:
                kv += extra
                note = f"recorded, plus the {extra / 2**30:.2f} GiB the running redundancy takes"
        params["kv_cache_bytes_per_gpu"] = Parameter(kv, 0.0, MEASURED, note)
    capacity_now = (tel.kv_cache_bytes_per_gpu / params["kv_cache_bytes_per_gpu"].value
                    if tel.kv_cache_bytes_per_gpu is not None else 1.0)
    memory = fit_memory(trace, cost, step_fit, capacity_now)
    if memory is not None:
        fit_info["memory"] = memory.notes
    ordered = {n: params[n] for n in PARAMETERS}
    refused = step_fit.refused_share if step_fit is not None else None
    return Calibration(ordered, use_async, fit_info, _ranges(ordered, mode_async, memory, cost, refused), memory)


def _ranges(params: dict[str, Parameter], mode_async: bool, memory: MemoryFit | None, cost: CostModel,
            refused_share: tuple[float, float] | None = None) -> dict:
    """The range of every parameter the decision should hold over (:class:`moe_eplb.eplb.robust.Range`):
    a measured one +/- 2 standard errors, the others over a stated prior range."""
    from moe_eplb.eplb.robust import Range

    out: dict = {}

    def add(name, value, lo, hi, source, note=""):
        out[name] = Range(name, float(value), float(min(lo, value)), float(max(hi, value)), source, note)

    def measured_or(name, prior_lo, prior_hi, floor=0.0, ceil=math.inf, rel=0.1):
        p = params[name]
        if p.source == MEASURED:
            half = max(2.0 * (p.uncertainty or 0.0), rel * abs(p.value))
            add(name, p.value, max(floor, p.value - half), min(ceil, p.value + half), MEASURED,
                "+/- 2 standard errors (at least 10 %)")
        else:
            add(name, p.value, prior_lo, prior_hi, "prior", "not measured: " + p.note)

    lo, hi = MOE_SHARE_PRIOR
    if refused_share is not None:  # too uncertain for a point value, but it still narrows the prior
        f, se = refused_share
        lo, hi = max(lo, f - 2 * se), min(hi, f + 2 * se)
        lo, hi = (lo, hi) if lo < hi else MOE_SHARE_PRIOR
    measured_or("moe_time_share", lo, hi, 0.0, 1.0, rel=0.0)
    if refused_share is not None and out["moe_time_share"].source != MEASURED:
        # the point estimate inside the fit's own range: the middle of it, not the constant
        out["moe_time_share"] = Range("moe_time_share", 0.5 * (lo + hi), lo, hi,
                                      "prior", f"fit refused ({f:.3f} +/- {se:.3f}): the prior "
                                      f"{MOE_SHARE_PRIOR[0]}-{MOE_SHARE_PRIOR[1]} cut to +/- 2 standard errors")
    if mode_async:
        v = params["async_s_per_moved_byte"].value
        measured_or("async_s_per_moved_byte", 0.25 * v, 4.0 * v)
    else:
        measured_or("sync_stall_s", 0.3, 2.0)
    if memory is None:
        measured_or("kv_throughput_elasticity", 0.0, 1.0, 0.0, 1.0)
        return out
    v = memory.values
    add("kv_batch_elasticity", cost.kv_batch_elasticity, *KV_BATCH_ELASTICITY_PRIOR, "prior",
        "throughput against batch once the cache caps it")
    add("kv_full_usage", cost.kv_full_usage, *KV_FULL_USAGE_PRIOR, "prior", "usage at which vLLM preempts")
    if not memory.prefix_measured:
        add("prefix_hit_max", 0.0, *PREFIX_HIT_PRIOR, "prior", "no prefix-cache telemetry")
        add("prefix_working_set", cost.prefix_working_set, *PREFIX_WORKING_SET_PRIOR, "prior", "no prefix-cache telemetry")
        add("prefix_prefill_share", 0.3, 0.1, 0.6, "prior", "no prefix-cache telemetry")
        return out
    if not memory.hit_rate:
        return out  # nothing hits the prefix cache: redundancy cannot evict what is never reused
    k = v["prefix_working_set"]
    if memory.working_set_se is not None:
        add("prefix_working_set", k, max(1e-3, k - 2 * memory.working_set_se), k + 2 * memory.working_set_se,
            MEASURED, "hit rate against free cache, +/- 2 standard errors")
    else:
        lo, hi = _working_set_range(memory.hit_rate, memory.free)
        add("prefix_working_set", k, lo, hi, "prior", memory.notes.get("prefix_working_set", ""))
    sh = v["prefix_prefill_share"]
    add("prefix_prefill_share", sh, sh * PREFILL_SHARE_PRIOR[0], min(0.9, sh * PREFILL_SHARE_PRIOR[1]), "prior",
        "measured share x 0.5-2 (what a prompt token costs against an average token)")
    return out


# --------------------------------------------------------------------------------------------------
# the memory model: KV demand, prefix-cache hit rate against free cache, prefill share
# --------------------------------------------------------------------------------------------------

#: KV demand given to a KV-bound bucket (in caches): more than any cache holds, so its batch follows
#: the cache's size whatever the redundancy.
KV_BOUND_DEMAND = 2.0
#: Quantiles of the per-bucket KV demand the cost model keeps.
DEMAND_QUANTILES = 32
#: Least spread (5th to 95th percentile, in caches) of the free cache over which the prefix-cache
#: curve's working set is fitted; narrower keeps the prior range.
MIN_FREE_SPREAD = 0.1
#: Prior range of the prefix working set (in caches without redundant experts) where the telemetry
#: cannot pin it: from a cache 20x the working set up to 2 caches.
PREFIX_WORKING_SET_PRIOR = (0.05, 2.0)
#: Prior range of the prefix hit rate an unlimited cache would reach, without prefix telemetry
#: (the llm-d study measured 68.6 % with prefix-affinity routing).
PREFIX_HIT_PRIOR = (0.0, 0.7)
#: Prior factor range on the measured prefill share: a prompt token may cost from half to twice an
#: average token of the step (attention over long prompts, chunked prefill).
PREFILL_SHARE_PRIOR = (0.5, 2.0)
#: Prior range of the MoE share of a step where the fit cannot pin it (published 0.03 on H800 to
#: about 0.6 for prefill-heavy work).
MOE_SHARE_PRIOR = (0.03, 0.6)
#: Prior ranges of the batch elasticity and of the usage at which vLLM starts preempting.
KV_BATCH_ELASTICITY_PRIOR = (0.5, 1.0)
KV_FULL_USAGE_PRIOR = (0.9, 1.0)


@dataclass(frozen=True)
class MemoryFit:
    """The memory model's values (:class:`CostModel` field -> value) and what pins them: ``hit_rate``
    the observed (queries-weighted) prefix hit rate, ``free`` the median free cache it was seen at
    (in caches without redundant experts), ``working_set`` the fitted K with its standard error
    (None when the prior range stands), ``notes`` by field."""

    values: dict
    hit_rate: float | None
    free: float | None
    working_set_se: float | None
    prefix_measured: bool
    notes: dict


def _fit_prefix_curve(free: np.ndarray, hit: np.ndarray, w: np.ndarray) -> tuple[float, float, float] | None:
    """``(hit_max, working_set, working_set se)`` of ``hit = hit_max (1 - exp(-free / K))`` fitted
    on buckets (weights ``w``), or None when the fit fails."""
    from scipy.optimize import least_squares

    sw = np.sqrt(w / w.mean())

    def resid(p):
        return sw * (p[0] * (1.0 - np.exp(-free / p[1])) - hit)

    try:
        res = least_squares(resid, [min(0.99, max(hit.max(), 0.05)), max(float(np.median(free)), 0.05)],
                            bounds=([0.0, 1e-3], [1.0, 20.0]))
    except ValueError:
        return None
    J = res.jac
    sigma2 = float(res.fun @ res.fun) / max(free.size - 2, 1)
    cov = np.linalg.pinv(J.T @ J) * sigma2
    return float(res.x[0]), float(res.x[1]), float(math.sqrt(max(cov[1, 1], 0.0)))


def fit_memory(trace: LoadTrace, cost: CostModel, step_fit: StepFit | None, capacity_now: float) -> MemoryFit | None:
    """The memory model from ``trace.telemetry`` (KV usage required; prefix counters and the step
    fit used when present), ``capacity_now`` the running cache as a share of the cache without
    redundant experts. None without ``kv_cache_usage``."""
    tel = trace.telemetry
    if tel is None or tel.kv_cache_usage is None:
        return None
    usage = tel.kv_cache_usage
    seen = np.isfinite(usage)
    demand = usage * capacity_now
    # a KV-bound bucket (full, with preemptions or a queue) wants more than any cache: its batch stays
    # capped and follows the cache's size
    bound = _kv_bound(usage, tel.preemptions, tel.requests_waiting)
    demand = np.where(bound, KV_BOUND_DEMAND, demand)[seen]
    qs = (np.arange(DEMAND_QUANTILES) + 0.5) / DEMAND_QUANTILES
    values: dict = {"kv_demand": tuple(float(x) for x in np.quantile(demand, qs))}
    notes = {"kv_demand": f"KV usage of {int(seen.sum())} buckets x the running cache ({capacity_now:.3f} of the "
                          "cache without redundant experts)"}
    if tel.kv_cache_tokens:
        values["kv_bytes_per_token"] = float(tel.kv_cache_bytes_per_gpu or cost.kv_cache_bytes_per_gpu * capacity_now) \
            / tel.kv_cache_tokens
    full = cost.kv_full_usage
    hit_obs = free_obs = k_se = None
    measured = False
    if tel.prefix_cache_hit_rate is not None and tel.prefix_cache_queries is not None:
        q = tel.prefix_cache_queries
        ok = seen & np.isfinite(tel.prefix_cache_hit_rate) & (q > 0)
        if ok.any():
            measured = True
            h = tel.prefix_cache_hit_rate[ok]
            free = capacity_now - np.minimum(usage[ok] * capacity_now, full * capacity_now)
            hit_obs = float(np.average(h, weights=q[ok]))
            free_obs = float(np.median(free))
            spread = float(np.percentile(free, 95) - np.percentile(free, 5))
            fitted = _fit_prefix_curve(free, h, q[ok]) if ok.sum() >= MIN_FIT_BUCKETS and spread >= MIN_FREE_SPREAD \
                and hit_obs >= 1e-3 else None
            if hit_obs < 1e-3:
                values["prefix_hit_max"] = 0.0
                notes["prefix_working_set"] = f"the prefix cache hit {hit_obs:.2%} of {q[ok].sum():.3g} queried tokens"
            elif fitted is not None and fitted[2] < fitted[1]:
                values["prefix_hit_max"], values["prefix_working_set"], k_se = fitted
                notes["prefix_working_set"] = (f"hit rate against free cache over {int(ok.sum())} buckets (free "
                                               f"{np.percentile(free, 5):.2f}-{np.percentile(free, 95):.2f} caches)")
            else:
                lo, hi = _working_set_range(hit_obs, free_obs)
                values["prefix_working_set"] = 0.5 * (lo + hi)
                values["prefix_hit_max"] = _hit_max(hit_obs, free_obs, values["prefix_working_set"])
                notes["prefix_working_set"] = (f"prior range {lo:.3g}-{hi:.3g}: the free cache spans only {spread:.2f} "
                                               f"caches (< {MIN_FREE_SPREAD}) or too few buckets; hit rate {hit_obs:.1%} "
                                               f"at {free_obs:.2f} caches free")
            values["prefix_prefill_share"] = _prefill_share(trace, step_fit, ok, hit_obs)
    if not measured:
        values["prefix_hit_max"] = 0.0
        notes["prefix_working_set"] = "no prefix-cache telemetry: hit rate 0 assumed, prior range kept"
    return MemoryFit(values, hit_obs, free_obs, k_se, measured, notes)


def _hit_max(hit: float, free: float, k: float) -> float:
    return float(min(1.0, hit / max(1.0 - math.exp(-free / k), 1e-9))) if hit > 0 else 0.0


def _working_set_range(hit: float, free: float) -> tuple[float, float]:
    """Prior range of K where one (hit rate, free cache) point cannot pin it: up to where the hit
    rate of an unlimited cache would have to be 1."""
    lo, hi = PREFIX_WORKING_SET_PRIOR
    if 0 < hit < 1 and free > 0:
        hi = min(hi, free / -math.log(1.0 - hit))
    return min(lo, hi), max(hi, lo)


def _prefill_share(trace: LoadTrace, step_fit: StepFit | None, ok: np.ndarray, hit: float) -> float:
    """Share of a step the queried prompt tokens would take if none hit (step-weighted): from the
    step fit's cost per token where there is one (a fixed part per step otherwise taken as 0)."""
    tel = trace.telemetry
    n = trace.bucket_steps.astype(np.float64)
    use = ok & (n > 0)
    if not use.any():
        return 0.0
    q = tel.prefix_cache_queries[use] * float(trace.top_k or 1) / n[use]  # routed units, as tokens_per_step
    tok = _tokens_per_step(trace)[use]
    h = tel.prefix_cache_hit_rate[use]
    c0, c1, tok_mean = 0.0, 1.0, 1.0
    if step_fit is not None and step_fit.coefficients is not None:
        c0, c1, tok_mean, _ = step_fit.coefficients
    share = c1 * q / tok_mean / (c0 + c1 * (tok + q * h) / tok_mean)
    return float(min(0.9, np.average(share, weights=n[use])))
