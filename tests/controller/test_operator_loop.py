"""Operator-in-the-loop: the real kopf operator (fresh registry, embedded in the test's loop) against
the emulated API server (``moe_eplb_harness.emulated.kubeapi``) over real HTTP, with the real validation and
rendering. Each test applies resources like a user would and asserts what lands in the API."""

from __future__ import annotations

import pytest

pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")
pytest.importorskip("kmock", reason="the test extra (kmock) is not installed")

import asyncio
import copy
import pathlib

import pytest
import yaml

from moe_eplb.contracts.k8s_names import CONFIG_HASH_ANNOTATION

pytestmark = pytest.mark.integration  # the real operator and an emulated API server

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "qwen3-vl-30b-a3b-awq-eplb.yaml"
NS = "default"
WORKLOAD_KINDS = ("Deployment", "LeaderWorkerSet")
CHILD_PATHS = (
    "/apis/apps/v1/namespaces/default/deployments",
    "/apis/leaderworkerset.x-k8s.io/v1/namespaces/default/leaderworkersets",
    "/api/v1/namespaces/default/services",
    "/api/v1/namespaces/default/configmaps",
    "/apis/policy/v1/namespaces/default/poddisruptionbudgets",
    "/apis/monitoring.coreos.com/v1/namespaces/default/podmonitors",
    "/apis/keda.sh/v1alpha1/namespaces/default/scaledobjects",
    "/apis/autoscaling/v2/namespaces/default/horizontalpodautoscalers",
    "/apis/apps/v1/namespaces/default/statefulsets",
    "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies",
)
PLURALS = {"Deployment": "deployments", "LeaderWorkerSet": "leaderworkersets", "Service": "services",
           "ConfigMap": "configmaps", "PodDisruptionBudget": "poddisruptionbudgets", "PodMonitor": "podmonitors",
           "ScaledObject": "scaledobjects", "HorizontalPodAutoscaler": "horizontalpodautoscalers",
           "StatefulSet": "statefulsets", "NetworkPolicy": "networkpolicies"}


def example(name: str | None = None) -> dict:
    res = yaml.safe_load(EXAMPLE.read_text())
    res["metadata"]["namespace"] = NS
    if name:
        res["metadata"]["name"] = name
    return res


