"""Child objects of a MoEInference: exactly what the operator applies (pure, no I/O).

:func:`render_children` returns, in apply order: Service, the workload (a Deployment when
``parallelism.nodes == 1``, else a LeaderWorkerSet whose groups run native vLLM data parallel;
during an experiment the two arms, :mod:`moe_eplb.render.experiment`),
PodDisruptionBudget, a PodMonitor when ``monitoring.podMonitor.enabled``, and the autoscaler (a KEDA
ScaledObject or a HorizontalPodAutoscaler, :mod:`moe_eplb.render.autoscaler`) when
``spec.autoscaling`` is on; first, where the engine pods run the exporter, the live-settings
ConfigMap (:func:`live_configmap`: the window and interval applied live, for pods that restart). The
chat template is mounted from the user's ConfigMap. The control Secret the engine pods
mount (:func:`control_secret`) is made once by the reconciler, outside this list: its token is random.

Every child carries the pinned labels, ``metadata.namespace`` (when the resource has one) and an
ownerReference to the MoEInference (when ``metadata.uid`` is present). The pod template carries
the annotation ``eplb.ai/eplb-config-hash`` of the effective EPLB settings, so a change of those
settings rolls the pods while a change of ``replicas`` does not.
"""

from __future__ import annotations

import base64
import copy
import math
from typing import Any

from moe_eplb import __version__
from moe_eplb.api.layout import SUPERVISOR_PORT, SUPERVISOR_PORT_NAME, PodLaunch
from moe_eplb.api.spec import EplbSettings, MoEInference
from moe_eplb.contracts import k8s_names, live_protocol, metric_names
from moe_eplb.contracts.k8s_names import (
    API,
    API_PORT,
    API_PORT_NAME,
    CONFIG_HASH_ANNOTATION,
    ENGINE_CONTAINER,
    EXPORTER_INIT_CONTAINER,
    EXPORTER_INJECT_DIR,
    EXPORTER_PLUGIN,
    EXPORTER_VOLUME,
    KIND,
    LWS_API_VERSION,
    LWS_WORKER_INDEX_LABEL,
    OPERATOR_IMAGE_REPOSITORY,
    PODMONITOR_API_VERSION,
)
from moe_eplb.render import control_key, elastic, experiment
from moe_eplb.render.autoscaler import autoscaler
from moe_eplb.render.engine_args import (
    CHAT_TEMPLATE_DIR,
    engine_args,
    engine_script,
    multinode_leader_args,
    multinode_worker_args,
    multinode_worker_script,
    termination_grace_seconds,
)
from moe_eplb.render.labels import labels, selector_labels
from moe_eplb.render.overlay import merge_pod_template

HEALTH_PATH = "/health"
PROBE_PERIOD_SECONDS = 10
#: the engine container's command where it serves the API: a fixed script that cleans /dev/shm and
#: execs ``vllm serve`` with the container ``args`` ("vllm" is the script's $0)
API_COMMAND = ["/bin/sh", "-c", engine_script(), "vllm"]
SCRAPE_INTERVAL = f"{k8s_names.SCRAPE_INTERVAL_SECONDS}s"


def render_children(inf: MoEInference) -> list[dict[str, Any]]:
    """All child objects of a parsed (valid) MoEInference, in apply order, with the effective EPLB
    settings (the tuner's override when it applies, :attr:`MoEInference.effective`)."""
    eplb = inf.effective
    owner = owner_reference(inf)
    children: list[dict[str, Any]] = [live_configmap(inf)] if inf.exporter_in_pod else []
    children.append(service(inf))
    children.extend(workloads(inf, eplb))
    children.append(pod_disruption_budget(inf))
    if inf.monitoring.pod_monitor:
        children.append(pod_monitor(inf))
    scaler = autoscaler(inf)
    if scaler is not None:
        children.append(scaler)
    if inf.elastic_enabled:
        children.append(elastic.network_policy(inf))
    for child in children:
        if inf.namespace:
            child["metadata"]["namespace"] = inf.namespace
        if owner:
            child["metadata"]["ownerReferences"] = [dict(owner)]
    return children


