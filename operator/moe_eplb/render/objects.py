"""Child objects of a MoEInference: exactly what the operator applies (pure, no I/O).

:func:`render_children` returns, in apply order: Service, the workload (a Deployment when
``parallelism.nodes == 1``, else a LeaderWorkerSet whose groups run native vLLM data parallel;
during an experiment the two arms, :mod:`moe_eplb.render.experiment`),
PodDisruptionBudget, a PodMonitor when ``monitoring.podMonitor.enabled``, and the autoscaler (a KEDA
ScaledObject or a HorizontalPodAutoscaler, :mod:`moe_eplb.render.autoscaler`) when
``spec.autoscaling`` is on. No ConfigMap is
created: the chat template is mounted from the user's ConfigMap.

Every child carries the pinned labels, ``metadata.namespace`` (when the resource has one) and an
ownerReference to the MoEInference (when ``metadata.uid`` is present). The pod template carries
the annotation ``eplb.ai/eplb-config-hash`` of the effective EPLB settings, so a change of those
settings rolls the pods while a change of ``replicas`` does not.
"""

from __future__ import annotations

import math
from typing import Any

from moe_eplb import __version__
from moe_eplb.api.spec import EplbSettings, MoEInference
from moe_eplb.contracts import k8s_names, metric_names
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
from moe_eplb.render import experiment
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
SCRAPE_INTERVAL = "15s"


def render_children(inf: MoEInference) -> list[dict[str, Any]]:
    """All child objects of a parsed (valid) MoEInference, in apply order, with the effective EPLB
    settings (the tuner's override when it applies, :attr:`MoEInference.effective`)."""
    eplb = inf.effective
    owner = owner_reference(inf)
    children: list[dict[str, Any]] = [service(inf)]
    children.extend(workloads(inf, eplb))
    children.append(pod_disruption_budget(inf))
    if inf.monitoring.pod_monitor:
        children.append(pod_monitor(inf))
    scaler = autoscaler(inf)
    if scaler is not None:
        children.append(scaler)
    for child in children:
        if inf.namespace:
            child["metadata"]["namespace"] = inf.namespace
        if owner:
            child["metadata"]["ownerReferences"] = [dict(owner)]
    return children


def workloads(inf: MoEInference, eplb: EplbSettings) -> list[dict[str, Any]]:
    """The engine workload: a Deployment or a LeaderWorkerSet; while an experiment runs
    (``status.autotune.experiment``), its two arms (:mod:`moe_eplb.render.experiment`)."""
    exp = inf.status.experiment if inf.eplb.enabled else None
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


# --- pods -----------------------------------------------------------------------------------------


def _env(inf: MoEInference, role: str = k8s_names.ROLE_API) -> list[dict[str, Any]]:
    user = [dict(e) for e in inf.engine.env]
    plugins = [EXPORTER_PLUGIN]
    for e in user:
        if e.get("name") == "VLLM_PLUGINS" and e.get("value"):
            plugins = [p for p in e["value"].split(",") if p and p != EXPORTER_PLUGIN] + plugins
    env: list[dict[str, Any]] = [{"name": "VLLM_PLUGINS", "value": ",".join(plugins)}]
    merged = {"VLLM_PLUGINS"}
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
            {"name": k8s_names.DRAIN_SECONDS_ENV, "value": str(inf.engine.drain_seconds)}]
    merged |= {k8s_names.ENGINE_ROLE_ENV, k8s_names.DRAIN_SECONDS_ENV}
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


def _probes(serves_api: bool, startup_timeout: int) -> dict[str, Any]:
    """Probes of an engine container (see docs/operator.md, "Pod health").

    A pod that serves the API waits for vLLM's ``/health`` (startup); a worker for its exporter.
    Readiness and liveness are the exporter's (``moe_eplb.exporter.health``): readiness fails while
    the pod drains (so the Service stops routing to it) or vLLM's ``/health`` fails; liveness fails
    when the engine's process is gone (the exporter ends with it) or a worker is stuck in a forward
    pass. The startup probe holds both off for up to ``spec.engine.startupTimeoutSeconds`` (model
    loading can take most of an hour for the largest models), on workers too.
    """
    exporter = k8s_names.EXPORTER_PORT_NAME
    start = {"path": HEALTH_PATH, "port": API_PORT_NAME} if serves_api else \
        {"path": k8s_names.EXPORTER_LIVE_PATH, "port": exporter}
    ready = {"path": k8s_names.EXPORTER_READY_PATH, "port": exporter}
    live = {"path": k8s_names.EXPORTER_LIVE_PATH, "port": exporter}
    return {
        "startupProbe": {
            "httpGet": start,
            "periodSeconds": PROBE_PERIOD_SECONDS,
            "timeoutSeconds": 5,
            "failureThreshold": math.ceil(startup_timeout / PROBE_PERIOD_SECONDS),
        },
        "readinessProbe": {"httpGet": ready, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"httpGet": live, "periodSeconds": 30, "timeoutSeconds": 10, "failureThreshold": 5},
    }


