"""The autotune decision: what one evaluation of one MoEInference concludes. Pure, no I/O.

The kopf timer (:mod:`moe_eplb.controller.autotune`) gathers the inputs -- the parsed resource, the
load read from Prometheus or the pods, the tuner's result, whether a rollout is already running --
and :func:`evaluate` turns them into a decision and the new ``status.autotune``
(:class:`~moe_eplb.api.autotune_status.AutotuneStatus`). Everything a later evaluation needs (last
change time, restarts in the last 24 h, the rollout in progress) lives there, so an operator
restart resumes from the resource alone.

Decisions (``status.autotune.lastEvaluation.decision`` and the ``decision`` label of
``moe_eplb_tuner_decisions_total``):

==========  =======================================================================
``Keep``    the tuner's best config is the current one, or its gain is below minGain
``Recommend``  Recommend mode: a better config exists; written to status, nothing changed
``Apply``   Apply mode: the recommended config is applied -- live (window and interval on the
            running engines, :mod:`.live`: ``Evaluated.live``; the loop carries it out) or by a
            rollout (a restart); ``lastEvaluation.applyMode`` says which (with
            ``spec.autotune.allowDisable``, a rollout that turns EPLB off where that is the pick)
``Experiment``  Apply mode with two or more replicas (``spec.autotune.experiments``): the change
            (or the tuner's exploration, ``TuneResult.explore``) runs on one replica first
            (:mod:`.experiment`)
``Defer``   a change is worth it but not now (cooldown, restart budget, a rollout or
            an unready workload); the reason says which
``NoData``  the load could not be read or is too short; nothing changed
``Error``   the tuner failed; nothing changed
==========  =======================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from moe_eplb.api.autotune_status import (
    ROLLING,
    AutotuneStatus,
    CalibratedParameter,
    CalibrationRecord,
    DataWindow,
    Evaluation,
    LiveChange,
    LiveSettings,
    Measurement,
    Override,
    Recommendation,
    ReplicaCost,
    Rollout,
    iso,
    parse_iso,
)
from moe_eplb.api.knobs import Knobs
from moe_eplb.api.spec import AutotuneSpec
from moe_eplb.controller import experiment as exp_mod
from moe_eplb.controller.outcome import Conditions, Event, describe
from moe_eplb.eplb.replay.capacity import KvCapacity, candidate_costs
from moe_eplb.eplb.tuning.calibrate import Calibration
from moe_eplb.eplb.tuning.replicas import PerReplica
from moe_eplb.eplb.tuning.tuner import TuneResult

KEEP, RECOMMEND, APPLY, DEFER, NODATA, ERROR = "Keep", "Recommend", "Apply", "Defer", "NoData", "Error"
EXPERIMENT = "Experiment"
DECISIONS = (KEEP, RECOMMEND, APPLY, EXPERIMENT, DEFER, NODATA, ERROR)
#: how an Apply changes the engines (``lastEvaluation.applyMode``)
LIVE, RESTART = "live", "restart"

# --- gates -------------------------------------------------------------------------------------

#: How far in the future a recorded change time may lie (clock skew between operator replicas)
#: before it is taken for a wrong clock or a restored backup and clamped to now.
FUTURE_TOLERANCE_S = 60.0


def clamp_future(state: AutotuneStatus, now: float) -> tuple[AutotuneStatus, str | None]:
    """``state`` with ``lastChangeTime`` and ``restarts`` that lie in the future (beyond
    :data:`FUTURE_TOLERANCE_S`: clock skew, a restored backup) clamped to ``now``, and a warning
    saying so (None when nothing was clamped). Written back with the evaluation, the cooldown then
    runs from the first evaluation that noticed -- instead of blocking until the clock catches up."""
    notes = []
    last = state.last_change_time
    if last is not None and last > now + FUTURE_TOLERANCE_S:
        notes.append(f"lastChangeTime {iso(last)} lies {last - now:.0f}s in the future (clock skew or a restored "
                     "backup); counted as now")
        last = now
    future = [t for t in state.restarts if t > now + FUTURE_TOLERANCE_S]
    if future:
        notes.append(f"{len(future)} restart time(s) in the future counted as now")
    if not notes:
        return state, None
    return state.replace(last_change_time=last, restarts=tuple(min(t, now) for t in state.restarts)), "; ".join(notes)


def change_blocker(cfg: AutotuneSpec, state: AutotuneStatus, now: float, *, workload_blocker: str | None) -> str | None:
    """Why a change may not start now, or None when it may.

    ``workload_blocker`` is set by the caller when the pods are not all ready or are rolling (e.g.
    a user's edit is still rolling out); None when the workload is settled.
    """
    if state.rollout is not None:
        return f"a {state.rollout.kind or 'change'} rollout is in progress"
    if state.experiment is not None:
        return f"an experiment of {describe(state.experiment.trial.knobs)} is running"
    if workload_blocker:
        return workload_blocker
    last = state.last_change_time
    if last is not None and now - last < cfg.cooldown_s:
        ago = max(0.0, now - last)  # a time in the future (see clamp_future) counts as now
        left = cfg.cooldown_s - ago
        return f"cooldown: last change {ago:.0f}s ago, {left:.0f}s of cooldownSeconds={cfg.cooldown_s:.0f} left"
    n = len(state.recent_restarts(now))
    if n >= cfg.max_restarts_per_day:
        return f"restart budget spent: {n} restarts in the last 24h (maxRestartsPerDay={cfg.max_restarts_per_day})"
    return None


@dataclass(frozen=True)
class ScalingState:
    """What the replica autoscaler shows now (``spec.autoscaling``), as typed values.

    Attributes:
        desired: ``spec.replicas`` (the count the autoscaler set through ``/scale``).
        running: replicas (replica groups) the workload is rendered with now (its ``spec.replicas``).
        max_replicas: ``spec.autoscaling.maxReplicas``.
        hpa_desired: the HorizontalPodAutoscaler's ``status.desiredReplicas`` (None: not reported).
        last_scale_time: when it last changed the count (``status.lastScaleTime``, clock seconds).
        limited: its ``ScalingLimited`` condition is True with reason ``TooManyReplicas`` (it wants
            more than ``maxReplicas``).
        waiting: requests waiting per replica group when the autoscaler's metric is RequestsWaiting.
    """

    desired: int
    running: int
    max_replicas: int
    hpa_desired: int | None = None
    last_scale_time: float | None = None
    limited: bool = False
    waiting: float | None = None


#: how each of :func:`scaling_blocker`'s reasons begins (the WaitingForAutoscaler Event is posted
#: once per wait, not at every evaluation)
SCALING_WAITS = ("the replica count is changing", "the autoscaler changed the replica count",
                 "the autoscaler is at maxReplicas")


def scaling_blocker(scaling: ScalingState | None, now: float, settle_s: float) -> str | None:
    """Why no tuner rollout may start because of the autoscaler, or None (also without one).

    A rollout restarts every replica, so it waits while the replica count is changing (the
    autoscaler asked for a count the workload does not run yet, or wants another one), for
    ``settle_s`` after the autoscaler last scaled (new replicas serve their first minutes on vLLM's
    initial placement), and while the autoscaler is at ``maxReplicas`` with requests waiting: then
    every replica is needed and a restart costs the most."""
    if scaling is None:
        return None
    if scaling.desired != scaling.running:
        return f"the replica count is changing ({scaling.running} -> {scaling.desired})"
    if scaling.hpa_desired is not None and scaling.hpa_desired != scaling.desired:
        return f"the replica count is changing (the autoscaler wants {scaling.hpa_desired}, {scaling.desired} set)"
    if scaling.last_scale_time is not None and now - scaling.last_scale_time < settle_s:
        ago = max(0.0, now - scaling.last_scale_time)
        return (f"the autoscaler changed the replica count {ago:.0f}s ago; waiting {settle_s - ago:.0f}s more for "
                "the new replicas to settle")
    waiting = scaling.waiting is not None and scaling.waiting > 0
    if scaling.desired >= scaling.max_replicas and (scaling.limited or waiting):
        what = f"{scaling.waiting:g} requests waiting per replica" if waiting else "demand beyond it"
        return (f"the autoscaler is at maxReplicas ({scaling.max_replicas}) with {what}: a restart now costs "
                "the most; raise spec.autoscaling.maxReplicas or wait for the load to drop")
    return None


def due(cfg: AutotuneSpec, state: AutotuneStatus, now: float) -> bool:
    """True when ``evaluationIntervalSeconds`` have passed since the last evaluation began: its load
    was read up to ``dataWindow.end`` (else its ``time``, when it was decided), so evaluations begin
    every interval however long the reading and tuning took."""
    last = state.last_evaluation
    if last is None:
        return True
    window = last.data_window
    began = min(window.end, last.time) if window is not None and window.end is not None else last.time
    return now - began >= cfg.evaluation_interval_s - 1e-6


# --- the tuner's answer --------------------------------------------------------------------------


@dataclass(frozen=True)
class TunerAnswer:
    """What the decision needs of a :class:`~moe_eplb.eplb.tuning.tuner.TuneResult`."""

    recommendation: Knobs
    wants_change: bool  # the tuner's own decision ("change" vs "keep")
    reason: str
    gain: float | None  # over the running configuration, else vLLM's defaults, else no EPLB
    breakdown: dict[str, float]
    restart_charge: float = 0.0  # a restart's share of the throughput over the tuner's horizon
    explore: Knobs | None = None  # the tuner's case for a trial although it would not switch
    explore_reason: str | None = None
    #: the tuner's pick is EPLB off (``TuneResult.enabled`` False): why, and its predicted gain over the
    #: running settings; the fields above are then the best EPLB-on setting's (its own verdict)
    disable: bool = False
    disable_reason: str | None = None
    disable_gain: float | None = None
    #: ``lastEvaluation.eplbAdvice`` (camelCase): is EPLB worth it, and what would change the answer
    advice: dict | None = None

    @classmethod
    def of(cls, result: TuneResult) -> TunerAnswer:
        gain, _vs = result.headline_gain()
        breakdown = {k: (round(float(v), 6) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
                     for k, v in result.chosen.result.throughput.to_dict().items()}
        cost = result.cost
        charge = float(cost.restart_s / cost.horizon_s) if cost.horizon_s else 0.0
        ex = result.explore
        # (a TuneResult built without its defaults, as a test double may be, has no advice: EPLB on)
        advice = advice_record(result) if getattr(result, "advice", None) is not None else None
        if not getattr(result, "enabled", True):  # EPLB off is the pick; the rest is the best EPLB-on setting's verdict
            cur = result.current
            on_gain = result.chosen.score / cur.score - 1.0 if cur is not None and cur.score > 0 else None
            return cls(result.recommendation, result.on_decision == "change", result.on_reason or "", on_gain,
                       breakdown, restart_charge=charge, disable=True, disable_reason=result.reason,
                       disable_gain=gain, advice=advice)
        return cls(result.recommendation, result.decision == "change", result.reason, gain, breakdown,
                   restart_charge=charge, explore=ex.candidate if ex is not None else None,
                   explore_reason=ex.reason if ex is not None else None, advice=advice)


def advice_record(result: TuneResult) -> dict:
    """``lastEvaluation.eplbAdvice``: the tuner's advice (:func:`moe_eplb.eplb.tuning.overlap.advise`)
    with camelCase keys, numbers rounded to 6 significant digits."""
    def sig(v):
        return float(f"{v:.6g}") if isinstance(v, float) else v

    a = result.advice or {}
    out = {"enabled": result.enabled, "mode": result.mode}
    for key, camel_key in (("off_vs_on", "offVsOn"), ("best_on", "bestOn"), ("overlap_loss", "overlapLoss"),
                           ("overlap_loss_low", "overlapLossLow"), ("overlap_loss_high", "overlapLossHigh"),
                           ("overlap_dropped", "overlapDropped"), ("shared_expert_ratio", "sharedExpertRatio"),
                           ("backend", "backend"), ("break_even_hidden", "breakEvenHidden")):
        if a.get(key) is not None:
            out[camel_key] = sig(a[key])
    if a.get("overlap_kept"):
        out["overlapKept"] = {"setting": a["overlap_kept"]["setting"], "gainVsPick": sig(a["overlap_kept"]["gain_vs_pick"])}
    out["whatWouldChange"] = list(a.get("what_would_change") or ())
    return out


def replica_costs(result: TuneResult, cap: KvCapacity | None, *, num_moe_layers: int | None,
                  bytes_per_expert: float | None, ep_size: int, limit: int = 6) -> tuple[ReplicaCost, ...]:
    """The tuner's best ``limit`` candidates with the KV cache per GPU their redundancy leaves and
    the replicas they would need at today's traffic and the autoscaler's target
    (:func:`moe_eplb.eplb.replay.capacity.candidate_costs`; a candidate predicted faster than the running
    settings needs fewer), as ``lastEvaluation.replicaCosts``. Empty without a measured KV cache or
    the model's expert size."""
    if cap is None or not num_moe_layers or not bytes_per_expert:
        return ()
    return tuple(ReplicaCost(c.window_size, c.step_interval, c.num_redundant_experts, c.kv_cache_gib_per_gpu,
                             c.replicas)
                 for c in candidate_costs(result, cap, num_moe_layers=num_moe_layers,
                                          bytes_per_expert=bytes_per_expert, ep_size=ep_size, limit=limit))


def replicas_record(per: PerReplica) -> dict:
    """``lastEvaluation.replicas`` (camelCase): the replicas' load divergence and, above the threshold,
    each replica's own pick with its predicted gain over the shared setting on its own load."""
    def sig(v: float) -> float:
        return float(f"{v:.6g}")

    out = {"divergenceBits": sig(per.divergence), "thresholdBits": per.threshold, "tuned": per.tuned}
    if per.tuned:
        out["gainVsShared"] = sig(per.gain)
        out["groups"] = {k: list(v) for k, v in per.groups.items()}
        out["perReplica"] = [{"replica": p.replica, "windowSize": p.knobs.window_size,
                              "stepInterval": p.knobs.step_interval,
                              "numRedundantExperts": p.knobs.num_redundant_experts, "enabled": p.enabled,
                              "gainVsShared": sig(p.gain_vs_shared)} for p in per.picks]
    return out


def replicas_event(per: PerReplica | None, previous: Evaluation | None, min_gain: float) -> Event | None:
    """A ``PerReplicaSettings`` Event when per-replica settings are predicted to beat the shared one by
    ``minGain`` and the groups differ from the last evaluation's (said once, not every evaluation).
    A recommendation: the operator renders one pod template for every replica (docs/autotune.md)."""
    if per is None or not per.tuned or per.gain < min_gain:
        return None
    before = (previous.replicas or {}).get("groups") if previous is not None else None
    groups = {k: list(v) for k, v in per.groups.items()}
    if before == groups:
        return None
    text = "; ".join(f"{k}: {', '.join(v)}" for k, v in groups.items())
    return ("Normal", "PerReplicaSettings",
            f"the replicas' expert loads diverge ({per.divergence:.3f} bits > {per.threshold} bits): their own settings "
            f"are predicted {per.gain:+.2%} over the shared {per.shared.label} ({text}); a recommendation, the "
            "operator runs one pod template for every replica")


def calibration_record(cal: Calibration) -> CalibrationRecord:
    """The status record of a calibration (values rounded to 6 significant digits)."""
    def sig(v: float | None) -> float | None:
        return None if v is None else float(f"{v:.6g}")

    return CalibrationRecord(
        parameters={n: CalibratedParameter(sig(p.value), sig(p.uncertainty), p.source) for n, p in cal.parameters.items()},
        measured=cal.measured, use_async=cal.use_async)


# --- one evaluation ----------------------------------------------------------------------------


@dataclass
class Evaluated:
    """What one evaluation concludes. The caller writes ``status`` to ``status.autotune`` (one
    conditional patch), applies the conditions and emits the events."""

    decision: str
    reason: str
    status: AutotuneStatus
    conditions: Conditions = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    predicted_gain: float | None = None
    started_rollout: bool = False
    #: a change of window and interval to apply live (the loop sends it: :func:`.live.apply_live`,
    #: then records it with :func:`record_live`); None: nothing to apply live
    live: Knobs | None = None

    def decide(self, decision: str, reason: str, tuned: str) -> None:
        """The decision, why, and the ``Tuned`` condition (True, reason ``tuned``, message why)."""
        self.decision, self.reason = decision, reason
        self.conditions["Tuned"] = ("True", tuned, reason)

    def start_rollout(self, state: AutotuneStatus, rollout: Rollout, override: Override, now: float) -> None:
        """A restarting rollout of ``override`` (an ``ApplyingTunedSettings`` Event with the reason); a
        restart counted against the budget and the cooldown."""
        self.events.append(("Normal", "ApplyingTunedSettings", self.reason))
        self.started_rollout = True
        self.status = self.status.replace(override=override, rollout=rollout, last_change_time=now,
                                          restarts=state.recent_restarts(now) + (now,))


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100.0 * x:+.1f}%"


