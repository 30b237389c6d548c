"""SIMULATED kubelet and Deployment controller, for tests and ``moe-eplb demo``. Not Kubernetes.

It watches (polls) the Deployments that moe-eplb manages in an emulated Kubernetes API
(``moe_eplb.sim.kubeapi``; any API server reachable over plain HTTP works) and, for each:

- runs one :class:`~moe_eplb.sim.engine.SimulatedEngine` per pod, with the EPLB settings parsed
  from the pod template's vLLM arguments (``--enable-eplb``, ``--eplb-config`` JSON or the old flat
  flags, ``--tensor-parallel-size`` x ``--data-parallel-size``), so a tuner change rolls pods that
  really behave differently;
- creates the Pod objects (``podIP: 127.0.0.1``, the container port named ``eplb-metrics`` set to
  the engine's real port, the template's labels and annotations, an ownerReference to the
  Deployment) and keeps their status (Ready once the engine has loaded; ``CrashLoopBackOff`` with a
  growing ``restartCount`` for a crash-looping pod);
- rolls pods like the Deployment controller's RollingUpdate: never more than ``replicas +
  maxSurge`` pods, never fewer than ``replicas - maxUnavailable`` ready ones, new pods first, old
  pods removed as new ones become ready;
- writes the Deployment's status (``observedGeneration``, ``replicas``, ``updatedReplicas``,
  ``readyReplicas``, ``availableReplicas``, ``unavailableReplicas``, conditions).

Crash loops are emulated for the tests: ``crash_if(settings) -> bool`` decides which settings make
the engine exit at start-up. ``faults_for(settings)`` can inject engine faults (see
:class:`~moe_eplb.sim.engine.EngineFaults`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import secrets
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp

from moe_eplb import k8s_names
from moe_eplb.api.knobs import VLLM_DEFAULTS, Knobs, KnobsError
from moe_eplb.eplb.trace import LoadTrace
from moe_eplb.sim.engine import EngineFaults, EngineSettings, SimClock, SimulatedEngine

log = logging.getLogger(__name__)

MANAGED_SELECTOR = "app.kubernetes.io/managed-by=moe-eplb"
CRASH_BACKOFF_SECONDS = 10.0  # simulated seconds before the first restart; doubles, capped at 300


class PodSpecError(ValueError):
    """The pod template does not say how to run the simulated engine."""


def _tokens(container: dict) -> list[str]:
    raw = list(container.get("command") or []) + list(container.get("args") or [])
    out: list[str] = []
    for tok in raw:
        if isinstance(tok, str) and (" --" in tok or tok.startswith("vllm ")) and "{" not in tok:
            out += shlex.split(tok)  # a `sh -c "vllm serve ..."` command line
        else:
            out.append(str(tok))
    return out


def _flag(tokens: list[str], *flags: str) -> str | None:
    for i, tok in enumerate(tokens):
        for f in flags:
            if tok == f and i + 1 < len(tokens):
                return tokens[i + 1]
            if tok.startswith(f + "="):
                return tok[len(f) + 1:]
    return None


def engine_settings(pod_spec: dict, *, share: float = 1.0, num_groups: int = 1) -> EngineSettings:
    """EPLB settings of the vLLM container in ``pod_spec`` (a Pod template's ``spec``).

    Raises:
        PodSpecError: no container runs ``vllm serve``, or its EPLB arguments are malformed.
    """
    for c in pod_spec.get("containers") or []:
        toks = _tokens(c)
        if "serve" not in toks:
            continue
        i = toks.index("serve")
        model = _flag(toks, "--served-model-name") or _flag(toks, "--model") or (
            toks[i + 1] if i + 1 < len(toks) and not toks[i + 1].startswith("-") else "model")
        tp = int(_flag(toks, "--tensor-parallel-size", "-tp") or 1)
        dp = int(_flag(toks, "--data-parallel-size", "-dp") or 1)
        enabled = "--enable-eplb" in toks
        w, iv, r = VLLM_DEFAULTS.window_size, VLLM_DEFAULTS.step_interval, VLLM_DEFAULTS.num_redundant_experts
        cfg = _flag(toks, "--eplb-config")
        if cfg is not None:
            try:
                d = json.loads(cfg)
            except json.JSONDecodeError as exc:
                raise PodSpecError(f"--eplb-config: not JSON ({exc})") from exc
            w, iv, r = int(d.get("window_size", w)), int(d.get("step_interval", iv)), int(d.get("num_redundant_experts", r))
        w = int(_flag(toks, "--eplb-window-size") or w)
        iv = int(_flag(toks, "--eplb-step-interval") or iv)
        r = int(_flag(toks, "--num-redundant-experts") or r)
        try:
            knobs = Knobs(w, iv, r)
        except KnobsError as exc:
            raise PodSpecError(f"EPLB arguments: {exc}") from exc
        return EngineSettings(model=model, ep_size=tp * dp, knobs=knobs, eplb_enabled=enabled,
                              num_groups=num_groups, share=share)
    raise PodSpecError("no container runs `vllm serve`")


def _int_or_percent(value: Any, total: int, *, round_up: bool) -> int:
    if value is None:
        return 0
    if isinstance(value, str) and value.endswith("%"):
        x = total * float(value[:-1]) / 100.0
        return int(math.ceil(x) if round_up else math.floor(x))
    return int(value)


def template_hash(template: dict) -> str:
    """Like the Deployment controller's ``pod-template-hash``: a digest of the pod template."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


@dataclass
class SimPod:
    name: str
    hash: str
    settings: EngineSettings | None
    engine: SimulatedEngine | None
    crash: bool
    created: float  # simulated time
    restarts: int = 0
    next_restart: float = 0.0
    ready: bool = False
    deleted: bool = False
    status_sent: dict = field(default_factory=dict)


@dataclass
class _Deploy:
    namespace: str
    name: str
    uid: str
    instance: str = ""  # the MoEInference (pod label eplb.ai/name)
    pods: dict[str, SimPod] = field(default_factory=dict)
    status_sent: dict = field(default_factory=dict)


class FakeKubelet:
    """Runs simulated engine pods for the moe-eplb Deployments of an API server (see module doc).

    Args:
        api_url: base URL of the API server (no auth, as the emulation serves it).
        workload: the trace every engine replays (global, following ``clock``).
        clock: shared simulated time.
        startup_seconds: simulated model-loading time of a pod.
        namespace: only this namespace (None: all).
        crash_if: settings -> True when a pod with them crash-loops.
        faults_for: settings -> engine faults to inject.
        num_groups: expert groups of the model (hierarchical policy), default 1.
        poll: wall seconds between reconciliations.
        on_change: called with :meth:`targets` whenever the set of ready pods changes.
        true_cost: the deployment's true cost parameters the engines' telemetry comes from
            (:class:`moe_eplb.sim.telemetry.TrueCost`; hidden from the operator).
    """

    def __init__(self, api_url: str, workload: LoadTrace, clock: SimClock, *, startup_seconds: float = 120.0,
                 namespace: str | None = None, crash_if: Callable[[EngineSettings], bool] | None = None,
                 faults_for: Callable[[EngineSettings], EngineFaults] | None = None, num_groups: int = 1,
                 poll: float = 0.1, engine_tick: float = 0.1,
                 on_change: Callable[[list[dict]], Any] | None = None, true_cost: Any = None) -> None:
        self.true_cost = true_cost
        self.url = api_url.rstrip("/")
        self.workload, self.clock = workload, clock
        self.startup_seconds = startup_seconds
        self.namespace = namespace
        self.crash_if = crash_if or (lambda s: False)
        self.faults_for = faults_for or (lambda s: EngineFaults())
        self.num_groups = num_groups
        self.poll, self.engine_tick = poll, engine_tick
        self.on_change = on_change
        self.deployments: dict[tuple[str, str], _Deploy] = {}
        self.pods_created = 0
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._last_targets: list[dict] | None = None

    # --- HTTP --------------------------------------------------------------------------------------

    async def _req(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Any:
        assert self._session is not None
        data = None if body is None else json.dumps(body)
        async with self._session.request(method, self.url + path, data=data,
                                         headers={"Content-Type": ctype}) as resp:
            payload = await resp.json(content_type=None)
            if resp.status == 404 and method in ("DELETE", "PATCH"):
                return None
            if resp.status >= 400:
                raise aiohttp.ClientResponseError(resp.request_info, resp.history, status=resp.status,
                                                  message=json.dumps(payload)[:500])
            return payload

    def _deploy_path(self, ns: str, name: str | None = None) -> str:
        base = f"/apis/apps/v1/namespaces/{ns}/deployments"
        return f"{base}/{name}" if name else base

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        # short timeouts and no keep-alive: a stalled request is retried on the next pass
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0),
                                              connector=aiohttp.TCPConnector(force_close=True))
        self._task = asyncio.create_task(self._run(), name="fake-kubelet")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for d in self.deployments.values():
            for p in d.pods.values():
                if p.engine:
                    await p.engine.stop()
        self.deployments.clear()
        if self._session:
            await self._session.close()

    async def __aenter__(self) -> "FakeKubelet":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def _run(self) -> None:
        while True:
            try:
                await self.reconcile_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a transient API error must not kill the simulation
                log.warning("fake kubelet: %s", exc)
            await asyncio.sleep(self.poll)

    # --- reconciliation ----------------------------------------------------------------------------

    async def reconcile_once(self) -> None:
        path = f"/apis/apps/v1/namespaces/{self.namespace}/deployments" if self.namespace else "/apis/apps/v1/deployments"
        async with self._session.get(self.url + path, params={"labelSelector": MANAGED_SELECTOR}) as resp:
            items = (await resp.json(content_type=None)).get("items", []) if resp.status < 400 else []
        seen = set()
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
        targets = self.targets()
        if targets != self._last_targets:
            self._last_targets = targets
            if self.on_change:
                r = self.on_change(targets)
                if asyncio.iscoroutine(r):
                    await r

    def targets(self) -> list[dict]:
        """Ready pods: ``[{namespace, pod, moeinference, port, hash}]`` sorted (for scrape configs)."""
        out = []
        for d in self.deployments.values():
            for p in d.pods.values():
                if p.ready and p.engine is not None:
                    out.append({"namespace": d.namespace, "pod": p.name, "moeinference": d.instance or d.name,
                                "port": p.engine.port, "hash": p.hash})
        return sorted(out, key=lambda x: (x["namespace"], x["pod"]))

    async def _remove_all(self, d: _Deploy, delete_objects: bool = True) -> None:
        for p in list(d.pods.values()):
            await self._delete_pod(d, p, delete_object=delete_objects)

    async def _delete_pod(self, d: _Deploy, p: SimPod, delete_object: bool = True) -> None:
        if p.engine:
            await p.engine.stop()
            p.engine = None
        p.ready = False
        d.pods.pop(p.name, None)
        if delete_object:
            await self._req("DELETE", f"/api/v1/namespaces/{d.namespace}/pods/{p.name}")

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
            if p.crash:
                if now >= p.next_restart:
                    p.restarts += 1
                    p.next_restart = now + min(300.0, CRASH_BACKOFF_SECONDS * 2 ** p.restarts)
            elif p.engine is not None:
                p.ready = p.engine.ready

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
            await self._write_pod_status(d, p)
        await self._write_deploy_status(d, dep, h, want)

    async def _create_pod(self, d: _Deploy, dep: dict, h: str, replicas: int) -> None:
        template = (dep["spec"].get("template") or {})
        tmd = template.get("metadata") or {}
        pod_spec = json.loads(json.dumps(template.get("spec") or {}))
        name = f"{d.name}-{h[:8]}-{secrets.token_hex(3)}"
        try:
            settings = engine_settings(pod_spec, share=1.0 / max(1, replicas), num_groups=self.num_groups)
        except (PodSpecError, ValueError) as exc:
            log.warning("fake kubelet: pod %s cannot run: %s", name, exc)
            settings = None
        crash = settings is None or bool(self.crash_if(settings))
        engine = None
        if not crash:
            try:
                engine = SimulatedEngine(self.workload, settings, self.clock, startup_seconds=self.startup_seconds,
                                         tick=self.engine_tick, faults=self.faults_for(settings),
                                         true_cost=self.true_cost,
                                         seed=self.pods_created)
                await engine.start()
            except ValueError as exc:  # e.g. experts + redundant not divisible: vLLM fails at start-up
                log.warning("fake kubelet: pod %s crashes: %s", name, exc)
                engine, crash = None, True
        for c in pod_spec.get("containers") or []:
            for port in c.get("ports") or []:
                if port.get("name") == k8s_names.EXPORTER_PORT_NAME and engine is not None:
                    port["containerPort"] = engine.port
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
            "spec": pod_spec,
        }
        await self._req("POST", f"/api/v1/namespaces/{d.namespace}/pods", body)

    async def _write_pod_status(self, d: _Deploy, p: SimPod) -> None:
        cname = "vllm"
        if p.crash:
            state = {"waiting": {"reason": "CrashLoopBackOff" if p.restarts else "ContainerCreating",
                                 "message": "simulated crash at start-up"}}
        elif p.ready:
            state = {"running": {}}
        else:
            state = {"running": {}}
        status = {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "hostIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if p.ready else "False"},
                           {"type": "ContainersReady", "status": "True" if p.ready else "False"}],
            "containerStatuses": [{"name": cname, "ready": p.ready, "restartCount": p.restarts,
                                   "started": not p.crash, "state": state, "image": "simulated"}],
        }
        if status != p.status_sent:
            await self._req("PATCH", f"/api/v1/namespaces/{d.namespace}/pods/{p.name}/status",
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
