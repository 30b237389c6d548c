"""What an experiment teaches: narrow a parameter's range from its two arms on the same traffic.

A trial (one replica on a candidate setting) and a control (the others on the running setting)
serve the same traffic at the same time, so what differs between their measurements comes from
the settings, not from the traffic. :func:`learn` turns that difference into a narrower range of
the cost-model parameters it informs -- above all those the calibration could not pin
(:class:`~moe_eplb.eplb.tuning.robust.Range` with ``source`` ``prior``), which is what
:attr:`moe_eplb.eplb.tuning.tuner.TuneResult.explore` runs a trial for; a measured range is narrowed too
where the arms say more -- and :func:`moe_eplb.eplb.tuning.calibrate.calibrate` keeps it (``learned=``):

``moe_time_share`` f -- from the arms' step times against their served imbalance.
    The cost model's balanced step time is scaled by ``(1 - f) + f x`` with ``x`` the served
    imbalance, ``sum_l max_rank / sum_l mean_rank`` (the arms measure it from the exporter's tokens
    per rank and layer; 1 / balancedness only where they do not: vLLM's balancedness averages the
    layers' mean/max, whose inverse understates ``x``). At comparable tokens per step (within
    :data:`TOKENS_TOLERANCE`) the ratio of mean step times ``r = step_t / step_c`` gives

        f = (r - 1) / ((x_t - 1) - r (x_c - 1))

    and ``r`` +/- 2 standard errors gives the range (f is monotone in r where the denominator
    keeps its sign). ``step_seconds`` must be the step time outside rearrangement stalls (the
    arms' inter-token latency with the measured rearrangement durations taken out), as the
    calibration's own fit does. A step-time mean over ``n = pods x seconds /``
    :data:`BUCKET_SECONDS` pod-buckets has relative standard error ``step_cv / sqrt(n)``
    (:data:`STEP_CV` by default: one pod's bucket mean varies by about 5 %).

``prefix_working_set`` K -- from the arms' prefix-cache hit rates at two KV cache sizes.
    The cost model's hit rate is ``hit_max (1 - exp(-free / K))`` with ``free`` the cache no
    running request holds, in caches without redundant experts:
    ``free = c - min(usage c, kv_full_usage c)`` for an arm whose redundancy leaves ``c``
    of the cache (``c = 1 - R x bytes_per_redundant_expert / kv_cache_bytes_per_gpu``). The ratio
    ``q = hit_t / hit_c`` falls monotonically in K from 1 (K -> 0) to ``free_t / free_c``
    (K -> infinity), so it is solved for K by bisection, with ``q`` +/- 2 standard errors
    (:data:`HIT_CV` relative per pod-bucket) giving the range.

``overlap_hidden`` -- from an EPLB-on and an EPLB-off arm (or period): the ratio of their step times,
    with the MoE share over its range and the off side's imbalance from a replay of vLLM's static
    placement (the exporter counts no load with EPLB off), solved for the share of the shared experts'
    time the overlap hid (:func:`moe_eplb.eplb.tuning.overlap.hidden_range`). The MoE share is then not
    learned from the same arms (their step times differ by the overlap as well).

Nothing is made up: a parameter is narrowed only when its range from the arms is at most
:data:`INFORMATIVE` of the prior's width; arms that cannot tell (equal balancedness or cache
sizes, incomparable batches, a missing measurement, a denominator that may vanish) give no range.
Where the arms' range misses the prior entirely, the arms' range stands (the experiment is the
more direct measurement). Pure: numbers in, numbers out.
"""

from __future__ import annotations

import math

from moe_eplb.eplb.replay.costmodel import CostModel
from moe_eplb.eplb.tuning.calibrate import Calibration
from moe_eplb.eplb.tuning.exploration import ArmObservation, LearnedRange

__all__ = ["learn", "share_range", "working_set_range", "BUCKET_SECONDS", "STEP_CV", "HIT_CV", "INFORMATIVE",
           "TOKENS_TOLERANCE"]