def _lifecycle(inf: MoEInference) -> dict[str, Any]:
    """The preStop drain (``spec.engine.drainSeconds`` > 0): the kubelet's GET on the exporter's
    ``/drain`` turns the pod unready and returns once vLLM has no request in flight (a worker: once
    its group's leader has none, or is gone), or after ``drainSeconds``; SIGTERM follows."""
    if inf.engine.drain_seconds <= 0:
        return {}
    drain = {"path": k8s_names.EXPORTER_DRAIN_PATH, "port": k8s_names.EXPORTER_PORT_NAME}
    return {"lifecycle": {"preStop": {"httpGet": drain}}}


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
    tmpl = inf.engine.chat_template
    if tmpl:
        volumes.append(
            {"name": "chat-template", "configMap": {"name": tmpl.name, "items": [{"key": tmpl.key, "path": tmpl.key}]}}
        )
        mounts.append({"name": "chat-template", "mountPath": CHAT_TEMPLATE_DIR, "readOnly": True})
    return volumes, mounts


def pod_template(
    inf: MoEInference, eplb: EplbSettings, *, command: list[str], args: list[str] | None, serves_api: bool = True
) -> dict[str, Any]:
    """Pod template of one engine pod (labels, config-hash annotation, GPUs, shm, probes, ports), with
    ``spec.engine.podTemplate`` merged in (:mod:`moe_eplb.render.overlay`)."""
    volumes, mounts = _volumes(inf)
    role = k8s_names.ROLE_API if serves_api else k8s_names.ROLE_WORKER
    ports = [{"name": k8s_names.EXPORTER_PORT_NAME, "containerPort": k8s_names.EXPORTER_PORT, "protocol": "TCP"}]
    if serves_api:
        ports.insert(0, {"name": API_PORT_NAME, "containerPort": API_PORT, "protocol": "TCP"})
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": inf.engine.image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        **({"args": args} if args is not None else {}),
        "ports": ports,
        "env": _env(inf, role),
        "resources": _resources(inf),
        "volumeMounts": mounts,
        **_probes(serves_api, inf.engine.startup_timeout_seconds),
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
        "metadata": _meta(inf),
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
    ranks keep serving while vLLM re-hosts the lost rank's experts."""
    ft = inf.fault_tolerance.enabled
    common = engine_args(inf, eplb)
    leader = pod_template(inf, eplb, command=API_COMMAND, args=common + multinode_leader_args(inf))
    # the worker's argv goes in `args` (expanded by Kubernetes exactly like the leader's) to a fixed
    # script; no user text is ever part of a `sh -c` string
    worker = pod_template(inf, eplb, command=["/bin/sh", "-c", multinode_worker_script(inf), "vllm"],
                          args=common + multinode_worker_args(inf), serves_api=ft)
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": _meta(inf),
        "spec": {
            "replicas": inf.replicas,
            "startupPolicy": "LeaderCreated",
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
    """ClusterIP Service for the API (leaders only for multi-node, unless fault tolerance has every
    rank serve its own API) and the exporter port."""
    selector = selector_labels(inf.name)
    if inf.parallelism.nodes > 1 and not inf.fault_tolerance.enabled:
        selector[LWS_WORKER_INDEX_LABEL] = "0"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(inf),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [
                {"name": API_PORT_NAME, "port": API_PORT, "targetPort": API_PORT_NAME, "protocol": "TCP"},
                {
                    "name": k8s_names.EXPORTER_PORT_NAME,
                    "port": k8s_names.EXPORTER_PORT,
                    "targetPort": k8s_names.EXPORTER_PORT_NAME,
                    "protocol": "TCP",
                },
            ],
        },
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
    endpoints = [
        {"port": k8s_names.EXPORTER_PORT_NAME, "path": k8s_names.EXPORTER_PATH, "interval": SCRAPE_INTERVAL,
         "relabelings": [dict(r) for r in relabel]},
        {"port": API_PORT_NAME, "path": "/metrics", "interval": SCRAPE_INTERVAL,
         "relabelings": [dict(r) for r in relabel]},
    ]
    spec: dict[str, Any] = {"selector": {"matchLabels": selector_labels(inf.name)}, "podMetricsEndpoints": endpoints}
    if inf.namespace:
        spec["namespaceSelector"] = {"matchNames": [inf.namespace]}
    meta = _meta(inf)
    meta["labels"] = {**inf.monitoring.pod_monitor_labels, **meta["labels"]}  # ours cannot be overridden
    return {"apiVersion": PODMONITOR_API_VERSION, "kind": "PodMonitor", "metadata": meta, "spec": spec}


def _prom_label(k8s_label: str) -> str:
    """Kubernetes label name as Prometheus service discovery spells it (``eplb.ai/name`` -> ``eplb_ai_name``)."""
    return "".join(c if c.isalnum() else "_" for c in k8s_label)