def control_secret(inf: MoEInference, token: str) -> dict[str, Any]:
    """The Secret holding the operator's control token (``<name>-control``, key ``token``), mounted
    into every engine container: a request that changes a running engine carries it. Not one of
    :func:`render_children`: the token is random, so the reconciler creates the Secret once (with a
    token it draws) and never patches it; deleting it rotates the token."""
    meta: dict[str, Any] = _meta(inf, k8s_names.control_secret_name(inf.name))
    if inf.namespace:
        meta["namespace"] = inf.namespace
    owner = owner_reference(inf)
    if owner:
        meta["ownerReferences"] = [owner]
    data = base64.b64encode(token.encode()).decode()
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
            "data": {k8s_names.CONTROL_TOKEN_KEY: data}}


def live_configmap(inf: MoEInference) -> dict[str, Any]:
    """The ConfigMap ``<name>-eplb-live``: ``status.autotune.live`` (the window and interval the
    operator applied live, the template's config hash they were applied on, the step they took
    effect) as JSON under ``settings.json``, ``{}`` without one. Every engine pod mounts it (optional)
    and each worker applies it at start when the hash is its own template's (``moe_eplb.exporter.live``),
    so a restarted pod comes back with the values in force; changing it never changes the pod template."""
    import json

    rec = inf.status.live
    data = {} if rec is None else {
        live_protocol.FILE_WINDOW: rec.window_size, live_protocol.FILE_INTERVAL: rec.step_interval,
        live_protocol.FILE_HASH: rec.config_hash, live_protocol.FILE_STEP: rec.step}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(inf, k8s_names.live_configmap_name(inf.name)),
            "data": {k8s_names.LIVE_FILE_KEY: json.dumps(data, sort_keys=True)}}


def workloads(inf: MoEInference, eplb: EplbSettings) -> list[dict[str, Any]]:
    """The engine workload: a Deployment or a LeaderWorkerSet; while an experiment runs
    (``status.autotune.experiment``), its two arms (:mod:`moe_eplb.render.experiment`)."""
    exp = inf.status.experiment if inf.eplb.enabled else None
    if inf.elastic_enabled:  # one group: founders (LWS) and the pods that join them (render.elastic)
        return [leader_worker_set(inf, eplb), elastic.joiner_stateful_set(inf, eplb, pod_template)]
    if exp is not None and not experiment.renders_arms(exp):
        exp = None  # an interleaved experiment (live, the same pods) or a pre-period: the workload as it is
    if inf.parallelism.nodes == 1:
        return [deployment(inf, eplb)] if exp is None else experiment.deployment_arms(inf, exp, deployment)
    return [leader_worker_set(inf, eplb)] if exp is None else experiment.lws_arms(inf, exp, leader_worker_set)