def _window_text(w: DataWindow | None) -> str:
    if w is None:
        return "load read"
    start = iso(w.start) if w.start is not None else "?"
    end = iso(w.end) if w.end is not None else "?"
    return (f"{w.buckets if w.buckets is not None else '?'} buckets, {w.steps if w.steps is not None else '?'} "
            f"engine steps from {w.source or '?'} ({start} .. {end})")


def evaluate(
    cfg: AutotuneSpec,
    state: AutotuneStatus,
    *,
    now: float,
    generation: int,
    current: Knobs,
    spec_eplb: Knobs,
    data_window: DataWindow | None,
    load_error: tuple[str, str] | None = None,
    answer: TunerAnswer | None = None,
    tune_error: str | None = None,
    workload_blocker: str | None = None,
    baseline: Measurement | None = None,
    from_hash: str | None = None,
    calibration: CalibrationRecord | None = None,
    scaling: ScalingState | None = None,
    replicas: int = 1,
    objective_before: dict | None = None,
    live_problem: str | None = "not checked",
    live_wait: str | None = None,
    interleave: Callable[[Knobs, Knobs], dict | str] | None = None,
) -> Evaluated:
    """Decide what to do with one tuning result.

    Args:
        cfg: ``spec.autotune``.
        state: the current ``status.autotune``.
        now: POSIX seconds.
        generation: ``metadata.generation`` (recorded in the override and the rollout).
        current: the knobs that run now (the effective settings).
        spec_eplb: ``spec.eplb``'s knobs now, recorded with the override (``specEplb``) so that it
            runs until the user edits ``spec.eplb``.
        data_window: what load was read.
        load_error: ``(reason, message)`` when the load could not be used.
        answer: the tuner's answer when it ran.
        tune_error: the tuner's error message when it failed.
        workload_blocker: why the workload cannot take a change now (see :func:`change_blocker`).
        baseline: measured performance before a change.
        from_hash: the pod-template config hash running now (rollout progress compares against it).
        calibration: the cost-model calibration used (recorded in ``lastEvaluation``).
        scaling: the replica autoscaler's state (None: no autoscaler); see :func:`scaling_blocker`.
        objective_before: the objective's buckets before the change (recorded in the rollout: a
            change applied to all is judged on the objective across time).
        replicas: the replicas (replica groups) running now: with two or more and
            ``spec.autotune.experiments.enabled`` a change starts as an experiment (``Experiment``).
        live_problem: None when the engines take a change of window and interval live
            (:func:`.live.live_capable`), else why not: such a change is then a restart as before.
        live_wait: why a live change must wait now (a live change whose first rearrangement has not
            come yet: live settings need no cooldown beyond that), or None.
        interleave: ``(target, current) -> schedule or why not`` (:func:`.interleaved.plan` with what
            the loop knows: the engine pods, their step rate, whether they take settings live): an
            experiment runs interleaved on the same replicas where it returns a schedule, else
            cross-pod (the reason says why). None: cross-pod.

    Returns:
        :class:`Evaluated`; its ``status`` is the complete new ``status.autotune``.
    """
    state, skew = clamp_future(state, now)
    ev = Evaluation(time=now, current=current, data_window=data_window, calibration=calibration)
    out = Evaluated(decision=KEEP, reason="", status=state)
    if skew:
        out.events.append(("Warning", "ClockSkew", skew))
    if load_error is not None:
        reason, message = load_error
        out.decision, out.reason = NODATA, f"{reason}: {message}"
        out.conditions["MetricsAvailable"] = ("False", reason, message)
        out.conditions["Tuned"] = ("False", "NoData", "no change: the load could not be read (see MetricsAvailable)")
    elif tune_error is not None or answer is None:
        msg = tune_error or "the tuner returned nothing"
        out.decision, out.reason = ERROR, f"tuner failed: {msg}"
        out.conditions["MetricsAvailable"] = ("True", "LoadRead", _window_text(data_window))
        out.conditions["Tuned"] = ("False", "TunerError", f"no change: {msg}")
        out.events.append(("Warning", "TunerError", msg))
    else:
        out.conditions["MetricsAvailable"] = ("True", "LoadRead", _window_text(data_window))
        ev = _judge(cfg, state, out, ev, now=now, generation=generation, current=current, spec_eplb=spec_eplb,
                    answer=answer, workload_blocker=workload_blocker, baseline=baseline, from_hash=from_hash,
                    scaling=scaling, replicas=replicas, objective_before=objective_before,
                    live_problem=live_problem, live_wait=live_wait, interleave=interleave)
    mode = LIVE if out.live is not None else (RESTART if out.decision in (APPLY, EXPERIMENT) else None)
    ev = Evaluation(**{**ev.__dict__, "decision": out.decision, "reason": out.reason, "apply_mode": mode})
    out.status = out.status.replace(last_evaluation=ev)
    return out


