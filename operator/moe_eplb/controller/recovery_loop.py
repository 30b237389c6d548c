"""The fault-recovery loop: a kopf timer per MoEInference with ``spec.faultTolerance.enabled`` that
reads the pods and every rank's fault-tolerance status, lets :func:`.recovery.step` decide per
replica group, writes ``status.faultTolerance`` and the ``FaultTolerant`` condition (one patch,
conditional on the resource version), and then acts: sends a round (:class:`.recovery_client.RecoveryClient`),
or starts a planned restart (deletes the group's leader pod, which drains). Events and the operator's
metrics (:mod:`.recovery_metrics`) follow a successful write only.

The timer runs every ``min(AutotuneSettings.tick_seconds, RECOVERY_POLL_SECONDS)`` wall seconds: vLLM's
engines wait 120 s by default, and every survivor must get the round within 10 s of the first. The
loop keeps nothing that matters in memory (the round in flight, its ``request_id`` and what it reached
are in the status), so a restarted operator polls the round it finds instead of sending another.

It meets the rest of the operator through the same seam as the tuning loop (the ``Controller``:
its API client); the tuning loop reads ``status.faultTolerance`` to pause (:func:`tuning_pause`), and
an elastic group's grow back is asked for through :func:`request_grow_back`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import kopf

from moe_eplb.api import ft_protocol as ftp
from moe_eplb.api.autotune_status import ROLLING, ROLLING_BACK, parse_iso
from moe_eplb.api.recovery_status import (
    DEGRADED,
    HEALTHY,
    SENT,
    RecoveryStatus,
    recovery_status_to_crd,
)
from moe_eplb.api.spec import MoEInference, SpecError, parse
from moe_eplb.contracts import k8s_names
from moe_eplb.contracts.k8s_names import API, API_GROUP, API_VERSION, KIND, PLURAL
from moe_eplb.controller import control, recovery_metrics
from moe_eplb.controller import decisions as dec
from moe_eplb.controller import recovery as rec
from moe_eplb.controller.autotune_settings import AutotuneSettings
from moe_eplb.controller.k8s import KubeClient
from moe_eplb.controller.recovery_client import Endpoint, RecoveryClient, accepted_id
from moe_eplb.controller.workload import read_scaling, workload_view

log = logging.getLogger("moe_eplb.recovery")

#: the loop's period at most (wall seconds); the autotune tick when that is shorter (tests)
RECOVERY_POLL_SECONDS = 2.0


# --- pure: the groups of a resource ----------------------------------------------------------------


def group_pods(inf: MoEInference, pods: list[dict], to_clock: Callable[[float], float] = lambda t: t
               ) -> dict[str, tuple[rec.GroupView, list[Endpoint]]]:
    """The replica groups of ``inf`` from its pods: a LeaderWorkerSet group per group index (pods by
    worker index), a Deployment pod per pod; each with the ranks of its pods (from the layout) and
    the endpoint of every rank's API server on a pod that has an address. ``readings`` are left
    empty (the loop fills them in)."""
    lay, p = inf.layout, inf.parallelism
    multinode = int(p.nodes or 1) > 1
    found: dict[str, dict[int, dict]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if multinode:
            gi, wi = labels.get(k8s_names.LWS_GROUP_INDEX_LABEL), labels.get(k8s_names.LWS_WORKER_INDEX_LABEL)
            if gi is None or wi is None or not str(wi).isdigit() or int(wi) >= len(lay.pods):
                continue
            found.setdefault(str(gi), {})[int(wi)] = pod
        elif meta.get("name"):
            found.setdefault(str(meta["name"]), {})[0] = pod
    out = {}
    for group, members in sorted(found.items()):
        views, eps = {}, []
        for index, pod in members.items():
            meta, st = pod.get("metadata") or {}, pod.get("status") or {}
            launch = lay.pods[index]
            created = parse_iso(meta.get("creationTimestamp"))
            ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
            ip = st.get("podIP")
            views[index] = rec.PodView(name=meta.get("name", ""), ranks=launch.ranks, ip=ip, ready=ready,
                                       running=st.get("phase") == "Running", deleting=bool(meta.get("deletionTimestamp")),
                                       created_by=to_clock(created + 1.0) if created is not None else None)
            if ip and not meta.get("deletionTimestamp"):
                eps += [Endpoint(rank, ip, a.port) for a in launch.api_servers for rank in a.ranks]
        leader = views[0].name if 0 in views and not views[0].deleting else None
        out[group] = (rec.GroupView(group=group, data=p.data, tensor=p.tensor, pods=views, readings={}, leader=leader), eps)
    return out


def facts_of(inf: MoEInference) -> rec.Facts:
    ft = inf.fault_tolerance
    version = inf.engine.version or (0, 0, 0)
    return rec.Facts(version=version, num_experts=inf.moe_shape.num_experts, redundant=inf.effective.num_redundant_experts,
                     timeout_s=float(ft.recovery_timeout_s or ftp.DEFAULT_RECOVERY_TIMEOUT_S),
                     elastic=bool(getattr(getattr(inf.parallelism, "elastic", None), "enabled", False)))


def tuner_busy(inf: MoEInference) -> tuple[str | None, str | None]:
    """(why the tuner is busy -- a restart must wait, why pods are being replaced on purpose -- no
    round opens): a rollout or an experiment."""
    st = inf.status
    if st.rollout is not None:
        why = f"a tuner rollout is {st.rollout.phase}"
        return why, why if st.rollout.phase in (ROLLING, ROLLING_BACK) else None
    if st.experiment is not None:
        why = f"an experiment is {st.experiment.phase}"
        return why, why if st.experiment.phase != "Running" else None
    return None, None


def tuning_pause(inf: MoEInference) -> str | None:
    """Why the tuner must not change the engines now because of fault recovery (None: it may): a
    round in flight or a planned restart (a change would restart the pods under it), or a group
    that runs on fewer ranks after a ``scale_down`` (EPLB no longer rebalances there; new settings
    would restart the engines and undo the recovery)."""
    st = inf.fault_recovery
    if not inf.fault_tolerance.enabled or st.phase == HEALTHY:
        return None
    if st.phase == DEGRADED:
        where = ", ".join(f"group {lr.group} ranks {list(lr.ranks)}" for lr in st.lost_ranks if lr.ranks)
        return (f"paused: the operator scaled down lost data-parallel rank(s) ({where}); EPLB no longer rebalances "
                "there and new settings would restart the engines and undo the recovery. Tuning resumes when the "
                "group is restored")
    return f"paused: fault recovery is {st.phase} (status.faultTolerance)"


# --- the loop -----------------------------------------------------------------------------------------


class RecoveryLoop:
    """The fault-recovery loop of one operator process (see the module docstring). ``host``: the
    ``Controller`` (its ``client``); ``settings``: the tuning loop's (clock and tick)."""

    def __init__(self, host: Any, settings: AutotuneSettings) -> None:
        self.host = host
        self.settings = settings
        self.http = RecoveryClient()
        self._waiting: dict[tuple[str, str], dict[str, str]] = {}
        self._groups_seen: dict[tuple[str, str], set[str]] = {}

    def now(self) -> float:
        return self.settings.clock.now()

    @property
    def interval(self) -> float:
        return min(self.settings.tick_seconds, RECOVERY_POLL_SECONDS)

    def register(self, registry: kopf.OperatorRegistry) -> None:
        """Add the loop's timer (one per MoEInference) to a ``kopf.OperatorRegistry``."""
        interval = self.interval

        @kopf.timer(API_GROUP, API_VERSION, PLURAL, id="fault-recovery", interval=interval,
                    initial_delay=min(interval, 1.0), backoff=max(1.0, 4 * interval), registry=registry)
        async def recovery_timer(body: Any, **_: Any) -> None:
            await self.on_timer(body)

    async def close(self) -> None:
        await self.http.close()

    async def on_timer(self, body: Mapping[str, Any]) -> str | None:
        if self.host.client is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        try:
            inf = parse(body)
        except SpecError:
            return None  # the reconciler reports it
        key = (inf.namespace or "default", inf.name)
        if not inf.fault_tolerance.enabled:
            if key in self._groups_seen:
                recovery_metrics.forget(*key, self._groups_seen.pop(key))
            return None
        return await self.tick(inf)

    async def tick(self, inf: MoEInference) -> str | None:
        """One look at every group of ``inf``: decide, write, act. Returns what happened (tests, logs)."""
        client: KubeClient | None = self.host.client
        if client is None:
            return None
        ns, key, now = inf.namespace or "default", (inf.namespace or "default", inf.name), self.now()
        pods = await client.list("v1", "Pod", ns, label_selector=f"{k8s_names.NAME_LABEL}={inf.name}")
        groups = group_pods(inf, pods, self.settings.to_clock)
        token = await control.read_token(client, ns, inf.name)
        version = inf.engine.version or (0, 0, 0)
        names = list(groups)
        polled = await asyncio.gather(*(self.http.statuses(groups[g][1], version, token) for g in names))
        readings = dict(zip(names, polled))  # per group: the ranks of different groups share numbers
        facts = facts_of(inf)
        tuner, busy = tuner_busy(inf)
        st, steps = inf.fault_recovery, {}
        for name, (view, eps) in groups.items():
            view = replace(view, readings=readings[name])
            groups[name] = (view, eps)
            coord = await self._coordination(client, inf, st, name, groups, tuner, now)
            s = rec.step(st, view, facts, now, resource=inf.name, coord=coord, busy=busy)
            st, steps[name] = s.status, s
        st = self._forget_gone(st, set(groups), now)
        st = rec.overall(st, list(groups))
        waiting = {g: s.waiting for g, s in steps.items() if s.waiting}
        cond = rec.condition(st, waiting)
        if not await self._write(client, inf, st, cond, now):
            return "conflict"
        self._waiting[key] = waiting
        self._groups_seen.setdefault(key, set()).update(groups)
        finished = [r for s in steps.values() for r in s.finished]
        recovery_metrics.record(*key, st, finished, self._groups_seen[key])
        for s in steps.values():
            for etype, reason, message in s.events:
                (log.warning if etype == "Warning" else log.info)("recovery %s/%s: %s: %s", *key, reason, message)
                await self._event(client, inf, etype, reason, message)
        out = await self._act(client, inf, st, steps, groups, token, version)
        return out or (f"phase:{st.phase}" if finished or any(s.events for s in steps.values()) else None)

    async def _act(self, client: KubeClient, inf: MoEInference, st: RecoveryStatus, steps: dict[str, rec.Step],
                   groups: dict[str, tuple[rec.GroupView, list[Endpoint]]], token: str | None, version: Any) -> str | None:
        """Send the rounds decided (then record what they reached), start the restarts decided."""
        done = None
        for name, s in steps.items():
            if s.send is not None:
                rnd = s.send
                eps = [ep for ep in groups[name][1] if ep.rank in rnd.ranks and ep.rank not in rnd.sent_to]
                body = ftp.apply_body(rnd.instruction, rnd.request_id, s.params)
                answers = await self.http.send_round(eps, version, body, token)
                reached = tuple(sorted(set(rnd.sent_to) | {r for r, (code, _) in answers.items() if code == ftp.ACCEPTED}))
                ids = tuple(sorted(set(rnd.accepted_ids) | {i for code, text in answers.values()
                                                            if code == ftp.ACCEPTED and (i := accepted_id(text))}))
                refused = {r: a for r, a in answers.items() if a[0] != ftp.ACCEPTED}
                if refused:
                    log.warning("recovery %s/%s: round %s not accepted by %s", inf.namespace, inf.name, rnd.request_id,
                                {r: f"{c} {t[:120]}" for r, (c, t) in refused.items()})
                fresh = await client.get(API, KIND, inf.namespace, inf.name)
                if fresh is not None:
                    cur = parse(fresh).fault_recovery
                    kept = cur.in_flight(name)
                    if kept is not None and kept.request_id == rnd.request_id and kept.state == SENT:
                        await self._write(client, parse(fresh), cur.with_round(replace(kept, sent_to=reached,
                                                                                      accepted_ids=ids)), None, self.now())
                done = f"sent:{rnd.instruction}"
            if s.restart is not None:
                if rec.restore_mode(facts_of(inf)) == "grow_back":
                    await request_grow_back(client, inf, inf.parallelism.data)
                else:
                    await client.delete("v1", "Pod", inf.namespace, s.restart)
                done = "restore"
        return done

    async def _coordination(self, client: KubeClient, inf: MoEInference, st: RecoveryStatus, group: str,
                            groups: dict[str, tuple[rec.GroupView, list[Endpoint]]], tuner: str | None,
                            now: float) -> rec.Coordination:
        """What a planned restart of ``group`` must wait for (read only when it could start)."""
        if rec.group_phase(st, group) != DEGRADED or st.in_flight(group) is not None:
            return rec.Coordination()
        others = [v for g, (v, _) in groups.items() if g != group and rec.group_phase(st, g) == HEALTHY
                  and v.pods and all(p.ready for p in v.pods.values()) and len(v.pods) >= len(inf.layout.pods)]
        restoring = sum(1 for lr in st.lost_ranks if lr.restoring_since is not None)
        autoscaler = None
        if inf.autoscaling is not None:
            view, _ = await workload_view(client, inf, crashloop_restarts=self.settings.crashloop_restarts,
                                          to_clock=self.settings.to_clock, to_wall=self.settings.clock.to_wall)
            scaling = await read_scaling(client, inf, view, self.settings.to_clock)
            autoscaler = dec.scaling_blocker(scaling, now, inf.autotune.observe_s)
        return rec.Coordination(tuner=tuner, autoscaler=autoscaler, other_ready_groups=len(others),
                                restoring_groups=restoring)

    def _forget_gone(self, st: RecoveryStatus, present: set[str], now: float) -> RecoveryStatus:
        """Groups that no longer exist (a Deployment pod replaced, a scale-in): their round ends
        (superseded) and their lost ranks are forgotten (new pods start whole)."""
        for r in st.rounds:
            if r.in_flight and r.group not in present:
                st = st.with_round(replace(r, finished_at=now, result="Superseded",
                                           reason="the group's pods are gone (replaced or scaled in)"))
        for lr in st.lost_ranks:
            if lr.group not in present:
                st = st.with_lost(None, lr.group)
        return st

    async def _write(self, client: KubeClient, inf: MoEInference, st: RecoveryStatus,
                     cond: tuple[str, str, str] | None, now: float) -> bool:
        """One status patch conditional on the resource version, when something changed; False on a 409."""
        new = recovery_status_to_crd(st)
        conds = None
        if cond is not None:
            old = next((c for c in inf.conditions if c.get("type") == rec.CONDITION), {})
            if (old.get("status"), old.get("reason"), old.get("message")) != cond:
                conds = dec.set_conditions(list(inf.conditions), {rec.CONDITION: cond}, now=now,
                                           generation=inf.generation)
        if new == {k: inf.fault_recovery.stored.get(k) for k in new} and conds is None:
            return True
        patch: dict[str, Any] = {"faultTolerance": new}
        if conds is not None:
            patch["conditions"] = conds
        return await client.patch_status(API, KIND, inf.namespace, inf.name, patch, resource_version=inf.resource_version)

    async def _event(self, client: KubeClient, inf: MoEInference, etype: str, reason: str, message: str) -> None:
        await client.try_post_event(inf.object_ref, type=etype, reason=reason, message=message)


async def request_grow_back(client: KubeClient, inf: MoEInference, target_data: int) -> bool:
    """Ask the elastic orchestrator to grow the group back to ``target_data`` data-parallel ranks
    (``status.elastic.targetDataParallel``, the field the autoscaler's resize request sets too; the
    resize itself is :mod:`moe_eplb.controller.elastic`'s). Conditional on the resource version;
    False on a conflict (the caller retries next tick)."""
    return await client.patch_status(API, KIND, inf.namespace, inf.name,
                                     {"elastic": {"targetDataParallel": int(target_data)}},
                                     resource_version=inf.resource_version)
