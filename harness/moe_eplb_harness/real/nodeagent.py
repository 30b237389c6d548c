"""SIMULATED GPU nodes for a REAL control plane (:mod:`moe_eplb_harness.real.controlplane`): a node agent that
plays the kubelet, and only the kubelet. Not Kubernetes.

On the emulation, :mod:`moe_eplb_harness.emulated.kubelet` also plays the Deployment controller. On a real
apiserver the real Deployment and ReplicaSet controllers create the pods and the real kube-scheduler
binds them; this agent

- registers ``nodes`` Node objects as a GPU node would have them (``nvidia.com/gpu`` capacity and
  allocatable, the GPU product and count labels, ``Ready``);
- runs each engine container's ``livenessProbe`` (``httpGet``, :mod:`moe_eplb_harness.real.probes`) once its
  engine is up, and restarts a container whose probe keeps failing (``restartCount`` + 1);
  :meth:`NodeAgent.stick` makes a pod's worker hang so that its probe fails;
- watches (polls) the pods bound to its nodes and runs one
  :class:`~moe_eplb_harness.engines.engine.SimulatedEngine` per pod, with the EPLB settings parsed from the pod's
  own vLLM arguments (:func:`moe_eplb_harness.floor.pods.engine_settings`), on a loopback address of its own
  (the "pod IP": 127.x.y.z in a /18 picked at random per agent, skipping an address whose port another
  process on the machine holds, so every pod serves the pod spec's ``eplb-metrics`` port, as on a
  cluster, and agents of concurrent test runs do not collide);
- reports pod status like a kubelet (``Running``, ``podIP``, ``Ready`` once the engine has loaded,
  ``CrashLoopBackOff`` with a growing ``restartCount`` for a crash-looping pod);
- confirms a pod's deletion (the apiserver keeps a bound pod ``Terminating`` until its kubelet does).

Pods of a LeaderWorkerSet group (made by the REAL LWS controller, :mod:`moe_eplb_harness.real.lwscontroller`:
its leader StatefulSet's pod and the group's worker StatefulSet's pods, grouped by the labels
``leaderworkerset.sigs.k8s.io/name`` and ``group-index`` its pod webhook sets) run ONE engine that
spans the group's ``size`` pods (``SimulatedEngine(pods=size, hosts=(ip of each pod, ...))``, every
pod serving its rank's metrics on its own IP). The engine starts once every pod of the group
(worker index 0 .. size-1, one template revision) is bound here; when a member of the group goes
away or is replaced, the group's engine stops and its remaining pods turn unready until the group
is whole again (the group restarts together). A crash-looping pod of a group shows its growing
``restartCount``, which is what makes LWS recreate the group (``RecreateGroupOnPodRestart``).

Pods the emulated LeaderWorkerSet controller creates (annotation ``sim.eplb.ai/simulated``) run
their group's engine in :class:`~moe_eplb_harness.emulated.kubelet.FakeKubelet` and are left alone here.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import ipaddress
import logging
import os
import random
import re
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from moe_eplb.contracts import k8s_names, metric_names
from moe_eplb_harness.engines.elastic import ElasticGroups, ElasticPod
from moe_eplb_harness.engines.engine import EngineSettings, SimulatedEngine
from moe_eplb_harness.floor.pods import (
    CRASH_BACKOFF_SECONDS,
    MANAGED_SELECTOR,
    KubeletSettings,
    PodSpecError,
    PollingKubelet,
    engine_settings,
    mount_engine,
    runs_flag,
    vllm_flag,
)
from moe_eplb_harness.real import ft_groups
from moe_eplb_harness.real.probes import LivenessProber

log = logging.getLogger(__name__)

SIMULATED_ANNOTATION = "sim.eplb.ai/simulated"
GPU_RESOURCE = "nvidia.com/gpu"
LWS_LIST_PATH = f"/apis/{k8s_names.LWS_API_VERSION}/leaderworkersets"


def group_of(meta: Mapping[str, Any]) -> tuple[tuple[str, str, int], int, int] | None:
    """``((namespace, lws name, group index), worker index, group size)`` of a pod of a
    LeaderWorkerSet group (the labels and annotation the LWS pod webhook sets), else ``None``."""
    labels = meta.get("labels") or {}
    name = labels.get(k8s_names.LWS_NAME_LABEL)
    gi, wi = labels.get(k8s_names.LWS_GROUP_INDEX_LABEL), labels.get(k8s_names.LWS_WORKER_INDEX_LABEL)
    size = (meta.get("annotations") or {}).get(k8s_names.LWS_SIZE_ANNOTATION)
    if name is None or gi is None or wi is None or size is None:
        return None
    return (meta["namespace"], name, int(gi)), int(wi), int(size)


def node_object(name: str, *, gpus: int, product: str = "NVIDIA-H200") -> dict[str, Any]:
    """A Node as a GPU node's kubelet and the NVIDIA device plugin / GPU feature discovery publish it."""
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
            "nvidia.com/gpu.product": product, "nvidia.com/gpu.count": str(gpus), "nvidia.com/gpu.present": "true"}},
        "spec": {},
    }


