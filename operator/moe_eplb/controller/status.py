"""MoEInference status from the children's readiness: phase, conditions and the /scale fields.

Pure functions over plain dicts (no I/O). The controller owns these status keys:
``observedGeneration, phase, message, endpoint, replicas, readyReplicas, selector, epSize, eplb``
and the conditions ``SpecValid, Ready, Progressing, Degraded, Autoscaling`` (the last only once
``spec.autoscaling`` was on). Other keys (``autotune``,
``balancedness``) and other condition types (``MetricsAvailable``, ``Tuned``) belong to other
loops and are carried over untouched.

Phases, first match wins (``Degraded`` also when the API server refused a rendered child in the
dry run that precedes every write; then nothing is applied):
``Invalid`` (SpecValid False) > ``Degraded`` > ``Running`` (Ready True) > ``Pending`` (no workload
has reported a status yet) > ``Progressing``.

``Degraded`` is also true while engine pods keep restarting (reason ``PodRestarting``, or
``GroupRestarting`` for LeaderWorkerSet groups recreated again and again; the message names the pod:
:func:`restarting`), and while ``status.autotune.degraded`` = {time, reason, message} is set: the
autotune loop records there that a tuner change crash-looped and was rolled back (it clears it
when a later change is kept); the condition then carries its reason and message.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moe_eplb.api.autotune_status import Degraded, parse_autotune_status

OWNED_CONDITIONS = ("SpecValid", "Ready", "Progressing", "Degraded", "Autoscaling")
#: a pod restarted this often (or a LeaderWorkerSet group recreated this often within
#: RESTART_WINDOW_SECONDS) keeps restarting: ``Degraded`` names it
DEGRADED_RESTARTS = 3
RESTART_WINDOW_SECONDS = 3600.0
WORKLOAD_KINDS = ("Deployment", "LeaderWorkerSet", "StatefulSet")


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Workloads:
    """Readiness summed over the workload children (Deployments / LeaderWorkerSets).

    ``desired``: sum of spec.replicas; ``replicas``/``ready``/``updated``: sums of the status
    counters (LWS counts groups); ``reported``: every workload has a status.observedGeneration;
    ``rolled_out``: every workload observed its generation and runs only updated replicas;
    ``failure``: a message when a workload reports it cannot progress (else '').
    """

    desired: int
    replicas: int
    ready: int
    updated: int
    reported: bool
    rolled_out: bool
    failure: str = ""


def observed_generation(status: Mapping[str, Any]) -> int | None:
    """The generation a workload's status describes: ``status.observedGeneration``, or the newest
    ``observedGeneration`` of its conditions. ``None``: neither is reported (not yet, or never: see
    :func:`workload_observed_generation`)."""
    if status.get("observedGeneration") is not None:
        return int(status["observedGeneration"])
    gens = [int(c["observedGeneration"]) for c in status.get("conditions") or [] if c.get("observedGeneration") is not None]
    return max(gens) if gens else None


def workload_observed_generation(obj: Mapping[str, Any]) -> int | None:
    """:func:`observed_generation` of a workload object, where a LeaderWorkerSet that reports no
    generation at all counts as observing its current one once its controller has written
    conditions: the real LWS controller up to v0.8.0 sets neither ``status.observedGeneration``
    (not in its CRD: the apiserver prunes it) nor the conditions' (its ``metav1.Condition``s leave
    it 0, omitted) -- checked against the real controller in ``tests/kube/test_lws_real.py``. Its
    counts then stand alone; a status read between a template write and the controller's next
    reconcile is stale, which is why the autotune loop also requires every pod of every group on
    the current template (``controller.workload.lws_settled``)."""
    st = obj.get("status") or {}
    observed = observed_generation(st)
    if observed is None and obj.get("kind") == "LeaderWorkerSet" and st.get("conditions"):
        return int((obj.get("metadata") or {}).get("generation") or 1)
    return observed


def summarize_workloads(children: Iterable[Mapping[str, Any]]) -> Workloads:
    """Sum the readiness of the workload objects among ``children`` (live objects from the API)."""
    desired = replicas = ready = updated = 0
    reported = rolled = True
    failure = ""
    for child in children:
        if child.get("kind") not in WORKLOAD_KINDS:
            continue
        spec, st, meta = child.get("spec") or {}, child.get("status") or {}, child.get("metadata") or {}
        want = int(spec.get("replicas", 1))
        desired += want
        replicas += int(st.get("replicas", 0))
        ready += int(st.get("readyReplicas", 0))
        upd = int(st.get("updatedReplicas", 0))
        updated += upd
        observed = workload_observed_generation(child)
        if observed is None:
            reported = False
        if int(observed or 0) < int(meta.get("generation", 1)) or upd < want \
                or int(st.get("replicas", 0)) > want:
            rolled = False
        for cond in st.get("conditions") or []:
            # a Deployment's Progressing=False is a failure (ProgressDeadlineExceeded); a
            # LeaderWorkerSet sets Progressing=False when Available turns true (the two exclude each other)
            if child.get("kind") == "Deployment" and cond.get("type") == "Progressing" and cond.get("status") == "False":
                failure = f"{child.get('kind')} {meta.get('name')}: {cond.get('reason')}: {cond.get('message', '')}"
    return Workloads(desired, replicas, ready, updated, reported, rolled, failure)


def condition(type_: str, status: bool, reason: str, message: str, generation: int,
              previous: Sequence[Mapping[str, Any]], now: str) -> dict[str, Any]:
    """A condition dict; ``lastTransitionTime`` is kept from ``previous`` while the status holds."""
    value = "True" if status else "False"
    old = next((c for c in previous if c.get("type") == type_), None)
    since = old.get("lastTransitionTime", now) if old is not None and old.get("status") == value else now
    return {"type": type_, "status": value, "reason": reason, "message": message,
            "lastTransitionTime": since, "observedGeneration": generation}


def _merge_conditions(previous: Sequence[Mapping[str, Any]], mine: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ours replaced in place, others' kept, new ones appended (stable order for clean diffs)."""
    by_type = {c["type"]: c for c in mine}
    out: list[dict[str, Any]] = []
    for cond in previous:
        out.append(by_type.pop(cond.get("type"), None) or dict(cond))
    out.extend(c for c in mine if c["type"] in by_type)
    return out