def cond(obj: dict, type_: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


async def children(emulated_cluster, name: str) -> dict[str, dict]:
    """Every child of ``name`` found by its label, keyed "Kind/name"."""
    out = {}
    for path in CHILD_PATHS:
        for item in await emulated_cluster.list(path, f"eplb.ai/name={name}"):
            out[f"{item['kind']}/{item['metadata']['name']}"] = item
    return out


def workloads(kids: dict[str, dict]) -> dict[str, dict]:
    return {k: v for k, v in kids.items() if v["kind"] in WORKLOAD_KINDS}


def pod_template(obj: dict) -> dict:
    spec = obj["spec"]
    return spec["template"] if obj["kind"] == "Deployment" else spec["leaderWorkerTemplate"]


def child_path(obj: dict) -> str:
    api = obj["apiVersion"]
    base = f"/apis/{api}" if "/" in api else f"/api/{api}"
    return f"{base}/namespaces/{obj['metadata']['namespace']}/{PLURALS[obj['kind']]}/{obj['metadata']['name']}"


async def observed(emulated_cluster, name: str, generation: int) -> dict | None:
    obj = await emulated_cluster.get(emulated_cluster.moeinference_path(NS, name))
    return obj if (obj.get("status") or {}).get("observedGeneration") == generation else None


async def events_for(emulated_cluster, name: str) -> list[dict]:
    return [e for e in await emulated_cluster.list("/api/v1/namespaces/default/events")
            if e.get("involvedObject", {}).get("name") == name]


async def make_ready(emulated_cluster, kids: dict[str, dict]) -> None:
    """Play the workload controllers: every workload reports all replicas updated and ready."""
    for obj in workloads(kids).values():
        live = await emulated_cluster.get(child_path(obj))
        await emulated_cluster.patch(child_path(obj) + "/status", {"status": emulated_cluster.api.ready_status(live)})


async def test_create_makes_children_and_status(emulated_cluster, operator_runner, eventually):
    res = example()
    name = res["metadata"]["name"]
    async with operator_runner():
        created = await emulated_cluster.create(emulated_cluster.moeinference_path(NS), res)
        obj = await eventually(lambda: observed(emulated_cluster, name, 1))
        kids = await children(emulated_cluster, name)

        # children: a workload, a Service with the http port, owned by the resource, labelled
        assert workloads(kids), kids.keys()
        assert any(k.startswith("Service/") for k in kids)
        assert "PodMonitor/" + name in kids  # the example enables it
        for child in kids.values():
            owners = child["metadata"]["ownerReferences"]
            assert [o["uid"] for o in owners] == [created["metadata"]["uid"]]
            assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "moe-eplb"
            assert child["metadata"]["labels"]["eplb.ai/name"] == name
        for w in workloads(kids).values():
            assert CONFIG_HASH_ANNOTATION in pod_template(w)["metadata"]["annotations"]

        st = obj["status"]
        assert cond(obj, "SpecValid")["status"] == "True"
        assert cond(obj, "Ready")["status"] == "False"
        assert cond(obj, "Progressing")["status"] == "True"
        assert st["phase"] == "Pending"
        assert st["epSize"] == 4
        assert st["eplb"] == {"enabled": True, "windowSize": 3000, "stepInterval": 1000, "numRedundantExperts": 8}
        assert st["endpoint"].startswith("http://") and f".{NS}.svc:" in st["endpoint"]
        assert f"eplb.ai/name={name}" in st["selector"]
        assert st["readyReplicas"] == 0

        # the workload controllers report ready -> the child watch refreshes the status
        await make_ready(emulated_cluster, kids)
        obj = await eventually(lambda: _phase(emulated_cluster, name, "Running"))
        assert cond(obj, "Ready")["status"] == "True"
        assert cond(obj, "Progressing")["status"] == "False"
        assert cond(obj, "Degraded")["status"] == "False"
        assert obj["status"]["readyReplicas"] == res["spec"]["replicas"]
        assert obj["status"]["replicas"] == res["spec"]["replicas"]

        reasons = [e["reason"] for e in await events_for(emulated_cluster, name)]
        assert "Created" in reasons


async def test_operator_wide_defaults_reach_the_children(emulated_cluster, eventually, started):
    """``moe-eplb run --pod-monitor-labels release=kube-prometheus-stack --exporter-image ...`` (the
    chart's operator.podMonitorLabels and its own image): the PodMonitor carries the label that
    kube-prometheus-stack selects by, the injection runs the operator's image; the resource is
    not changed (the defaults are the operator's, not written back)."""
    from moe_eplb.controller import settings as s

    settings = s.build(pod_monitor_labels='{"release": "kube-prometheus-stack"}',
                       exporter_image="registry.example.com/moe-eplb/operator:0.3.0")
    res = example()
    name = res["metadata"]["name"]
    async with started(res, operator_settings=settings) as obj:
        kids = await children(emulated_cluster, name)
        assert kids[f"PodMonitor/{name}"]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        (workload,) = workloads(kids).values()
        inits = pod_template(workload)["spec"]["initContainers"]
        assert [c["image"] for c in inits] == ["registry.example.com/moe-eplb/operator:0.3.0"]
        assert "labels" not in (obj["spec"].get("monitoring") or {}).get("podMonitor", {})
        assert "image" not in (obj["spec"]["engine"].get("exporter") or {})


async def _phase(emulated_cluster, name, phase):
    obj = await emulated_cluster.get(emulated_cluster.moeinference_path(NS, name))
    return obj if (obj.get("status") or {}).get("phase") == phase else None


async def test_eplb_change_rolls_the_pod_template(emulated_cluster, eventually, started):
    res = example()
    name = res["metadata"]["name"]
    async with started(res):
        before = workloads(await children(emulated_cluster, name))
        hashes = {k: pod_template(v)["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] for k, v in before.items()}

        await emulated_cluster.patch(emulated_cluster.moeinference_path(NS, name), {"spec": {"eplb": {"windowSize": 2000}}})
        obj = await eventually(lambda: observed(emulated_cluster, name, 2))
        after = workloads(await children(emulated_cluster, name))

    assert obj["status"]["eplb"]["windowSize"] == 2000
    assert set(after) == set(before)
    for key, w in after.items():
        assert pod_template(w)["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] != hashes[key]
        assert w["metadata"]["generation"] == before[key]["metadata"]["generation"] + 1
        assert "2000" in yaml.safe_dump(pod_template(w))  # the new window reaches the engine args


async def test_scale_changes_replicas_only(emulated_cluster, eventually, started):
    res = example()
    name = res["metadata"]["name"]
    async with started(res):
        before = workloads(await children(emulated_cluster, name))
        first = len(list(emulated_cluster.api))

        await emulated_cluster.patch(emulated_cluster.moeinference_path(NS, name), {"spec": {"replicas": 3}})
        await eventually(lambda: observed(emulated_cluster, name, 2))
        after = workloads(await children(emulated_cluster, name))
        reasons = [e["reason"] for e in await events_for(emulated_cluster, name)]

    assert sum(w["spec"].get("replicas", 1) for w in after.values()) >= 3
    for key, w in after.items():
        if key in before:  # the same pod template: no pod restarts
            assert pod_template(w) == pod_template(before[key])
    # what the operator sent to the workloads: replicas and nothing else
    workload_patches = [r.data for r in list(emulated_cluster.api)[first:]
                        if r.method == "PATCH" and r.resource is not None
                        and r.resource.plural in ("deployments", "leaderworkersets") and r.subresource is None]
    assert workload_patches and all(p == {"spec": {"replicas": p["spec"]["replicas"]}} for p in workload_patches)
    assert "Scaled" in reasons


async def test_invalid_spec_is_reported_and_applies_nothing(emulated_cluster, eventually, started):
    res = example("bad")
    res["spec"]["eplb"]["numRedundantExperts"] = 7  # 128 + 7 is not divisible by EP size 4
    async with started(res) as obj:
        kids = await children(emulated_cluster, "bad")
        events = await events_for(emulated_cluster, "bad")

    assert kids == {}
    assert obj["status"]["phase"] == "Invalid"
    spec_valid = cond(obj, "SpecValid")
    assert spec_valid["status"] == "False" and spec_valid["reason"] == "InvalidSpec"
    assert "spec.eplb.numRedundantExperts" in spec_valid["message"]
    warnings = [e for e in events if e["type"] == "Warning" and e["reason"] == "InvalidSpec"]
    assert len(warnings) == 1 and "numRedundantExperts" in warnings[0]["message"]


async def test_invalid_update_leaves_running_children_untouched(emulated_cluster, eventually, started):
    res = example()
    name = res["metadata"]["name"]
    async with started(res):
        before = await children(emulated_cluster, name)

        await emulated_cluster.patch(emulated_cluster.moeinference_path(NS, name),
                         {"spec": {"eplb": {"numRedundantExperts": 5}, "replicas": 2}})
        obj = await eventually(lambda: observed(emulated_cluster, name, 2))
        after = await children(emulated_cluster, name)

    assert cond(obj, "SpecValid")["status"] == "False"
    assert obj["status"]["phase"] == "Invalid"
    assert {k: v["metadata"]["resourceVersion"] for k, v in after.items()} == \
        {k: v["metadata"]["resourceVersion"] for k, v in before.items()}


async def test_hand_edits_are_put_back(emulated_cluster, eventually, started):
    res = example()
    name = res["metadata"]["name"]
    async with started(res):
        kids = await children(emulated_cluster, name)
        key, workload = next(iter(workloads(kids).items()))
        template = pod_template(workload)
        path = child_path(workload)

        # someone edits the pod template and the replicas by hand
        broken = copy.deepcopy(template)
        broken["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] = "edited-by-hand"
        field = "template" if workload["kind"] == "Deployment" else "leaderWorkerTemplate"
        await emulated_cluster.patch(path, {"spec": {field: broken, "replicas": 7}})

        async def restored():
            live = await emulated_cluster.get(path)
            return live if pod_template(live) == template and live["spec"]["replicas"] == workload["spec"]["replicas"] \
                else None
        await eventually(restored)

        # someone deletes the Service: it comes back
        svc = next(v for v in kids.values() if v["kind"] == "Service")
        await emulated_cluster.delete(child_path(svc))
        back = await eventually(lambda: emulated_cluster.get_or_none(child_path(svc)))
        assert back["metadata"]["uid"] != svc["metadata"]["uid"]
        assert back["spec"]["ports"] == svc["spec"]["ports"]
        reasons = [e["reason"] for e in await events_for(emulated_cluster, name)]
    assert "DriftCorrected" in reasons


async def test_timer_restores_drift_without_child_events(emulated_cluster, eventually, started):
    """The periodic resync also puts hand edits back (here the child watch cannot see the edit:
    it is written straight into the emulator's store, without a watch event)."""
    res = example()
    name = res["metadata"]["name"]
    async with started(res, resync_seconds=0.3):
        kids = await children(emulated_cluster, name)
        svc = next(v for v in kids.values() if v["kind"] == "Service")
        key = next(k for k in emulated_cluster.api.store if k[0].plural == "services" and k[2] == svc["metadata"]["name"])
        emulated_cluster.api.store[key]["spec"]["ports"] = [{"name": "http", "port": 9999}]
        fixed = await eventually(lambda: _ports_are(emulated_cluster, child_path(svc), svc["spec"]["ports"]))
    assert fixed


async def _ports_are(emulated_cluster, path, ports):
    live = await emulated_cluster.get(path)
    return live if live["spec"]["ports"] == ports else None


async def test_delete_removes_children_and_the_resource(emulated_cluster, eventually, started):
    res = example()
    name = res["metadata"]["name"]
    async with started(res) as obj:
        assert "eplb.ai/finalizer" in obj["metadata"]["finalizers"]
        assert await children(emulated_cluster, name)

        await emulated_cluster.delete(emulated_cluster.moeinference_path(NS, name))
        await eventually(lambda: _gone(emulated_cluster, emulated_cluster.moeinference_path(NS, name)))
        assert await children(emulated_cluster, name) == {}
    deletes = [w for w in emulated_cluster.api.writes if w[0] == "delete" and w[3] == name and w[1] != "moeinferences"]
    assert {w[1] for w in deletes} >= {"services"}


async def _gone(emulated_cluster, path):
    return await emulated_cluster.get_or_none(path) is None


async def test_restart_resumes_without_duplicate_work(emulated_cluster, operator_runner, eventually, started):
    res = example()
    name = res["metadata"]["name"]
    async with started(res):
        kids = await children(emulated_cluster, name)
        await make_ready(emulated_cluster, kids)
        await eventually(lambda: _phase(emulated_cluster, name, "Running"))
    before = {k: v["metadata"]["resourceVersion"] for k, v in (await children(emulated_cluster, name)).items()}
    parent_before = await emulated_cluster.get(emulated_cluster.moeinference_path(NS, name))
    writes_before = len(emulated_cluster.api.writes)

    results: list[str] = []
    async with operator_runner(counter=results.append):
        await eventually(lambda: "ok" in results, timeout=10)  # the resume handler ran
        after_kids = await children(emulated_cluster, name)
    after = {k: v["metadata"]["resourceVersion"] for k, v in after_kids.items()}
    parent_after = await emulated_cluster.get(emulated_cluster.moeinference_path(NS, name))

    assert after == before
    child_writes = [w for w in emulated_cluster.api.writes[writes_before:] if w[1] != "moeinferences"]
    assert child_writes == []
    assert parent_after["status"] == parent_before["status"]


async def test_multinode_resource_runs_as_leaderworkerset_and_scales_groups(emulated_cluster, eventually, started):
    res = next(d for d in yaml.safe_load_all((ROOT / "examples" / "deepseek-v3-multinode.yaml").read_text())
               if d and d.get("kind") == "MoEInference")
    name = res["metadata"]["name"]
    async with started(res) as obj:
        kids = await children(emulated_cluster, name)
        lws = kids[f"LeaderWorkerSet/{name}"]
        assert not any(k.startswith("Deployment/") for k in kids)
        assert obj["status"]["epSize"] == 16
        await make_ready(emulated_cluster, kids)
        await eventually(lambda: _phase(emulated_cluster, name, "Running"))

        await emulated_cluster.patch(emulated_cluster.moeinference_path(NS, name), {"spec": {"replicas": 2}})
        obj = await eventually(lambda: observed(emulated_cluster, name, 2))
        scaled = (await children(emulated_cluster, name))[f"LeaderWorkerSet/{name}"]
    assert scaled["spec"]["replicas"] == 2
    assert scaled["spec"]["leaderWorkerTemplate"] == lws["spec"]["leaderWorkerTemplate"]
    # the LWS observed generation 1 only: the status says it is rolling out the new replica count
    assert obj["status"]["phase"] in ("Progressing", "Running") and cond(obj, "Ready")["status"] == "False"


async def test_child_refused_by_the_api_server_applies_nothing(emulated_cluster, eventually, started):
    """An admission webhook (played by a kmock reaction) refuses the PodMonitor: the dry run that
    precedes every write catches it, so not even the Service or the Deployment is created."""
    emulated_cluster.api["post /apis/monitoring.coreos.com/v1/namespaces/default/podmonitors"] << 422 << {
        "apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 422, "reason": "Invalid",
        "message": "admission webhook denied the request: podMetricsEndpoints[0].interval: too short"}
    res = example()
    name = res["metadata"]["name"]
    async with started(res) as obj:
        kids = await children(emulated_cluster, name)
        events = await events_for(emulated_cluster, name)
    assert kids == {}
    assert obj["status"]["phase"] == "Degraded"
    degraded = cond(obj, "Degraded")
    assert degraded["reason"] == "ChildRejected" and "PodMonitor/" + name in degraded["message"]
    assert "too short" in degraded["message"]
    assert [e["reason"] for e in events if e["type"] == "Warning"] == ["ChildRejected"]


async def test_scale_subresource_like_an_autoscaler(emulated_cluster, eventually, started):
    """HPA/KEDA write /scale: the operator scales the workload; /scale reports the selector."""
    res = example()
    name = res["metadata"]["name"]
    path = emulated_cluster.moeinference_path(NS, name)
    async with started(res):
        before = workloads(await children(emulated_cluster, name))
        scale = await emulated_cluster.get(path + "/scale")
        assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 1
        assert f"eplb.ai/name={name}" in scale["status"]["selector"]

        await emulated_cluster.patch(path + "/scale", {"spec": {"replicas": 2}})
        await eventually(lambda: observed(emulated_cluster, name, 2))
        after = workloads(await children(emulated_cluster, name))
    assert sum(w["spec"]["replicas"] for w in after.values()) == 2
    assert all(pod_template(after[k]) == pod_template(before[k]) for k in after)


async def test_child_no_longer_rendered_is_pruned(emulated_cluster, eventually, started):
    res = example()
    name = res["metadata"]["name"]
    async with started(res):
        assert f"PodMonitor/{name}" in await children(emulated_cluster, name)
        await emulated_cluster.patch(emulated_cluster.moeinference_path(NS, name), {"spec": {"monitoring": {"podMonitor": {"enabled": False}}}})
        await eventually(lambda: observed(emulated_cluster, name, 2))
        kids = await children(emulated_cluster, name)
        reasons = [e["reason"] for e in await events_for(emulated_cluster, name)]
    assert f"PodMonitor/{name}" not in kids and f"Service/{name}" in kids
    assert "Pruned" in reasons


def _multinode() -> dict:
    return next(d for d in yaml.safe_load_all((ROOT / "examples" / "deepseek-v3-multinode.yaml").read_text())
                if d and d.get("kind") == "MoEInference")


@pytest.mark.parametrize("make", [example, _multinode], ids=["Deployment", "LeaderWorkerSet"])
async def test_status_heals_after_transient_status_write_failures(emulated_cluster, eventually, started, make):
    """Status writes of the operator fail for a while (500 and 409 in turn) just when the workload
    becomes ready: the refresh that child event triggered is retried with backoff, so the status
    reaches Running within seconds of the API recovering -- not at the next resync (an hour here)."""
    from moe_eplb.controller.k8s import USER_AGENT

    res = make()
    name = res["metadata"]["name"]
    failed = []

    def faults(request):
        if failing and request.subresource == "status" and request.resource is not None \
                and request.resource.plural == "moeinferences" and request.headers.get("User-Agent") == USER_AGENT:
            failed.append(request.method)
            return (500, "InternalError", "etcdserver: request timed out") if len(failed) % 2 else \
                (409, "Conflict", "the object has been modified; please apply your changes to the latest version")
        return None

    failing = False
    emulated_cluster.api.faults = faults
    async with started(res) as obj:
        assert obj["status"]["phase"] in ("Pending", "Progressing")
        failing = True
        await make_ready(emulated_cluster, await children(emulated_cluster, name))  # a child event -> a refresh, which fails
        await eventually(lambda: len(failed) >= 1, timeout=10)  # refused
        await asyncio.sleep(1.0)  # the API keeps failing for a second
        stale = (await emulated_cluster.get(emulated_cluster.moeinference_path(NS, name)))["status"]
        assert stale["phase"] != "Running" and cond({"status": stale}, "Ready")["status"] == "False"
        failing = False
        healed = await eventually(lambda: _phase(emulated_cluster, name, "Running"), timeout=8)
    assert healed["status"]["readyReplicas"] == healed["spec"].get("replicas", 1)
    assert cond(healed, "Ready")["status"] == "True" and cond(healed, "Progressing")["status"] == "False"


async def test_malformed_pod_template_is_refused_and_children_stay(emulated_cluster, eventually, started):
    """A malformed ``spec.engine.podTemplate`` (an apiserver without the CRD's rules, or an edit that
    bypassed admission) is refused by the reconcile with one line naming the field and the fix; the
    running children are not touched."""
    res = example()
    name = res["metadata"]["name"]
    async with started(res):
        before = await children(emulated_cluster, name)
        bad = {"containers": [{"name": "vllm", "command": ["sleep", "infinity"]}], "hostNetwork": "yes"}
        await emulated_cluster.patch(emulated_cluster.moeinference_path(NS, name), {"spec": {"engine": {"podTemplate": {"spec": bad}}}})
        obj = await eventually(lambda: observed(emulated_cluster, name, 2))
        after = await children(emulated_cluster, name)

    spec_valid = cond(obj, "SpecValid")
    assert spec_valid["status"] == "False" and obj["status"]["phase"] == "Invalid"
    assert "spec.engine.podTemplate.spec.hostNetwork" in spec_valid["message"]
    assert {k: v["metadata"]["resourceVersion"] for k, v in after.items()} == \
        {k: v["metadata"]["resourceVersion"] for k, v in before.items()}
    assert "sleep" not in yaml.safe_dump(after)