def owner_reference(inf: MoEInference) -> dict[str, Any] | None:
    """Controller ownerReference to the MoEInference, or None without ``metadata.uid``."""
    if not inf.uid:
        return None
    return {
        "apiVersion": API,
        "kind": KIND,
        "name": inf.name,
        "uid": inf.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def endpoint(inf: MoEInference) -> str:
    """In-cluster URL of the OpenAI-compatible API (for ``status.endpoint``)."""
    return f"http://{inf.name}.{inf.namespace or 'default'}.svc:{API_PORT}"


def _meta(inf: MoEInference, name: str | None = None) -> dict[str, Any]:
    return {"name": name or inf.name, "labels": labels(inf.name)}


def _workload_meta(inf: MoEInference) -> dict[str, Any]:
    """The workload object's metadata: ``spec.workload.metadata`` (Kueue's queue label, LeaderWorkerSet's
    exclusive-topology annotation, ...) with the operator's labels, which cannot be overridden."""
    meta = _meta(inf)
    w = inf.spec.workload
    meta["labels"] = {**w.labels, **meta["labels"]}
    if w.annotations:
        meta["annotations"] = dict(w.annotations)
    return meta


# --- pods -----------------------------------------------------------------------------------------


def _env(inf: MoEInference, role: str = k8s_names.ROLE_API, pod: PodLaunch | None = None,
         config_hash: str | None = None) -> list[dict[str, Any]]:
    user = [dict(e) for e in inf.engine.env]
    plugins = [EXPORTER_PLUGIN] if inf.exporter_in_pod else []  # a stock engine: vLLM's own plugin choice
    for e in user:
        if e.get("name") == "VLLM_PLUGINS" and e.get("value"):
            plugins = [p for p in e["value"].split(",") if p and p != EXPORTER_PLUGIN] + plugins
    env: list[dict[str, Any]] = [{"name": "VLLM_PLUGINS", "value": ",".join(plugins)}] if plugins else []
    merged = {"VLLM_PLUGINS"} if plugins else set()
    if inf.engine.exporter.inject:
        # the injected plugin first on Python's path, the user's PYTHONPATH (if any) after it
        paths = [EXPORTER_INJECT_DIR] + [e["value"] for e in user if e.get("name") == "PYTHONPATH" and e.get("value")]
        env.append({"name": "PYTHONPATH", "value": ":".join(paths)})
        merged.add("PYTHONPATH")
    tok = inf.model.hf_token_secret
    if tok:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": tok.name, "key": tok.key}}})
    pvc = inf.model.pvc
    if pvc and not inf.model.name.startswith("/"):
        env.append({"name": "HF_HOME", "value": pvc.mount_path})
    # what the exporter's health endpoints need: whose requests to drain, for how long
    # (the operator's: a user's entry of the same name is left out, spec.engine.drainSeconds sets it)
    env += [{"name": k8s_names.ENGINE_ROLE_ENV, "value": role},
            {"name": k8s_names.DRAIN_SECONDS_ENV, "value": str(inf.engine.drain_seconds)},
            # where the exporter finds the token of the operator's control requests (control_secret)
            {"name": k8s_names.CONTROL_TOKEN_FILE_ENV, "value": k8s_names.CONTROL_TOKEN_FILE}]
    merged |= {k8s_names.ENGINE_ROLE_ENV, k8s_names.DRAIN_SECONDS_ENV, k8s_names.API_PORTS_ENV,
               k8s_names.CONTROL_TOKEN_FILE_ENV}
    if pod is not None and len(pod.api_servers) > 1:  # several API servers: health and drain follow all
        env.append({"name": k8s_names.API_PORTS_ENV, "value": ",".join(map(str, pod.api_ports))})
    token = control_key.env(inf)  # the control token among vLLM's API keys, where the user has a key
    env += token
    merged |= {e["name"] for e in token}
    if inf.exporter_in_pod and config_hash is not None:
        # the live-settings file (live_configmap) and the template it must have been written for
        env += [{"name": k8s_names.LIVE_FILE_ENV, "value": k8s_names.LIVE_FILE},
                {"name": k8s_names.CONFIG_HASH_ENV, "value": config_hash}]
        merged |= {k8s_names.LIVE_FILE_ENV, k8s_names.CONFIG_HASH_ENV}
    return env + [e for e in user if e.get("name") not in merged]


def exporter_image(inf: MoEInference) -> str:
    """The image the init container copies the exporter plugin from: ``spec.engine.exporter.image``,
    else the operator's own image of this version."""
    return inf.engine.exporter.image or f"{OPERATOR_IMAGE_REPOSITORY}:{__version__}"


def _exporter_init_container(inf: MoEInference) -> dict[str, Any]:
    """Copies the exporter plugin and its entry point into the shared volume (the engine finds it
    through PYTHONPATH and VLLM_PLUGINS; see moe_eplb.exporter.inject)."""
    return {
        "name": EXPORTER_INIT_CONTAINER,
        "image": exporter_image(inf),
        "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-m", "moe_eplb.exporter.inject", EXPORTER_INJECT_DIR],
        "volumeMounts": [{"name": EXPORTER_VOLUME, "mountPath": EXPORTER_INJECT_DIR}],
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
    }


def _resources(inf: MoEInference) -> dict[str, Any]:
    gpus, name = inf.parallelism.gpus_per_pod, inf.engine.gpu_resource_name
    res = {k: dict(v) for k, v in (inf.engine.resources or {}).items() if isinstance(v, dict)}
    limits = res.setdefault("limits", {})
    limits[name] = gpus
    if "requests" in res:
        res["requests"][name] = gpus
    return res


