"""The safe-rollout state machine for a tuner change. Pure, no I/O.

A change of EPLB knobs restarts vLLM. The tuner starts one by writing ``status.autotune.override``
(which the reconciler renders into the pod template, so the workload rolls its pods with the
strategy from ``spec.rollout``) together with ``status.autotune.rollout``. Every tick of the autotune
timer then calls :func:`advance` with what the cluster shows; the state moves

    Rolling --(new pods all ready)--> Observing --(observeSeconds served, measured)--> done (kept)
       |                                  |---------(worse than before by > tolerance)--> RollingBack
       |--(crash loop / timeout)--> RollingBack --(previous pods ready)--> done (rolled back)
    any phase --(the user edited spec.eplb, disabled EPLB, or the change became invalid for the
                 spec)--> done (superseded); a replicas / autotune edit does not supersede

and every transition is a single status patch, so an operator killed at any point resumes from the
resource: a rollout is never started twice (the override and the rollout record are written
together) and a rollback decided is never lost (``phase: RollingBack`` is written with the restored
override). The judge in Observing is the objective across time (step time at comparable load, or
throughput per GPU when saturated: :func:`moe_eplb.eplb.tuning.experiment.before_after_estimate`, its
interval's upper end below ``-rollbackTolerance`` rolls back); only where the objective cannot be
measured (no step telemetry) does measured balancedness against the baseline decide, as before.
The records are :mod:`moe_eplb.api.autotune_status`'s ``Rollout``, ``HistoryEntry`` and
``Degraded``; ``status.autotune.degraded`` is set when a tuner change crash-looped (and stays until
a later change is kept), so the reconciler keeps ``Degraded`` true.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from moe_eplb.api.autotune_status import (
    OBSERVING,
    ROLLING,
    ROLLING_BACK,
    AutotuneStatus,
    Degraded,
    HistoryEntry,
    Measurement,
    Rollout,
)
from moe_eplb.api.knobs import Knobs
from moe_eplb.api.spec import AutotuneSpec
from moe_eplb.controller.outcome import StatusStep, describe

__all__ = ["ROLLING", "OBSERVING", "ROLLING_BACK", "WorkloadView", "Step", "advance", "measurement_window",
           "rollout_timeout_s", "superseded_reason"]


@dataclass(frozen=True)
class WorkloadView:
    """What the cluster shows about a MoEInference's pods right now.

    Attributes:
        generation: the resource's ``metadata.generation``.
        settled: every child workload has rolled out its current template: observed its
            generation, all replicas (replica groups) updated, ready and available, no surplus old ones.
        template_hash: the ``eplb.ai/eplb-config-hash`` of the current pod template (None when
            no child workload exists yet).
        crashlooping: names of pods of the current template (``template_hash``) that are crash
            looping (``CrashLoopBackOff`` or restarted >= the threshold).
        spec_eplb: ``spec.eplb``'s knobs now; None: unknown (then a rollout is superseded by the
            old generation rule).
        eplb_enabled: ``spec.eplb.enabled`` now.
        target_invalid: why the rollout's target settings cannot run with the spec now (e.g. the EP
            size changed), else None.
    """

    generation: int
    settled: bool
    template_hash: str | None
    crashlooping: tuple[str, ...] = ()
    spec_eplb: Knobs | None = None
    eplb_enabled: bool = True
    target_invalid: str | None = None
    #: when the youngest replica (engine pod) started, clock seconds; None: unknown
    newest_replica_at: float | None = None
    #: replicas (replica groups) the child workloads are rendered with (sum of their spec.replicas)
    replicas: int | None = None


def _target(ro: Rollout) -> str:
    """What the rollout changes to, in words (a change that turns EPLB off says so)."""
    return "EPLB off" if ro.to_enabled is False else describe(ro.to_knobs)


def rollout_timeout_s(cfg: AutotuneSpec, *, stop_seconds: float = 0.0, replicas: int = 1, max_surge: int = 1,
                      max_unavailable: int = 0) -> float:
    """How long the new pods may take to become ready before the change is rolled back: the
    autotune allowance (``AutotuneSpec.rollout_timeout_s``) plus, for every batch of the rolling update
    (``replicas`` replaced ``max_surge + max_unavailable`` at a time), the time an old pod may take to
    stop (``stop_seconds``: its drain, vLLM's shutdown and the margin, i.e. its
    ``terminationGracePeriodSeconds``): a long drain must not look like a stuck rollout."""
    batches = -(-max(1, replicas) // max(1, max_surge + max_unavailable))
    return cfg.rollout_timeout_s + batches * max(0.0, stop_seconds)


def superseded_reason(ro: Rollout, view: WorkloadView) -> str | None:
    """Why the user's settings now win over rollout ``ro`` (None: they do not).

    Only what changes the settings that run supersedes: an edit of ``spec.eplb``, EPLB disabled,
    or the target no longer valid for the spec. A ``replicas`` (``/scale``) or ``autotune`` edit
    does not. A rollout without ``specEplb`` (older operator) keeps the generation rule.
    """
    if ro.spec_eplb is not None and view.spec_eplb is not None:
        if not view.eplb_enabled:
            return "spec.eplb.enabled was set to false"
        if ro.spec_eplb != view.spec_eplb:
            return f"spec.eplb changed ({describe(ro.spec_eplb)} -> {describe(view.spec_eplb)})"
        if view.target_invalid and ro.kind == "apply":
            return f"{_target(ro)} is no longer valid for the spec ({view.target_invalid})"
        return None
    if ro.spec_generation is not None and int(view.generation) != int(ro.spec_generation):
        return f"spec changed (generation {ro.spec_generation} -> {view.generation})"
    return None


@dataclass
class Step(StatusStep):
    """The result of one :func:`advance`: the complete new ``status.autotune`` plus side effects."""

    rollback_reason: str | None = None  # label for moe_eplb_rollbacks_total when a rollback starts
    needs_measurement: tuple[float, float] | None = None  # (start, end) POSIX s when a measurement is wanted


def measurement_window(cfg: AutotuneSpec, state: AutotuneStatus, now: float,
                       newest_replica_at: float | None = None) -> tuple[float, float] | None:
    """The ``(start, end)`` window to measure when the rollout is ready to be judged, else None.

    Replicas younger than the window are not judged: a replica the autoscaler added while the
    change was observed serves its first minutes on vLLM's initial placement, which says nothing
    about the tuned settings, so the window starts when the youngest replica started
    (``newest_replica_at``) and is judged once it spans ``observeSeconds``."""
    ro = state.rollout
    if ro is None or ro.phase != OBSERVING or ro.ready_at is None:
        return None
    start = ro.ready_at if newest_replica_at is None else max(ro.ready_at, newest_replica_at)
    if now - start < cfg.observe_s:
        return None
    return start, now


# --- transitions -----------------------------------------------------------------------------------


def _finish(step: Step, ro: Rollout, now: float, action: str, reason: str, **status_changes) -> None:
    """End the rollout: a history entry, no rollout record (plus ``status_changes``)."""
    entry = HistoryEntry(time=now, action=action, from_knobs=ro.from_knobs, to_knobs=ro.to_knobs, reason=reason,
                         predicted_gain=ro.predicted_gain, baseline=ro.baseline, measured=ro.measured,
                         started_at=ro.started_at, to_enabled=ro.to_enabled)
    step.status = step.status.with_history(entry).replace(rollout=None, **status_changes)
    step.changed = True


def _start_rollback(step: Step, ro: Rollout, view: WorkloadView, now: float, label: str, message: str, *,
                    degraded: bool) -> None:
    """Restore the previous override (None: ``spec.eplb``) and roll the pods back."""
    state = step.status
    to_hash = ro.to_hash or (view.template_hash if view.template_hash != ro.from_hash else None)
    rollback = dataclasses.replace(ro, kind="rollback", phase=ROLLING_BACK, rollback_started_at=now, to_hash=to_hash,
                                   reason=message, degraded=degraded)
    changes = dict(override=ro.previous_override, rollout=rollback, restarts=state.recent_restarts(now) + (now,),
                   last_change_time=now)
    if degraded:
        changes["degraded"] = Degraded(now, "CrashLoopAfterTuning", message)
        step.conditions["Degraded"] = ("True", "CrashLoopAfterTuning", message)
    step.status = state.replace(**changes)
    step.changed = True
    step.rollback_reason = label
    step.events.append(("Warning", "RollingBack", message))
    step.conditions["Tuned"] = ("False", "RolledBack", message)


def _crash_loop_rollback(step: Step, ro: Rollout, view: WorkloadView, now: float) -> None:
    """The one crash-loop rule of Rolling and Observing: roll back and mark Degraded."""
    _start_rollback(step, ro, view, now, "crashloop",
                    f"pods crash-looping after applying {_target(ro)}: "
                    f"{', '.join(sorted(view.crashlooping)[:5])}; restoring {describe(ro.from_knobs)}",
                    degraded=True)


def _rolling(step: Step, cfg: AutotuneSpec, ro: Rollout, view: WorkloadView, now: float, timeout_s: float) -> None:
    new_template = view.template_hash is not None and view.template_hash != ro.from_hash
    if view.crashlooping and new_template:
        _crash_loop_rollback(step, ro, view, now)
    elif view.settled and new_template:
        step.status = step.status.replace(rollout=dataclasses.replace(ro, phase=OBSERVING, ready_at=now,
                                                                      to_hash=view.template_hash))
        step.changed = True
        step.events.append(("Normal", "TunedPodsReady",
                            f"pods with {_target(ro)} are ready; observing for {cfg.observe_s:.0f}s"))
        step.conditions["Tuned"] = ("True", "Observing", f"pods with {_target(ro)} are ready; "
                                    f"observing for {cfg.observe_s:.0f}s")
    elif now - (ro.started_at if ro.started_at is not None else now) > timeout_s:
        started = ro.started_at if ro.started_at is not None else now
        _start_rollback(step, ro, view, now, "timeout",
                        f"pods with {_target(ro)} not ready after {now - started:.0f}s; "
                        f"restoring {describe(ro.from_knobs)}", degraded=False)


def _observing(step: Step, cfg: AutotuneSpec, ro: Rollout, view: WorkloadView, now: float,
               measured: Measurement | None) -> None:
    if view.crashlooping:
        _crash_loop_rollback(step, ro, view, now)
        return
    window = measurement_window(cfg, step.status, now, view.newest_replica_at)
    ready = ro.ready_at if ro.ready_at is not None else now
    if window is None:
        if view.newest_replica_at is not None and view.newest_replica_at > ready \
                and now - ready >= judge_limit_s(cfg):
            _keep_unmeasured(step, ro, now, f"the autoscaler kept adding replicas (the youngest started "
                             f"{now - view.newest_replica_at:.0f}s ago, less than observeSeconds)")
        return
    step.needs_measurement = window
    objective = measured is not None and measured.estimate is not None and measured.ci_high is not None
    if measured is None or (measured.balancedness is None and not objective):
        # No data to judge yet: wait up to another observe period, then keep (the prediction stands).
        if now - ready >= judge_limit_s(cfg):
            _keep_unmeasured(step, ro, now, f"none after {now - ready:.0f}s")
        return
    if objective:
        _judge_objective(step, cfg, ro, view, now, measured, observed_s=now - ready)
        return
    ro = dataclasses.replace(ro, measured=measured, judged_at=now)
    base = ro.baseline.balancedness if ro.baseline is not None else None
    got = float(measured.balancedness)
    if base is not None and got < float(base) * (1.0 - cfg.rollback_tolerance):
        _start_rollback(step, ro, view, now, "regression",
                        f"measured balancedness {got:.3f} after applying {_target(ro)} is worse than "
                        f"{float(base):.3f} before by more than rollbackTolerance {cfg.rollback_tolerance:.0%}; "
                        f"restoring {describe(ro.from_knobs)}", degraded=False)
        return
    vs = f" (was {float(base):.3f})" if base is not None else ""
    msg = f"kept {_target(ro)}: measured balancedness {got:.3f}{vs}"
    _finish(step, ro, now, "Kept", msg, degraded=None)
    step.events.append(("Normal", "TunedSettingsKept", msg))
    step.conditions["Tuned"] = ("True", "Kept", msg)


#: The fewest residual degrees of freedom an interval needs to decide before :func:`judge_limit_s`.
#: A fit of four parameters on five or six buckets gives an interval whose width is itself a guess:
#: a full run saw +5% changes measured at [-21%, -9%] with 2 and a change judged on every new
#: bucket (each look another chance to be wrong) needs more than the t quantile alone.
JUDGE_MIN_DOF = 4


def judge_limit_s(cfg: AutotuneSpec) -> float:
    """How long a change applied to every replica may be observed without a decision (no data yet,
    the autoscaler still adding replicas, or the objective's interval inconclusive):
    ``2 x observeSeconds + 60 s``."""
    return 2 * cfg.observe_s + 60


def _judge_objective(step: Step, cfg: AutotuneSpec, ro: Rollout, view: WorkloadView, now: float,
                     m: Measurement, *, observed_s: float) -> None:
    """The judge on the objective across time (normalised by the offered load, with its interval):
    roll back when the interval says the change loses by more than ``rollbackTolerance`` (its upper
    end below ``-rollbackTolerance``), keep when it says it does not (its lower end at or above); an
    interval across ``-rollbackTolerance``, or one from fewer than :data:`JUDGE_MIN_DOF` degrees of
    freedom, is inconclusive: observe on (the window grows) until :func:`judge_limit_s`, then the
    estimate decides, the interval stated. Balancedness is reported beside it, never the judge."""
    tol = cfg.rollback_tolerance
    est = float(m.estimate if m.estimate is not None else 0.0)
    lo = float(m.ci_low if m.ci_low is not None else -math.inf)
    hi = float(m.ci_high if m.ci_high is not None else math.inf)
    enough = m.dof is None or m.dof >= JUDGE_MIN_DOF  # None: a record from before dof was stored
    conclusive = enough and (hi < -tol or lo >= -tol)
    if not conclusive and observed_s < judge_limit_s(cfg):
        return  # more buckets narrow the interval; the rollout stays Observing
    ro = dataclasses.replace(ro, measured=m, judged_at=now)
    base = ro.baseline.balancedness if ro.baseline is not None else None
    bal = (f"; balancedness {m.balancedness:.3f}" + (f" (was {float(base):.3f})" if base is not None else "")
           if m.balancedness is not None else "")
    got = (f"{est:+.2%} [{lo:+.2%}, {hi:+.2%}] on {m.objective} "
           f"({cfg.experiments.confidence:.0%} interval, normalised by the offered load)")
    if not conclusive:
        few = "" if enough else f" ({m.dof} degrees of freedom)"
        got += f", inconclusive after {observed_s:.0f}s{few}: decided on the estimate"
    if (hi < -tol) if conclusive else (est < -tol):
        _start_rollback(step, ro, view, now, "regression",
                        f"the objective after applying {_target(ro)} is {got}: worse by more than "
                        f"rollbackTolerance {tol:.0%}{bal}; restoring {describe(ro.from_knobs)}",
                        degraded=False)
        return
    msg = f"kept {_target(ro)}: the objective {got}{bal}"
    _finish(step, ro, now, "Kept", msg, degraded=None)
    step.events.append(("Normal", "TunedSettingsKept", msg))
    step.conditions["Tuned"] = ("True", "Kept", msg)


def _keep_unmeasured(step: Step, ro: Rollout, now: float, why: str) -> None:
    msg = f"kept {_target(ro)} without a measurement ({why}); the tuner's prediction stands"
    _finish(step, dataclasses.replace(ro, judged_at=now), now, "Kept", msg)
    step.events.append(("Normal", "TunedSettingsKept", msg))
    step.conditions["Tuned"] = ("True", "KeptUnmeasured", msg)


def _rolling_back(step: Step, ro: Rollout, view: WorkloadView, now: float) -> None:
    back = view.template_hash is not None and (
        view.template_hash == ro.from_hash or (ro.to_hash is not None and view.template_hash != ro.to_hash))
    if view.settled and back:
        msg = f"rolled back to {describe(ro.from_knobs)}: {ro.reason or ''}".strip()
        changes = {}
        if ro.degraded:
            # the reconciler keeps Degraded true from this record (controller/status.py)
            changes["degraded"] = Degraded(now, "RolledBackAfterCrashLoop", msg)
            step.conditions["Degraded"] = ("True", "RolledBackAfterCrashLoop", msg)
        _finish(step, ro, now, "RolledBack", msg, **changes)
        step.events.append(("Normal", "RolledBack", msg))
        step.conditions["Tuned"] = ("False", "RolledBack", msg)
    elif view.crashlooping and back:
        msg = f"pods still crash-looping after restoring {describe(ro.from_knobs)}; tuning stopped"
        _finish(step, ro, now, "RollbackFailed", msg, degraded=Degraded(now, "CrashLoop", msg))
        step.events.append(("Warning", "RollbackFailed", msg))
        step.conditions["Degraded"] = ("True", "CrashLoop", msg)
        step.conditions["Tuned"] = ("False", "RollbackFailed", msg)


def advance(cfg: AutotuneSpec, state: AutotuneStatus, view: WorkloadView, *, now: float,
            measured: Measurement | None = None, timeout_s: float | None = None) -> Step:
    """Move the rollout in ``state.rollout`` one step.

    Args:
        cfg: ``spec.autotune``.
        state: current ``status.autotune``.
        view: the pods as they are now.
        now: POSIX seconds.
        measured: the new pods' performance over :func:`measurement_window` when the caller could
            measure it (None: no data).
        timeout_s: how long the new pods may take to become ready (:func:`rollout_timeout_s`, which
            counts the old pods' drain); None: ``cfg.rollout_timeout_s``.

    Returns:
        A :class:`Step`; ``changed`` says whether its ``status`` differs from ``state``. Every
        path that ends the rollout sets the ``Tuned`` condition.
    """
    step = Step(status=state)
    ro = state.rollout
    if ro is None:
        return step
    why = superseded_reason(ro, view)
    if why is not None:
        # A user's edit of spec.eplb wins over the tuner (pinned precedence); a replicas edit does not.
        msg = f"{why} during the {ro.kind} rollout; the user's settings win, the tuner's override is dropped"
        _finish(step, ro, now, "Superseded", msg, override=None)
        step.events.append(("Normal", "TuningSuperseded", msg))
        step.conditions["Tuned"] = ("True", "Superseded", msg)
    elif ro.phase == ROLLING:
        _rolling(step, cfg, ro, view, now, cfg.rollout_timeout_s if timeout_s is None else timeout_s)
    elif ro.phase == OBSERVING:
        _observing(step, cfg, ro, view, now, measured)
    elif ro.phase == ROLLING_BACK:
        _rolling_back(step, ro, view, now)
    else:
        # Unknown phase (written by a newer operator?): drop it rather than act on it.
        msg = f"unknown rollout phase {ro.phase!r}; the rollout record was dropped"
        _finish(step, ro, now, "Abandoned", msg)
        step.conditions["Tuned"] = ("False", "Abandoned", msg)
    return step
