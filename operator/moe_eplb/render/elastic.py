"""The workload of an elastic group (``spec.parallelism.elastic``), pure: its founding pods, the pods
that join it, and the NetworkPolicy of its ports.

Why two objects. The real LeaderWorkerSet controller (sigs.k8s.io/lws v0.8.0, run in
tests/kube/test_elastic_real.py) keeps ``leaderWorkerTemplate.size`` in the template revision: a size
change is a new revision, and the rolling update recreates every group -- the running ranks would be
killed, which is what an elastic resize exists to avoid. So the group is:

* **founders**: the LeaderWorkerSet of :func:`moe_eplb.render.objects.leader_worker_set`, one group of
  ``spec.parallelism.nodes`` pods holding the launch size ``spec.parallelism.data`` (also for one pod:
  LWS gives rank 0 the stable address ``<name>-0.<name>-0``, under the group's headless Service, that
  the joiners handshake with). A resize never changes it; a tuner rollout or a restart recreates it as
  before, and the group launches again at ``data`` ranks;
* **joiners**: a StatefulSet ``<name>-join`` (``podManagementPolicy: Parallel``, ``updateStrategy:
  OnDelete``) of the pods above the launch size. Pod ``<name>-join-j`` runs ranks ``data + j x
  dataLocal`` and up. Raising ``replicas`` adds the highest pods, lowering it removes the highest first
  (what a shrink retires: vLLM always retires the highest ranks); with ``OnDelete`` a template change (the
  size a new pod joins at) never restarts a running pod. Its replicas and template come from
  ``status.elastic`` (:func:`moe_eplb.api.elastic.joiner_pods`), so the operator drives a resize by writing
  the status and rendering.

A joining pod is started as vLLM expects a scale-up launch: ``VLLM_ELASTIC_EP_SCALE_UP_LAUNCH=1``, the
size it joins (``--data-parallel-size``), its ranks (``--data-parallel-rank`` or the multi-port supervisor's
start rank, from its own name through the downward API) and rank 0's address and handshake port.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from moe_eplb.api import elastic
from moe_eplb.api.layout import DP_RPC_PORT, SUPERVISOR_PORT, PodLaunch, dp_flags
from moe_eplb.api.spec import EplbSettings, MoEInference
from moe_eplb.contracts import k8s_names
from moe_eplb.render.engine_args import SHM_CLEAN, engine_args, k8s_escape
from moe_eplb.render.labels import labels, selector_labels

#: labels the operator's own pods carry (the chart's selector labels) and Prometheus' pods (the
#: Prometheus Operator's): the NetworkPolicy lets them reach the exporter's port
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "moe-eplb", "app.kubernetes.io/component": "operator"}
PROMETHEUS_POD_LABELS = {"app.kubernetes.io/name": "prometheus"}


def founder_address(inf: MoEInference) -> str:
    """Rank 0's address for a joining pod: the LeaderWorkerSet's group 0 leader under the group's
    headless Service, ``<name>-0.<name>-0`` (what the founders' LWS_LEADER_ADDRESS names, relative to
    the namespace: :func:`moe_eplb.contracts.k8s_names.lws_leader_address`)."""
    return k8s_names.lws_leader_address(inf.name, 0)


def joiner_launch(inf: MoEInference) -> PodLaunch:
    """The launch of a joining pod: ``dataLocal`` ranks, one API server each (external load balancing,
    vLLM's multi-port supervisor where there are several); its first rank comes from its ordinal."""
    lay = inf.layout
    first = lay.pods[0]
    return replace(first, role=k8s_names.ELASTIC_JOINER, index=-1, ranks=tuple(range(inf.parallelism.data_local)))


def joiner_args(inf: MoEInference, eplb: EplbSettings, size: int) -> list[str]:
    """``vllm serve`` arguments of a pod joining at ``size`` ranks (after the fixed script's ``"$@"``)."""
    args = engine_args(inf, eplb)
    i = args.index("--data-parallel-size")
    args[i + 1] = str(size)
    return args + ["--data-parallel-size-local", str(inf.parallelism.data_local),
                   "--data-parallel-rpc-port", str(DP_RPC_PORT),
                   "--data-parallel-address", founder_address(inf)]


def joiner_script(inf: MoEInference) -> str:
    """The joining pod's ``sh -c`` script: clean /dev/shm, then ``exec vllm serve "$@"`` and its rank
    flags with the first rank ``data + ordinal x dataLocal`` (the ordinal: the last ``-`` part of its name,
    :data:`moe_eplb.contracts.k8s_names.POD_NAME_ENV`). No user text; ``$`` escaped for Kubernetes."""
    par = inf.parallelism
    first = f'"$((${{{k8s_names.POD_NAME_ENV}##*-}} * {int(par.data_local)} + {int(par.data)}))"'
    tail = " ".join(dp_flags(inf.layout, joiner_launch(inf), start_rank=first))
    return k8s_escape(f'{SHM_CLEAN}; exec vllm serve "$@" {tail}')


def joiner_stateful_set(inf: MoEInference, eplb: EplbSettings, pod_template: Any) -> dict[str, Any]:
    """The StatefulSet of the joining pods (see the module doc); ``pod_template`` is
    :func:`moe_eplb.render.objects.pod_template` (passed in: that module imports this one)."""
    st, par = inf.elastic_status, inf.parallelism
    size = elastic.joiner_launch_size(st)
    template = pod_template(inf, eplb, command=["/bin/sh", "-c", joiner_script(inf), "vllm"],
                            args=joiner_args(inf, eplb, size), pod=joiner_launch(inf))
    template["metadata"]["labels"][k8s_names.ELASTIC_ROLE_LABEL] = k8s_names.ELASTIC_JOINER
    template["metadata"]["labels"][k8s_names.SERVING_LABEL] = "true"
    container = next(c for c in template["spec"]["containers"] if c["name"] == k8s_names.ENGINE_CONTAINER)
    container["env"] = [e for e in container["env"] if e["name"] not in (elastic.SCALE_UP_LAUNCH_ENV,
                                                                             k8s_names.POD_NAME_ENV)] + [
        {"name": elastic.SCALE_UP_LAUNCH_ENV, "value": "1"},
        {"name": k8s_names.POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    selector = {**selector_labels(inf.name), k8s_names.ELASTIC_ROLE_LABEL: k8s_names.ELASTIC_JOINER}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": k8s_names.elastic_name(inf.name), "labels": labels(inf.name)},
        "spec": {
            "replicas": elastic.joiner_pods(st, par.data, par.data_local),
            # the client Service: nothing dials a joiner by name (it dials rank 0: founder_address)
            "serviceName": inf.name,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": selector},
            "template": template,
        },
    }


def mark_founders(template: dict[str, Any]) -> dict[str, Any]:
    """A founding pod template of an elastic group: labelled ``founder`` and serving."""
    template["metadata"]["labels"][k8s_names.ELASTIC_ROLE_LABEL] = k8s_names.ELASTIC_FOUNDER
    template["metadata"]["labels"][k8s_names.SERVING_LABEL] = "true"
    return template


def network_policy(inf: MoEInference) -> dict[str, Any]:
    """Ingress to an elastic group's pods where the cluster enforces NetworkPolicies: every API port
    from anywhere (clients, a gateway; vLLM's own ``/scale_elastic_ep`` is on the same port and
    unauthenticated -- see docs/resource.md "Who may resize"), the exporter's port (metrics and the
    operator's authenticated control relay) and the supervisor's health port only from the operator
    and Prometheus, and anything from the group's own pods (NCCL, the handshake, vLLM's stores)."""
    lay, sel = inf.layout, selector_labels(inf.name)
    api = [{"protocol": "TCP", "port": a.port} for a in lay.api_ports]
    private = [{"protocol": "TCP", "port": k8s_names.EXPORTER_PORT}]
    if lay.supervised:
        private.append({"protocol": "TCP", "port": SUPERVISOR_PORT})
    watchers = [{"namespaceSelector": {}, "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}},
                {"namespaceSelector": {}, "podSelector": {"matchLabels": dict(PROMETHEUS_POD_LABELS)}}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": inf.name, "labels": labels(inf.name)},
        "spec": {
            "podSelector": {"matchLabels": sel},
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": api},
                        {"from": [{"podSelector": {"matchLabels": dict(sel)}}]},
                        {"from": watchers, "ports": private}],
        },
    }
