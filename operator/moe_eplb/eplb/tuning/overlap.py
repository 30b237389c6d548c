"""Is EPLB worth it here? What being on costs (the shared-expert overlap), and the advice on on, off or
rearrange-only, with what would change the answer. Pure: numbers in, numbers out.

**The cost of being on.** vLLM overlaps a model's shared experts with the routed experts' dispatch and
combine, and turns that overlap off when EPLB is on, unless the all2all backend is one it knows to be
safe (:func:`moe_eplb.api.wide_ep.eplb_drops_shared_overlap`, checked against each release's own code).
The cost model prices it as ``overlap_loss = f * shared_expert_ratio * overlap_hidden`` of every
EPLB-on step (:attr:`moe_eplb.eplb.replay.costmodel.CostModel.overlap_loss`): ``f`` the MoE share of a
step, ``shared_expert_ratio`` the shared experts' compute over the routed experts' (the model catalog:
DeepSeek-V3 1/8, DeepSeek-V2 1/3, Llama 4 1, Qwen3-MoE 0) and ``overlap_hidden`` the share of the
shared experts' time the overlap hid (how much of it ran under the all2all's communication). Nothing in
an EPLB-on trace tells ``overlap_hidden`` apart from the balanced step time, so it is a range
(:data:`~moe_eplb.eplb.replay.costmodel.OVERLAP_HIDDEN_PRIOR`, 0-1, its point 0.5) unless EPLB-on and
EPLB-off step times were measured at comparable batches: two periods (before and after a change of
``spec.eplb.enabled``) or two arms. Then

    r = step_on / step_off = ((1 - f) + f x_on + f rho h) / ((1 - f) + f x_off)

gives ``h = (r ((1 - f) + f x_off) - (1 - f) - f x_on) / (f rho)`` (:func:`hidden_range`): with ``r``
+/- 2 standard errors and ``f`` over its range, monotone in both, so the corners bound it. ``x_off``,
the imbalance of vLLM's static placement, is what the off side served: the exporter counts nothing
with EPLB off (it reads EPLB's own state), so it comes from a replay of the on side's load
(:meth:`moe_eplb.eplb.replay.simulator.Replay.run_static`).

**The advice** (:func:`advise`, ``TuneResult.advice``): the mode of the pick (``off``, ``rearrange_only``:
EPLB on with vLLM's fewest redundant experts, it only reshuffles; ``balance``), EPLB off against the
best EPLB-on setting, the overlap loss priced, and what would change the answer: the same setting
where the overlap is kept (another backend, named by :class:`OverlapContext`), and the share of the
shared experts' time the overlap must hide for the answer to flip (the break-even ``overlap_hidden``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moe_eplb.eplb.replay.costmodel import CostModel

__all__ = ["EPLB_OFF", "EplbOff", "OverlapContext", "context_for", "hidden_range", "hidden_range_from_ratio", "advise",
           "BREAK_EVEN_STEPS"]

#: Bisection steps for the break-even share hidden (2^-30 of the 0-1 range).
BREAK_EVEN_STEPS = 30


class EplbOff:
    """The setting "EPLB off" (vLLM's static expert placement: no redundancy, no rearrangement, no
    shared-expert overlap lost) as a candidate of the tuner's search: it stands where a
    :class:`~moe_eplb.api.knobs.Knobs` does (a label, a description, a JSON form, no redundant experts)
    but has no window or interval. One instance: :data:`EPLB_OFF`."""

    label = "off"
    num_redundant_experts = 0

    def describe(self) -> str:
        return "EPLB off"

    def to_dict(self) -> dict:
        return {"enabled": False}

    def __repr__(self) -> str:
        return "EPLB_OFF"


#: The "EPLB off" candidate (``spec.eplb.enabled: false``).
EPLB_OFF = EplbOff()


@dataclass(frozen=True)
class OverlapContext:
    """What decides the overlap loss of one deployment: the backend that runs (None: vLLM's default),
    whether vLLM drops the overlap there with EPLB on, the model's shared-expert ratio (0: none, or a
    model outside the catalog), and the overlap-safe backends the hardware and vLLM version allow
    (``(backend, condition)``, :func:`moe_eplb.api.wide_ep.overlap_safe_backends`)."""

    backend: str | None
    drops: bool
    shared_expert_ratio: float
    alternatives: tuple[tuple[str, str], ...] = ()
    model: str | None = None

    def apply(self, cost: CostModel) -> CostModel:
        """``cost`` pricing this overlap (its ``overlap_hidden`` kept)."""
        return cost.with_(shared_expert_ratio=float(self.shared_expert_ratio),
                          overlap_dropped=bool(self.drops and self.shared_expert_ratio > 0))

    @property
    def priced(self) -> bool:
        return self.drops and self.shared_expert_ratio > 0


def context_for(model: str | None, backend: str | None, version, *, gpu_resource_name: str | None = None,
                nodes: int = 1, data_parallel: int = 2, shared_expert_ratio: float | None = None) -> OverlapContext:
    """The overlap context of a deployment: ``model`` looked up in the catalog (its shared-expert
    ratio; ``shared_expert_ratio`` overrides it), vLLM ``version``'s rule for ``backend`` and the
    overlap-safe backends GPUs named ``gpu_resource_name`` run (``nodes`` > 1: FlashInfer's one-sided
    NVLink backend needs one NVLink domain across them)."""
    from moe_eplb.api import catalog, wide_ep

    entry = catalog.lookup(model) if model else None
    ratio = shared_expert_ratio if shared_expert_ratio is not None else (entry.shared_expert_ratio if entry else 0.0)
    drops = wide_ep.eplb_drops_shared_overlap(backend, version, data_parallel=data_parallel)
    alts = tuple(wide_ep.overlap_safe_backends(version, wide_ep.gpu_vendor(gpu_resource_name), nodes=nodes))
    return OverlapContext(backend, drops, float(ratio), alts, entry.display_name if entry else model)


def hidden_range_from_ratio(r_low: float, r_high: float, share: tuple[float, float], ratio: float, x_on: float,
                            x_off: float) -> tuple[float, float] | None:
    """The range of ``overlap_hidden`` (within 0-1) that step-time ratios ``r = step_on / step_off``
    between ``r_low`` and ``r_high`` give, over the MoE share ``share = (low, high)``, for a model whose
    shared experts are ``ratio`` of the routed compute, the on side serving imbalance ``x_on`` and the
    off side ``x_off`` (both ``sum max / sum mean`` >= 1). None when it cannot tell (no shared experts,
    a share of 0, a range outside 0-1)."""
    if ratio <= 0 or not all(math.isfinite(v) for v in (r_low, r_high, x_on, x_off)) or r_low > r_high:
        return None
    ends = []
    for r in (r_low, r_high):
        for f in share:
            if f <= 0:
                return None
            ends.append((r * ((1 - f) + f * x_off) - (1 - f) - f * x_on) / (f * ratio))
    lo, hi = max(0.0, min(ends)), min(1.0, max(ends))
    return (lo, hi) if lo < hi else None


def hidden_range(on, off, share: tuple[float, float], ratio: float, *, off_balancedness: float | None = None,
                 step_cv: float = 0.05, bucket_seconds: float = 30.0, tokens_tolerance: float = 0.05,
                 ) -> tuple[float, float] | None:
    """``overlap_hidden``'s range from an EPLB-on and an EPLB-off observation
    (:class:`~moe_eplb.eplb.tuning.exploration.ArmObservation`: two arms on the same traffic, or two
    periods) at comparable tokens per step (within ``tokens_tolerance``): ``r`` is the ratio of their
    mean step times +/- 2 standard errors (each mean over ``pods x seconds / bucket_seconds`` buckets
    of relative spread ``step_cv``). The off side's served balancedness is its own when measured, else
    ``off_balancedness`` (vLLM's static placement replayed on the on side's load). None when they
    cannot tell."""
    bal_off = off.balancedness if off.balancedness is not None else off_balancedness
    need = (on.step_seconds, off.step_seconds, on.balancedness, bal_off)
    if any(v is None or not math.isfinite(v) or v <= 0 for v in need):
        return None
    if on.tokens_per_step is not None and off.tokens_per_step is not None:
        if off.tokens_per_step <= 0 or abs(on.tokens_per_step / off.tokens_per_step - 1) > tokens_tolerance:
            return None

    def rel_se(obs) -> float:
        return step_cv / math.sqrt(max(1.0, obs.pods * obs.seconds / bucket_seconds))

    r = on.step_seconds / off.step_seconds
    se = r * math.hypot(rel_se(on), rel_se(off))
    # the on side's served imbalance as the cost model has it (the replayed off side's is that already)
    return hidden_range_from_ratio(r - 2 * se, r + 2 * se, share, ratio, on.cost_imbalance(),
                                   1.0 / min(1.0, bal_off))


def _score(result, cost: CostModel, bucket_steps, edges, shape) -> float:
    from moe_eplb.eplb.tuning.robust import cvar, scenario_segments, terms_of

    return cvar(scenario_segments(terms_of(result, bucket_steps, edges), cost, *shape))


def _break_even(on, off, cost: CostModel, bucket_steps, edges, shape) -> float | str:
    """The ``overlap_hidden`` at which the EPLB-on candidate ``on`` scores as EPLB ``off`` does, or
    ``"off"`` / ``"on"`` when that side wins over the whole 0-1 range."""
    off_score = _score(off.result, cost, bucket_steps, edges, shape)

    def margin(h: float) -> float:
        return _score(on.result, cost.with_(overlap_hidden=h), bucket_steps, edges, shape) - off_score

    lo, hi = 0.0, 1.0
    if margin(lo) <= 0:
        return "off"  # off wins even where the overlap hid nothing
    if margin(hi) >= 0:
        return "on"  # on wins even where the overlap hid all of the shared experts' time
    for _ in range(BREAK_EVEN_STEPS):
        mid = 0.5 * (lo + hi)
        if margin(mid) > 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _alternatives_text(ctx: OverlapContext | None) -> str:
    if ctx is None or not ctx.alternatives:
        return "an overlap-safe all2all backend"
    return " or ".join(f"{b}" + (f" ({cond})" if cond else "") for b, cond in ctx.alternatives)


def advise(*, pick, chosen_on, off, exact: list, cost: CostModel, bucket_steps: np.ndarray, edges: np.ndarray,
           shape: tuple[int, int, int], context: OverlapContext | None, redundancy_floor: int,
           hidden_range_: tuple[float, float] | None = None, scenario_costs: list | None = None) -> dict:
    """The advice of one tuning (module docstring): ``mode`` of the pick, ``off_vs_on`` (EPLB off's
    score over the best EPLB-on setting's, ``best_on``, minus 1), ``overlap_loss`` (point, and its ``low``/``high``
    over ``hidden_range_``), ``overlap_kept`` (the best EPLB-on candidate of ``exact`` scored with the
    overlap kept, against the pick) and ``break_even_hidden`` (the share hidden at which EPLB on and
    off score the same), with ``what_would_change`` in words. ``shape`` is ``(ep, layers, experts)``;
    ``scenario_costs`` (the robust decision's scenarios) add ``off_vs_on_low`` / ``_high``, EPLB off
    against the best EPLB-on setting over the parameter ranges."""
    ons = [c for c in exact if c.knobs is not EPLB_OFF] or [chosen_on]
    best_on = max(ons, key=lambda c: (c.score, c.mean))  # the best EPLB-on setting by the point estimate
    off_on = None if off is None else (_score(off.result, cost, bucket_steps, edges, shape)
                                       / max(_score(best_on.result, cost, bucket_steps, edges, shape), 1e-12) - 1.0)
    mode = ("off" if pick.knobs is EPLB_OFF else
            "rearrange_only" if chosen_on.knobs.num_redundant_experts <= redundancy_floor else "balance")
    loss = cost.overlap_loss
    out: dict = {"mode": mode, "off_vs_on": off_on, "best_on": best_on.knobs.label, "overlap_loss": loss,
                 "overlap_dropped": cost.overlap_dropped,
                 "shared_expert_ratio": cost.shared_expert_ratio, "backend": context.backend if context else None,
                 "what_would_change": []}
    if off is not None and scenario_costs:
        ratios = [_score(off.result, c, bucket_steps, edges, shape) /
                  max(_score(best_on.result, c, bucket_steps, edges, shape), 1e-12) - 1.0 for c in scenario_costs]
        out["off_vs_on_low"], out["off_vs_on_high"] = min(ratios), max(ratios)
    if hidden_range_ is not None and cost.overlap_dropped:
        base = cost.moe_time_share * cost.shared_expert_ratio
        out["overlap_loss_low"], out["overlap_loss_high"] = base * hidden_range_[0], base * hidden_range_[1]
    words = out["what_would_change"]
    if cost.overlap_dropped and cost.shared_expert_ratio > 0:
        kept = cost.with_(overlap_dropped=False)
        scored = [(c, _score(c.result, kept, bucket_steps, edges, shape)) for c in exact if c.knobs is not EPLB_OFF]
        if scored:
            best, score = max(scored, key=lambda t: t[1])
            gain = score / max(pick.score, 1e-12) - 1.0
            out["overlap_kept"] = {"setting": best.knobs.label, "gain_vs_pick": gain}
            words.append(f"switch the all2all backend (spec.parallelism.all2allBackend) to {_alternatives_text(context)}: "
                         f"the shared-expert overlap is kept and EPLB on at {best.knobs.label} is predicted {gain:+.2%} "
                         f"against the pick")
    if off is not None and cost.overlap_dropped and cost.shared_expert_ratio > 0:
        h = _break_even(best_on, off, cost, bucket_steps, edges, shape)
        out["break_even_hidden"] = h if isinstance(h, float) else None
        if isinstance(h, float):
            side = ("EPLB on would win if the overlap hid less than" if mode == "off"
                    else "EPLB off would win if the overlap hid more than")
            words.append(f"{side} {h:.0%} of the shared experts' time (priced at {cost.overlap_hidden:.0%}"
                         + (f", range {hidden_range_[0]:.0%}-{hidden_range_[1]:.0%}" if hidden_range_ else "")
                         + "): EPLB-on against EPLB-off step times (two periods, or arms) measure it")
        else:
            words.append(f"EPLB off wins against EPLB on at {best_on.knobs.label} whatever share of the shared "
                         "experts' time the overlap hid (0-100 %): balancing gains less than its rearrangements cost"
                         if h == "off" else
                         f"EPLB on at {best_on.knobs.label} wins against EPLB off whatever share of the shared "
                         "experts' time the overlap hid (0-100 %)")
    if off is not None and not words:
        spread = (f" ({out['off_vs_on_low']:+.2%} to {out['off_vs_on_high']:+.2%} over the parameter ranges)"
                  if "off_vs_on_low" in out else "")
        if off_on < 0:
            words.append(f"EPLB on at {best_on.knobs.label} is predicted {-off_on:.2%} ahead of EPLB off{spread}: "
                         "only a smaller MoE share of the step or traffic spread more evenly over the experts "
                         "would make EPLB off worth it")
        elif mode == "off":
            words.append(f"EPLB off is predicted {off_on:+.2%} against EPLB on at {best_on.knobs.label}{spread}: "
                         "balancing gains less than its rearrangements and redundant experts cost; more skewed "
                         "traffic or a larger MoE share of the step would make EPLB on worth it")
        else:
            words.append(f"EPLB off is predicted {off_on:+.2%} against EPLB on at {best_on.knobs.label}{spread}, "
                         "not enough to pay a restart or not in every stretch of the history")
    return out
