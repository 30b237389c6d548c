"""SIMULATED kubelet, Deployment controller and LeaderWorkerSet controller, for tests and
``moe-eplb demo``. Not Kubernetes.

It watches (polls) the Deployments and LeaderWorkerSets that moe-eplb manages in an emulated
Kubernetes API (``moe_eplb_harness.emulated.kubeapi``; any API server reachable over plain HTTP works) and:

- runs one :class:`~moe_eplb_harness.engines.engine.SimulatedEngine` per engine -- one per pod of a Deployment,
  one per LeaderWorkerSet group, spanning the group's pods (its ranks step in lockstep, each pod
  serving its own ranks' counters on its own port) -- with the EPLB settings parsed from the pod
  template's vLLM arguments (``--enable-eplb``, ``--eplb-config`` JSON or the old flat flags,
  ``--tensor-parallel-size`` x ``--data-parallel-size``), so a tuner change rolls pods that really
  behave differently;
- creates the Pod objects (``podIP: 127.0.0.1``, the container port named ``eplb-metrics`` set to
  the engine's real port, the template's labels and annotations; for a group also what
  LeaderWorkerSet adds, see :mod:`moe_eplb_harness.emulated.lws`) and keeps their status (Ready once the engine
  has loaded; ``CrashLoopBackOff`` with a growing ``restartCount`` for a crash-looping pod);
- rolls Deployment pods like the Deployment controller's RollingUpdate: never more than ``replicas +
  maxSurge`` pods, never fewer than ``replicas - maxUnavailable`` ready ones, new pods first, old
  pods removed as new ones become ready;
- rolls LeaderWorkerSet groups like the LWS controller (:mod:`moe_eplb_harness.emulated.lws`: partition by group,
  ``maxUnavailable`` / ``maxSurge`` on groups), recreates a whole group when one of its pods restarts
  (``RecreateGroupOnPodRestart``) and records the ``RecreateGroup`` Event (one per recreation: the
  Event's ``related`` leader pod is a new object each time, so client-go's recorder never merges them);
- writes the workloads' status (Deployment: ``observedGeneration``, ``replicas``,
  ``updatedReplicas``, ``readyReplicas``, ``availableReplicas``, ``unavailableReplicas``,
  conditions; LeaderWorkerSet: groups, ``hpaPodSelector``, conditions -- validated by the emulated
  API against the published LWS CRD).

Which engine runs a pod is decided in ONE place, :meth:`FakeKubelet._engine`: a
:class:`~moe_eplb_harness.engines.engine.SimulatedEngine` by default, or whatever ``engine_factory`` builds from
an :class:`EngineRequest` (the pod's parsed settings AND its pod spec, so a factory can start a real
``vllm serve`` from the rendered container; the real-engine demo in harness/moe_eplb_harness/vllm_engine does). The
kubelet only uses an engine's ``start()`` / ``stop()`` coroutines, ``ready`` and ``ports`` (one
exporter port per pod of the engine, known before ``start()`` returns).

Crash loops are emulated for the tests: ``crash_if(settings) -> bool`` decides which settings make
the engine exit at start-up (every pod of it), ``crash_pod_if(settings, worker_index)`` which pods of
a group (0 = leader). ``faults_for(settings)`` can inject engine faults (see
:class:`~moe_eplb_harness.engines.engine.EngineFaults`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from moe_eplb.contracts import k8s_names, metric_names
from moe_eplb_harness.emulated import lws as lws_mod
from moe_eplb_harness.engines.engine import EngineSettings, SimulatedEngine
from moe_eplb_harness.floor.client import ClusterClient, Connection, open_session
from moe_eplb_harness.floor.pods import (
    CRASH_BACKOFF_SECONDS,
    MANAGED_SELECTOR,
    EngineRequest,
    KubeletSettings,
    PodSpecError,
    PollingKubelet,
    engine_settings,
    mount_engine,
)

log = logging.getLogger(__name__)

def _int_or_percent(value: Any, total: int, *, round_up: bool) -> int:
    return lws_mod.scaled(value, total, round_up=round_up)


def template_hash(template: dict) -> str:
    """Like the Deployment controller's ``pod-template-hash``: a digest of the pod template."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class SimPod:
    name: str
    hash: str  # the pod template's hash (Deployment) or the group's template revision (LWS)
    settings: EngineSettings | None
    engine: SimulatedEngine | None
    crash: bool
    created: float  # simulated time
    restarts: int = 0
    next_restart: float = 0.0
    ready: bool = False
    deleted: bool = False
    status_sent: dict = field(default_factory=dict)
    worker: int = 0  # index in its LWS group (0: leader, or a Deployment pod)
    uid: str = ""  # the Pod object's uid
    group_restart: bool = False  # its LWS group is recreated when it restarts (RecreateGroupOnPodRestart)

    @property
    def port(self) -> int | None:
        return self.engine.ports[self.worker] if self.engine is not None and self.engine.ports else None


