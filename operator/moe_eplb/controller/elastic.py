"""The operator as the orchestrator of an elastic group's resize (``spec.parallelism.elastic``).

Every ``tick_seconds`` a kopf timer of each elastic MoEInference reads what is there -- the group's
pods (founders: the LeaderWorkerSet's; joiners: the StatefulSet ``<name>-join``'s), and for each pod
its relay's report of vLLM's operation (:mod:`moe_eplb.exporter.elastic_relay`, on the exporter's
port) -- lets :func:`moe_eplb.controller.elastic_plan.advance` decide, and then acts in this order:
the record (``status.elastic`` and the ``Resizing`` condition, one patch conditional on the resource
version: a 409 means "decide again next tick"), the children rendered from it (the joiners' replicas and
template), the pods' ``eplb.ai/serving`` label and the founders' restart, and only then
``/scale_elastic_ep`` (through each pod's relay, with the control token). An operator that dies at any
point resumes from the record: a request it had not sent yet is sent again, one the relays have is
not repeated (they key it by the operation's id).

What the spec wants is one number, ``spec.replicas`` (pods of ``dataLocal`` ranks): the autoscaler
moves it through ``/scale``, a user with ``kubectl scale``, and fault recovery with
:func:`request_size`, the same path. No resize starts while the tuner rolls out or runs an experiment
(:func:`tuner_blocker`); the tuner, for its part, waits while a resize runs
(:func:`moe_eplb.controller.workload.elastic_scaling`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from moe_eplb.api import elastic as el
from moe_eplb.api.autotune_status import parse_iso
from moe_eplb.api.elastic import ElasticStatus
from moe_eplb.api.spec import MoEInference
from moe_eplb.api.validation import check
from moe_eplb.contracts import k8s_names
from moe_eplb.contracts.k8s_names import API, API_GROUP, API_VERSION, KIND, PLURAL
from moe_eplb.controller import control, elastic_metrics
from moe_eplb.controller import elastic_plan as plan
from moe_eplb.controller.k8s import ApiError, KubeClient
from moe_eplb.controller.status import condition, now_rfc3339

log = logging.getLogger("moe_eplb.elastic")

#: the pods' relay answers within this (its own calls to vLLM take at most 2 s each)
RELAY_TIMEOUT_S = 8.0


@dataclass
class ElasticSettings:
    """``tick_seconds``: how often each elastic resource is looked at (``MOE_EPLB_ELASTIC_TICK_SECONDS``,
    default 5)."""

    tick_seconds: float = 5.0

    @classmethod
    def from_env(cls) -> ElasticSettings:
        try:
            tick = float(os.environ.get("MOE_EPLB_ELASTIC_TICK_SECONDS", "") or 5.0)
        except ValueError:
            tick = 5.0
        return cls(tick_seconds=max(0.1, tick))


def tuner_blocker(inf: MoEInference) -> str | None:
    """Why no resize may start now because of the tuner: a rollout restarts the group's pods (and its
    ``Observing`` measures them), an experiment measures its arms; capacity must not move under either."""
    state = inf.status
    if state.rollout is not None:
        return f"the tuner's rollout is {state.rollout.phase}"
    if state.experiment is not None:
        return f"the tuner's experiment is {state.experiment.phase}"
    return None


def resizing_since(inf: MoEInference) -> float | None:
    """When the ``Resizing`` condition last changed (POSIX seconds): an operation's start while it is
    True, a failure's time while it is False."""
    cond = next((c for c in inf.conditions if c.get("type") == plan.RESIZING), None)
    try:
        return parse_iso(cond.get("lastTransitionTime")) if cond else None
    except ValueError:
        return None