def node_status(gpus: int, now: str, gpu_resource: str = GPU_RESOURCE) -> dict[str, Any]:
    """A Ready node's status with ``gpus`` of the device plugin's resource ``gpu_resource``."""
    capacity = {"cpu": "128", "memory": "2Ti", "pods": "110", "ephemeral-storage": "4Ti", gpu_resource: str(gpus)}
    return {"status": {
        "capacity": capacity, "allocatable": capacity,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "simulated node agent",
                        "lastHeartbeatTime": now, "lastTransitionTime": now}],
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
        "nodeInfo": {"kubeletVersion": "v1.36.3-sim", "containerRuntimeVersion": "simulated://1",
                     "architecture": "amd64", "operatingSystem": "linux", "kernelVersion": "", "osImage": "",
                     "kubeProxyVersion": "", "machineID": "", "systemUUID": "", "bootID": ""}}}


def exporter_port(pod_spec: Mapping[str, Any]) -> int | None:
    for c in pod_spec.get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == k8s_names.EXPORTER_PORT_NAME:
                return int(p["containerPort"])
    return None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class AgentPod:
    uid: str
    namespace: str
    name: str
    instance: str
    ip: str
    port: int | None
    hash: str
    settings: EngineSettings | None = None
    engine: SimulatedEngine | None = None
    crash: bool = False
    restarts: int = 0
    next_restart: float = 0.0
    ready_since: str = ""
    created_at: str = field(default_factory=lambda: _now())
    status_sent: dict = field(default_factory=dict)
    group: tuple[str, str, int] | None = None  # (namespace, lws, group index) for a pod of an LWS group
    worker: int = 0
    size: int = 1
    spec: dict = field(default_factory=dict)
    prober: LivenessProber | None = None  # the engine container's liveness probe, run as a kubelet would
    last_termination: dict | None = None  # lastState.terminated after a liveness restart
    elastic: ElasticPod | None = None  # a pod of an elastic group (engines.elastic), instead of an engine

    @property
    def ready(self) -> bool:
        if self.elastic is not None:
            return not self.crash and self.elastic.ready
        return (not self.crash) and self.engine is not None and self.engine.ready


@dataclass
class AgentGroup:
    """One LWS group's engine and the pods (by worker index: uid) it was started for."""

    members: dict[int, str]
    engine: SimulatedEngine | None


