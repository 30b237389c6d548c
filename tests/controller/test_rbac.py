"""RBAC_RULES match the operator's real API calls, both ways.

The real operator (kopf included, cluster-wide, with peering through a ClusterKopfPeering) runs a
whole lifecycle against the emulated API server: a single-node (Deployment) and a multi-node
(LeaderWorkerSet) resource are created, made ready, tuned (EPLB change), scaled, put in autotune
mode Recommend (the autotune timer, ticking fast, lists the engine pods and writes an evaluation),
given an autoscaler (a KEDA ScaledObject, an HPA), edited by hand (every child kind) and deleted. Every request it sent is then checked against RBAC_RULES, and
every (group, resource, verb) the rules grant must have been used."""

from __future__ import annotations

import pytest

pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")
pytest.importorskip("kmock", reason="the test extra (kmock) is not installed")

import yaml

from moe_eplb.controller.k8s import USER_AGENT
from moe_eplb.controller.rbac import (
    NAMESPACED_MODE_CLUSTER_RULES,
    RBAC_RULES,
    allows,
    grants,
    request_verb,
)
from tests.controller.test_operator_loop import (  # noqa: F401
    NS,
    ROOT,
    _gone,
    child_path,
    children,
    make_ready,
    observed,
)

pytestmark = pytest.mark.integration  # the real operator and an emulated API server


def operator_requests(emulated_cluster, *, with_scope: bool = False):
    """(group, resource[/subresource], verb) of every resource request sent by kopf or the controller;
    with ``with_scope``, a 4th item: whether the URL named a namespace."""
    seen = set()
    for req in emulated_cluster.api:
        agent = req.headers.get("User-Agent", "")
        if not (agent.startswith("kopf/") or agent == USER_AGENT):
            continue
        if req.resource is None or req.resource.plural is None:
            continue  # discovery (/api, /apis/...): granted to every authenticated user
        resource = req.resource.plural + (f"/{req.subresource}" if req.subresource else "")
        verb = request_verb(req.method.value if hasattr(req.method, "value") else str(req.method),
                            named=req.name is not None, watch=req.params.get("watch") == "true")
        seen.add((req.resource.group, resource, verb) + ((req.namespace is not None,) if with_scope else ()))
    return seen


def examples():
    single = yaml.safe_load((ROOT / "examples" / "qwen3-vl-30b-a3b-awq-eplb.yaml").read_text())
    multi = next(d for d in yaml.safe_load_all((ROOT / "examples" / "deepseek-v3-multinode.yaml").read_text())
                 if d and d.get("kind") == "MoEInference")
    return single, multi


@pytest.fixture
def fast_autotune():
    """The autotune timer ticks every 0.2 s (instead of 15 s) so the lifecycle sees it work; it gives
    the unreachable Prometheus of the lifecycle 3 s of retries (instead of 30 s), so the deletion at
    the end does not wait half a minute for a tick in flight."""
    from moe_eplb.controller.autotune_settings import AutotuneSettings

    return AutotuneSettings(tick_seconds=0.2, http_timeout=1.0, prometheus_budget_seconds=3.0)


async def _evaluated(emulated_cluster, name):
    obj = await emulated_cluster.get(emulated_cluster.moeinference_path(NS, name))
    return ((obj.get("status") or {}).get("autotune") or {}).get("lastEvaluation")


def _pod_log_read(emulated_cluster) -> bool:
    return any(req.resource is not None and req.resource.plural == "pods" and req.subresource == "log"
               for req in emulated_cluster.api)