def _judge(cfg: AutotuneSpec, state: AutotuneStatus, out: Evaluated, ev: Evaluation, *, now: float, generation: int,
           current: Knobs, spec_eplb: Knobs, answer: TunerAnswer, workload_blocker: str | None,
           baseline: Measurement | None, from_hash: str | None, scaling: ScalingState | None = None,
           replicas: int = 1, objective_before: dict | None = None, live_problem: str | None = "not checked",
           live_wait: str | None = None, interleave: Callable[[Knobs, Knobs], dict | str] | None = None) -> Evaluation:
    """Keep, Recommend, Defer or Apply a tuner answer; fills ``out``, returns the evaluation record."""
    target, gain = answer.recommendation, answer.gain
    out.predicted_gain = gain
    ev = Evaluation(**{**ev.__dict__, "recommended": target, "predicted_gain": gain,
                       "gain_breakdown": answer.breakdown, "tuner_decision": "change" if answer.wants_change else "keep",
                       "tuner_reason": answer.reason, "eplb_advice": answer.advice})
    out.status = state.replace(recommendation=Recommendation(target.window_size, target.step_interval,
                                                            target.num_redundant_experts, gain, now))
    if answer.disable:
        if cfg.mode == "Apply" and cfg.allow_disable:
            _judge_off(cfg, state, out, now=now, generation=generation, current=current, spec_eplb=spec_eplb,
                       answer=answer, workload_blocker=workload_blocker, baseline=baseline, from_hash=from_hash,
                       scaling=scaling, objective_before=objective_before)
            return Evaluation(**{**ev.__dict__, "tuner_decision": "disable", "tuner_reason": answer.disable_reason,
                                 "predicted_gain": answer.disable_gain})
        _judge_on(cfg, state, out, now=now, generation=generation, current=current, spec_eplb=spec_eplb,
                  answer=answer, workload_blocker=workload_blocker, baseline=baseline, from_hash=from_hash,
                  scaling=scaling, replicas=replicas, objective_before=objective_before, live_problem=live_problem,
                  live_wait=live_wait, interleave=interleave)
        _recommend_off(cfg, state, out, answer, now)
        return ev
    _judge_on(cfg, state, out, now=now, generation=generation, current=current, spec_eplb=spec_eplb, answer=answer,
              workload_blocker=workload_blocker, baseline=baseline, from_hash=from_hash, scaling=scaling,
              replicas=replicas, objective_before=objective_before, live_problem=live_problem, live_wait=live_wait,
              interleave=interleave)
    return ev