#: Seconds of one pod's measurement bucket (the step-time and hit-rate means are over such buckets).
BUCKET_SECONDS = 30.0
#: Relative standard deviation of one pod's mean step time over a bucket.
STEP_CV = 0.05
#: Relative standard deviation of one pod's prefix hit rate over a bucket.
HIT_CV = 0.05
#: A learned range is kept only when at most this share of the prior range's width.
INFORMATIVE = 0.8
#: Tokens per step of the two arms must agree within this (relative) for their step times to compare.
TOKENS_TOLERANCE = 0.05
#: Where K is searched (caches), as in the calibration's prefix-curve fit.
_K_BOUNDS = (1e-3, 20.0)


def _rel_se(arm: ArmObservation, cv: float) -> float:
    n = max(1.0, arm.pods * arm.seconds / BUCKET_SECONDS)
    return cv / math.sqrt(n)


def share_range(trial: ArmObservation, control: ArmObservation, *, step_cv: float = STEP_CV) -> tuple[float, float] | None:
    """The MoE share's range ``(low, high)`` within [0, 1] from the arms' step times against their
    served balancedness (see the module docstring), or None when the arms cannot tell."""
    need = (trial.step_seconds, control.step_seconds, trial.balancedness, control.balancedness)
    if any(v is None or not math.isfinite(v) or v <= 0 for v in need):
        return None
    if trial.tokens_per_step is not None and control.tokens_per_step is not None:
        if control.tokens_per_step <= 0 or abs(trial.tokens_per_step / control.tokens_per_step - 1) > TOKENS_TOLERANCE:
            return None
    x_t, x_c = trial.cost_imbalance(), control.cost_imbalance()
    r = trial.step_seconds / control.step_seconds
    se = r * math.hypot(_rel_se(trial, step_cv), _rel_se(control, step_cv))
    ends = []
    for rr in (r - 2 * se, r + 2 * se):
        den = (x_t - 1.0) - rr * (x_c - 1.0)
        ends.append((rr - 1.0, den))
    if ends[0][1] * ends[1][1] <= 0:  # the denominator may vanish: any share fits
        return None
    f = sorted(num / den for num, den in ends)
    lo, hi = max(0.0, f[0]), min(1.0, f[1])
    return (lo, hi) if lo < hi else None


def _free(arm: ArmObservation, capacity: float, full: float) -> float | None:
    if arm.kv_cache_usage is None or not math.isfinite(arm.kv_cache_usage):
        return None
    return capacity - min(arm.kv_cache_usage * capacity, full * capacity)


def _solve_k(q: float, free_t: float, free_c: float) -> float:
    """K with ``(1 - exp(-free_t/K)) / (1 - exp(-free_c/K)) = q`` (q between the limits)."""
    def g(k: float) -> float:
        return -math.expm1(-free_t / k) / -math.expm1(-free_c / k)

    lo, hi = math.log(_K_BOUNDS[0]), math.log(_K_BOUNDS[1])
    g_lo = g(_K_BOUNDS[0]) - q
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        v = g(math.exp(mid)) - q
        if (v > 0) == (g_lo > 0):
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


