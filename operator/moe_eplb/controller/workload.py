"""Reading a MoEInference's child workloads for the tuning loop (I/O; the judging is :mod:`.rollout`'s).

:func:`workload_view` reads the Deployment, or for a multi-node resource the LeaderWorkerSet, its
groups and their ``RecreateGroupOnPodRestart`` Events, and the pods into a
:class:`~.rollout.WorkloadView`: whether the current template has rolled out everywhere, its hash,
the pods that crash-loop, the replica count and when the youngest pod started. :func:`read_scaling`
reads the replica autoscaler's state (the HorizontalPodAutoscaler) into a
:class:`~.decisions.ScalingState`.

Times are in the loop's clock seconds: ``to_clock(wall)`` maps the API's wall timestamps onto it
(identity on the real clock).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moe_eplb.api.autotune_status import parse_iso
from moe_eplb.api.elastic import pods_for
from moe_eplb.api.knobs import Knobs
from moe_eplb.api.spec import MoEInference
from moe_eplb.contracts import k8s_names
from moe_eplb.controller import decisions as dec
from moe_eplb.controller import rollout as ro
from moe_eplb.controller.k8s import ApiError
from moe_eplb.controller.status import workload_observed_generation
from moe_eplb.render.autoscaler import hpa_name

log = logging.getLogger("moe_eplb.autotune")


async def workload_view(client: Any, inf: MoEInference, *, crashloop_restarts: int,
                        to_clock: Callable[[float], float] = lambda t: t,
                        to_wall: Callable[[float], float] = lambda t: t, target: Knobs | None = None,
                        since: float | None = None) -> tuple[ro.WorkloadView, list[dict]]:
    """The child workload and Pods of a MoEInference -> (WorkloadView, pods).

    Single-node replicas: the Deployment(s). Multi-node replicas (``parallelism.nodes > 1``): the
    LeaderWorkerSet, settled by group (:func:`lws_settled`), its template hash from both the leader
    and the worker template, and crash loops of any pod of a group on the current template -- also
    the ones LeaderWorkerSet hides by recreating the group on every restart, counted from its
    ``RecreateGroupOnPodRestart`` Events since ``since`` (clock seconds; None: not counted;
    ``to_wall(since)`` is compared with the Events' wall-clock times).
    ``target``: a rollout's target knobs, checked against the spec now (``target_invalid``);
    ``crashloop_restarts``: restarts (or group recreations) of a pod of the current template that
    count as a crash loop."""
    ns = inf.namespace or "default"
    selector = f"{k8s_names.NAME_LABEL}={inf.name}"
    extra = dict(spec_eplb=inf.spec_knobs, eplb_enabled=inf.eplb.enabled,
                 target_invalid=inf.knobs_problem(target) if target is not None else None)
    multinode = inf.uses_lws
    if multinode:
        workloads = await client.list(k8s_names.LWS_API_VERSION, k8s_names.LWS_KIND, ns, label_selector=selector)
    else:
        workloads = await client.list("apps/v1", "Deployment", ns, label_selector=selector)
    pods = await client.list("v1", "Pod", ns, label_selector=selector)
    extra["newest_replica_at"] = newest_pod_start(pods, to_clock)
    if not workloads:
        return ro.WorkloadView(inf.generation, False, None, **extra), pods
    hashes = sorted({_config_hash(t) for w in workloads for t in _pod_templates(w)})
    crashes = list(crashlooping(pods, hashes, crashloop_restarts))
    if multinode:
        settled = all(lws_settled(w, pods, hashes) for w in workloads)
        if since is not None:
            for w in workloads:
                crashes += await recreated_groups(client, w, pods, hashes, to_wall(since), crashloop_restarts)
    else:
        settled = all(_deployment_settled(d) for d in workloads)
    extra["replicas"] = sum(int((w.get("spec") or {}).get("replicas", 1)) for w in workloads)
    return ro.WorkloadView(inf.generation, settled, ",".join(hashes), tuple(sorted(set(crashes))), **extra), pods


async def restarts_of(client: Any, inf: MoEInference, workloads: list[dict], now_wall: float
                      ) -> tuple[str, str] | None:
    """``(reason, message)`` when the engine pods of ``inf`` keep restarting (the ``Degraded``
    condition, :func:`moe_eplb.controller.status.restarting`): its pods' restart counts, and for a
    LeaderWorkerSet (``workloads``: the live workload children) its group recreations of the last
    :data:`~moe_eplb.controller.status.RESTART_WINDOW_SECONDS` (fresh pods hide those restarts)."""
    from moe_eplb.controller import status

    ns = inf.namespace or "default"
    pods = await client.list("v1", "Pod", ns, label_selector=f"{k8s_names.NAME_LABEL}={inf.name}")
    recreated: list[str] = []
    for w in workloads:
        if w.get("kind") != k8s_names.LWS_KIND:
            continue
        hashes = sorted({_config_hash(t) for t in _pod_templates(w)})
        recreated += await recreated_groups(client, w, pods, hashes, now_wall - status.RESTART_WINDOW_SECONDS,
                                            status.DEGRADED_RESTARTS)
    return status.restarting(pods, recreated)


def newest_pod_start(pods: list[dict], to_clock: Callable[[float], float] = lambda t: t) -> float | None:
    """When the youngest engine pod (not being deleted) was created, in clock seconds; None without pods."""
    times = [parse_iso((p.get("metadata") or {}).get("creationTimestamp")) for p in pods
             if not (p.get("metadata") or {}).get("deletionTimestamp")]
    times = [t for t in times if t is not None]
    return to_clock(max(times)) if times else None


async def read_scaling(client: Any, inf: MoEInference, view: ro.WorkloadView,
                       to_clock: Callable[[float], float] = lambda t: t) -> dec.ScalingState | None:
    """The replica autoscaler's state (:class:`~.decisions.ScalingState`) from the resource, the
    workload's replica count and the HorizontalPodAutoscaler (ours, or the one KEDA made for the
    ScaledObject); None without ``spec.autoscaling``. A missing HPA (KEDA not reconciled yet) leaves
    its fields unknown."""
    auto = inf.autoscaling
    group = elastic_scaling(inf)
    if auto is None:
        return group
    try:
        hpa = await client.get(k8s_names.HPA_API_VERSION, k8s_names.HPA_KIND, inf.namespace or "default",
                               hpa_name(inf))
    except ApiError as exc:
        log.info("autotune %s/%s: cannot read the autoscaler's HPA: %s", inf.namespace, inf.name, exc)
        hpa = None
    running = group.running if group is not None else view.replicas
    return scaling_state(inf.replicas, running, auto.max_replicas, auto.metric.type, hpa, to_clock)


def elastic_scaling(inf: MoEInference) -> dec.ScalingState | None:
    """An elastic group's size in pods as the tuner's :class:`~.decisions.ScalingState`: ``running`` the
    committed pods (``status.elastic.dataParallel``), ``desired`` the pods being driven to, so that no
    tuner rollout starts while a resize runs (:func:`~.decisions.scaling_blocker`). None for other resources."""
    if not inf.elastic_enabled:
        return None
    st, par = inf.elastic_status, inf.parallelism
    want = st.target_data_parallel if st.in_progress else inf.elastic_desired
    return dec.ScalingState(desired=pods_for(want, par.data_local),
                            running=pods_for(st.data_parallel, par.data_local),
                            max_replicas=pods_for(par.max_data, par.data_local))


def scaling_state(desired: int, running: int | None, max_replicas: int, metric_type: str, hpa: dict | None,
                  to_clock: Callable[[float], float] = lambda t: t) -> dec.ScalingState:
    """:class:`~.decisions.ScalingState` from an ``autoscaling/v2`` HorizontalPodAutoscaler object
    (its status: desiredReplicas, lastScaleTime, the ScalingLimited condition, the current metric)."""
    st = (hpa or {}).get("status") or {}
    last = parse_iso(st.get("lastScaleTime"))
    limited = any(c.get("type") == "ScalingLimited" and c.get("status") == "True" and c.get("reason") == "TooManyReplicas"
                  for c in st.get("conditions") or [])
    waiting = None
    if metric_type == "RequestsWaiting":
        for m in st.get("currentMetrics") or []:
            current = (m.get(m.get("type", "").lower() or "external") or {}).get("current") or {}
            value = current.get("averageValue", current.get("value"))
            if value is not None:
                waiting = quantity_value(value)
    desired_hpa = st.get("desiredReplicas")
    return dec.ScalingState(desired=desired, running=desired if running is None else running,
                            max_replicas=max_replicas, hpa_desired=int(desired_hpa) if desired_hpa is not None else None,
                            last_scale_time=to_clock(last) if last is not None else None, limited=limited,
                            waiting=waiting)


def quantity_value(q: Any) -> float | None:
    """A Kubernetes quantity as a number (``"1500m"`` -> 1.5, ``"3"`` -> 3.0); None when unreadable."""
    text = str(q).strip()
    scale = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9}
    try:
        if text and text[-1] in scale:
            return float(text[:-1]) * scale[text[-1]]
        return float(text)
    except ValueError:
        return None


def _pod_templates(workload: dict) -> list[dict]:
    spec = workload.get("spec") or {}
    if workload.get("kind") == k8s_names.LWS_KIND:
        lwt = spec.get("leaderWorkerTemplate") or {}
        return [t for t in (lwt.get("leaderTemplate"), lwt.get("workerTemplate")) if t]
    return [spec.get("template") or {}]


def _config_hash(template: dict) -> str:
    return ((template.get("metadata") or {}).get("annotations") or {}).get(k8s_names.CONFIG_HASH_ANNOTATION, "")


def _pod_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def lws_groups(lws: dict, pods: list[dict]) -> dict[int, dict[int, dict]]:
    """The pods of a LeaderWorkerSet by group index and worker index (0 = leader)."""
    name = lws["metadata"]["name"]
    out: dict[int, dict[int, dict]] = {}
    for p in pods:
        labels = (p.get("metadata") or {}).get("labels") or {}
        if labels.get(k8s_names.LWS_NAME_LABEL) != name or (p.get("metadata") or {}).get("deletionTimestamp"):
            continue
        try:
            group, worker = int(labels[k8s_names.LWS_GROUP_INDEX_LABEL]), int(labels[k8s_names.LWS_WORKER_INDEX_LABEL])
        except (KeyError, ValueError):
            continue
        out.setdefault(group, {})[worker] = p
    return out


def lws_settled(lws: dict, pods: list[dict], hashes: list[str]) -> bool:
    """A LeaderWorkerSet has rolled out its current template: its status observed the generation and
    counts every group updated and ready with no surge group left, and the pods agree -- each of
    the ``replicas`` groups has its leader and all ``size - 1`` workers, every one ready and on the
    current template, and no pod of a group beyond ``replicas`` remains."""
    spec, st = lws.get("spec") or {}, lws.get("status") or {}
    want = int(spec.get("replicas", 1))
    size = int((spec.get("leaderWorkerTemplate") or {}).get("size") or 1)
    if not (int(workload_observed_generation(lws) or 0) >= int(lws["metadata"].get("generation") or 1)
            and int(st.get("updatedReplicas") or 0) >= want and int(st.get("readyReplicas") or 0) >= want
            and int(st.get("replicas") or 0) == want):
        return False
    groups = lws_groups(lws, pods)
    if set(groups) != set(range(want)):
        return False
    for members in groups.values():
        if set(members) != set(range(size)):
            return False
        for p in members.values():
            ann = (p.get("metadata") or {}).get("annotations") or {}
            if ann.get(k8s_names.CONFIG_HASH_ANNOTATION) not in hashes or not _pod_ready(p):
                return False
    return True


@dataclass(frozen=True)
class EventTime:
    """A time an Event carries, with its precision: ``eventTime`` and ``series.lastObservedTime`` are
    MicroTime (exact); ``firstTimestamp`` and ``lastTimestamp``, which the legacy core/v1 recorder
    (the real LWS controller's) writes, are whole seconds."""

    wall: float
    whole_seconds: bool

    def at_or_after(self, since_wall: float) -> bool:
        """Whether the Event may have happened at or after ``since_wall``: exact times are compared
        exactly (an Event a moment before counts not -- on an accelerated clock a whole crash loop fits
        in one wall second), whole-second times at whole-second precision (one stamped with the
        second ``since_wall`` falls in counts)."""
        return self.wall >= (math.floor(since_wall) if self.whole_seconds else since_wall)


def event_span(e: dict) -> tuple[EventTime | None, EventTime | None]:
    """(first, last) occurrence of a core/v1 Event, each with its precision; last is first when
    the Event has no later occurrence."""
    def at(value: Any, whole_seconds: bool) -> EventTime | None:
        t = parse_iso(value)
        return EventTime(t, whole_seconds) if t is not None else None

    series = e.get("series") or {}
    first = at(e.get("eventTime"), False) or at(e.get("firstTimestamp"), True)
    last = at(series.get("lastObservedTime"), False) or at(e.get("lastTimestamp"), True) or first
    return first, last


_RECREATE_MESSAGE = re.compile(r"[Ww]orker pod (?P<pod>\S+) failed.*recreate group (?P<group>\d+)")


async def recreated_groups(client: Any, lws: dict, pods: list[dict], hashes: list[str], since_wall: float,
                           crashloop_restarts: int) -> list[str]:
    """Crash loops that LeaderWorkerSet's ``RecreateGroupOnPodRestart`` hides: a pod that restarts
    makes it recreate the whole group (fresh pods, ``restartCount`` 0), so the restarts are counted
    from its ``RecreateGroupOnPodRestart`` Events on the LWS since ``since_wall`` (wall POSIX seconds;
    one per recreation; an Event series that began earlier counts once). A group recreated at least
    ``crashloop_restarts`` times whose pods now run a current template crash-loops; returns
    ``"<pod> (group <i> recreated <n>x)"``."""
    ns = lws["metadata"].get("namespace") or "default"
    try:
        events = await client.list("v1", "Event", ns, field_selector=(
            f"involvedObject.kind={k8s_names.LWS_KIND},involvedObject.name={lws['metadata']['name']},"
            f"reason={k8s_names.LWS_RECREATE_GROUP_REASON}"))
    except ApiError as exc:  # no Events (RBAC): crash loops are then seen as restarts only
        log.info("autotune: cannot list events of LeaderWorkerSet %s/%s: %s", ns, lws["metadata"]["name"], exc)
        return []
    counts: dict[int, int] = {}
    failed: dict[int, str] = {}
    for e in events:
        uid = (e.get("involvedObject") or {}).get("uid")
        if uid and uid != lws["metadata"].get("uid"):
            continue  # an earlier LWS of the same name
        first, last = event_span(e)
        m = _RECREATE_MESSAGE.search(e.get("message") or "")
        if last is None or not last.at_or_after(since_wall) or m is None:
            continue
        group = int(m.group("group"))
        series = e.get("series") or {}
        repeats = max(int(series.get("count") or 0), int(e.get("count") or 0), 1)
        counts[group] = counts.get(group, 0) + (repeats if first is not None and first.at_or_after(since_wall) else 1)
        failed[group] = m.group("pod")
    groups = lws_groups(lws, pods)
    out = []
    for group, n in sorted(counts.items()):
        members = groups.get(group, {})
        current = bool(members) and all(
            ((p.get("metadata") or {}).get("annotations") or {}).get(k8s_names.CONFIG_HASH_ANNOTATION) in hashes
            for p in members.values())
        if n >= crashloop_restarts and current:
            out.append(f"{failed[group]} (group {group} recreated {n}x)")
    return out


def crashlooping(pods: list[dict], hashes: list[str], crashloop_restarts: int) -> tuple[str, ...]:
    """Names of the pods of the current templates (``hashes``) that crash-loop."""
    bad = []
    for p in pods:
        ann = (p.get("metadata") or {}).get("annotations") or {}
        if ann.get(k8s_names.CONFIG_HASH_ANNOTATION) not in hashes or (p["metadata"].get("deletionTimestamp")):
            continue
        for cs in (p.get("status") or {}).get("containerStatuses") or []:
            waiting = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
            if waiting == "CrashLoopBackOff" or int(cs.get("restartCount") or 0) >= crashloop_restarts:
                bad.append(p["metadata"]["name"])
                break
    return tuple(sorted(bad))


def _deployment_settled(d: dict) -> bool:
    spec, st = d.get("spec") or {}, d.get("status") or {}
    want = int(spec.get("replicas", 1))
    return (int(st.get("observedGeneration") or 0) >= int(d["metadata"].get("generation") or 1)
            and int(st.get("updatedReplicas") or 0) == want
            and int(st.get("readyReplicas") or 0) >= want
            and int(st.get("availableReplicas") or 0) >= want
            and int(st.get("replicas") or 0) == want)