def _recommend_off(cfg: AutotuneSpec, state: AutotuneStatus, out: Evaluated, answer: TunerAnswer, now: float) -> None:
    """The tuner's pick is EPLB off, but Apply may not turn it off (Recommend mode, or
    ``spec.autotune.allowDisable`` false): a recommendation in status (``recommendation.enabled:
    false``) and a ``RecommendEplbOff`` Event when it is new; the best EPLB-on setting was judged as
    usual (:func:`_judge_on`)."""
    why = ("mode Recommend" if cfg.mode != "Apply" else
           "spec.autotune.allowDisable is false: set it true to let Apply turn EPLB off, or set spec.eplb.enabled: false")
    note = f"EPLB off predicted {_pct(answer.disable_gain)} better ({answer.disable_reason}); not applied: {why}"
    rec = out.status.recommendation
    out.status = out.status.replace(recommendation=Recommendation(
        rec.window_size, rec.step_interval, rec.num_redundant_experts, answer.disable_gain, now, enabled=False))
    if state.recommendation is None or state.recommendation.enabled is not False:
        out.events.append(("Normal", "RecommendEplbOff", note))
    if out.decision == KEEP and cfg.mode == "Recommend":
        out.decision, out.reason = RECOMMEND, note
        out.conditions["Tuned"] = ("True", "Recommended", note)
    else:
        out.reason = f"{out.reason}; {note}"
        status, reason, message = out.conditions.get("Tuned", ("True", "Kept", ""))
        out.conditions["Tuned"] = (status, reason, f"{message}; {note}")