async def fault_tolerance_reads_pod_logs(emulated_cluster, eventually, name):
    """Fault tolerance on vLLM 0.34: the autotune loop reads the running engine pods' logs for vLLM's
    scale_down line (the emulated apiserver has no kubelet: the read is answered with an error)."""
    from moe_eplb.contracts.k8s_names import NAME_LABEL

    await emulated_cluster.patch(emulated_cluster.moeinference_path(NS, name), {"spec": {
        "engine": {"image": "vllm/vllm-openai:v0.34.0"}, "eplb": {"numRedundantExperts": 256},
        "parallelism": {"all2allBackend": "deepep_low_latency"},
        "faultTolerance": {"enabled": True, "rankFailuresToSurvive": 8},
        "monitoring": {"prometheusUrl": None},  # read the pods directly: nothing waits on an unreachable host
        "autotune": {"evaluationIntervalSeconds": 10}}})
    await emulated_cluster.create(f"/api/v1/namespaces/{NS}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-0", "namespace": NS, "labels": {NAME_LABEL: name}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.34.0"}]}})
    await emulated_cluster.patch(f"/api/v1/namespaces/{NS}/pods/{name}-0/status", {"status": {"phase": "Running"}})
    await eventually(lambda: _pod_log_read(emulated_cluster), timeout=30)
    await emulated_cluster.patch(emulated_cluster.moeinference_path(NS, name), {"spec": {"autotune": {"evaluationIntervalSeconds": 300}}})
    await emulated_cluster.delete(f"/api/v1/namespaces/{NS}/pods/{name}-0")


async def lifecycle(emulated_cluster, eventually, res):
    """Create, make ready, change EPLB, scale, autotune (Recommend), autoscale, hand-edit every child, delete."""
    name = res["metadata"]["name"]
    await emulated_cluster.create(emulated_cluster.moeinference_path(NS), res)
    await eventually(lambda: observed(emulated_cluster, name, 1))
    await make_ready(emulated_cluster, await children(emulated_cluster, name))
    await emulated_cluster.patch(emulated_cluster.moeinference_path(NS, name), {"spec": {"eplb": {"windowSize": 1500}}})
    await eventually(lambda: observed(emulated_cluster, name, 2))
    await emulated_cluster.patch(emulated_cluster.moeinference_path(NS, name), {"spec": {"replicas": 2}})
    await eventually(lambda: observed(emulated_cluster, name, 3))
    # the autotune loop: lists the pods (direct scrape, workload view); no load -> a NoData evaluation
    await emulated_cluster.patch(emulated_cluster.moeinference_path(NS, name), {"spec": {"autotune": {"mode": "Recommend"}}})
    await eventually(lambda: observed(emulated_cluster, name, 4))
    evaluation = await eventually(lambda: _evaluated(emulated_cluster, name), timeout=15)
    assert evaluation["decision"] == "NoData"
    # autoscaling on: a KEDA ScaledObject (single-node) or an HPA on an External metric (multi-node)
    multinode = res["spec"].get("parallelism", {}).get("nodes", 1) > 1
    autoscaling = {"maxReplicas": 4, **({"backend": "HPA", "hpa": {"metricsApi": "External"}} if multinode else {})}
    await emulated_cluster.patch(emulated_cluster.moeinference_path(NS, name), {"spec": {
        "autoscaling": autoscaling, "monitoring": {"prometheusUrl": "http://prometheus.invalid:9090",
                                                   "podMonitor": {"enabled": True}}}})
    await eventually(lambda: observed(emulated_cluster, name, 5))
    if multinode:
        await fault_tolerance_reads_pod_logs(emulated_cluster, eventually, name)
    kinds = {c["kind"] for c in (await children(emulated_cluster, name)).values()}
    assert ("HorizontalPodAutoscaler" if multinode else "ScaledObject") in kinds, kinds
    for child in (await children(emulated_cluster, name)).values():  # hand edits, put back by the operator
        await emulated_cluster.patch(child_path(child), {"metadata": {"ownerReferences": []}})
    await eventually(lambda: _all_owned(emulated_cluster, name))
    await emulated_cluster.delete(emulated_cluster.moeinference_path(NS, name))
    # kopf holds the deletion until an autotune tick in flight ends (here retrying an unreachable
    # Prometheus, up to its 3 s budget) and checks every second (controller.main CANCELLATION_POLLING_S;
    # kopf's default, 60 s, made this take a minute): time for that on a loaded machine
    await eventually(lambda: _gone(emulated_cluster, emulated_cluster.moeinference_path(NS, name)), timeout=20)


def _pod(name: str, labels: dict, *, ready: bool) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": labels},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.34.0"}]}}


