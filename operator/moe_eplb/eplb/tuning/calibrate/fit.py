""":func:`calibrate`: every parameter from one trace's telemetry -- the step-time fit, the
rearrangement cost (sync stall or async seconds per moved byte), the KV cache's pressure
(:func:`kv_pressure`) and the memory model --, and :func:`with_learned` (ranges an experiment
learned)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from moe_eplb.eplb.replay.costmodel import OVERLAP_HIDDEN_PRIOR, CostModel
from moe_eplb.eplb.tuning.calibrate.memory import (
    KV_BATCH_ELASTICITY_PRIOR,
    KV_FULL_USAGE_PRIOR,
    MOE_SHARE_PRIOR,
    PREFILL_SHARE_PRIOR,
    PREFIX_HIT_PRIOR,
    PREFIX_WORKING_SET_PRIOR,
    _working_set_range,
    fit_memory,
    kv_pressure,
)
from moe_eplb.eplb.tuning.calibrate.record import (
    DEFAULT,
    KV_FULL_USAGE,
    MEASURED,
    MIN_FIT_BUCKETS,
    MIN_REARRANGEMENTS,
    PARAMETERS,
    Calibration,
    CalibrationError,
    MemoryFit,
    Parameter,
)
from moe_eplb.eplb.tuning.calibrate.step_time import StepFit, _least_squares, _tokens_per_step, fit_step_model
from moe_eplb.eplb.tuning.exploration import LearnedRange
from moe_eplb.eplb.workload.trace import LoadTrace, Telemetry


def fit_sync_stall(seconds: np.ndarray) -> tuple[float, float] | None:
    """``(median, standard error of the median)`` of measured sync rearrangement durations
    (seconds), or None with fewer than :data:`MIN_REARRANGEMENTS`."""
    s = np.asarray(seconds, np.float64)
    if s.size < MIN_REARRANGEMENTS:
        return None
    med = float(np.median(s))
    mad = float(np.median(np.abs(s - med)))
    return med, 1.2533 * 1.4826 * mad / math.sqrt(s.size)


def _moved_bytes_per_rearrangement(trace: LoadTrace, tel: Telemetry, cost: CostModel, num_nodes: int,
                                   num_groups: int) -> tuple[float | None, str]:
    """Mean bytes one GPU receives per rearrangement of the recorded configuration, from a replay of
    the trace (the first rearrangement, out of vLLM's start-up placement, left out when there are
    more); (None, why) when it cannot be known."""
    from moe_eplb.eplb.replay.simulator import Replay, SimError, Topology

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


def calibrate(trace: LoadTrace, *, cost: CostModel = CostModel(), num_nodes: int = 1,
              num_groups: int = 1, learned: Sequence[LearnedRange] = ()) -> Calibration:
    """Measure the cost model's parameters from ``trace.telemetry`` (see the module docstring).

    ``cost`` supplies the defaults (and the expert size, for the async rearrangement cost and the
    KV cache taken by the running redundancy); ``num_nodes``/``num_groups`` the topology of the
    replay the async cost needs. ``learned``: ranges earlier experiments narrowed
    (:func:`moe_eplb.eplb.tuning.learn.learn`, kept in ``status.autotune.learned``); each parameter's range
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
    from moe_eplb.eplb.tuning.robust import EXPERIMENT, Range

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
    """The range of every parameter the decision should hold over (:class:`moe_eplb.eplb.tuning.robust.Range`):
    a measured one +/- 2 standard errors, the others over a stated prior range."""
    from moe_eplb.eplb.tuning.robust import Range

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
    if cost.overlap_dropped and cost.shared_expert_ratio > 0:  # nothing in an EPLB-on trace pins it
        add("overlap_hidden", cost.overlap_hidden, *OVERLAP_HIDDEN_PRIOR, "prior",
            "share of the shared experts' time the overlap hid: an EPLB-on trace cannot tell it from the "
            "balanced step time; EPLB-on against EPLB-off step times measure it")
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