def _judge_off(cfg: AutotuneSpec, state: AutotuneStatus, out: Evaluated, *, now: float, generation: int,
               current: Knobs, spec_eplb: Knobs, answer: TunerAnswer, workload_blocker: str | None,
               baseline: Measurement | None, from_hash: str | None, scaling: ScalingState | None,
               objective_before: dict | None) -> None:
    """Apply mode with ``spec.autotune.allowDisable``: turn EPLB off through the safe rollout (the same
    blockers, restart budget and judge; never as an experiment: a trial arm runs EPLB settings)."""
    gain = answer.disable_gain
    out.predicted_gain = gain
    rec = out.status.recommendation
    out.status = out.status.replace(recommendation=Recommendation(
        rec.window_size, rec.step_interval, rec.num_redundant_experts, gain, now, enabled=False))
    blocker = scaling_blocker(scaling, now, cfg.observe_s) or change_blocker(cfg, state, now,
                                                                             workload_blocker=workload_blocker)
    if blocker is not None:
        out.decide(DEFER, f"EPLB off predicted {_pct(gain)} better, deferred: {blocker}", "Deferred")
        return
    out.decide(APPLY, f"turning EPLB off (was {describe(current)}): predicted {_pct(gain)} better "
                      f"({answer.disable_reason})", "Applying")
    rollout = Rollout(kind="apply", phase=ROLLING, started_at=now, from_knobs=current, to_knobs=spec_eplb,
                      previous_override=state.override, spec_generation=generation, spec_eplb=spec_eplb,
                      from_hash=from_hash, baseline=baseline, predicted_gain=gain,
                      replicas=scaling.desired if scaling is not None else None,
                      objective_before=objective_before, to_enabled=False)
    out.start_rollout(state, rollout, Override.disabled(spec_generation=generation, spec_eplb=spec_eplb), now)