def _probe(get: dict[str, Any], period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {"httpGet": get, "periodSeconds": period, "timeoutSeconds": timeout, "failureThreshold": failures}


def _probes(inf: MoEInference, pod: PodLaunch) -> dict[str, Any]:
    """Probes of an engine container (see docs/operator.md, "Pod health").

    A pod that serves the API waits for vLLM's ``/health`` (startup; with several API servers, the
    multi-port supervisor's ``/health``, which answers 200 once every one of them is ready); a
    worker for its exporter. With the exporter in the pod, readiness and liveness are its own
    (``moe_eplb.exporter.health``): readiness fails while the pod drains (so the Service stops
    routing to it) or vLLM's ``/health`` fails (on any of the pod's API ports); liveness fails when
    the engine's process is gone (the exporter ends with it) or a worker is stuck in a forward pass.
    Without it (a stock engine, ``spec.engine.exporter.inject: false``) they are vLLM's own
    ``/health`` (the supervisor's with several API servers; a headless worker has none, so only its
    process is watched). The startup probe holds both off for up to ``spec.engine.startupTimeoutSeconds``
    (model loading can take most of an hour for the largest models), on workers too.
    """
    exporter = k8s_names.EXPORTER_PORT_NAME
    vllm_health = {"path": HEALTH_PATH, "port": SUPERVISOR_PORT_NAME if pod.supervised else API_PORT_NAME}
    serves_api = bool(pod.api_servers)
    startup_failures = math.ceil(inf.engine.startup_timeout_seconds / PROBE_PERIOD_SECONDS)
    if not inf.exporter_in_pod:
        if not serves_api:
            return {}
        return {"startupProbe": _probe(vllm_health, PROBE_PERIOD_SECONDS, 5, startup_failures),
                "readinessProbe": _probe(dict(vllm_health), 10, 5, 3),
                "livenessProbe": _probe(dict(vllm_health), 30, 10, 5)}
    start = vllm_health if serves_api else {"path": k8s_names.EXPORTER_LIVE_PATH, "port": exporter}
    return {
        "startupProbe": _probe(start, PROBE_PERIOD_SECONDS, 5, startup_failures),
        "readinessProbe": _probe({"path": k8s_names.EXPORTER_READY_PATH, "port": exporter}, 10, 5, 3),
        "livenessProbe": _probe({"path": k8s_names.EXPORTER_LIVE_PATH, "port": exporter}, 30, 10, 5),
    }


def _lifecycle(inf: MoEInference) -> dict[str, Any]:
    """The preStop drain (``spec.engine.drainSeconds`` > 0, the exporter in the pod): an ``exec`` of
    ``python3 -m moe_eplb.exporter.drain`` inside the engine container, which asks the exporter on
    loopback (the only address it takes a drain from) to turn the pod unready, and returns once vLLM
    has no request in flight (a worker: once its group's leader has none, or is gone), or after
    ``drainSeconds``; SIGTERM follows. Without the exporter (a stock engine) there is no hook: vLLM's
    own graceful shutdown (``--shutdown-timeout drainSeconds``) finishes what runs."""
    if inf.engine.drain_seconds <= 0 or not inf.exporter_in_pod:
        return {}
    return {"lifecycle": {"preStop": {"exec": {"command": list(k8s_names.DRAIN_COMMAND)}}}}


def _volumes(inf: MoEInference) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    shm: dict[str, Any] = {"medium": "Memory"}
    if inf.engine.shm_size is not None:
        shm["sizeLimit"] = inf.engine.shm_size
    volumes = [{"name": "dshm", "emptyDir": shm}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    pvc = inf.model.pvc
    if pvc:
        claim = {"claimName": pvc.claim_name, "readOnly": pvc.read_only}
        volumes.append({"name": "model-storage", "persistentVolumeClaim": claim})
        mount = {"name": "model-storage", "mountPath": pvc.mount_path, "readOnly": pvc.read_only}
        if pvc.sub_path:
            mount["subPath"] = pvc.sub_path
        mounts.append(mount)
    if inf.engine.exporter.inject:
        volumes.append({"name": EXPORTER_VOLUME, "emptyDir": {}})
        mounts.append({"name": EXPORTER_VOLUME, "mountPath": EXPORTER_INJECT_DIR, "readOnly": True})
    # the operator's control token (control_secret; the default file mode, so an engine that runs as
    # any user can read it); optional, so a pod whose Secret is missing (its objects applied without
    # the operator) starts, with control requests off
    volumes.append({"name": k8s_names.CONTROL_VOLUME, "secret": {
        "secretName": k8s_names.control_secret_name(inf.name), "optional": True,
        "items": [{"key": k8s_names.CONTROL_TOKEN_KEY, "path": k8s_names.CONTROL_TOKEN_KEY}]}})
    mounts.append({"name": k8s_names.CONTROL_VOLUME, "mountPath": k8s_names.CONTROL_MOUNT_DIR, "readOnly": True})
    if inf.exporter_in_pod:  # the live settings (live_configmap; optional: a pod starts without it)
        volumes.append({"name": k8s_names.LIVE_VOLUME, "configMap": {
            "name": k8s_names.live_configmap_name(inf.name), "optional": True}})
        mounts.append({"name": k8s_names.LIVE_VOLUME, "mountPath": k8s_names.LIVE_MOUNT_DIR, "readOnly": True})
    tmpl = inf.engine.chat_template
    if tmpl:
        volumes.append(
            {"name": "chat-template", "configMap": {"name": tmpl.name, "items": [{"key": tmpl.key, "path": tmpl.key}]}}
        )
        mounts.append({"name": "chat-template", "mountPath": CHAT_TEMPLATE_DIR, "readOnly": True})
    return volumes, mounts


def _ports(inf: MoEInference, pod: PodLaunch) -> list[dict[str, Any]]:
    """The container ports: every API server of the pod (``http``, ``http-1``, ...), the multi-port
    supervisor's health port where it runs, and the exporter's where it is in the pod."""
    ports = [{"name": a.name, "containerPort": a.port, "protocol": "TCP"} for a in pod.api_servers]
    if pod.supervised:
        ports.append({"name": SUPERVISOR_PORT_NAME, "containerPort": SUPERVISOR_PORT, "protocol": "TCP"})
    if inf.exporter_in_pod:
        ports.append({"name": k8s_names.EXPORTER_PORT_NAME, "containerPort": k8s_names.EXPORTER_PORT, "protocol": "TCP"})
    return ports


def pod_template(
    inf: MoEInference, eplb: EplbSettings, *, command: list[str], args: list[str] | None, pod: PodLaunch | None = None
) -> dict[str, Any]:
    """Pod template of one engine pod of the layout (``pod``: the Deployment's pod by default; labels,
    config-hash annotation, GPUs, shm, probes, ports), with ``spec.engine.podTemplate`` merged in
    (:mod:`moe_eplb.render.overlay`)."""
    pod = pod if pod is not None else inf.layout.pods[0]
    volumes, mounts = _volumes(inf)
    role = k8s_names.ROLE_API if pod.api_servers else k8s_names.ROLE_WORKER
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": inf.engine.image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        **({"args": args} if args is not None else {}),
        "ports": _ports(inf, pod),
        "env": _env(inf, role, pod, eplb.config_hash()),
        "resources": _resources(inf),
        "volumeMounts": mounts,
        **_probes(inf, pod),
        **_lifecycle(inf),
    }
    spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": termination_grace_seconds(inf),
    }
    if inf.engine.exporter.inject:
        spec["initContainers"] = [_exporter_init_container(inf)]
    if inf.engine.node_selector:
        spec["nodeSelector"] = dict(inf.engine.node_selector)
    if inf.engine.tolerations:
        spec["tolerations"] = [dict(t) for t in inf.engine.tolerations]
    if inf.engine.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in inf.engine.image_pull_secrets]
    # spec.engine.podTemplate last: it is part of the pod template, so a change of it rolls the pods
    # (the config-hash annotation stays the EPLB settings')
    return merge_pod_template({
        "metadata": {"labels": labels(inf.name), "annotations": {CONFIG_HASH_ANNOTATION: eplb.config_hash()}},
        "spec": spec,
    }, inf.engine.pod_template)


