"""Step time against the served imbalance: :func:`fit_step_model` (the robust fit of the MoE share
and the balanced step time, :class:`StepFit`) and :func:`fit_sync_stall`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moe_eplb.eplb.tuning.calibrate.record import MAX_SHARE_UNCERTAINTY, MIN_FIT_BUCKETS, MIN_IMBALANCE_SPREAD, MIN_REARRANGEMENTS
from moe_eplb.eplb.workload.trace import LoadTrace


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

    @property
    def batch_elasticity(self) -> float | None:
        """d log(step time) / d log(tokens per step) at the mean batch: the per-token part of the
        balanced step time, ``c1 / (c0 + c1)`` (0: a fixed cost per step, 1: all per token); None
        without a fit."""
        if self.coefficients is None:
            return None
        c0, c1, _, _ = self.coefficients
        return float(c1 / (c0 + c1)) if c0 + c1 > 0 else None

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


def _tokens_per_step(trace: LoadTrace) -> np.ndarray:
    routed = trace.load.sum(axis=2).mean(axis=1)  # [T] (token, top-k slot) pairs per layer
    steps = trace.bucket_steps.astype(np.float64)
    return np.divide(routed, steps, out=np.zeros_like(routed), where=steps > 0)