def _judge_on(cfg: AutotuneSpec, state: AutotuneStatus, out: Evaluated, *, now: float, generation: int,
              current: Knobs, spec_eplb: Knobs, answer: TunerAnswer, workload_blocker: str | None,
              baseline: Measurement | None, from_hash: str | None, scaling: ScalingState | None,
              replicas: int, objective_before: dict | None, live_problem: str | None = "not checked",
              live_wait: str | None = None, interleave: Callable[[Knobs, Knobs], dict | str] | None = None) -> None:
    """Keep, Recommend, Defer, Experiment or Apply the best EPLB-on setting (``live_problem`` None: a
    change of window and interval alone is applied live, unless ``live_wait`` says why not yet)."""
    target, gain = answer.recommendation, answer.gain
    wants_change = target != current and (gain is None or gain >= cfg.min_gain) and answer.wants_change
    explore = not wants_change and answer.explore is not None and answer.explore != current \
        and cfg.mode == "Apply" and exp_mod.possible(cfg, replicas)
    if explore and live_problem is None and answer.explore.num_redundant_experts == current.num_redundant_experts \
            and not isinstance(interleave(answer.explore, current) if interleave is not None else None, dict):
        # window and interval alone on engines that change them live: compared on the same pods (an
        # interleaved experiment), never a trial that restarts a replica (its template could be the
        # running pods' own, the live values aside); where no interleaved schedule fits, no exploration
        explore = False
    if explore:
        target = answer.explore
    if not wants_change and not explore:
        why = answer.reason or ("the current settings are the best found" if target == current
                                else f"predicted gain {_pct(gain)} is below minGain {_pct(cfg.min_gain)}")
        out.decision, out.reason = KEEP, why
        out.conditions["Tuned"] = ("True", "Kept", f"keeping {describe(current)}: {why}")
    elif cfg.mode == "Recommend":
        out.decide(RECOMMEND, f"{describe(target)} predicted {_pct(gain)} better; mode Recommend, not applied",
                   "Recommended")
        out.events.append(("Normal", "Recommended", out.reason))
    elif target.num_redundant_experts == current.num_redundant_experts and live_problem is None and not explore:
        # (an exploration is a trial on one replica, never applied to every one: the experiment below)
        _apply_live(cfg, state, out, now=now, current=current, target=target, gain=gain, scaling=scaling,
                    workload_blocker=workload_blocker, live_wait=live_wait)
    elif (blocker := scaling_blocker(scaling, now, cfg.observe_s)  # first: a scale-out also leaves pods unready
          or change_blocker(cfg, state, now, workload_blocker=workload_blocker)) is not None:
        autoscaler = blocker == scaling_blocker(scaling, now, cfg.observe_s)
        out.decide(DEFER, f"{describe(target)} predicted {_pct(gain)} better, deferred: {blocker}",
                   "WaitingForAutoscaler" if autoscaler else "Deferred")
        previous = (state.last_evaluation.reason if state.last_evaluation is not None else None) or ""
        if autoscaler and next(c for c in SCALING_WAITS if blocker.startswith(c)) not in previous:  # once per wait
            out.events.append(("Normal", "WaitingForAutoscaler", f"tuner rollout of {describe(target)} waits: {blocker}"))
    elif exp_mod.possible(cfg, replicas):
        _start_experiment(cfg, state, out, now=now, generation=generation, current=current, target=target,
                          spec_eplb=spec_eplb, answer=answer, from_hash=from_hash, replicas=replicas,
                          explore=answer.explore_reason if explore else None,
                          schedule=interleave(target, current) if interleave is not None
                          else "the engines do not take settings live")
    else:
        how = "" if target.num_redundant_experts != current.num_redundant_experts or live_problem == "not checked" \
            else f" (restart: {live_problem})"
        out.decide(APPLY, f"applying {describe(target)} (was {describe(current)}): predicted {_pct(gain)} better{how}",
                   "Applying")
        rollout = Rollout(kind="apply", phase=ROLLING, started_at=now, from_knobs=current, to_knobs=target,
                          previous_override=state.override, spec_generation=generation, spec_eplb=spec_eplb,
                          from_hash=from_hash, baseline=baseline, predicted_gain=gain,
                          replicas=scaling.desired if scaling is not None else None,
                          objective_before=objective_before)
        out.start_rollout(state, rollout, Override.of(target, spec_generation=generation, spec_eplb=spec_eplb), now)


