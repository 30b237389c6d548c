"""The safe-rollout state machine for a tuner change. Pure, no I/O.

A change of EPLB knobs restarts vLLM. The tuner starts one by writing ``status.autotune.override``
(which the reconciler renders into the pod template, so the Deployment rolls its pods with the
strategy from ``spec.rollout``) together with ``status.autotune.rollout``. Every tick of the autotune
timer then calls :func:`advance` with what the cluster shows; the state moves

    Rolling --(new pods all ready)--> Observing --(observeSeconds served, measured)--> done (kept)
       |                                  |---------(worse than baseline by > tolerance)--> RollingBack
       |--(crash loop / timeout)--> RollingBack --(previous pods ready)--> done (rolled back)
    any phase --(the user edited spec.eplb, disabled EPLB, or the change became invalid for the
                 spec)--> done (superseded); a replicas / autotune edit does not supersede

and every transition is a single status patch, so an operator killed at any point resumes from the
resource: a rollout is never started twice (the override and the rollout record are written
together) and a rollback decided is never lost (``phase: RollingBack`` is written with the restored
override).

``status.autotune.rollout`` (absent when idle)::

    kind: apply | rollback         phase: Rolling | Observing | RollingBack
    startedAt, readyAt, judgedAt   RFC 3339
    from, to                       knob dicts (see controller.decisions)
    previousOverride               the override to restore on rollback (None: spec.eplb)
    specGeneration                 metadata.generation the change was made for (record; the rule
                                   for rollouts without specEplb, written by older operators)
    specEplb                       spec.eplb {windowSize, stepInterval, numRedundantExperts} then
    fromHash, toHash               pod-template config hashes before / after
    baseline, measured             {"balancedness": float, ...} measured before / after
    predictedGain, reason

``status.autotune.degraded`` = {time, reason, message} is set when a tuner change crash-looped
(and stays until a later change is kept), so the reconciler can keep ``Degraded`` true.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_eplb.controller.decisions import (
    AutotuneConfig,
    append_history,
    fmt_knobs,
    iso,
    parse_iso,
    recent_restarts,
)

ROLLING, OBSERVING, ROLLING_BACK = "Rolling", "Observing", "RollingBack"


@dataclass(frozen=True)
class WorkloadView:
    """What the cluster shows about a MoEInference's pods right now.

    Attributes:
        generation: the resource's ``metadata.generation``.
        settled: every child workload has rolled out its current template: observed its
            generation, all replicas updated, ready and available, no surplus old pods.
        template_hash: the ``eplb.ai/eplb-config-hash`` of the current pod template (None when
            no child workload exists yet).
        crashlooping: names of pods of the current template (``template_hash``) that are crash
            looping (``CrashLoopBackOff`` or restarted >= the threshold).
        spec_eplb: ``spec.eplb`` now (:func:`moe_eplb.api.spec.spec_eplb_record`); None: unknown
            (then a rollout is superseded by the old generation rule).
        eplb_enabled: ``spec.eplb.enabled`` now.
        target_invalid: why the rollout's target settings cannot run with the spec now (e.g. the EP
            size changed), else None.
    """

    generation: int
    settled: bool
    template_hash: str | None
    crashlooping: tuple[str, ...] = ()
    spec_eplb: dict | None = None
    eplb_enabled: bool = True
    target_invalid: str | None = None


def superseded_reason(ro: dict, view: WorkloadView) -> str | None:
    """Why the user's settings now win over rollout ``ro`` (None: they do not).

    Only what changes the settings that run supersedes: an edit of ``spec.eplb``, EPLB disabled,
    or the target no longer valid for the spec. A ``replicas`` (``/scale``) or ``autotune`` edit
    does not. A rollout without ``specEplb`` (older operator) keeps the generation rule.
    """
    recorded = ro.get("specEplb")
    if recorded is not None and view.spec_eplb is not None:
        if not view.eplb_enabled:
            return "spec.eplb.enabled was set to false"
        if dict(recorded) != dict(view.spec_eplb):
            return f"spec.eplb changed ({fmt_knobs(recorded)} -> {fmt_knobs(view.spec_eplb)})"
        if view.target_invalid and ro.get("kind") == "apply":
            return f"{fmt_knobs(ro.get('to'))} is no longer valid for the spec ({view.target_invalid})"
        return None
    spec_gen = ro.get("specGeneration")
    if spec_gen is not None and int(view.generation) != int(spec_gen):
        return f"spec changed (generation {spec_gen} -> {view.generation})"
    return None


@dataclass
class Step:
    """The result of one :func:`advance`: the complete new ``status.autotune`` plus side effects."""

    autotune: dict
    changed: bool = False
    events: list[tuple[str, str, str]] = field(default_factory=list)
    conditions: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    rollback_reason: str | None = None  # label for moe_eplb_rollbacks_total when a rollback starts
    needs_measurement: tuple[float, float] | None = None  # (start, end) POSIX s when a measurement is wanted


def measurement_window(cfg: AutotuneConfig, state: dict, now: float) -> tuple[float, float] | None:
    """The ``(start, end)`` window to measure when the rollout is ready to be judged, else None."""
    ro = state.get("rollout") or {}
    if ro.get("phase") != OBSERVING:
        return None
    ready = parse_iso(ro.get("readyAt"))
    if ready is None or now - ready < cfg.observe_s:
        return None
    return ready, now


def advance(
    cfg: AutotuneConfig,
    state: dict,
    view: WorkloadView,
    *,
    now: float,
    measured: dict | None = None,
) -> Step:
    """Move the rollout in ``state["rollout"]`` one step.

    Args:
        cfg: ``spec.autotune``.
        state: current ``status.autotune`` (not modified).
        view: the pods as they are now.
        now: POSIX seconds.
        measured: ``{"balancedness": float, ...}`` over :func:`measurement_window` when the caller
            could measure it (None: no data).

    Returns:
        A :class:`Step`; ``changed`` says whether ``autotune`` differs from ``state``.
    """
    new = dict(state)
    step = Step(autotune=new)
    ro = dict(state.get("rollout") or {})
    if not ro:
        return step
    now_s = iso(now)
    phase = ro.get("phase")

    def finish(action: str, reason: str, **extra) -> None:
        entry = {
            "time": now_s,
            "action": action,
            "from": ro.get("from"),
            "to": ro.get("to"),
            "reason": reason,
            "predictedGain": ro.get("predictedGain"),
            "baseline": ro.get("baseline"),
            "measured": ro.get("measured"),
            "startedAt": ro.get("startedAt"),
            **extra,
        }
        new["history"] = append_history(state, {k: v for k, v in entry.items() if v is not None})
        new.pop("rollout", None)
        step.changed = True

    def start_rollback(reason_label: str, message: str, *, degraded: bool) -> None:
        prev = ro.get("previousOverride")
        new["override"] = prev
        if prev is None:
            new.pop("override", None)
        new["rollout"] = {
            **ro,
            "kind": "rollback",
            "phase": ROLLING_BACK,
            "rollbackStartedAt": now_s,
            "toHash": ro.get("toHash") or (
                view.template_hash if view.template_hash != ro.get("fromHash") else None),
            "reason": message,
            "degraded": degraded,
        }
        new["restarts"] = recent_restarts(state, now) + [now_s]
        new["lastChangeTime"] = now_s
        step.changed = True
        step.rollback_reason = reason_label
        step.events.append(("Warning", "RollingBack", message))
        step.conditions["Tuned"] = ("False", "RolledBack", message)
        if degraded:
            step.conditions["Degraded"] = ("True", "CrashLoopAfterTuning", message)
            new["degraded"] = {"time": now_s, "reason": "CrashLoopAfterTuning", "message": message}

    # A user's edit of spec.eplb wins over the tuner (pinned precedence); a replicas edit does not.
    why = superseded_reason(ro, view)
    if why is not None:
        msg = (f"{why} during the {ro.get('kind')} rollout; the user's settings win, "
               "the tuner's override is dropped")
        new.pop("override", None)
        finish("Superseded", msg)
        step.events.append(("Normal", "TuningSuperseded", msg))
        step.conditions["Tuned"] = ("True", "Superseded", msg)
        return step

    if phase == ROLLING:
        if view.crashlooping and view.template_hash != ro.get("fromHash"):
            start_rollback(
                "crashloop",
                f"pods crash-looping after applying {fmt_knobs(ro.get('to'))}: "
                f"{', '.join(sorted(view.crashlooping)[:5])}; restoring {fmt_knobs(ro.get('from'))}",
                degraded=True,
            )
            return step
        if view.settled and view.template_hash and view.template_hash != ro.get("fromHash"):
            new["rollout"] = {**ro, "phase": OBSERVING, "readyAt": now_s, "toHash": view.template_hash}
            step.changed = True
            step.events.append(("Normal", "TunedPodsReady",
                                f"pods with {fmt_knobs(ro.get('to'))} are ready; observing for {cfg.observe_s:.0f}s"))
            return step
        started = parse_iso(ro.get("startedAt")) or now
        if now - started > cfg.rollout_timeout_s:
            start_rollback(
                "timeout",
                f"pods with {fmt_knobs(ro.get('to'))} not ready after {now - started:.0f}s; "
                f"restoring {fmt_knobs(ro.get('from'))}",
                degraded=False,
            )
        return step

    if phase == OBSERVING:
        if view.crashlooping:
            start_rollback(
                "crashloop",
                f"pods crash-looping after applying {fmt_knobs(ro.get('to'))}: "
                f"{', '.join(sorted(view.crashlooping)[:5])}; restoring {fmt_knobs(ro.get('from'))}",
                degraded=True,
            )
            return step
        window = measurement_window(cfg, state, now)
        if window is None:
            return step
        step.needs_measurement = window
        if measured is None or measured.get("balancedness") is None:
            # No data to judge yet: wait up to another observe period, then keep (the prediction stands).
            ready = parse_iso(ro.get("readyAt")) or now
            if now - ready >= 2 * cfg.observe_s + 60:
                ro["judgedAt"] = now_s
                finish("Kept", "no measurement after the change; kept on the tuner's prediction")
                step.events.append(("Normal", "TunedSettingsKept",
                                    f"kept {fmt_knobs(ro.get('to'))} (no measurement to judge it)"))
            return step
        ro["measured"] = measured
        ro["judgedAt"] = now_s
        base = (ro.get("baseline") or {}).get("balancedness")
        got = float(measured["balancedness"])
        if base is not None and got < float(base) * (1.0 - cfg.rollback_tolerance):
            msg = (f"measured balancedness {got:.3f} after applying {fmt_knobs(ro.get('to'))} is worse than "
                   f"{float(base):.3f} before by more than rollbackTolerance {cfg.rollback_tolerance:.0%}; "
                   f"restoring {fmt_knobs(ro.get('from'))}")
            start_rollback("regression", msg, degraded=False)
            return step
        vs = f" (was {float(base):.3f})" if base is not None else ""
        msg = f"kept {fmt_knobs(ro.get('to'))}: measured balancedness {got:.3f}{vs}"
        finish("Kept", msg)
        new.pop("degraded", None)
        step.events.append(("Normal", "TunedSettingsKept", msg))
        step.conditions["Tuned"] = ("True", "Kept", msg)
        return step

    if phase == ROLLING_BACK:
        to_hash = ro.get("toHash")
        back = view.template_hash is not None and (
            view.template_hash == ro.get("fromHash") or (to_hash is not None and view.template_hash != to_hash)
        )
        if view.settled and back:
            msg = f"rolled back to {fmt_knobs(ro.get('from'))}: {ro.get('reason', '')}".strip()
            finish("RolledBack", msg)
            step.events.append(("Normal", "RolledBack", msg))
            if ro.get("degraded"):
                step.conditions["Degraded"] = ("True", "RolledBackAfterCrashLoop", msg)
                # the reconciler keeps Degraded true from this record (controller/status.py)
                new["degraded"] = {"time": now_s, "reason": "RolledBackAfterCrashLoop", "message": msg}
            return step
        if view.crashlooping and back:
            msg = f"pods still crash-looping after restoring {fmt_knobs(ro.get('from'))}; tuning stopped"
            finish("RollbackFailed", msg)
            step.events.append(("Warning", "RollbackFailed", msg))
            step.conditions["Degraded"] = ("True", "CrashLoop", msg)
            new["degraded"] = {"time": now_s, "reason": "CrashLoop", "message": msg}
        return step

    # Unknown phase (written by a newer operator?): drop it rather than act on it.
    finish("Abandoned", f"unknown rollout phase {phase!r}")
    return step
