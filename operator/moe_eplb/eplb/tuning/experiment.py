"""The statistics of an experiment: two arms on the same traffic, judged on the objective (pure, numpy).

An experiment runs a candidate setting on one replica (group), the **trial** arm, while the other
replicas keep the running setting, the **control** arm; the Service splits the same traffic between
them. Every bucket (the loop's scrape interval) gives each arm an :class:`ArmBucket` read from vLLM's
own metrics of its pods. The **objective** of a bucket is

* the token throughput per GPU where an engine is saturated (requests waiting, or the KV cache
  full): the arm that serves more per GPU wins;
* the step (inter-token) time where neither is saturated, at comparable batch sizes (tokens per
  step within a factor ``1 +`` :data:`BATCH_TOLERANCE` of each other, either way; a bucket whose
  batches differ more is left out):
  the arm whose steps are shorter wins;

and TTFT is a guard: a trial whose mean TTFT is more than :data:`TTFT_GUARD` above the control's is
discarded whatever its objective says.

:func:`paired_estimate` turns the buckets into the relative gain of the trial over the control and a
two-sided Student-t confidence interval on the per-bucket paired differences (log ratios, so a gain
and a loss of the same size weigh the same; the estimate is ``exp(mean) - 1``). Pairing removes
what both arms share (the traffic's ups and downs); what is left is the settings' effect plus the
engines' own noise.

With one replica there is no control arm: :func:`before_after_estimate` judges the change across
time, normalised by the offered load (a least-squares fit of the log objective on the log batch
size and its square, with an indicator for "after the change": the indicator's coefficient, with its
t interval). The periods' loads should overlap: far apart, the fit extrapolates.

The verdict of an experiment is not taken here: :mod:`moe_eplb.eplb.tuning.judge` holds the rule
(autocorrelation-robust errors, the pre-period subtracted, a sequential rule over the repeated looks).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: tokens per step of the two arms within this relative difference: their step times are comparable
BATCH_TOLERANCE = 0.2
#: the trial's mean TTFT may be this much above the control's (relative) before the guard discards it
TTFT_GUARD = 0.25
#: fewest usable buckets for an interval
MIN_BUCKETS = 3
#: the tolerance where the design takes the arms' batch difference out -- the interleaved arms swap
#: replicas every block, so a replica that gets more traffic (bigger batches, longer steps) weighs
#: on both arms alike; a cross-pod experiment subtracts its pre-period's difference and adjusts for
#: the batch ratio (:func:`moe_eplb.eplb.tuning.judge.adjust`): only a batch ratio beyond a factor
#: 1 + this is left out (an arm barely serving)
SWAPPED_BATCH_TOLERANCE = 1.0

THROUGHPUT = "throughput_per_gpu"
STEP_TIME = "step_time"

PROMOTED = "promoted"
DISCARDED = "discarded"
VERDICTS = (PROMOTED, DISCARDED)


@dataclass(frozen=True)
class ArmBucket:
    """One arm in one bucket (None where the metric is not exported or the arm did not serve):
    mean step time, mean tokens per step, tokens per second per GPU, whether the engine was
    saturated, mean TTFT, the balancedness it served (vLLM's definition, reported) and its served
    imbalance (the cost model's, what the learning step weighs step times by)."""

    step_seconds: float | None = None
    tokens_per_step: float | None = None
    tokens_per_second_per_gpu: float | None = None
    saturated: bool = False
    ttft_seconds: float | None = None
    balancedness: float | None = None  # served: mean over layers of mean/max tokens over the EP ranks
    #: served imbalance, the cost model's ``x``: sum over layers of the busiest rank's tokens over the
    #: sum of the mean rank's (:func:`moe_eplb.eplb.workload.trace.served_imbalance`), >= 1/balancedness
    imbalance: float | None = None


@dataclass(frozen=True)
class Estimate:
    """The trial's relative gain on the objective (``+0.03``: 3% better) with its two-sided
    interval at ``confidence``, from ``buckets`` usable buckets (``objective``: which objective they
    used: :data:`THROUGHPUT`, :data:`STEP_TIME` or both joined by ``+``); ``ttft_ratio``: the
    trial's mean TTFT over the control's (None without TTFT); ``dof``: the interval's residual
    degrees of freedom where it comes from a fit (:func:`before_after_estimate`)."""

    objective: str
    buckets: int
    estimate: float
    ci_low: float
    ci_high: float
    confidence: float
    ttft_ratio: float | None = None
    dof: int | None = None

    def describe(self) -> str:
        return (f"{self.estimate:+.2%} [{self.ci_low:+.2%}, {self.ci_high:+.2%}] at {self.confidence:.0%} "
                f"({self.objective}, {self.buckets} buckets)")


# --- the Student-t quantile (no scipy) --------------------------------------------------------------


def _t_cdf_upper_half(x: float, df: float) -> float:
    """P(0 <= T <= x) for Student's t with ``df`` degrees of freedom (Simpson's rule on the density
    in the variable u = atan(t / sqrt(df)), where it is smooth and bounded)."""
    if x <= 0:
        return 0.0
    # t = sqrt(df) tan(u): the density becomes c * cos(u)^(df - 1) on [0, atan(x/sqrt(df))]
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)
    hi = math.atan(x / math.sqrt(df))
    n = 2000
    u = np.linspace(0.0, hi, n + 1)
    f = np.cos(u) ** (df - 1)
    simpson = (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum()) * (hi / n) / 3
    return float(c * simpson)


@functools.lru_cache(maxsize=1024)
def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile (0.5 <= p < 1) of Student's t with ``df`` (>= 1) degrees of freedom."""
    if not 0.5 <= p < 1 or df < 1:
        raise ValueError(f"t_quantile: need 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    target = p - 0.5
    lo, hi = 0.0, 1.0
    while _t_cdf_upper_half(hi, df) < target:
        hi *= 2.0
        if hi > 1e7:
            return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if _t_cdf_upper_half(mid, df) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# --- two arms on the same traffic ---------------------------------------------------------------


def bucket_difference(trial: ArmBucket, control: ArmBucket, *, batch_tolerance: float = BATCH_TOLERANCE,
                      step_time_only: bool = False) -> tuple[str, float] | None:
    """The log ratio of the trial's objective over the control's in one bucket, and which objective
    it is; None when the bucket cannot compare them (an arm did not serve, batches not comparable).
    ``step_time_only``: the step time whether saturated or not (where the settings do not change
    how big a batch fits -- window and interval -- the batch is the traffic's, and a design that
    swaps the arms cancels the difference)."""
    if (trial.saturated or control.saturated) and not step_time_only:
        t, c = trial.tokens_per_second_per_gpu, control.tokens_per_second_per_gpu
        if t is None or c is None or t <= 0 or c <= 0:
            return None
        return THROUGHPUT, math.log(t / c)
    ts, cs, tb, cb = trial.step_seconds, control.step_seconds, trial.tokens_per_step, control.tokens_per_step
    if ts is None or cs is None or ts <= 0 or cs <= 0 or tb is None or cb is None or tb <= 0 or cb <= 0:
        return None
    if abs(math.log(tb / cb)) > math.log1p(batch_tolerance):  # symmetric: the arms may swap (interleaved)
        return None
    return STEP_TIME, math.log(cs / ts)  # shorter trial steps: a positive gain


def _objective_name(kinds: Sequence[str]) -> str:
    present = [k for k in (THROUGHPUT, STEP_TIME) if k in kinds]
    return "+".join(present)


def _ttft_ratio(pairs: Sequence[tuple[ArmBucket, ArmBucket]]) -> float | None:
    t = [a.ttft_seconds for a, b in pairs if a.ttft_seconds is not None and b.ttft_seconds is not None]
    c = [b.ttft_seconds for a, b in pairs if a.ttft_seconds is not None and b.ttft_seconds is not None]
    if not t or sum(c) <= 0:
        return None
    return float(sum(t) / sum(c))


def interval(values: Sequence[float], confidence: float) -> tuple[float, float, float]:
    """Mean of ``values`` and its two-sided Student-t interval at ``confidence`` (at least 2 values)."""
    x = np.asarray(values, dtype=float)
    n = len(x)
    mean = float(x.mean())
    se = float(x.std(ddof=1) / math.sqrt(n))
    half = t_quantile(0.5 + confidence / 2, n - 1) * se
    return mean, mean - half, mean + half


def paired_estimate(pairs: Sequence[tuple[ArmBucket, ArmBucket]], confidence: float, *,
                    batch_tolerance: float = BATCH_TOLERANCE) -> Estimate | None:
    """The trial's gain over the control from per-bucket ``(trial, control)`` pairs; None with fewer
    than :data:`MIN_BUCKETS` usable buckets."""
    diffs = [d for d in (bucket_difference(t, c, batch_tolerance=batch_tolerance) for t, c in pairs)
             if d is not None]
    if len(diffs) < MIN_BUCKETS:
        return None
    mean, lo, hi = interval([v for _, v in diffs], confidence)
    return Estimate(objective=_objective_name([k for k, _ in diffs]), buckets=len(diffs),
                    estimate=math.expm1(mean), ci_low=math.expm1(lo), ci_high=math.expm1(hi),
                    confidence=confidence, ttft_ratio=_ttft_ratio(pairs))


# --- one replica: before and after, normalised by the offered load -------------------------------


def _speed(b: ArmBucket) -> tuple[bool, float, float] | None:
    """(saturated, log objective (higher is better), log batch size) of one bucket, or None."""
    if b.saturated:
        if b.tokens_per_second_per_gpu is None or b.tokens_per_second_per_gpu <= 0:
            return None
        return True, math.log(b.tokens_per_second_per_gpu), 0.0
    if b.step_seconds is None or b.step_seconds <= 0 or b.tokens_per_step is None or b.tokens_per_step <= 0:
        return None
    return False, -math.log(b.step_seconds), math.log(b.tokens_per_step)


def before_after_estimate(before: Sequence[ArmBucket], after: Sequence[ArmBucket],
                          confidence: float) -> Estimate | None:
    """The change's gain with one replica: the log objective of every bucket fitted by least squares
    on an intercept, a saturated indicator, the unsaturated buckets' log batch size (the offered
    load) and its square (step time is affine in the batch, curved in logs) and an "after"
    indicator; the gain is ``exp(coef) - 1`` of the last, with its t interval.
    None with too few usable buckets on either side, or where the "after" indicator is not
    identified: every bucket before unsaturated and every one after saturated (or the reverse)
    measure two different objectives, and no fit can tell the change from the switch."""
    rows, ys, kinds = [], [], []
    for flag, buckets in ((0.0, before), (1.0, after)):
        for b in buckets:
            s = _speed(b)
            if s is None:
                continue
            sat, y, x = s
            rows.append([1.0, 1.0 if sat else 0.0, 0.0 if sat else x, 0.0 if sat else x * x, flag])
            ys.append(y)
            kinds.append(THROUGHPUT if sat else STEP_TIME)
    flags = [r[-1] for r in rows]
    if flags.count(0.0) < MIN_BUCKETS - 1 or flags.count(1.0) < MIN_BUCKETS - 1:
        return None
    a = np.asarray(rows)
    keep = [j for j in range(a.shape[1]) if np.ptp(a[:, j]) > 0 or j == 0]  # drop constant columns
    a = a[:, keep]
    y = np.asarray(ys)
    rank = int(np.linalg.matrix_rank(a))
    if rank == int(np.linalg.matrix_rank(a[:, :-1])):
        return None  # the "after" column lies in the others' span: the change is confounded
    dof = len(y) - rank  # other columns may still be collinear (two batch sizes: x^2 affine in x)
    if dof < 1:
        return None
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    resid = y - a @ coef
    sigma2 = float(resid @ resid) / dof
    cov = sigma2 * np.linalg.pinv(a.T @ a)
    c, se = float(coef[-1]), math.sqrt(max(float(cov[-1, -1]), 0.0))
    half = t_quantile(0.5 + confidence / 2, dof) * se
    return Estimate(objective=_objective_name(kinds), buckets=len(y), estimate=math.expm1(c),
                    ci_low=math.expm1(c - half), ci_high=math.expm1(c + half), confidence=confidence, dof=dof)


def buckets_of_trace(trace, *, gpus_per_engine: int, kv_full: float = 0.95) -> list[ArmBucket]:
    """The objective's buckets of a (per-engine) load trace with telemetry: mean step time, tokens
    per step, tokens per second of step time per GPU, saturated where requests waited or the KV
    cache was full. Buckets without steps or a step time are left out; [] without telemetry."""
    tel = getattr(trace, "telemetry", None)
    if tel is None or tel.step_seconds is None:
        return []
    steps = np.asarray(trace.bucket_steps, dtype=float)
    tokens = np.asarray(trace.load, dtype=float)[:, 0, :].sum(axis=1) / max(1, int(trace.top_k or 1))
    out = []
    for t in range(trace.num_buckets):
        step_s = float(tel.step_seconds[t])
        if steps[t] <= 0 or not math.isfinite(step_s) or step_s <= 0:
            continue
        per_step = float(tokens[t] / steps[t])
        waiting = float(tel.requests_waiting[t]) if tel.requests_waiting is not None else 0.0
        kv = float(tel.kv_cache_usage[t]) if tel.kv_cache_usage is not None else 0.0
        out.append(ArmBucket(step_seconds=step_s, tokens_per_step=per_step,
                             tokens_per_second_per_gpu=per_step / step_s / max(1, gpus_per_engine),
                             saturated=(math.isfinite(waiting) and waiting > 0) or (math.isfinite(kv) and kv >= kv_full)))
    return out


def buckets_record(buckets: Sequence[ArmBucket]) -> dict:
    """Buckets as the status stores them (one list per field)."""
    return {"stepSeconds": [round(b.step_seconds or 0.0, 9) for b in buckets],
            "tokensPerStep": [round(b.tokens_per_step or 0.0, 6) for b in buckets],
            "tokensPerSecondPerGpu": [round(b.tokens_per_second_per_gpu or 0.0, 6) for b in buckets],
            "saturated": [bool(b.saturated) for b in buckets]}


def buckets_from_record(rec: dict | None) -> list[ArmBucket]:
    """The inverse of :func:`buckets_record` (a malformed record gives [])."""
    try:
        cols = [rec[k] for k in ("stepSeconds", "tokensPerStep", "tokensPerSecondPerGpu", "saturated")]  # type: ignore[index]
        return [ArmBucket(step_seconds=float(a), tokens_per_step=float(b), tokens_per_second_per_gpu=float(c),
                          saturated=bool(d)) for a, b, c, d in zip(*cols)]
    except (TypeError, KeyError, ValueError):
        return []