def _apply_live(cfg: AutotuneSpec, state: AutotuneStatus, out: Evaluated, *, now: float, current: Knobs,
                target: Knobs, gain: float | None, scaling: ScalingState | None, workload_blocker: str | None,
                live_wait: str | None) -> None:
    """A change of window and interval only, on engines that take it live: no restart, so neither
    the cooldown nor the restart budget applies -- only a rollout or experiment in progress, an
    unsettled workload or autoscaler, and the previous live change's first rearrangement hold it."""
    blocker = (scaling_blocker(scaling, now, cfg.observe_s)
               or (f"a {state.rollout.kind or 'change'} rollout is in progress" if state.rollout is not None else None)
               or (f"an experiment of {describe(state.experiment.trial.knobs)} is running"
                   if state.experiment is not None else None)
               or workload_blocker or live_wait)
    if blocker is not None:
        out.decide(DEFER, f"{describe(target)} predicted {_pct(gain)} better (live), deferred: {blocker}", "Deferred")
        return
    out.decide(APPLY, f"applying live {describe(target)} (was {describe(current)}): predicted {_pct(gain)} better; "
                      "window and interval change on the running engines at one engine step, no restart", "ApplyingLive")
    out.live = target


def record_live(state: AutotuneStatus, *, now: float, current: Knobs, target: Knobs, config_hash: str,
                step: int | None, steps: dict | None, reason: str) -> AutotuneStatus:
    """``state`` with a live change every EP rank confirmed: ``live`` (what runs over the template
    ``config_hash``) and one ``liveChanges`` entry. Not a restart: ``restarts`` and
    ``lastChangeTime`` (the restarts' cooldown) are left alone."""
    live = LiveSettings(target.window_size, target.step_interval, config_hash, step, dict(steps or {}) or None, now)
    return state.replace(live=live).with_live_change(
        LiveChange(at=now, from_knobs=current, to_knobs=target, step=step, steps=dict(steps or {}) or None,
                   reason=reason))