def pod_state(pod: Mapping[str, Any]) -> plan.PodState:
    """:class:`~.elastic_plan.PodState` of an engine pod object."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    labels = meta.get("labels") or {}
    name = meta.get("name", "")
    ordinal = -1
    if labels.get(k8s_names.ELASTIC_ROLE_LABEL) == k8s_names.ELASTIC_JOINER and name.rsplit("-", 1)[-1].isdigit():
        ordinal = int(name.rsplit("-", 1)[-1])
    conds = {c.get("type"): c for c in status.get("conditions") or []}
    engine = next((c for c in status.get("containerStatuses") or [] if c.get("name") == k8s_names.ENGINE_CONTAINER), {})
    state = engine.get("state") or {}
    stuck = None
    waiting = state.get("waiting") or {}
    if waiting.get("reason") in plan.STUCK_REASONS:
        stuck = f"{waiting['reason']}: {waiting.get('message', '')}".strip(": ")
    sched = conds.get("PodScheduled") or {}
    if sched.get("status") == "False" and sched.get("reason") == "Unschedulable":
        stuck = f"Unschedulable: {sched.get('message', '')}".strip(": ")
    try:
        created = parse_iso(meta.get("creationTimestamp")) or 0.0
    except ValueError:
        created = 0.0
    return plan.PodState(name=name, ordinal=ordinal, ready=(conds.get("Ready") or {}).get("status") == "True",
                         running="running" in state, deleting=bool(meta.get("deletionTimestamp")),
                         serving=labels.get(k8s_names.SERVING_LABEL, "true") == "true", stuck=stuck, created=created)


def rank_report(answer: Mapping[str, Any], op: str) -> plan.RankReport:
    """A pod's relay answer (``GET /control/elastic/status``) as one :class:`~.elastic_plan.RankReport`
    for operation ``op``: the store as its first API server sees it, ``serving`` only when every API
    server serves, the requests in flight summed, the operation ``done`` once every rank answered."""
    ranks = [r for r in answer.get("ranks") or [] if isinstance(r, Mapping)]
    store = next((r["status"] for r in ranks if isinstance(r.get("status"), Mapping)), {})
    serving_each = [r.get("serving") for r in ranks]
    serving = None if not ranks or None in serving_each else all(serving_each)
    flights = [r.get("inFlight") for r in ranks]
    in_flight = None if not ranks or None in flights else float(sum(flights))
    rec = (answer.get("operations") or {}).get(op)
    state = code = detail = None
    if isinstance(rec, Mapping):
        each = [r for r in rec.get("ranks") or [] if isinstance(r, Mapping)]
        state = plan.DONE if each and all(r.get("state") == "done" for r in each) else plan.PENDING
        bad = next((r for r in each if r.get("state") == "done" and r.get("code") != 200), None)
        if bad is not None:
            state, code, detail = plan.DONE, bad.get("code"), bad.get("detail")
        elif state == plan.DONE:
            code = 200
    requested = store.get("requested_data_parallel_size")
    return plan.RankReport(phase=store.get("phase"), epoch=store.get("epoch"), error=store.get("error"),
                           requested=requested if isinstance(requested, int) else None, serving=serving,
                           in_flight=in_flight, op_state=state, op_code=code, op_detail=detail)


def record_patch(inf: MoEInference, step: plan.Step, now: str) -> dict[str, Any]:
    """The status patch of a step: ``status.elastic`` and the conditions with ``Resizing`` set."""
    previous = [dict(c) for c in inf.conditions]
    mine = condition(plan.RESIZING, *step.condition, inf.generation, previous, now)
    conds = [mine if c.get("type") == plan.RESIZING else c for c in previous]
    if not any(c.get("type") == plan.RESIZING for c in previous):
        conds.append(mine)
    # explicit nulls: a merge patch keeps a key the new record leaves out
    return {"elastic": {"epoch": None, "lastError": None, **step.status.to_crd()}, "conditions": conds}


def status_fields(inf: MoEInference, live_children: list[dict[str, Any]]) -> dict[str, Any]:
    """What the reconciler's status says of an elastic group: ``replicas`` its committed pods (what
    ``/scale`` reads), ``readyReplicas`` those of them ready (the founders' group counts its pods), the
    EP size and the redundant experts vLLM runs at the committed size (``R' = (E + R) DP' / DP - E``:
    the tuner's value for the launch size, re-expressed, never re-applied with a restart)."""
    par, st = inf.parallelism, inf.elastic_status
    lws = next((c for c in live_children if c.get("kind") == k8s_names.LWS_KIND), {})
    sts = next((c for c in live_children if c.get("kind") == "StatefulSet"), {})
    committed = el.pods_for(st.data_parallel, par.data_local)
    ready = par.nodes * min(1, int((lws.get("status") or {}).get("readyReplicas") or 0)) + int(
        (sts.get("status") or {}).get("readyReplicas") or 0)
    try:
        redundant = inf.redundancy_at(st.data_parallel)
    except el.ElasticError:
        redundant = inf.effective.num_redundant_experts
    return {"replicas": committed, "readyReplicas": min(committed, ready),
            "epSize": par.tensor * st.data_parallel, "numRedundantExperts": redundant}


async def request_size(client: KubeClient, namespace: str, name: str, data_parallel: int, data_local: int) -> None:
    """Ask for an elastic group of ``data_parallel`` ranks the way the autoscaler does: ``/scale``'s
    replicas (pods of ``data_local`` ranks). For fault recovery: growing back is
    this call; the loop then drives ``status.elastic.targetDataParallel`` there. With an autoscaler on,
    its next sync sets the count it wants. (RBAC: ``patch`` on ``moeinferences/scale``, which
    :data:`moe_eplb.controller.rbac.RBAC_RULES` grants once the operator calls this: the RBAC test
    keeps every grant in use.)"""
    pods = el.pods_for(data_parallel, data_local)
    await client.patch(API, KIND, namespace, name, {"spec": {"replicas": pods}}, subresource="scale")


class ElasticLoop:
    """The resize loop of one operator process. ``host``: the reconciler seam (the handlers'
    ``Controller``: ``client``, ``settings``, ``reconcile(body)``)."""

    def __init__(self, host: Any, settings: ElasticSettings | None = None) -> None:
        self.host = host
        self.settings = settings or ElasticSettings.from_env()
        self._session: aiohttp.ClientSession | None = None

    def register(self, registry: kopf.OperatorRegistry) -> None:
        tick = self.settings.tick_seconds

        def elastic_on(spec: Mapping[str, Any], **_: Any) -> bool:
            return bool(((spec.get("parallelism") or {}).get("elastic") or {}).get("enabled"))

        @kopf.timer(API_GROUP, API_VERSION, PLURAL, id="elastic", interval=tick, initial_delay=min(tick, 1.0),
                    backoff=max(1.0, 2 * tick), when=elastic_on, registry=registry)
        async def elastic_timer(body: Any, **_: Any) -> None:
            await self.on_timer(body)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=RELAY_TIMEOUT_S))
        return self._session

    async def on_timer(self, body: Mapping[str, Any]) -> str | None:
        if self.host.client is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        checked = check(body)  # an invalid spec changes nothing (the reconciler reports it: SpecValid=False)
        inf = checked.inference
        if checked.problems or inf is None or not inf.elastic_enabled:
            return None
        return await self.tick(inf)

    async def tick(self, inf: MoEInference) -> str | None:
        """One step for one elastic resource; returns ``<phase>`` after a write, ``conflict``, or None."""
        client = self.host.client
        now = time.time()
        st = inf.elastic_status
        pods = await client.list("v1", "Pod", inf.namespace, f"{k8s_names.NAME_LABEL}={inf.name}")
        since = resizing_since(inf)
        view = await self.observe(inf, pods, st, now, since)
        step = plan.advance(st, view)
        wrote = False
        if step.status != st or not _same_condition(inf, step):
            if not await client.patch_status(API, KIND, inf.namespace, inf.name, record_patch(inf, step, now_rfc3339()),
                                             resource_version=inf.resource_version):
                return "conflict"
            wrote = True
        fresh = await client.get(API, KIND, inf.namespace, inf.name) if wrote and step.status != st else None
        if fresh is not None:  # the joiners' StatefulSet, and the status's size, follow the record
            await self.host.reconcile(fresh)
        await self._act(client, inf, pods, step, since)
        for etype, reason, message in step.events:
            log.info("elastic %s/%s: %s: %s", inf.namespace, inf.name, reason, message)
            await self._event(client, inf, etype, reason, message)
        elastic_metrics.record(inf.namespace or "default", inf.name, st, step, view, now)
        return step.status.phase if wrote else None

    async def observe(self, inf: MoEInference, pods: list[dict[str, Any]], st: ElasticStatus, now: float,
                      since: float | None) -> plan.ElasticView:
        """The :class:`~.elastic_plan.ElasticView`: the pods and, for every running pod, its relay's report."""
        role = k8s_names.ELASTIC_ROLE_LABEL
        founders = [p for p in pods if (p["metadata"].get("labels") or {}).get(role) == k8s_names.ELASTIC_FOUNDER]
        joiners = [p for p in pods if (p["metadata"].get("labels") or {}).get(role) == k8s_names.ELASTIC_JOINER]
        op = plan.op_id(st, since)
        reports = await asyncio.gather(*(self._report(p, op) for p in founders + joiners))
        par = inf.parallelism
        return plan.ElasticView(
            desired=inf.elastic_desired, launch=par.data, data_local=par.data_local, founders_expected=par.nodes,
            founders=tuple(pod_state(p) for p in founders), joiners=tuple(sorted((pod_state(p) for p in joiners),
                                                                                key=lambda s: s.ordinal)),
            reports={p["metadata"]["name"]: r for p, r in zip(founders + joiners, reports) if r is not None},
            now=now, since=since, blocker=tuner_blocker(inf), start_s=float(inf.engine.startup_timeout_seconds),
            drain_s=float(inf.engine.drain_seconds), fault_tolerance=inf.fault_tolerance.enabled)

    async def _report(self, pod: Mapping[str, Any], op: str) -> plan.RankReport | None:
        url = _relay_url(pod, k8s_names.ELASTIC_STATUS_PATH)
        if url is None:
            return None
        try:
            async with self._http().get(url) as resp:
                if resp.status != 200:
                    return plan.RankReport(unreachable=f"relay answered {resp.status}")
                return rank_report(await resp.json(content_type=None), op)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            return plan.RankReport(unreachable=f"relay unreachable: {exc or type(exc).__name__}")

    async def _act(self, client: KubeClient, inf: MoEInference, pods: list[dict[str, Any]], step: plan.Step,
                   since: float | None) -> None:
        by_name = {p["metadata"]["name"]: p for p in pods}
        for name, serving in step.serving.items():
            await _ignore_gone(client.patch("v1", "Pod", inf.namespace, name, {"metadata": {"labels": {
                k8s_names.SERVING_LABEL: "true" if serving else "false"}}}))
        for name in step.restart:
            log.warning("elastic %s/%s: deleting founding pod %s to restart the group", inf.namespace, inf.name, name)
            await _ignore_gone(client.delete("v1", "Pod", inf.namespace, name))
        if step.scale is not None:
            target, names = step.scale
            token = await control.read_token(client, inf.namespace or "default", inf.name)
            if token is None:
                log.warning("elastic %s/%s: no control token yet; the resize request waits", inf.namespace, inf.name)
                return
            body = {"op": plan.op_id(step.status, since), "new_data_parallel_size": target,
                    "drain_timeout": max(1, int(inf.engine.drain_seconds) or el.DEFAULT_DRAIN_TIMEOUT)}
            await asyncio.gather(*(self._send(by_name[n], token, body) for n in names if n in by_name))

    async def _send(self, pod: Mapping[str, Any], token: str, body: dict[str, Any]) -> None:
        url = _relay_url(pod, k8s_names.ELASTIC_SCALE_PATH)
        if url is None:
            return
        try:
            async with self._http().post(url, json=body, headers=control.auth_header(token)) as resp:
                if resp.status not in (200, 202):
                    log.warning("elastic: %s refused the resize: %s %s", pod["metadata"]["name"], resp.status,
                                (await resp.text())[:300])
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # the next tick sends it again
            log.warning("elastic: %s: resize request failed: %s", pod["metadata"]["name"], exc)

    async def _event(self, client: KubeClient, inf: MoEInference, etype: str, reason: str, message: str) -> None:
        await client.try_post_event(inf.object_ref, type=etype, reason=reason, message=message)


def _same_condition(inf: MoEInference, step: plan.Step) -> bool:
    cond = next((c for c in inf.conditions if c.get("type") == plan.RESIZING), None)
    if cond is None:
        return False
    status, reason, message = step.condition
    return (cond.get("status") == ("True" if status else "False") and cond.get("reason") == reason
            and cond.get("message") == message)


def _relay_url(pod: Mapping[str, Any], path: str) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    if not ip or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None
    port = next((p.get("containerPort") for c in (pod.get("spec") or {}).get("containers") or []
                 for p in c.get("ports") or [] if p.get("name") == k8s_names.EXPORTER_PORT_NAME), None)
    if port is None:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}{path}"


async def _ignore_gone(call: Any) -> None:
    try:
        await call
    except ApiError as exc:
        if exc.status not in (404, 409):
            raise