# --- workloads ------------------------------------------------------------------------------------


def deployment(inf: MoEInference, eplb: EplbSettings) -> dict[str, Any]:
    """Single-node replica groups: one Deployment, one pod per replica group."""
    template = pod_template(inf, eplb, command=API_COMMAND, args=engine_args(inf, eplb))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _workload_meta(inf),
        "spec": {
            "replicas": inf.replicas,
            "selector": {"matchLabels": selector_labels(inf.name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": inf.rollout.max_surge, "maxUnavailable": inf.rollout.max_unavailable},
            },
            "revisionHistoryLimit": 3,
            # a rolling step waits for an old pod's drain and a new pod's start
            "progressDeadlineSeconds": inf.engine.startup_timeout_seconds + termination_grace_seconds(inf) + 600,
            "template": template,
        },
    }


def leader_worker_set(inf: MoEInference, eplb: EplbSettings) -> dict[str, Any]:
    """Multi-node replica groups: a LeaderWorkerSet; each group is ``nodes`` pods running one vLLM
    data-parallel engine (leader serves the API, workers run ``--headless``).

    With ``spec.faultTolerance`` every data-parallel rank serves its own API (vLLM refuses fault
    tolerance with its internal load balancing), so workers get the API's port, probes and drain, and
    a failed pod is not answered by recreating its group (``restartPolicy: None``): the surviving
    ranks keep serving while vLLM re-hosts the lost rank's experts.

    ``networkConfig.subdomainPolicy: UniquePerReplica`` (:data:`moe_eplb.contracts.k8s_names.LWS_SUBDOMAIN_POLICY`):
    LWS makes a headless Service ``<name>-<group>`` per group, the subdomain of its pods, and
    ``LWS_LEADER_ADDRESS`` is ``<name>-<group>.<name>-<group>.<ns>``. LWS's default (``Shared``) would
    want a headless Service ``<name>``, the client Service's name (:func:`service`): LWS skips a
    Service that exists, and the workers would never resolve their leader."""
    ft = inf.fault_tolerance.enabled
    lay = inf.layout
    common = engine_args(inf, eplb)
    leader = pod_template(inf, eplb, command=API_COMMAND, args=common + multinode_leader_args(inf), pod=lay.pods[0])
    # the worker's argv goes in `args` (expanded by Kubernetes exactly like the leader's) to a fixed
    # script; no user text is ever part of a `sh -c` string
    if len(lay.pods) > 1:
        worker = pod_template(inf, eplb, command=["/bin/sh", "-c", multinode_worker_script(inf), "vllm"],
                              args=common + multinode_worker_args(inf), pod=lay.pods[1])
    else:  # an elastic group launched in one pod: a group of size 1 (LWS still asks for a worker template)
        worker = copy.deepcopy(leader)
    if inf.elastic_enabled:  # one group; spec.replicas counts the elastic group's pods (render.elastic)
        leader, worker = elastic.mark_founders(leader), elastic.mark_founders(worker)
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": _workload_meta(inf),
        "spec": {
            "replicas": 1 if inf.elastic_enabled else inf.replicas,
            "startupPolicy": "LeaderCreated",
            # a headless Service per group (<name>-<group>), the pods' subdomain: LWS's shared one would
            # be named <name>, the client Service's name (service()), so LWS_LEADER_ADDRESS would never resolve
            "networkConfig": {"subdomainPolicy": k8s_names.LWS_SUBDOMAIN_POLICY},
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {
                    "maxSurge": inf.rollout.max_surge,
                    "maxUnavailable": inf.rollout.max_unavailable,
                    # every group on the template; an experiment holds the control groups back
                    # (render.experiment; explicit, so that the end of one sets it back)
                    "partition": 0,
                },
            },
            "leaderWorkerTemplate": {
                "size": inf.parallelism.nodes,
                "restartPolicy": "None" if ft else "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }


# --- networking, disruption, monitoring -----------------------------------------------------------


def service(inf: MoEInference) -> dict[str, Any]:
    """ClusterIP Service of every API port of the layout (``http`` 8000; with several API servers a
    pod, ``http-1`` 8001, ...: each reaches one rank of every pod) and the exporter's port; it selects
    the pods that serve an API: the leaders only for a multi-node group with vLLM's internal load
    balancing (its API dispatches to every rank), every pod when every rank serves its own."""
    lay = inf.layout
    selector = selector_labels(inf.name)
    if inf.parallelism.nodes > 1 and not lay.workers_serve_api:
        selector[LWS_WORKER_INDEX_LABEL] = "0"
    if inf.elastic_enabled:  # a shrink takes the retiring pods out first (controller.elastic)
        selector[k8s_names.SERVING_LABEL] = "true"
    ports = [{"name": a.name, "port": a.port, "targetPort": a.name, "protocol": "TCP"} for a in lay.api_ports]
    if inf.exporter_in_pod:
        ports.append({"name": k8s_names.EXPORTER_PORT_NAME, "port": k8s_names.EXPORTER_PORT,
                      "targetPort": k8s_names.EXPORTER_PORT_NAME, "protocol": "TCP"})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(inf),
        "spec": {"type": "ClusterIP", "selector": selector, "ports": ports},
    }