def _start_experiment(cfg: AutotuneSpec, state: AutotuneStatus, out: Evaluated, *, now: float, generation: int,
                      current: Knobs, target: Knobs, spec_eplb: Knobs, answer: TunerAnswer, from_hash: str | None,
                      replicas: int, explore: str | None, schedule: dict | str) -> None:
    """The change is tried against the running settings first (:func:`.experiment.start`): decision
    ``Experiment``, interleaved on the same replicas where ``schedule`` is one, else cross-pod on one
    restarted replica after the pre-period (``schedule``: why not interleaved)."""
    out.decision = EXPERIMENT
    why = f"exploring ({explore})" if explore else f"predicted {_pct(answer.gain)} better"
    xp = cfg.experiments
    if isinstance(schedule, dict):
        out.reason = (f"experiment: {describe(target)} against {describe(current)} in turns on the same {replicas} "
                      f"replicas (interleaved, applied live; blocks of {schedule['blockSeconds']:.0f}s): {why}; "
                      "promoted when the sequential interval is above 0")
    else:
        pre = f"a {xp.baseline_s:.0f}s pre-period on the running settings, then " if xp.baseline_s > 0 else ""
        out.reason = (f"experiment: {describe(target)} on 1 of {replicas} replicas against {describe(current)} "
                      f"on the others, same traffic (cross-pod: {schedule}): {why}; {pre}a {xp.warmup_s:.0f}s "
                      f"warm-up; promoted when the sequential interval beats the restart charge "
                      f"{answer.restart_charge:.2%}")
    out.conditions["Tuned"] = ("True", "Experimenting", out.reason)
    out.events.append(("Normal", "ExperimentStarted", out.reason))
    out.started_rollout = True
    out.status = exp_mod.start(out.status, now=now, current=current, target=target, replicas=replicas,
                               generation=generation, spec_eplb=spec_eplb, from_hash=from_hash,
                               restart_charge=answer.restart_charge, predicted_gain=answer.gain, explore=explore,
                               baseline_s=xp.baseline_s, schedule=schedule if isinstance(schedule, dict) else None)


# --- status helpers ----------------------------------------------------------------------------


def set_conditions(conditions: list[dict] | None, updates: Conditions, *, now: float,
                   generation: int | None) -> list[dict]:
    """Apply ``{type: (status, reason, message)}`` to a conditions list (new list returned).

    ``lastTransitionTime`` changes only when a condition's status changes; other types are kept.
    """
    out = [dict(c) for c in (conditions or [])]
    by_type = {c.get("type"): c for c in out}
    for ctype, (status, reason, message) in updates.items():
        c = by_type.get(ctype)
        if c is None:
            c = {"type": ctype}
            out.append(c)
            by_type[ctype] = c
        if c.get("status") != status:
            c["lastTransitionTime"] = iso(now).split(".")[0] + "Z"
        c.update(status=status, reason=reason, message=message[:1000])
        if generation is not None:
            c["observedGeneration"] = int(generation)
    return out


__all__ = ["KEEP", "RECOMMEND", "APPLY", "EXPERIMENT", "DEFER", "NODATA", "ERROR", "DECISIONS", "TunerAnswer", "Evaluated",
           "evaluate", "change_blocker", "SCALING_WAITS",
           "scaling_blocker", "ScalingState", "clamp_future", "due", "set_conditions", "describe", "iso", "parse_iso",
           "calibration_record", "advice_record", "replicas_record", "replicas_event", "record_live"]
