"""The memory model: KV demand, the prefix-cache hit rate against the free cache, the prefill share
(:func:`fit_memory`, :class:`MemoryFit`)."""

from __future__ import annotations

import math

import numpy as np

from moe_eplb.eplb.replay.costmodel import CostModel
from moe_eplb.eplb.tuning.calibrate.record import FULL_KV_ELASTICITY, KV_FULL_USAGE, MIN_FIT_BUCKETS, MemoryFit, _hit_max
from moe_eplb.eplb.tuning.calibrate.step_time import StepFit, _tokens_per_step
from moe_eplb.eplb.workload.trace import LoadTrace

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