def pod_disruption_budget(inf: MoEInference) -> dict[str, Any]:
    """At most ``rollout.maxUnavailable`` replica groups voluntarily disrupted at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(inf),
        "spec": {
            "maxUnavailable": max(1, inf.rollout.max_unavailable) * inf.parallelism.nodes,
            "selector": {"matchLabels": selector_labels(inf.name)},
        },
    }


def pod_monitor(inf: MoEInference) -> dict[str, Any]:
    """PodMonitor scraping the exporter (``eplb-metrics``) and vLLM's own ``/metrics`` (``http``).

    Each series gets label ``moeinference`` from the pod label ``eplb.ai/name`` and ``arm`` from
    ``eplb.ai/arm`` (an experiment's trial pods; absent on the others); for a multi-node
    resource (LeaderWorkerSet) also ``replica_group``, ``group_worker`` and ``group_size`` from the
    pod's LWS group-index and worker-index labels and size annotation.
    """
    relabel = [
        {
            "sourceLabels": ["__meta_kubernetes_pod_label_" + _prom_label(k8s_names.NAME_LABEL)],
            "targetLabel": metric_names.MOEINFERENCE_LABEL,
            "action": "replace",
        },
        {  # an experiment's trial pods: the dashboard's row per arm
            "sourceLabels": ["__meta_kubernetes_pod_label_" + _prom_label(k8s_names.ARM_LABEL)],
            "targetLabel": metric_names.ARM_LABEL,
            "action": "replace",
        },
    ]
    if inf.parallelism.nodes > 1:  # so that the load reader can sum a group's pods and refuse an incomplete group
        relabel += [{"sourceLabels": [source], "targetLabel": target, "action": "replace"} for source, target in (
            ("__meta_kubernetes_pod_label_" + _prom_label(k8s_names.LWS_GROUP_INDEX_LABEL), metric_names.GROUP_LABEL),
            ("__meta_kubernetes_pod_label_" + _prom_label(k8s_names.LWS_WORKER_INDEX_LABEL),
             metric_names.GROUP_WORKER_LABEL),
            ("__meta_kubernetes_pod_annotation_" + _prom_label(k8s_names.LWS_SIZE_ANNOTATION),
             metric_names.GROUP_SIZE_LABEL))]
    endpoints = []
    if inf.exporter_in_pod:
        endpoints.append({"port": k8s_names.EXPORTER_PORT_NAME, "path": k8s_names.EXPORTER_PATH,
                          "interval": SCRAPE_INTERVAL, "relabelings": [dict(r) for r in relabel]})
    # vLLM's own /metrics on every API port: with several API servers a pod, each serves its rank's
    # engine series, so the autoscaler's query and the tuner's reader see every rank
    endpoints += [{"port": a.name, "path": "/metrics", "interval": SCRAPE_INTERVAL,
                   "relabelings": [dict(r) for r in relabel]} for a in inf.layout.api_ports]
    spec: dict[str, Any] = {"selector": {"matchLabels": selector_labels(inf.name)}, "podMetricsEndpoints": endpoints}
    if inf.namespace:
        spec["namespaceSelector"] = {"matchNames": [inf.namespace]}
    meta = _meta(inf)
    meta["labels"] = {**inf.monitoring.pod_monitor_labels, **meta["labels"]}  # ours cannot be overridden
    return {"apiVersion": PODMONITOR_API_VERSION, "kind": "PodMonitor", "metadata": meta, "spec": spec}


def _prom_label(k8s_label: str) -> str:
    """Kubernetes label name as Prometheus service discovery spells it (``eplb.ai/name`` -> ``eplb_ai_name``)."""
    return "".join(c if c.isalnum() else "_" for c in k8s_label)