@dataclass(frozen=True)
class NodePool:
    """The simulated GPU nodes a :class:`NodeAgent` registers and runs its pods on."""

    nodes: int = 4
    """How many Nodes: ``<prefix>-0`` ... ``<prefix>-<nodes - 1>``."""

    gpus_per_node: int = 8
    """GPUs each Node reports (capacity and allocatable of ``gpu_resource``)."""

    prefix: str = "gpu-node"
    """The Nodes' name prefix (unique per world on a shared control plane)."""

    gpu_resource: str = GPU_RESOURCE
    """The GPUs' extended resource name (``amd.com/gpu`` for a ROCm node)."""

    subnet: str | None = None
    """The loopback network the pod IPs come from (None: one of the 256 /18s of 127.64.0.0/10, at random)."""

    remove_on_stop: bool = False
    """Delete the Nodes when the agent stops (a world on a shared control plane: the next one's pods
    must not be scheduled onto machines nobody runs)."""

    api_ports: bool = False
    """Engines serve vLLM's own series on the pod's API port (a PodMonitor's ``http`` endpoint), the
    exporter's on ``eplb-metrics``, as real pods do."""


class NodeAgent(PollingKubelet):
    """The simulated nodes' kubelet (see module doc). ``cluster.request(method, path, body=None,
    content_type=...)`` is the API client's call (:class:`moe_eplb_harness.real.realapi.RealCluster`);
    ``kubelet``: what every simulated kubelet of the world is given
    (:class:`~moe_eplb_harness.floor.pods.KubeletSettings`); ``pool``: its Nodes (:class:`NodePool`)."""

    role = "node agent"

    def __init__(self, cluster: Any, kubelet: KubeletSettings, pool: NodePool = NodePool()) -> None:
        self._take(kubelet)
        self.cluster = cluster
        self.node_names = [f"{pool.prefix}-{i}" for i in range(pool.nodes)]
        self.remove_nodes = pool.remove_on_stop
        self.api_ports = pool.api_ports  # engines serve vLLM's series on the pod's API port (a PodMonitor's `http`)
        self.gpus_per_node = pool.gpus_per_node
        self.gpu_resource = pool.gpu_resource  # the device plugin's resource name (spec.engine.gpuResourceName)
        subnet = pool.subnet
        if subnet is None:  # one of the 256 /18s of 127.64.0.0/10
            subnet = str(ipaddress.ip_network("127.64.0.0/18").network_address + (random.randrange(256) << 14)) + "/18"
        self._ips = (str(ip) for ip in ipaddress.ip_network(subnet).hosts())
        self.pods: dict[str, AgentPod] = {}
        self.groups: dict[tuple[str, str, int], AgentGroup] = {}
        self.pods_started = 0
        #: fault-tolerant groups (``--enable-fault-tolerance``): the simulated timing
        #: (:class:`moe_eplb_harness.engines.fault_tolerance.FtConfig` fields: detect_s, recover_s, ...)
        self.ft_timing: dict[str, float] = {}
        self.elastic = ElasticGroups()  # the elastic groups' simulated protocol (engines.elastic)

    # --- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        now = _now()
        for name in self.node_names:
            try:
                await self.cluster.create("/api/v1/nodes", node_object(name, gpus=self.gpus_per_node))
            except aiohttp.ClientResponseError as exc:
                if exc.status != 409:
                    raise
            status = node_status(self.gpus_per_node, now, self.gpu_resource)
            await self.cluster.request("PATCH", f"/api/v1/nodes/{name}/status", status,
                                       content_type="application/merge-patch+json")
            # the apiserver taints a new Node not-ready (TaintNodesByCondition); the node lifecycle
            # controller lifts it once the node reports Ready. That controller is not run here (it
            # would also evict pods of nodes without lease heartbeats), so the agent lifts it itself.
            await self.cluster.request("PATCH", f"/api/v1/nodes/{name}", {"spec": {"taints": None}},
                                       content_type="application/merge-patch+json")
        self._start_polling()

    async def stop(self) -> None:
        await self._stop_polling()
        for engine in self.engines():
            await engine.stop()
        for p in self.pods.values():
            if p.elastic is not None:
                p.elastic.stop()
        self.elastic.close()
        self.pods.clear()
        self.groups.clear()
        if self.remove_nodes:  # the machines leave the cluster (their pods are the caller's to delete)
            for name in self.node_names:
                try:
                    await self.cluster.request("DELETE", f"/api/v1/nodes/{name}")
                except aiohttp.ClientResponseError as exc:
                    if exc.status != 404:
                        raise

    # --- the kubelet's work ------------------------------------------------------------------------
    async def reconcile_once(self) -> None:
        listed = await self.cluster.request("GET", "/api/v1/pods", params={"labelSelector": MANAGED_SELECTOR})
        deployments = await self.cluster.request("GET", "/apis/apps/v1/deployments",
                                                 params={"labelSelector": MANAGED_SELECTOR})
        replicas: dict = {}
        for d in deployments.get("items", []):  # per instance: an experiment's trial Deployment shares its traffic
            tlabels = ((d["spec"].get("template") or {}).get("metadata") or {}).get("labels") or {}
            key = (d["metadata"]["namespace"], tlabels.get(k8s_names.NAME_LABEL, d["metadata"]["name"]))
            replicas[key] = replicas.get(key, 0) + int(d["spec"].get("replicas") or 1)
        try:
            lws = await self.cluster.request("GET", LWS_LIST_PATH, params={"labelSelector": MANAGED_SELECTOR})
        except aiohttp.ClientResponseError as exc:  # no LeaderWorkerSet CRD installed
            if exc.status != 404:
                raise
            lws = {}
        replicas.update({("lws", d["metadata"]["namespace"], d["metadata"]["name"]): int(d["spec"].get("replicas") or 1)
                         for d in lws.get("items", [])})
        seen, live = set(), []
        for pod in listed.get("items", []):
            meta, spec = pod["metadata"], pod.get("spec") or {}
            if spec.get("nodeName") not in self.node_names or SIMULATED_ANNOTATION in (meta.get("annotations") or {}):
                continue
            uid = meta["uid"]
            seen.add(uid)
            p = self.pods.get(uid)
            if meta.get("deletionTimestamp"):
                await self._finish(meta, p)
                continue
            if p is None:
                p = await self._start_pod(pod, replicas)
            live.append(p)
        for uid in [u for u in self.pods if u not in seen]:  # deleted without us (e.g. grace 0 by a test)
            p = self.pods.pop(uid)
            if p.engine is not None and p.group is None:
                await p.engine.stop()
            self._stop_elastic(p)
        await self._reconcile_groups(replicas)
        for p in live:
            if p.uid in self.pods:
                self._advance(p)
                await self._probe(p)
                await self._write_status(p)
        await self._notify_targets()

    def _api_port(self, pod_spec: Mapping[str, Any] | None) -> int:
        """vLLM's API port of the pod spec (``http``) when :attr:`api_ports`, else 0 (none)."""
        if not self.api_ports or pod_spec is None:
            return 0
        return next((int(p["containerPort"]) for c in pod_spec.get("containers") or [] for p in c.get("ports") or []
                     if p.get("name") == k8s_names.API_PORT_NAME), 0)

    def _next_ip(self, port: int | None) -> str:
        """The next pod IP of the subnet where ``port`` is free (another process may hold it)."""
        for ip in self._ips:
            if not port:
                return ip
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((ip, port))
                except OSError:
                    continue
            return ip
        raise RuntimeError("node agent: no free pod IP left in its subnet")

    async def _start_pod(self, pod: dict, replicas: Mapping[tuple[str, str], int]) -> AgentPod:
        meta, spec = pod["metadata"], pod["spec"]
        labels = meta.get("labels") or {}
        instance = labels.get(k8s_names.NAME_LABEL, meta["name"])
        n = replicas.get((meta["namespace"], instance), 1)
        port = exporter_port(spec)
        p = AgentPod(uid=meta["uid"], namespace=meta["namespace"], name=meta["name"], instance=instance,
                     ip=self._next_ip(port), port=port,
                     hash=labels.get("pod-template-hash") or labels.get(k8s_names.LWS_TEMPLATE_REVISION_LABEL, ""))
        vllm = next((c for c in spec.get("containers") or [] if c.get("name") == "vllm"), None)
        if vllm is not None and vllm.get("livenessProbe"):
            p.prober = LivenessProber(vllm, self.clock.now)
        self.pods[p.uid] = p
        vllm = next((c for c in spec.get("containers") or [] if c.get("name") == "vllm"), None)
        if vllm is not None and runs_flag(vllm, "--enable-elastic-ep"):
            p.spec = spec
            await self._start_elastic(p, pod, vllm)
            self.pods_started += 1
            return p
        p.spec = spec
        member = group_of(meta)
        if member is not None:  # its group's engine starts once the group is whole (_reconcile_groups)
            p.group, p.worker, p.size = member
            p.spec = spec
            self.pods_started += 1
            p.next_restart = self.clock.now() + CRASH_BACKOFF_SECONDS
            return p
        try:
            p.settings = engine_settings(spec, share=1.0 / max(1, n), num_groups=self.groups_for(instance))
        except (PodSpecError, ValueError) as exc:
            log.warning("node agent: pod %s/%s cannot run: %s", p.namespace, p.name, exc)
            p.crash = True
        if p.settings is not None and self.crash_if(p.settings):
            p.crash = True
        if not p.crash:
            try:
                p.engine = SimulatedEngine(self.trace_for(instance), p.settings, self.clock,
                                           self.engine_run(p.settings, self.pods_started, port=p.port or 0,
                                                           hosts=(p.ip,), api_port=self._api_port(spec)))
                await mount_engine(self.cluster, p.engine, p.namespace, instance, spec)
                await p.engine.start()
            except (ValueError, OSError) as exc:  # e.g. experts + redundant not divisible: vLLM fails at start-up
                log.warning("node agent: pod %s/%s crashes: %s", p.namespace, p.name, exc)
                p.engine, p.crash = None, True
        self.pods_started += 1
        p.next_restart = self.clock.now() + CRASH_BACKOFF_SECONDS
        return p

    async def _start_elastic(self, p: AgentPod, pod: dict, vllm: dict) -> None:
        """A pod of an elastic group: its ranks join the group's simulated protocol (engines.elastic), each
        rank's API on the pod's IP, the exporter's port with the relay (the control token read from the
        resource's Secret, as the kubelet mounts it)."""
        meta = pod["metadata"]
        local = int(vllm_flag(vllm, "--data-parallel-size-local") or 1)
        labels = meta.get("labels") or {}
        founder = labels.get(k8s_names.ELASTIC_ROLE_LABEL) == k8s_names.ELASTIC_FOUNDER
        if founder:
            launch = int(vllm_flag(vllm, "--data-parallel-size") or 1)
            first = int(labels.get(k8s_names.LWS_WORKER_INDEX_LABEL) or 0) * local
        else:  # "$((${MOE_EPLB_POD_NAME##*-} * L + DATA))": the launch size is DATA
            expr = vllm_flag(vllm, "--data-parallel-start-rank", "--data-parallel-rank") or ""
            found = re.search(r"\*\s*(\d+)\s*\+\s*(\d+)", expr)
            launch = int(found.group(2)) if found else 0
            first = launch + int(meta["name"].rsplit("-", 1)[-1]) * local
        trace = self.trace_for(p.instance)
        redundant = 0
        try:
            redundant = engine_settings(pod["spec"]).knobs.num_redundant_experts
        except (PodSpecError, ValueError):
            pass
        group = self.elastic.group((p.namespace, p.instance), launch=launch, data_local=local,
                                   max_data=int(vllm_flag(vllm, "--elastic-ep-max-dp-size") or launch),
                                   experts=trace.num_experts, redundant=redundant)
        token_file = await self._token_file(p)
        p.elastic = ElasticPod(group, p.name, p.ip, tuple(range(first, first + local)), exporter_port=p.port or 9400,
                               token_file=token_file)
        p.elastic.start()
        group.attach(p.name, p.elastic.ranks, founder=founder)

    async def _token_file(self, p: AgentPod) -> str | None:
        """The pod's control token as the kubelet mounts it: the resource's Secret, in a file."""
        try:
            secret = await self.cluster.request(
                "GET", f"/api/v1/namespaces/{p.namespace}/secrets/{k8s_names.control_secret_name(p.instance)}")
        except aiohttp.ClientResponseError:
            return None
        data = (secret.get("data") or {}).get(k8s_names.CONTROL_TOKEN_KEY)
        if not data:
            return None
        path = os.path.join(tempfile.gettempdir(), f"moe-eplb-sim-token-{p.uid}")
        with open(path, "w", encoding="utf-8") as f:
            f.write(base64.b64decode(data).decode())
        return path

    def _stop_elastic(self, p: AgentPod) -> None:
        if p.elastic is not None:
            p.elastic.stop()
            p.elastic.group.detach(p.name)
            p.elastic = None

    def _advance(self, p: AgentPod) -> None:
        self.advance_crash(p, self.clock.now())
        if p.ready and not p.ready_since:
            p.ready_since = _now()

    async def _probe(self, p: AgentPod) -> None:
        """Run the pod's liveness probe once its engine has started; restart the container when it
        fails ``failureThreshold`` times: ``restartCount`` + 1 (which makes LeaderWorkerSet recreate
        a group), and a Deployment pod's engine starts again."""
        if p.prober is None or p.crash or p.engine is None or not p.engine.ready:
            return
        p.prober.started()
        failure = await p.prober.step(p.ip)
        if failure is None:
            return
        log.info("node agent: pod %s/%s: %s; restarting its container", p.namespace, p.name, failure)
        p.restarts += 1
        p.last_termination = {"terminated": {"reason": "Error", "exitCode": 137, "message": failure}}
        if p.group is None:  # a Deployment pod: its engine starts again (a group waits for LWS)
            await p.engine.stop()
            p.engine = SimulatedEngine(self.trace_for(p.instance), p.settings, self.clock,
                                       self.engine_run(p.settings, self.pods_started, port=p.port or 0, hosts=(p.ip,)))
            await mount_engine(self.cluster, p.engine, p.namespace, p.instance, p.spec)
            await p.engine.start()
            p.ready_since = ""

    def stick(self, namespace: str, pod: str) -> None:
        """Make the worker of pod ``pod`` hang in a forward pass (its liveness path fails; tests)."""
        p = next(p for p in self.pods.values() if (p.namespace, p.name) == (namespace, pod))
        if p.engine is None:
            raise ValueError(f"pod {namespace}/{pod} runs no engine")
        p.engine.stuck.add(p.worker)

    async def _write_status(self, p: AgentPod) -> None:
        last = p.last_termination
        if p.crash and p.restarts and p.group is not None:
            # restarted and running again (about to fail) when LWS sees the restart and recreates the
            # group (RecreateGroupOnPodRestart), as the emulation shows it (moe_eplb_harness/emulated/kubelet.py)
            state = {"running": {"startedAt": p.created_at}}
            last = {"terminated": {"reason": "Error", "exitCode": 1, "message": "simulated crash at start-up"}}
        elif p.crash:
            state = {"waiting": {"reason": "CrashLoopBackOff" if p.restarts else "ContainerCreating",
                                 "message": "simulated crash at start-up"}}
        else:
            state = {"running": {"startedAt": p.created_at}}
        ready = "True" if p.ready else "False"
        since = p.ready_since or p.created_at
        status = {
            "phase": "Running", "podIP": p.ip, "podIPs": [{"ip": p.ip}], "hostIP": "127.0.0.1",
            "conditions": [{"type": "PodScheduled", "status": "True"},
                           {"type": "Initialized", "status": "True"},
                           {"type": "Ready", "status": ready, "lastTransitionTime": since},
                           {"type": "ContainersReady", "status": ready, "lastTransitionTime": since}],
            "containerStatuses": [{"name": "vllm", "ready": p.ready, "restartCount": p.restarts,
                                   "started": not p.crash, "state": state, "image": "simulated",
                                   "imageID": "simulated", "containerID": f"simulated://{p.uid}",
                                   **({"lastState": last} if last else {})}],
        }
        if status != p.status_sent:
            try:
                await self.cluster.request("PATCH", f"/api/v1/namespaces/{p.namespace}/pods/{p.name}/status",
                                           {"status": status}, content_type="application/merge-patch+json")
            except aiohttp.ClientResponseError as exc:
                if exc.status != 404:
                    raise
            p.status_sent = status

    async def _finish(self, meta: Mapping[str, Any], p: AgentPod | None) -> None:
        """The kubelet's side of a graceful deletion: stop the container, then remove the object."""
        if p is not None:
            if p.engine is not None and p.group is None:  # a group's engine stops with the group
                await p.engine.stop()
            self._stop_elastic(p)
            self.pods.pop(p.uid, None)
        try:
            await self.cluster.request("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                       {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                                        "preconditions": {"uid": meta["uid"]}})
        except aiohttp.ClientResponseError as exc:
            if exc.status not in (404, 409):
                raise

    # --- LeaderWorkerSet groups --------------------------------------------------------------------
    async def _reconcile_groups(self, replicas: Mapping[tuple[str, ...], int]) -> None:
        """Stop the engine of a group whose pods changed; start one for a group that is whole."""
        by_key: dict[tuple[str, str, int], dict[int, AgentPod]] = {}
        for p in self.pods.values():
            if p.group is not None:
                by_key.setdefault(p.group, {})[p.worker] = p
        for key, g in list(self.groups.items()):
            members = {w: p.uid for w, p in by_key.get(key, {}).items()}
            if g.engine is not None and g.engine.ft is not None and await ft_groups.keep_serving(self, key, g, members):
                continue  # fault tolerance: the survivors serve on (moe_eplb_harness.real.ft_groups)
            if members != g.members:  # a pod left or was replaced: the group restarts together
                if g.engine is not None:
                    await g.engine.stop()
                del self.groups[key]
                for p in by_key.get(key, {}).values():
                    p.engine, p.settings, p.crash, p.ready_since = None, None, False, ""
        for key, pods in by_key.items():
            if key in self.groups:
                continue
            size = next(iter(pods.values())).size
            if sorted(pods) != list(range(size)) or len({p.hash for p in pods.values()}) != 1:
                continue  # not whole yet (or old and new revisions mixed while one goes away)
            await self._start_group(key, [pods[w] for w in range(size)], replicas.get(("lws", key[0], key[1]), 1))

    async def _start_group(self, key: tuple[str, str, int], pods: list[AgentPod], replicas: int) -> None:
        leader, size = pods[0], len(pods)
        settings = None
        try:
            each = [engine_settings(p.spec, share=1.0 / max(1, replicas), num_groups=self.groups_for(leader.instance))
                    for p in pods]
            if any(s != each[0] for s in each[1:]):
                raise ValueError("the leader's and the workers' engine arguments differ")
            settings = dataclasses.replace(each[0], num_nodes=size)
        except (PodSpecError, ValueError) as exc:
            log.warning("node agent: group %s/%s-%d cannot run: %s", *key, exc)
            settings = None
        crashing = {p.worker for p in pods if settings is None or self.crash_if(settings)
                    or self.crash_pod_if(settings, p.worker)}
        engine = None
        if not crashing:
            try:
                engine = SimulatedEngine(self.trace_for(leader.instance), settings, self.clock,
                                         self.engine_run(settings, self.pods_started, port=leader.port or 0, pods=size,
                                                         hosts=tuple(p.ip for p in pods),
                                                         api_port=self._api_port(leader.spec)))
                await mount_engine(self.cluster, engine, leader.namespace, leader.instance, leader.spec)
                await engine.start()
                await ft_groups.attach(self, engine, pods)
            except (ValueError, OSError) as exc:  # vLLM fails at start-up: every pod of the group
                log.warning("node agent: group %s/%s-%d crashes: %s", *key, exc)
                engine, crashing = None, {p.worker for p in pods}
        self.groups[key] = AgentGroup({p.worker: p.uid for p in pods}, engine)
        for p in pods:
            p.settings, p.engine, p.crash = settings, engine, p.worker in crashing
            p.next_restart = self.clock.now() + CRASH_BACKOFF_SECONDS

    # --- what Prometheus scrapes -------------------------------------------------------------------
    def targets(self) -> list[dict]:
        """Ready pods: ``[{namespace, pod, moeinference, host, port, hash}]`` (for scrape configs);
        pods of an LWS group also carry the group labels a PodMonitor copies (``replica_group``,
        ``group_worker``, ``group_size``)."""
        out = []
        for p in self.pods.values():
            if not (p.ready and p.engine is not None and p.port):
                continue
            t = {"namespace": p.namespace, "pod": p.name, "moeinference": p.instance, "host": p.ip,
                 "port": p.port, "hash": p.hash}
            if p.group is not None:
                t.update({metric_names.GROUP_LABEL: str(p.group[2]), metric_names.GROUP_WORKER_LABEL: str(p.worker),
                          metric_names.GROUP_SIZE_LABEL: str(p.size)})
            out.append(t)
        return sorted(out, key=lambda x: (x["namespace"], x["pod"]))

    def engines(self, instance: str | None = None) -> list[SimulatedEngine]:
        """The running engines (one per Deployment pod, one per LWS group), of one MoEInference or all."""
        out: dict[int, SimulatedEngine] = {}
        for p in self.pods.values():
            if p.engine is not None and instance in (None, p.instance):
                out.setdefault(id(p.engine), p.engine)
        for g in self.groups.values():  # a group whose pods all went already
            if g.engine is not None and instance is None:
                out.setdefault(id(g.engine), g.engine)
        return list(out.values())


class RealNodes:
    """The kubelet side of a simulated cluster on a real control plane, with the calls the demo and
    the tests use on :class:`~moe_eplb_harness.emulated.kubelet.FakeKubelet`: the :class:`NodeAgent` runs the
    pods of Deployments and, with the real LeaderWorkerSet controller, of LWS groups; ``lws``: the
    FakeKubelet in LWS-only mode when the emulated LeaderWorkerSet controller runs instead (the real
    one not built), else ``None``."""

    def __init__(self, agent: NodeAgent, lws: Any = None) -> None:
        self.agent, self.lws = agent, lws

    async def start(self) -> None:
        """The agent (its Nodes registered), then the LWS stand-in."""
        await self.agent.start()
        if self.lws is not None:
            await self.lws.start()

    async def stop(self) -> None:
        if self.lws is not None:
            await self.lws.stop()
        await self.agent.stop()

    @property
    def pods_created(self) -> int:
        return self.agent.pods_started + (self.lws.pods_created if self.lws else 0)

    def engines(self, instance: str | None = None) -> list[SimulatedEngine]:
        return self.agent.engines(instance) + (self.lws.engines(instance) if self.lws else [])

    def set_true_cost(self, true_cost: Any) -> None:
        """The deployment's truth from now on, for the agent's engines and the LWS stand-in's."""
        for kubelet in (self.agent, self.lws):
            if kubelet is not None:
                kubelet.set_true_cost(true_cost)

    def running(self) -> list[tuple[str, Any]]:
        return [(p.instance, p) for p in self.agent.pods.values()] + (self.lws.running() if self.lws else [])

    def targets(self) -> list[dict]:
        mine = self.agent.targets() + (self.lws.targets() if self.lws else [])
        return sorted(mine, key=lambda x: (x["namespace"], x["pod"]))