def invalid_status(resource: Mapping[str, Any], problems: Sequence[Any], now: str | None = None) -> dict[str, Any]:
    """The status for a spec that fails validation (``problems``: objects with ``field``/``message``).
    Only SpecValid, phase, message and observedGeneration change; the rest stays as it was."""
    now = now or now_rfc3339()
    current = dict(resource.get("status") or {})
    generation = int(resource.get("metadata", {}).get("generation", 1))
    text = "; ".join(f"{p.field}: {p.message}" for p in problems)
    previous = current.get("conditions") or []
    spec_valid = condition("SpecValid", False, "InvalidSpec", text, generation, previous, now)
    current.update(observedGeneration=generation, phase="Invalid", message=f"invalid spec: {text}",
                   conditions=_merge_conditions(previous, [spec_valid]))
    return current


def rejected_status(resource: Mapping[str, Any], refusals: Sequence[str], now: str | None = None) -> dict[str, Any]:
    """The status when the API server refused (in a dry run) some rendered child: nothing was
    applied. ``Degraded=True`` (reason ``ChildRejected``), phase ``Degraded``."""
    now = now or now_rfc3339()
    current = dict(resource.get("status") or {})
    generation = int(resource.get("metadata", {}).get("generation", 1))
    previous = current.get("conditions") or []
    text = "; ".join(refusals)
    mine = [condition("SpecValid", True, "Valid", "", generation, previous, now),
            condition("Degraded", True, "ChildRejected", f"the API server refused: {text}", generation, previous, now)]
    current.update(observedGeneration=generation, phase="Degraded", message=f"nothing applied: {text}",
                   conditions=_merge_conditions(previous, mine))
    return current


def _last_termination(pod: Mapping[str, Any]) -> str:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("lastState") or {}).get("terminated") or {}
        if term:
            parts = [str(term.get("reason") or "terminated")]
            if term.get("exitCode") is not None:
                parts.append(f"exit code {term['exitCode']}")
            if term.get("message"):
                parts.append(str(term["message"]).strip().splitlines()[-1][:200])
            return ", ".join(parts)
    return ""


def restarting(pods: Iterable[Mapping[str, Any]], recreated_groups: Sequence[str] = (),
               threshold: int = DEGRADED_RESTARTS) -> tuple[str, str] | None:
    """``(reason, message)`` when engine pods keep restarting, naming the pod, else None.

    ``GroupRestarting``: LeaderWorkerSet groups recreated ``threshold`` times or more
    (``recreated_groups``: ``"<pod> (group <i> recreated <n>x)"``, from its ``RecreateGroupOnPodRestart``
    Events, :func:`moe_eplb.controller.workload.recreated_groups`); ``PodRestarting``: a pod (not being
    deleted) in ``CrashLoopBackOff`` or restarted ``threshold`` times, with its last termination
    (e.g. a failed liveness probe, ``moe_eplb.exporter.health``)."""
    if recreated_groups:
        return "GroupRestarting", "replica groups keep restarting: " + "; ".join(sorted(recreated_groups)[:5])
    bad = []
    for p in pods:
        meta = p.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        for cs in (p.get("status") or {}).get("containerStatuses") or []:
            count = int(cs.get("restartCount") or 0)
            waiting = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
            if count >= threshold or waiting == "CrashLoopBackOff":
                last = _last_termination(p)
                bad.append(f"pod {meta.get('name')} restarted {count}x" + (f" (last: {last})" if last else ""))
                break
    if not bad:
        return None
    return "PodRestarting", "engine pods keep restarting: " + "; ".join(sorted(bad)[:5])