@dataclass
class _Deploy:
    namespace: str
    name: str
    uid: str
    instance: str = ""  # the MoEInference (pod label eplb.ai/name)
    pods: dict[str, SimPod] = field(default_factory=dict)
    status_sent: dict = field(default_factory=dict)


@dataclass
class _Group:
    """One LWS group: its pods (by worker index) share one engine."""

    index: int
    revision: str
    pods: dict[int, SimPod]
    engine: SimulatedEngine | None

    @property
    def ready(self) -> bool:
        return bool(self.pods) and all(p.ready for p in self.pods.values())


@dataclass
class _Lws:
    namespace: str
    name: str
    uid: str
    instance: str = ""
    leader_set: lws_mod.LeaderSet | None = None
    templates: dict[str, dict] = field(default_factory=dict)  # revision -> LWS spec (its ControllerRevisions)
    groups: dict[int, _Group] = field(default_factory=dict)
    status_sent: dict = field(default_factory=dict)

    @property
    def pods(self) -> dict[str, SimPod]:
        return {p.name: p for g in self.groups.values() for p in g.pods.values()}


class FakeKubelet(PollingKubelet):
    """Runs simulated engine pods for the moe-eplb Deployments and LeaderWorkerSets of an API server
    (see module doc).

    Args:
        api: the API server's base URL (no auth, as the emulation serves it), or a
            :class:`moe_eplb.controller.k8s.Connection` with a real one's credentials.
        kubelet: what every simulated kubelet of the world is given
            (:class:`~moe_eplb_harness.floor.pods.KubeletSettings`: the workload, the clock, start-up,
            ticks, expert groups, true costs, fault injection, the ready-pods notice).
        namespace: only this namespace (None: all).
        engine_factory: ``factory(EngineRequest) -> engine`` (not started) instead of a
            :class:`~moe_eplb_harness.engines.engine.SimulatedEngine`; the kubelet awaits ``engine.start()``
            (which must return quickly: readiness is read from ``engine.ready`` later), reads
            ``engine.ports`` and awaits ``engine.stop()`` when the pod goes. A ``ValueError`` from
            the factory is a crash at start-up.
        deployments: False leaves Deployments to the real controllers (the LeaderWorkerSet
            controller and its pods' kubelet only); ``node_name`` binds those pods.
    """

    role = "fake kubelet"

    def __init__(self, api: str | Connection, kubelet: KubeletSettings, *, namespace: str | None = None,
                 engine_factory: Callable[[EngineRequest], Any] | None = None,
                 deployments: bool = True, node_name: str | None = None) -> None:
        self._take(kubelet)
        # ``api``: the API server's URL (no auth, as the emulation serves it) or a Connection with its
        # credentials (a real API server); ``deployments=False`` leaves Deployments to the real
        # Deployment and ReplicaSet controllers (and their pods to the real backend's node agent), so
        # this plays only the LeaderWorkerSet controller and its pods' kubelet; ``node_name`` binds those pods
        self.connection = api if isinstance(api, Connection) else Connection(server=api.rstrip("/"))
        self.manage_deployments = deployments
        self.node_name = node_name
        self.engine_factory = engine_factory
        self.url = self.connection.server.rstrip("/")
        self.namespace = namespace
        self.deployments: dict[tuple[str, str], _Deploy] = {}
        self.leaderworkersets: dict[tuple[str, str], _Lws] = {}
        self.pods_created = 0
        self.client: ClusterClient | None = None  # the harness's apiserver client, while started
        self._exits = contextlib.AsyncExitStack()

    # --- HTTP --------------------------------------------------------------------------------------

    async def _req(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Any:
        """One API call; a DELETE or PATCH of an object already gone answers ``None``."""
        assert self.client is not None
        return await self.client.request(method, path, body, ctype, missing_ok=method in ("DELETE", "PATCH"))

    def _deploy_path(self, ns: str, name: str | None = None) -> str:
        base = f"/apis/apps/v1/namespaces/{ns}/deployments"
        return f"{base}/{name}" if name else base

    def _lws_path(self, ns: str, name: str | None = None) -> str:
        base = f"/apis/{k8s_names.LWS_API_VERSION}/namespaces/{ns}/leaderworkersets"
        return f"{base}/{name}" if name else base

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        # short timeouts: a stalled request is retried on the next pass
        session = await self._exits.enter_async_context(
            open_session(self.connection, user_agent="moe-eplb-sim-kubelet", timeout=5.0))
        self.client = ClusterClient(url=self.url, kubeconfig="", session=session, connection=self.connection)
        self._start_polling()

    async def stop(self) -> None:
        await self._stop_polling()
        for d in self.deployments.values():
            for p in d.pods.values():
                if p.engine:
                    await p.engine.stop()
        for lw in self.leaderworkersets.values():
            for g in lw.groups.values():
                if g.engine:
                    await g.engine.stop()
        self.deployments.clear()
        self.leaderworkersets.clear()
        self.client = None
        await self._exits.aclose()

    async def __aenter__(self) -> FakeKubelet:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # --- reconciliation ----------------------------------------------------------------------------

    async def _list(self, path: str) -> list[dict] | None:
        assert self.client is not None
        try:
            return await self.client.list(path, label_selector=MANAGED_SELECTOR)
        except aiohttp.ClientResponseError:
            return None

    async def reconcile_once(self) -> None:
        ns = self.namespace
        items = None
        if self.manage_deployments:
            items = await self._list(self._deploy_path(ns) if ns else "/apis/apps/v1/deployments")
        if items is not None:
            seen = set()
            self._listed = {}  # replicas per (namespace, instance) as listed now (a trial Deployment's too)
            for dep in items:
                md, sp = dep.get("metadata") or {}, dep.get("spec") or {}
                inst = (((sp.get("template") or {}).get("metadata") or {}).get("labels") or {}).get(
                    k8s_names.NAME_LABEL, md["name"])
                ikey = (md.get("namespace") or "default", inst)
                self._listed[ikey] = self._listed.get(ikey, 0) + int(sp.get("replicas", 1))
            for dep in items:
                md = dep.get("metadata") or {}
                key = (md.get("namespace") or "default", md["name"])
                seen.add(key)
                d = self.deployments.get(key)
                if d is None or d.uid != md.get("uid"):
                    if d is not None:
                        await self._remove_all(d)
                    d = self.deployments[key] = _Deploy(key[0], key[1], md.get("uid", ""))
                await self._reconcile(d, dep)
            for key in list(self.deployments):
                if key not in seen:
                    await self._remove_all(self.deployments.pop(key), delete_objects=False)
        items = await self._list(self._lws_path(ns) if ns else f"/apis/{k8s_names.LWS_API_VERSION}/leaderworkersets")
        if items is not None:
            seen = set()
            for obj in items:
                md = obj.get("metadata") or {}
                key = (md.get("namespace") or "default", md["name"])
                seen.add(key)
                lw = self.leaderworkersets.get(key)
                if lw is None or lw.uid != md.get("uid"):
                    if lw is not None:
                        await self._remove_lws(lw)
                    lw = self.leaderworkersets[key] = _Lws(key[0], key[1], md.get("uid", ""))
                await self._reconcile_lws(lw, obj)
            for key in list(self.leaderworkersets):
                if key not in seen:
                    await self._remove_lws(self.leaderworkersets.pop(key), delete_objects=False)
        await self._notify_targets()

    def targets(self) -> list[dict]:
        """Ready pods: ``[{namespace, pod, moeinference, port, hash}]`` sorted (for scrape configs);
        pods of an LWS group also carry the group labels a PodMonitor copies (``replica_group``,
        ``group_worker``, ``group_size``)."""
        out = []
        for d in self.deployments.values():
            for p in d.pods.values():
                if p.ready and p.engine is not None:
                    out.append({"namespace": d.namespace, "pod": p.name, "moeinference": d.instance or d.name,
                                "port": p.port, "hash": p.hash})
        for lw in self.leaderworkersets.values():
            for g in lw.groups.values():
                for p in g.pods.values():
                    if p.ready and p.engine is not None:
                        out.append({"namespace": lw.namespace, "pod": p.name, "moeinference": lw.instance or lw.name,
                                    "port": p.port, "hash": p.hash, metric_names.GROUP_LABEL: str(g.index),
                                    metric_names.GROUP_WORKER_LABEL: str(p.worker),
                                    metric_names.GROUP_SIZE_LABEL: str(len(g.pods))})
        return sorted(out, key=lambda x: (x["namespace"], x["pod"]))

    def running(self) -> list[tuple[str, SimPod]]:
        """``(MoEInference name, pod)`` of every pod (Deployments and LWS groups)."""
        out = [(d.instance or d.name, p) for d in self.deployments.values() for p in d.pods.values()]
        out += [(lw.instance or lw.name, p) for lw in self.leaderworkersets.values() for p in lw.pods.values()]
        return out

    def engines(self, instance: str | None = None) -> list[SimulatedEngine]:
        """The running engines (one per Deployment pod, one per LWS group), of one MoEInference or all."""
        out = [p.engine for d in self.deployments.values() if instance in (None, d.instance)
               for p in d.pods.values() if p.engine is not None]
        out += [g.engine for lw in self.leaderworkersets.values() if instance in (None, lw.instance)
                for g in lw.groups.values() if g.engine is not None]
        return out

    async def _remove_all(self, d: _Deploy, delete_objects: bool = True) -> None:
        for p in list(d.pods.values()):
            await self._delete_pod(d, p, delete_object=delete_objects)

    async def evict(self, namespace: str, name: str) -> bool:
        """Take one Deployment pod away (an eviction, a node lost): its engine stops, its object goes,
        and the Deployment's next pass starts a replacement from the template (tests). False when no
        such pod runs."""
        for d in self.deployments.values():
            if d.namespace == namespace and name in d.pods:
                await self._delete_pod(d, d.pods[name])
                return True
        return False

    async def _delete_pod(self, d: _Deploy, p: SimPod, delete_object: bool = True) -> None:
        if p.engine:
            await p.engine.stop()
            p.engine = None
        p.ready = False
        d.pods.pop(p.name, None)
        if delete_object:
            await self._req("DELETE", f"/api/v1/namespaces/{d.namespace}/pods/{p.name}?gracePeriodSeconds=0")

    async def _reconcile(self, d: _Deploy, dep: dict) -> None:
        spec = dep.get("spec") or {}
        template = spec.get("template") or {}
        labels = (template.get("metadata") or {}).get("labels") or {}
        d.instance = labels.get(k8s_names.NAME_LABEL, d.name)
        want = int(spec.get("replicas", 1))
        h = template_hash(template)
        strategy = (spec.get("strategy") or {})
        ru = strategy.get("rollingUpdate") or {}
        recreate = strategy.get("type") == "Recreate"
        surge = 0 if recreate else _int_or_percent(ru.get("maxSurge", "25%"), want, round_up=True)
        unavail = want if recreate else _int_or_percent(ru.get("maxUnavailable", "25%"), want, round_up=False)
        if surge == 0 and unavail == 0:
            unavail = 1
        now = self.clock.now()

        # pod lifecycles: readiness, crash restarts
        for p in list(d.pods.values()):
            self._advance_pod(p, now)

        new = [p for p in d.pods.values() if p.hash == h]
        old = [p for p in d.pods.values() if p.hash != h]
        # surplus new pods (scale down): unready first
        if len(new) > want:
            for p in sorted(new, key=lambda p: (p.ready, p.created))[: len(new) - want]:
                await self._delete_pod(d, p)
            new = [p for p in d.pods.values() if p.hash == h]
        # scale up new pods within maxSurge
        room = want + surge - len(d.pods)
        to_create = min(want - len(new), room)
        if not old:
            to_create = want - len(new)
        for _ in range(max(0, to_create)):
            await self._create_pod(d, dep, h, want)
        # remove old pods while availability allows; unready old pods go first
        ready_total = sum(1 for p in d.pods.values() if p.ready)
        min_ready = want - unavail
        for p in sorted(old, key=lambda p: (p.ready, p.created)):
            if not p.ready:
                await self._delete_pod(d, p)
            elif ready_total - 1 >= min_ready:
                await self._delete_pod(d, p)
                ready_total -= 1
        if old and not [p for p in d.pods.values() if p.hash != h]:
            # the old pods went: fill up to `want` new ones (maxSurge 0 case)
            new = [p for p in d.pods.values() if p.hash == h]
            for _ in range(max(0, want - len(new))):
                await self._create_pod(d, dep, h, want)

        for p in list(d.pods.values()):
            await self._write_pod_status(d.namespace, p)
        await self._write_deploy_status(d, dep, h, want)

    def _advance_pod(self, p: SimPod, now: float) -> None:
        """Readiness from the engine; a crashing container restarts with a doubling back-off."""
        if p.crash:
            self.advance_crash(p, now)
        elif p.engine is not None:
            p.ready = p.engine.ready

    def _settings_of(self, instance: str, pod_spec: dict, replicas: int,
                     pods: int = 1) -> tuple[EngineSettings | None, str | None]:
        """The engine settings of a pod (of an engine spanning ``pods`` pods), or why it cannot run."""
        try:
            settings = engine_settings(pod_spec, share=1.0 / max(1, replicas), num_groups=self.groups_for(instance))
        except (PodSpecError, ValueError) as exc:
            return None, str(exc)
        return (dataclasses.replace(settings, num_nodes=pods) if pods > 1 else settings), None

    async def _engine(self, settings: EngineSettings, instance: str, pods: int = 1, *, pod_spec: dict | None = None,
                      namespace: str = "default") -> Any:
        """Start the engine of a pod (or of an LWS group spanning ``pods`` pods): the factory's, else a
        :class:`~moe_eplb_harness.engines.engine.SimulatedEngine` replaying the instance's workload."""
        if self.engine_factory is not None:
            engine = self.engine_factory(EngineRequest(settings=settings, instance=instance, namespace=namespace,
                                                       pod_spec=json.loads(json.dumps(pod_spec or {})), pods=pods,
                                                       seed=self.pods_created))
        else:
            engine = SimulatedEngine(self.trace_for(instance), settings, self.clock,
                                     self.engine_run(settings, self.pods_created, pods=pods))
        await mount_engine(self.client, engine, namespace, instance, pod_spec)
        await engine.start()
        return engine

    async def _create_pod(self, d: _Deploy, dep: dict, h: str, replicas: int) -> None:
        template = (dep["spec"].get("template") or {})
        tmd = template.get("metadata") or {}
        pod_spec = json.loads(json.dumps(template.get("spec") or {}))
        name = f"{d.name}-{h[:8]}-{secrets.token_hex(3)}"
        # the Service splits the traffic over every pod of the instance (a trial Deployment's too)
        total = getattr(self, "_listed", {}).get((d.namespace, d.instance)) or replicas
        settings, why = self._settings_of(d.instance, pod_spec, total)
        if why:
            log.warning("fake kubelet: pod %s cannot run: %s", name, why)
        crash = settings is None or bool(self.crash_if(settings))
        engine = None
        if not crash:
            try:
                engine = await self._engine(settings, d.instance, pod_spec=pod_spec, namespace=d.namespace)
            except ValueError as exc:  # e.g. experts + redundant not divisible: vLLM fails at start-up
                log.warning("fake kubelet: pod %s crashes: %s", name, exc)
                engine, crash = None, True
        now = self.clock.now()
        pod = SimPod(name=name, hash=h, settings=settings, engine=engine, crash=crash, created=now,
                     next_restart=now + CRASH_BACKOFF_SECONDS)
        d.pods[name] = pod
        self.pods_created += 1
        annotations = dict(tmd.get("annotations") or {})
        annotations["sim.eplb.ai/simulated"] = "true"
        body = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": name, "namespace": d.namespace,
                "labels": {**(tmd.get("labels") or {}), "pod-template-hash": h},
                "annotations": annotations,
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": d.name,
                                     "uid": d.uid, "controller": True, "blockOwnerDeletion": True}],
            },
            "spec": _with_exporter_port(pod_spec, pod.port),
        }
        await self._req("POST", f"/api/v1/namespaces/{d.namespace}/pods", body)

    async def _write_pod_status(self, namespace: str, p: SimPod) -> None:
        cname = "vllm"
        last = None
        if p.crash and p.restarts and p.group_restart:
            # restarted and running again (about to fail) when LWS notices the restart and recreates the group
            state = {"running": {}}
            last = {"terminated": {"reason": "Error", "exitCode": 1, "message": "simulated crash at start-up"}}
        elif p.crash:
            state = {"waiting": {"reason": "CrashLoopBackOff" if p.restarts else "ContainerCreating",
                                 "message": "simulated crash at start-up"}}
        else:
            state = {"running": {}}
        status = {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "hostIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if p.ready else "False"},
                           {"type": "ContainersReady", "status": "True" if p.ready else "False"}],
            "containerStatuses": [{"name": cname, "ready": p.ready, "restartCount": p.restarts,
                                   "started": not p.crash, "state": state, "image": "simulated",
                                   **({"lastState": last} if last else {})}],
        }
        if status != p.status_sent:
            await self._req("PATCH", f"/api/v1/namespaces/{namespace}/pods/{p.name}/status",
                            {"status": status}, "application/merge-patch+json")
            p.status_sent = status

    async def _write_deploy_status(self, d: _Deploy, dep: dict, h: str, want: int) -> None:
        pods = list(d.pods.values())
        updated = [p for p in pods if p.hash == h]
        ready = [p for p in pods if p.ready]
        complete = len(updated) == want == len(pods) and all(p.ready for p in updated)
        status = {
            "observedGeneration": dep["metadata"].get("generation", 1),
            "replicas": len(pods),
            "updatedReplicas": len(updated),
            "readyReplicas": len(ready),
            "availableReplicas": len(ready),
            "unavailableReplicas": max(0, want - len(ready)),
            "conditions": [
                {"type": "Available", "status": "True" if len(ready) >= want else "False",
                 "reason": "MinimumReplicasAvailable" if len(ready) >= want else "MinimumReplicasUnavailable"},
                {"type": "Progressing", "status": "True",
                 "reason": "NewReplicaSetAvailable" if complete else "ReplicaSetUpdated"},
            ],
        }
        if status != d.status_sent:
            await self._req("PATCH", self._deploy_path(d.namespace, d.name) + "/status", {"status": status},
                            "application/merge-patch+json")
            d.status_sent = status

    # --- LeaderWorkerSets --------------------------------------------------------------------------

    async def _remove_lws(self, lw: _Lws, delete_objects: bool = True) -> None:
        for g in list(lw.groups.values()):
            await self._delete_group(lw, g, delete_objects=delete_objects)

    async def _delete_group(self, lw: _Lws, g: _Group, delete_objects: bool = True) -> None:
        if g.engine is not None:
            await g.engine.stop()
            g.engine = None
        for p in g.pods.values():
            p.engine, p.ready = None, False
        lw.groups.pop(g.index, None)
        if delete_objects:
            for p in sorted(g.pods.values(), key=lambda p: p.worker):  # the leader first, as LWS does
                await self._req("DELETE", f"/api/v1/namespaces/{lw.namespace}/pods/{p.name}?gracePeriodSeconds=0")

    async def _reconcile_lws(self, lw: _Lws, obj: dict) -> None:
        spec = obj.get("spec") or {}
        lwt = spec.get("leaderWorkerTemplate") or {}
        labels = ((lwt.get("workerTemplate") or {}).get("metadata") or {}).get("labels") or {}
        lw.instance = labels.get(k8s_names.NAME_LABEL, lw.name)
        strategy = lws_mod.Strategy.of(spec)
        revision = lws_mod.template_revision(spec)
        lw.templates.setdefault(revision, json.loads(json.dumps(spec)))
        recreate = (lwt.get("restartPolicy") or "RecreateGroupOnPodRestart") in lws_mod.RECREATE_POLICIES
        now = self.clock.now()

        # pod lifecycles: readiness, crashes; a restarted pod recreates its group (restart policy)
        for g in list(lw.groups.values()):
            for p in g.pods.values():
                self._advance_pod(p, now)
            # the LWS pod controller reacts to a restart it has seen (the pod's status shows it)
            failed = [p for p in g.pods.values() if _restarts_sent(p) > 0]
            if recreate and failed:
                leader = g.pods.get(0)
                # stamped with the wall-clock time, as the real controller's recorder does (the
                # operator maps API times onto its clock)
                event = lws_mod.recreate_event(obj, g.index, failed[0].name, _iso(time.time()), suffix=secrets.token_hex(8),
                                               leader_uid=leader.uid if leader is not None else "")
                await self._req("POST", f"/api/v1/namespaces/{lw.namespace}/events", event)
                await self._delete_group(lw, g)

        states = self._group_states(lw, revision, lw.leader_set.groups if lw.leader_set else 0)
        ls = lws_mod.plan(strategy, revision, lw.leader_set, states)
        lw.leader_set = ls
        for i in sorted((i for i in lw.groups if i >= ls.groups), reverse=True):  # scale down
            await self._delete_group(lw, lw.groups[i])
        ready = {i: g.ready for i, g in lw.groups.items()}
        for i in lws_mod.replacements(ls, strategy, {i: g.revision for i, g in lw.groups.items()}, ready):
            await self._delete_group(lw, lw.groups[i])  # the StatefulSet replaces it with the new revision
        for i in range(ls.groups):
            if i not in lw.groups:
                await self._create_group(lw, obj, i, ls.revision_of(i), strategy.replicas)

        for g in lw.groups.values():
            for p in g.pods.values():
                await self._write_pod_status(lw.namespace, p)
        states = self._group_states(lw, revision, ls.groups)
        status = lws_mod.status(obj, ls, states, _iso(now)[:19] + "Z", (obj.get("status") or {}).get("conditions"))
        if _strip_times(status) != _strip_times(lw.status_sent) or (obj.get("status") or {}).get(
                "observedGeneration") != status["observedGeneration"]:
            await self._req("PATCH", self._lws_path(lw.namespace, lw.name) + "/status", {"status": status},
                            "application/merge-patch+json")
            lw.status_sent = status

    @staticmethod
    def _group_states(lw: _Lws, revision: str, groups: int) -> list[lws_mod.GroupState]:
        out = []
        for i in range(max(groups, max(lw.groups, default=-1) + 1)):
            g = lw.groups.get(i)
            out.append(lws_mod.GroupState(ready=g is not None and g.ready,
                                          updated=g is not None and g.revision == revision, exists=g is not None))
        return out

    async def _create_group(self, lw: _Lws, obj: dict, index: int, revision: str, replicas: int) -> None:
        spec = lw.templates.get(revision) or obj.get("spec") or {}
        lwt = spec.get("leaderWorkerTemplate") or {}
        size = int(lwt.get("size") or 1)
        bodies = [lws_mod.group_pod(obj, spec, index, w, revision) for w in range(size)]
        leader_settings, why = self._settings_of(lw.instance, bodies[0]["spec"], replicas, pods=size)
        worker_settings = [self._settings_of(lw.instance, b["spec"], replicas, pods=size)[0] for b in bodies[1:]]
        if why or any(ws is None or ws != leader_settings for ws in worker_settings):
            log.warning("fake kubelet: group %s/%d cannot run: %s", lw.name, index,
                        why or "the leader's and the workers' engine arguments differ")
            leader_settings = None
        crashing = {w for w in range(size) if leader_settings is None or self.crash_if(leader_settings)
                    or self.crash_pod_if(leader_settings, w)}
        recreate = (lwt.get("restartPolicy") or "RecreateGroupOnPodRestart") in lws_mod.RECREATE_POLICIES
        engine = None
        if not crashing:
            try:
                engine = await self._engine(leader_settings, lw.instance, pods=size, pod_spec=bodies[0]["spec"],
                                            namespace=lw.namespace)
            except ValueError as exc:  # vLLM fails at start-up: every pod of the group
                log.warning("fake kubelet: group %s/%d crashes: %s", lw.name, index, exc)
                crashing = set(range(size))
        now = self.clock.now()
        g = _Group(index, revision, {}, engine)
        lw.groups[index] = g
        for w, body in enumerate(bodies):
            pod = SimPod(name=body["metadata"]["name"], hash=revision, settings=leader_settings, engine=engine,
                         crash=w in crashing, created=now, next_restart=now + CRASH_BACKOFF_SECONDS, worker=w,
                         group_restart=recreate)
            g.pods[w] = pod
            self.pods_created += 1
            body["metadata"]["annotations"]["sim.eplb.ai/simulated"] = "true"
            body["spec"] = _with_exporter_port(body["spec"], pod.port)
            if self.node_name:
                body["spec"]["nodeName"] = self.node_name
            created = await self._req("POST", f"/api/v1/namespaces/{lw.namespace}/pods", body)
            pod.uid = (created or {}).get("metadata", {}).get("uid", "")

def _with_exporter_port(pod_spec: dict, port: int | None) -> dict:
    """The pod spec with the ``eplb-metrics`` container port set to the engine's real port."""
    spec = json.loads(json.dumps(pod_spec))
    if port is None:
        return spec
    for c in spec.get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == k8s_names.EXPORTER_PORT_NAME:
                p["containerPort"] = port
    return spec


def _restarts_sent(p: SimPod) -> int:
    """The restart count the pod's status in the API shows."""
    return int(((p.status_sent.get("containerStatuses") or [{}])[0]).get("restartCount") or 0)


def _strip_times(status: dict) -> dict:
    out = dict(status)
    out["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                         for c in status.get("conditions") or []]
    return out