def working_set_range(trial: ArmObservation, control: ArmObservation, capacity_trial: float,
                      capacity_control: float, *, full_usage: float = 0.95,
                      hit_cv: float = HIT_CV) -> tuple[float, float] | None:
    """The prefix working set's range ``(low, high)`` (caches) from the arms' hit rates at their
    free caches (see the module docstring), or None when the arms cannot tell."""
    h_t, h_c = trial.prefix_hit_rate, control.prefix_hit_rate
    free_t, free_c = _free(trial, capacity_trial, full_usage), _free(control, capacity_control, full_usage)
    if h_t is None or h_c is None or free_t is None or free_c is None or h_t <= 0 or h_c <= 0:
        return None
    if free_t <= 0 or free_c <= 0 or abs(free_t / free_c - 1.0) < 0.02:
        return None  # equal caches (or none free) say nothing about the curve's shape
    # order so that arm "a" has the smaller free cache: q = h_a / h_b in (free_a / free_b, 1)
    (h_a, f_a, arm_a), (h_b, f_b, arm_b) = sorted([(h_t, free_t, trial), (h_c, free_c, control)], key=lambda t: t[1])
    q = h_a / h_b
    se = q * math.hypot(_rel_se(arm_a, hit_cv), _rel_se(arm_b, hit_cv))
    limit = f_a / f_b
    q_lo, q_hi = q - 2 * se, q + 2 * se
    if q_hi <= limit or q_lo >= 1.0:
        return None  # outside what the curve can give: the model does not describe these arms
    k_hi = _K_BOUNDS[1] if q_lo <= limit else _solve_k(q_lo, f_a, f_b)
    k_lo = _K_BOUNDS[0] if q_hi >= 1.0 else _solve_k(q_hi, f_a, f_b)
    return (k_lo, k_hi) if k_lo < k_hi else None


def _narrowed(name: str, got: tuple[float, float] | None, calibration: Calibration, source: str) -> list[LearnedRange]:
    prior = calibration.ranges.get(name)
    if got is None or prior is None or prior.width <= 0:
        return []
    lo, hi = max(prior.low, got[0]), min(prior.high, got[1])
    if lo >= hi:  # the arms' range misses the prior: the experiment is the more direct measurement
        lo, hi = got
    if hi - lo > INFORMATIVE * prior.width:
        return []
    return [LearnedRange(name, float(lo), float(hi), float(prior.low), float(prior.high), source)]


def learn(calibration: Calibration, cost: CostModel, trial: ArmObservation, control: ArmObservation, *,
          source: str, bytes_per_redundant_expert: float | None = None, step_cv: float = STEP_CV,
          hit_cv: float = HIT_CV, off_balancedness: float | None = None) -> list[LearnedRange]:
    """The parameter ranges an experiment narrows (see the module docstring): the MoE share from the
    arms' step times and served balancedness; the prefix working set from their hit rates at two KV
    cache sizes (``bytes_per_redundant_expert``: bytes per GPU one redundant expert takes,
    ``num_moe_layers x bytes_per_expert / ep_size``; without it, arms of different redundancy have
    caches of unknown size and the working set is not learned). Each is narrowed against the
    calibration's range of it (``calibration.ranges``); ``source`` names the experiment. Returns []
    when the observations cannot tell (never a made-up range). An EPLB-off arm (``eplb`` False)
    against an EPLB-on one teaches ``overlap_hidden`` instead of the MoE share (``off_balancedness``:
    vLLM's static placement replayed on the same traffic, where the off arm measured none)."""
    if trial.eplb != control.eplb:
        from moe_eplb.eplb.tuning.overlap import hidden_range

        on, off = (trial, control) if trial.eplb else (control, trial)
        share = calibration.ranges.get("moe_time_share")
        got = None if share is None else hidden_range(on, off, (share.low, share.high), cost.shared_expert_ratio,
                                                       off_balancedness=off_balancedness, step_cv=step_cv,
                                                       bucket_seconds=BUCKET_SECONDS, tokens_tolerance=TOKENS_TOLERANCE)
        return _narrowed("overlap_hidden", got, calibration, source)
    out = _narrowed("moe_time_share", share_range(trial, control, step_cv=step_cv), calibration, source)
    same_r = trial.knobs.num_redundant_experts == control.knobs.num_redundant_experts
    if "prefix_working_set" in calibration.ranges and (bytes_per_redundant_expert is not None or same_r):
        per_r = bytes_per_redundant_expert or 0.0

        def capacity(arm: ArmObservation) -> float:
            return max(1e-6, 1.0 - arm.knobs.num_redundant_experts * per_r / cost.kv_cache_bytes_per_gpu)

        got = working_set_range(trial, control, capacity(trial), capacity(control), full_usage=cost.kv_full_usage,
                                hit_cv=hit_cv)
        out += _narrowed("prefix_working_set", got, calibration, source)
    return out