def tuner_degraded(record: Degraded | None) -> tuple[str, str] | None:
    """``(reason, message)`` of ``status.autotune.degraded`` (set by the autotune loop after a
    crash-loop rollback), or None when absent."""
    if record is None:
        return None
    reason = record.reason if record.reason and record.reason.isidentifier() else "CrashLoopAfterTuning"
    return reason, record.message or "a tuner change crash-looped and was rolled back"


def tuner_degraded_of(status: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """:func:`tuner_degraded` of a stored status (a fresh read after a conflict)."""
    autotune = (status or {}).get("autotune")
    return tuner_degraded(parse_autotune_status(autotune).degraded)


def ready_status(resource: Mapping[str, Any], children: Sequence[Mapping[str, Any]], *, eplb: Mapping[str, Any],
                 ep_size: int, selector: str, endpoint: str | None, tuner: tuple[str, str] | None = None,
                 autoscaling: tuple[bool, str, str] | None = None, restarts: tuple[str, str] | None = None,
                 now: str | None = None) -> dict[str, Any]:
    """The status of a valid resource whose children are applied; ``children`` are the live objects;
    ``tuner``: ``(reason, message)`` while a tuner change that crash-looped keeps Degraded true;
    ``restarts``: ``(reason, message)`` of pods or groups that keep restarting (:func:`restarting`);
    ``autoscaling``: the ``Autoscaling`` condition ``(status, reason, message)`` (None: no
    autoscaler; the condition is then False, or absent when it never was set)."""
    now = now or now_rfc3339()
    current = dict(resource.get("status") or {})
    generation = int(resource.get("metadata", {}).get("generation", 1))
    previous = current.get("conditions") or []
    w = summarize_workloads(children)
    counts = f"{w.ready}/{w.desired} replicas ready"
    all_ready = w.rolled_out and w.ready >= w.desired
    was_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in previous)
    lost = w.rolled_out and w.ready < w.desired and was_ready
    degraded = bool(w.failure) or lost or tuner is not None or restarts is not None
    if w.failure:
        degraded_reason, degraded_msg = "ProgressDeadlineExceeded", w.failure
    elif tuner is not None:  # the cause, when a tuner change made the pods restart
        degraded_reason, degraded_msg = tuner
    elif restarts is not None:
        degraded_reason, degraded_msg = restarts
    elif lost:
        degraded_reason, degraded_msg = "ReplicasUnavailable", counts
    else:
        degraded_reason, degraded_msg = "AsExpected", ""
    if all_ready:
        progressing = ("Complete", False, counts)
    elif not w.rolled_out:
        progressing = ("RollingOut", True, f"rolling out generation {generation}: {w.updated}/{w.desired} updated")
    else:
        progressing = ("WaitingForReady", True, counts)
    mine = [
        condition("SpecValid", True, "Valid", "", generation, previous, now),
        condition("Ready", all_ready, "AllReplicasReady" if all_ready else "ReplicasNotReady", counts,
                  generation, previous, now),
        condition("Progressing", progressing[1], progressing[0], progressing[2], generation, previous, now),
        condition("Degraded", degraded, degraded_reason, degraded_msg, generation, previous, now),
    ]
    if autoscaling is not None:
        mine.append(condition("Autoscaling", *autoscaling, generation, previous, now))
    elif any(c.get("type") == "Autoscaling" for c in previous):
        mine.append(condition("Autoscaling", False, "Disabled", "spec.autoscaling is off: spec.replicas is set by hand",
                              generation, previous, now))
    if degraded:
        phase = "Degraded"
    elif all_ready:
        phase = "Running"
    elif not w.reported:
        phase = "Pending"
    else:
        phase = "Progressing"
    current.update(
        observedGeneration=generation, phase=phase,
        message=degraded_msg if degraded else progressing[2],
        replicas=w.replicas, readyReplicas=w.ready, selector=selector, epSize=ep_size,
        eplb={k: eplb[k] for k in ("enabled", "windowSize", "stepInterval", "numRedundantExperts") if k in eplb},
        conditions=_merge_conditions(previous, mine),
    )
    if endpoint:
        current["endpoint"] = endpoint
    return current


def _strip_times(status: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(status)
    out["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                         for c in status.get("conditions") or []]
    return out


def status_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch of ``status`` that turns ``old`` into ``new`` (top-level keys only),
    or ``None`` when nothing but timestamps would change."""
    old = old or {}
    if _strip_times(old) == _strip_times(new):
        return None
    patch = {k: v for k, v in new.items() if old.get(k) != v}
    return patch or None


def selector_string(labels: Mapping[str, str]) -> str:
    """``{'a': '1', 'b': '2'}`` -> ``'a=1,b=2'`` (the form /scale's labelSelectorPath wants)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