async def elastic_lifecycle(emulated_cluster, eventually) -> None:
    """An elastic group: its joiners' StatefulSet and NetworkPolicy made, put back and deleted as
    children; the resize loop takes a shrink's retiring pods out of the Service (a pod label) and
    restarts a group vLLM left paused (deletes its founding pods). No kubelet here: the pods are made by
    hand and the record is written as the loop would find it."""
    from moe_eplb.contracts import k8s_names

    res = yaml.safe_load((ROOT / "examples" / "deepseek-v3-elastic.yaml").read_text())
    res["spec"].pop("autoscaling")
    res["spec"]["monitoring"] = {}
    name = res["metadata"]["name"]
    path = emulated_cluster.moeinference_path(NS, name)
    await emulated_cluster.create(emulated_cluster.moeinference_path(NS), res)
    await eventually(lambda: observed(emulated_cluster, name, 1))
    kinds = {c["kind"] for c in (await children(emulated_cluster, name)).values()}
    assert {"StatefulSet", "NetworkPolicy", "LeaderWorkerSet"} <= kinds, kinds
    role, base = k8s_names.ELASTIC_ROLE_LABEL, {k8s_names.NAME_LABEL: name}
    for pod, labels in ((f"{name}-0", {role: "founder"}), (f"{name}-0-1", {role: "founder"}),
                        (f"{name}-join-0", {role: "joiner", k8s_names.SERVING_LABEL: "true"}),
                        (f"{name}-join-1", {role: "joiner", k8s_names.SERVING_LABEL: "true"})):
        await emulated_cluster.create(f"/api/v1/namespaces/{NS}/pods", _pod(pod, {**base, **labels}, ready=True))
        await emulated_cluster.patch(f"/api/v1/namespaces/{NS}/pods/{pod}/status", {"status": {
            "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "vllm", "state": {"running": {}}}]}})
    # 32 ranks serve and the spec asks for 16 (2 pods): the loop drains the two highest pods
    await emulated_cluster.patch(path + "/status", {"status": {"elastic": {
        "dataParallel": 32, "targetDataParallel": 32, "phase": "Stable"}}})

    async def drained():
        pod = await emulated_cluster.get(f"/api/v1/namespaces/{NS}/pods/{name}-join-1")
        return pod["metadata"]["labels"].get(k8s_names.SERVING_LABEL) == "false"

    await eventually(drained, timeout=15)
    # a group vLLM left paused: the loop restarts it, deleting the founding pods older than the operation
    await emulated_cluster.patch(path + "/status", {"status": {
        "elastic": {"dataParallel": 16, "targetDataParallel": 32, "phase": "RestartingGroup", "lastError": "x"},
        "conditions": [{"type": "Resizing", "status": "True", "reason": "RestartingGroup", "message": "x",
                        "lastTransitionTime": "2999-01-01T00:00:00Z"}]}})
    await eventually(lambda: _gone(emulated_cluster, f"/api/v1/namespaces/{NS}/pods/{name}-0"), timeout=15)
    for child in (await children(emulated_cluster, name)).values():  # hand edits, put back
        await emulated_cluster.patch(child_path(child), {"metadata": {"ownerReferences": []}})
    await eventually(lambda: _all_owned(emulated_cluster, name))
    await emulated_cluster.delete(path)
    await eventually(lambda: _gone(emulated_cluster, path))


async def test_rbac_rules_cover_every_call_and_every_rule_is_used(emulated_cluster, operator_runner, eventually, fast_autotune):
    from moe_eplb.controller.elastic import ElasticSettings

    await emulated_cluster.create("/apis/kopf.dev/v1/clusterkopfpeerings", {"metadata": {"name": "moe-eplb"}})
    async with operator_runner(standalone=False, peering_name="moe-eplb", autotune=fast_autotune,
                               elastic=ElasticSettings(tick_seconds=0.2)):
        for res in examples():
            await lifecycle(emulated_cluster, eventually, res)
        await elastic_lifecycle(emulated_cluster, eventually)

    used = operator_requests(emulated_cluster)
    not_allowed = sorted(u for u in used if not allows(*u))
    assert not_allowed == [], f"calls not covered by RBAC_RULES: {not_allowed}"
    unused = sorted(set(grants(RBAC_RULES)) - used)
    assert unused == [], f"RBAC_RULES grants never used: {unused}"


async def test_namespaced_mode_needs_only_namespaced_access_plus_crds(emulated_cluster, operator_runner, eventually, fast_autotune):
    """With --namespace, every call to a namespaced resource names the namespace (a Role there
    suffices), peering uses KopfPeering, and only kopf's CRD discovery and its namespace observer
    are cluster-wide (NAMESPACED_MODE_CLUSTER_RULES)."""
    await emulated_cluster.create("/apis/kopf.dev/v1/namespaces/default/kopfpeerings", {"metadata": {"name": "moe-eplb"}})
    async with operator_runner(standalone=False, peering_name="moe-eplb", namespaces=("default",),
                               autotune=fast_autotune):
        for res in examples():
            await lifecycle(emulated_cluster, eventually, res)

    namespaced_rules = [dict(r, resources=["kopfpeerings" if x == "clusterkopfpeerings" else x
                                           for x in r["resources"]]) for r in RBAC_RULES]
    namespaced_rules += NAMESPACED_MODE_CLUSTER_RULES
    used = operator_requests(emulated_cluster, with_scope=True)
    cluster_wide = sorted((g, r, v) for g, r, v, ns in used if not ns)
    assert cluster_wide == [("", "namespaces", "list"), ("", "namespaces", "watch"),
                            ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
                            ("apiextensions.k8s.io", "customresourcedefinitions", "watch")]
    not_allowed = sorted((g, r, v) for g, r, v, _ in used if not allows(g, r, v, namespaced_rules))
    assert not_allowed == []
    assert ("kopf.dev", "kopfpeerings", "patch", True) in used


async def _all_owned(emulated_cluster, name):
    kids = await children(emulated_cluster, name)
    return kids and all(c["metadata"].get("ownerReferences") for c in kids.values())


def test_request_verb_mapping():
    assert request_verb("GET", named=True, watch=False) == "get"
    assert request_verb("GET", named=False, watch=False) == "list"
    assert request_verb("GET", named=False, watch=True) == "watch"
    assert request_verb("PATCH", named=True, watch=False) == "patch"
    assert request_verb("POST", named=False, watch=False) == "create"
    assert request_verb("DELETE", named=True, watch=False) == "delete"
    assert allows("apps", "deployments", "patch") and not allows("apps", "deployments", "update")
