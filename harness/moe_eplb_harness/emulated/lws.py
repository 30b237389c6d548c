"""SIMULATED LeaderWorkerSet controller: what it decides and what the pods of a group look like.
Pure (no I/O); :mod:`moe_eplb_harness.emulated.kubelet` applies it. Not the LeaderWorkerSet controller.

Written from the LeaderWorkerSet v1 API (kubernetes-sigs/lws: ``api/leaderworkerset/v1``, its
published CRD, the rolling-update and restart-policy documentation) so that the operator meets what
a cluster with LWS installed shows it:

* **groups**: ``spec.replicas`` groups of ``spec.leaderWorkerTemplate.size`` pods. Group ``i``'s
  leader is pod ``<lws>-<i>`` (from ``leaderTemplate``), its workers ``<lws>-<i>-<j>``, ``j = 1 ..
  size-1`` (from ``workerTemplate``); every pod carries the labels ``leaderworkerset.sigs.k8s.io/
  name``, ``group-index``, ``worker-index`` (0 = leader), ``group-key`` (the same on every pod of the
  group) and ``template-revision-hash``, the annotation ``leaderworkerset.sigs.k8s.io/size`` (workers
  also ``leader-name``) and the env ``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX``.
  A pod's ``spec.subdomain`` is the headless Service's name: the LWS's (``networkConfig.subdomainPolicy:
  Shared``, the default) or, with ``UniquePerReplica``, the group's (its leader's name);
  ``LWS_LEADER_ADDRESS`` is ``<leader>.<subdomain>.<namespace>``.
  A group is ready when its leader and all its workers are.
* **revisions**: a change of ``leaderWorkerTemplate`` makes a new template revision; a change of
  ``replicas`` does not (scaling adds or removes groups at the highest indexes, no pod restarts).
* **rolling update by group** (``rolloutStrategy.rollingUpdateConfiguration``): the controller keeps
  a partition and a group count (its leader StatefulSet's). Groups at or above the partition run the
  new revision; the partition moves down from ``replicas`` in steps of ``maxUnavailable`` while the
  groups above it are ready on the new revision, so at most ``maxUnavailable`` groups are down at
  once. ``maxSurge`` adds that many groups (new revision, indexes ``replicas ..``) for the update and
  removes them as the original ones become ready on the new revision. ``maxUnavailable`` (default 1)
  rounds down and ``maxSurge`` (default 0) rounds up when given as a percentage of ``replicas``;
  ``maxSurge`` is capped at ``replicas``. ``partition`` (canary) is honoured.
* **restart policy** ``RecreateGroupOnPodRestart`` (the default): a container restart in any pod of
  a group deletes the leader, and with it the whole group, which is created again (same index, the
  revision its index should run); the controller records an Event ``RecreateGroupOnPodRestart`` on the LWS
  ("Worker pod <pod> failed, deleted leader pod <leader> to recreate group <i>", related to the
  leader pod -- a new object each time, so the events recorder keeps one Event per recreation).
  ``None`` (or the deprecated ``Default``): only the
  failed pod's container restarts (``CrashLoopBackOff``, growing ``restartCount``).
* **status**: ``replicas`` (groups that exist, surge included), ``readyReplicas`` (ready groups,
  any revision), ``updatedReplicas`` (groups on the new revision, ready or not),
  ``observedGeneration``, ``hpaPodSelector`` (the leaders: ``name=<lws>,worker-index=0``) and the
  conditions ``Available`` / ``Progressing`` / ``UpdateInProgress`` (metav1.Condition).

Differences from the real controller (``sigs.k8s.io/lws`` v0.8.0, run by
:mod:`moe_eplb_harness.real.lwscontroller`; see docs/operator.md): the real one reports no generation at all
(this one writes ``observedGeneration`` in the status and the conditions), writes one aggregated
core/v1 Event per message with a growing ``count`` and wall-clock times (this one: one Event per
recreation, related to the new leader, on the simulation's clock), omits ``updatedReplicas`` /
``readyReplicas`` when 0, owns the pods through StatefulSets, and with ``maxSurge`` gave back the
surge group in the same reconcile as it replaced the last original group (ready groups fell below
``replicas - maxUnavailable``; this one keeps them).

Simplifications (documented, none of them visible to the operator): no StatefulSet, ControllerRevision
or headless Service objects are written (pods are owned by the LWS directly); ``startupPolicy:
LeaderReady`` starts the workers with the leader, like ``LeaderCreated`` (a vLLM leader is not
ready before its workers anyway); no ``subGroupPolicy``, exclusive placement or volume claims.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from moe_eplb.contracts import k8s_names

#: restart policies that recreate the whole group when one of its pods restarts
RECREATE_POLICIES = ("RecreateGroupOnPodRestart", "RecreateGroupAfterStart")


def scaled(value: Any, total: int, *, round_up: bool) -> int:
    """An IntOrString (``2`` or ``"25%"``) against ``total``; percentages round as the API says."""
    if value is None:
        return 0
    if isinstance(value, str) and value.endswith("%"):
        x = total * float(value[:-1]) / 100.0
        return int(math.ceil(x) if round_up else math.floor(x))
    return int(value)


@dataclass(frozen=True)
class Strategy:
    """``spec.replicas`` and the rolling-update configuration, in groups."""

    replicas: int
    max_surge: int
    max_unavailable: int
    partition: int = 0

    @classmethod
    def of(cls, spec: dict) -> Strategy:
        replicas = int(spec.get("replicas", 1))
        ru = (spec.get("rolloutStrategy") or {}).get("rollingUpdateConfiguration") or {}
        surge = min(scaled(ru.get("maxSurge", 0), replicas, round_up=True), replicas)
        unavailable = scaled(ru.get("maxUnavailable", 1), replicas, round_up=False)
        return cls(replicas, surge, unavailable, int(ru.get("partition") or 0))

    @property
    def burst(self) -> int:
        return self.replicas + self.max_surge


@dataclass(frozen=True)
class GroupState:
    """One group index as the controller sees it: ``ready`` (leader and every worker ready),
    ``updated`` (every pod on the new revision) and whether its pods exist at all."""

    ready: bool
    updated: bool
    exists: bool = True

    @property
    def done(self) -> bool:
        return self.ready and self.updated


@dataclass(frozen=True)
class LeaderSet:
    """What the controller keeps in its leader StatefulSet: how many groups exist (``groups``), from
    which index they run the new revision (``partition``), the new revision (``revision``) and the
    one the groups below the partition run (``stable``), and the ``spec.replicas`` it was written
    for."""

    groups: int
    partition: int
    revision: str
    stable: str
    replicas: int

    def revision_of(self, index: int) -> str:
        return self.revision if index >= self.partition else self.stable


def _groups_during_update(s: Strategy, not_done: int) -> int:
    """How many groups to keep while ``not_done`` of the first ``replicas`` groups are not ready on
    the new revision: all surge groups while more than ``maxSurge`` are not, then only as many as
    keep ``maxUnavailable`` (surge groups are given back one by one)."""
    if not_done > s.max_surge:
        return s.burst
    return s.replicas + max(0, not_done - s.max_unavailable)


def _next_partition(states: list[GroupState], groups: int, step: int, partition: int) -> int:
    """Lower the partition by up to ``step`` groups below the groups already done at the top, never
    counting down more groups than are available, and past groups that are down anyway."""
    done_on_top = 0
    for st in reversed(states[:groups]):
        if not st.done:
            break
        done_on_top += 1
    floor = max(0, groups - done_on_top - step)
    down_below = sum(1 for st in states[:floor] if not st.ready)
    target = floor + down_below  # groups below the floor that are down count against maxUnavailable
    i = min(target, groups - 1)
    while i >= floor and (not states[i].ready or states[i].updated):
        target = i  # updating a group that is down (or done) costs no availability
        i -= 1
    return min(target, partition)  # the partition only moves down


def plan(s: Strategy, revision: str, current: LeaderSet | None, states: list[GroupState]) -> LeaderSet:
    """The leader set after one reconcile of the controller.

    ``states[i]`` for the groups ``0 .. current.groups - 1`` (missing groups: not ready, not updated);
    ``updated`` is relative to ``revision`` (the LWS's template now)."""
    if current is None:  # first reconcile: every group on the revision, no rolling
        return LeaderSet(s.replicas, s.partition, revision, revision, s.replicas)
    if revision != current.revision:  # a new template: start a rolling update
        partition = min(s.replicas, current.groups)
        groups = s.replicas if current.groups < s.replicas else _groups_during_update(s, s.replicas)
        stable = current.revision if current.partition == 0 else current.stable
        return LeaderSet(groups, max(partition, s.partition), revision, stable, s.replicas)
    if current.partition <= s.partition and current.groups == s.replicas:
        # at rest (or the update is finished): the new revision is the stable one
        stable = current.revision if all(st.updated for st in states[:current.groups]) else current.stable
        return LeaderSet(s.replicas, s.partition, revision, stable, s.replicas)
    if current.groups < s.replicas:  # scale up first: new groups get the new revision
        return dataclasses.replace(current, groups=s.replicas, replicas=s.replicas)
    not_done = sum(1 for i in range(s.replicas) if i >= len(states) or not states[i].done)
    if current.replicas != s.replicas:  # replicas changed during the update
        return dataclasses.replace(current, groups=_groups_during_update(s, not_done),
                                   partition=max(min(current.partition, s.burst), s.partition), replicas=s.replicas)
    step = s.max_unavailable + s.max_surge - (s.burst - current.groups)
    partition = _next_partition(states, current.groups, step, current.partition)
    return dataclasses.replace(current, groups=_groups_during_update(s, not_done),
                               partition=max(partition, s.partition))


def replacements(ls: LeaderSet, s: Strategy, revisions: dict[int, str | None], ready: dict[int, bool]) -> list[int]:
    """Groups the leader StatefulSet replaces now (highest index first): those at or above the
    partition not on the new revision, while fewer than ``maxUnavailable + maxSurge`` (at least 1)
    of its groups are down."""
    budget = max(1, s.max_unavailable + s.max_surge)
    down = sum(1 for i in range(ls.groups) if not ready.get(i, False))
    out = []
    for i in range(ls.groups - 1, ls.partition - 1, -1):
        if revisions.get(i) is not None and revisions[i] != ls.revision:
            if ready.get(i, False):
                if down >= budget:
                    break
                down += 1
            out.append(i)
    return out


#: condition types that are never true together (setting one true sets the other false)
_EXCLUSIVE = {("Available", "Progressing"), ("Available", "UpdateInProgress")}


def status(lws: dict, ls: LeaderSet, states: list[GroupState], now_iso: str,
           previous: list[dict] | None = None) -> dict:
    """The LWS status the controller writes (see module doc); ``states``: every group index of the
    leader set (surge groups included)."""
    s = Strategy.of(lws.get("spec") or {})
    name = lws["metadata"]["name"]
    gen = int(lws["metadata"].get("generation") or 1)
    base = [st for i, st in enumerate(states) if i < s.replicas]
    current = [st for i, st in enumerate(states) if s.partition <= i < s.replicas and st.exists]
    if sum(1 for st in current if st.updated) < len(current):
        on = [("UpdateInProgress", "GroupsUpdating", "Rolling Upgrade is in progress"),
              ("Progressing", "GroupsProgressing", "Replicas are progressing")]
    elif sum(1 for st in base if st.ready) == s.replicas and sum(1 for st in current if st.done) == len(current):
        on = [("Available", "AllGroupsReady", "All replicas are ready")]
    else:
        on = [("Progressing", "GroupsProgressing", "Replicas are progressing")]
    conditions = [dict(c) for c in previous or []]
    for ctype, reason, message in on:  # a condition is set true; one exclusive with it is set false
        found = False
        for c in conditions:
            if c.get("type") == ctype:
                found = True
                if c.get("status") != "True" or c.get("observedGeneration") != gen:
                    c.update(status="True", reason=reason, message=message, lastTransitionTime=now_iso)
            elif ((c.get("type"), ctype) in _EXCLUSIVE or (ctype, c.get("type")) in _EXCLUSIVE) \
                    and c.get("status") == "True":
                c.update(status="False", lastTransitionTime=now_iso)
        if not found:
            conditions.append({"type": ctype, "status": "True", "reason": reason, "message": message,
                               "lastTransitionTime": now_iso})
    for c in conditions:
        c["observedGeneration"] = gen
    return {"observedGeneration": gen, "replicas": sum(1 for st in states if st.exists),
            "readyReplicas": sum(1 for st in states if st.ready),
            "updatedReplicas": sum(1 for st in states if st.updated),
            "hpaPodSelector": f"{k8s_names.LWS_NAME_LABEL}={name},{k8s_names.LWS_WORKER_INDEX_LABEL}=0",
            "conditions": conditions}


# --- pods of a group --------------------------------------------------------------------------------


def template_revision(lws_spec: dict) -> str:
    """The template revision hash of an LWS (its ``leaderWorkerTemplate``: ``replicas`` excluded)."""
    blob = json.dumps(lws_spec.get("leaderWorkerTemplate") or {}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def group_key(namespace: str, leader: str) -> str:
    """The ``group-key`` label: a hash of the leader pod's namespace/name."""
    return hashlib.sha1(f"{namespace}/{leader}".encode()).hexdigest()


def pod_name(lws_name: str, group: int, worker: int) -> str:
    return f"{lws_name}-{group}" if worker == 0 else f"{lws_name}-{group}-{worker}"


def group_pod(lws: dict, template_spec: dict, group: int, worker: int, revision: str) -> dict:
    """The Pod object of worker ``worker`` (0 = leader) of group ``group``, from the LWS's
    ``leaderWorkerTemplate`` at ``revision`` (``template_spec``), with what LWS adds."""
    meta = lws["metadata"]
    name, ns = meta["name"], meta.get("namespace") or "default"
    lwt = template_spec.get("leaderWorkerTemplate") or {}
    size = int(lwt.get("size") or 1)
    tmpl = (lwt.get("leaderTemplate") if worker == 0 else None) or lwt.get("workerTemplate") or {}
    tmd = tmpl.get("metadata") or {}
    leader = pod_name(name, group, 0)
    labels = {**(tmd.get("labels") or {}),
              k8s_names.LWS_NAME_LABEL: name, k8s_names.LWS_GROUP_INDEX_LABEL: str(group),
              k8s_names.LWS_WORKER_INDEX_LABEL: str(worker), k8s_names.LWS_GROUP_KEY_LABEL: group_key(ns, leader),
              k8s_names.LWS_TEMPLATE_REVISION_LABEL: revision}
    annotations = {**(tmd.get("annotations") or {}), k8s_names.LWS_SIZE_ANNOTATION: str(size)}
    if worker:
        annotations[k8s_names.LWS_LEADER_NAME_ANNOTATION] = leader
    spec = copy.deepcopy(tmpl.get("spec") or {})
    # the pods' subdomain: the LWS's headless Service (Shared, the default) or the group's (UniquePerReplica)
    policy = (template_spec.get("networkConfig") or {}).get("subdomainPolicy") or "Shared"
    subdomain = leader if policy == "UniquePerReplica" else name
    env = [{"name": k8s_names.LWS_LEADER_ADDRESS_ENV, "value": f"{leader}.{subdomain}.{ns}"},
           {"name": k8s_names.LWS_GROUP_SIZE_ENV, "value": str(size)},
           {"name": k8s_names.LWS_WORKER_INDEX_ENV, "value": str(worker)}]
    for c in spec.get("containers") or []:
        have = {e.get("name") for e in c.get("env") or []}
        c["env"] = [e for e in env if e["name"] not in have] + list(c.get("env") or [])
    spec.setdefault("hostname", pod_name(name, group, worker))
    spec["subdomain"] = subdomain
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod_name(name, group, worker), "namespace": ns, "labels": labels,
                     "annotations": annotations,
                     "ownerReferences": [{"apiVersion": k8s_names.LWS_API_VERSION, "kind": k8s_names.LWS_KIND,
                                          "name": name, "uid": meta.get("uid", ""), "controller": True,
                                          "blockOwnerDeletion": True}]},
        "spec": spec,
    }


def recreate_event(lws: dict, group: int, failed_pod: str, now_iso: str, *, suffix: str, leader_uid: str = "") -> dict:
    """The ``RecreateGroupOnPodRestart`` Event of the LWS pod controller (core/v1 view of an events.k8s.io Event)."""
    meta = lws["metadata"]
    ns = meta.get("namespace") or "default"
    leader = pod_name(meta["name"], group, 0)
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{leader}.{suffix}", "namespace": ns},
        "involvedObject": {"apiVersion": k8s_names.LWS_API_VERSION, "kind": k8s_names.LWS_KIND,
                           "name": meta["name"], "namespace": ns, "uid": meta.get("uid", "")},
        "related": {"apiVersion": "v1", "kind": "Pod", "name": leader, "namespace": ns, "uid": leader_uid},
        "reason": k8s_names.LWS_RECREATE_GROUP_REASON, "action": "Delete", "type": "Normal",
        "message": f"Worker pod {failed_pod} failed, deleted leader pod {leader} to recreate group {group}",
        "eventTime": now_iso, "reportingComponent": "lws", "reportingInstance": "lws-controller-manager",
        "source": {"component": "lws"},
    }
