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
from dataclasses import dataclass, field, replace

import numpy as np

from moe_eplb.eplb.costmodel import CostModel
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

    @property
    def measured(self) -> tuple[str, ...]:
        """Names of the measured parameters."""
        return tuple(n for n, p in self.parameters.items() if p.source == MEASURED)

    def apply(self, cost: CostModel) -> CostModel:
        """``cost`` with the measured values (and the recorded async/sync mode) in place."""
        changes = {n: self.parameters[n].value for n in self.measured}
        if self.use_async is not None:
            changes["use_async"] = self.use_async
        return replace(cost, **changes)

    def to_dict(self) -> dict:
        return {
            "parameters": {n: p.to_dict() for n, p in self.parameters.items()},
            "measured": list(self.measured),
            "use_async": self.use_async,
            "fit": self.fit,
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
    if fit_f and est["f_se"] > MAX_SHARE_UNCERTAINTY:
        reason = (f"the fitted share {est['f']:.3f} +/- {est['f_se']:.3f} is too uncertain (> {MAX_SHARE_UNCERTAINTY}): "
                  f"step-time noise {est['sigma']:.1%} against served imbalance {lo:.3f}-{hi:.3f}; record longer")
        fit_f = False
        est = _least_squares(y, n, t, x, k_over_n if fit_d else None, False, default_share)
    return StepFit(est["f"] if fit_f else None, est["f_se"] if fit_f else None, est["s0"], est["s0_se"],
                   est.get("d"), est.get("d_se"), est["sigma"], B, est["outliers"], (lo, hi), reason,
                   (est["c0"], est["c1"], tok_mean, est["f"]))


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


def kv_pressure(usage: np.ndarray, preemptions: np.ndarray | None, waiting: np.ndarray | None
                ) -> tuple[float, float, float]:
    """``(elasticity, standard error, KV-bound share of buckets)`` from per-bucket mean usage
    ``[T]`` (0..1), preemptions ``[T]`` and mean waiting requests ``[T]`` (either may be None).

    A bucket is KV-bound when usage >= :data:`KV_FULL_USAGE` and some request was preempted or
    waiting (usage alone when neither series exists); the elasticity is the KV-bound share times
    :data:`FULL_KV_ELASTICITY`."""
    u = np.asarray(usage, np.float64)
    seen = np.isfinite(u)  # buckets where an engine ran
    full = np.where(seen, u, 0.0) >= KV_FULL_USAGE
    if preemptions is not None or waiting is not None:
        queue = np.zeros(u.shape, bool)
        if preemptions is not None:
            queue |= np.asarray(preemptions) > 0
        if waiting is not None:
            queue |= np.nan_to_num(np.asarray(waiting, np.float64)) >= 0.5
        full &= queue
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
              num_groups: int = 1) -> Calibration:
    """Measure the cost model's parameters from ``trace.telemetry`` (see the module docstring).

    ``cost`` supplies the defaults (and the expert size, for the async rearrangement cost and the
    KV cache taken by the running redundancy); ``num_nodes``/``num_groups`` the topology of the
    replay the async cost needs.

    Raises:
        CalibrationError: the trace has no telemetry at all.
    """
    tel = trace.telemetry
    if tel is None:
        from moe_eplb.trace_format import TELEMETRY_KEYS

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

    # --- step time against served imbalance --------------------------------------------------
    counts = tel.rearrangements_per_bucket(trace.num_buckets)
    step_fit = None
    if tel.step_seconds is None or tel.rank_load is None:
        missing = " and ".join(k for k in ("step_seconds", "rank_load") if getattr(tel, k) is None)
        why = f"needs step_seconds and rank_load; the trace has no {missing}"
        default("moe_time_share", why)
        default("seconds_per_step", why)
    else:
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

    # --- rearrangement cost --------------------------------------------------------------------
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

    # --- KV cache ------------------------------------------------------------------------------
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
    return Calibration({n: params[n] for n in PARAMETERS}, use_async, fit_info)
