"""The operator on a REAL control plane, installed by its Helm chart and running under the chart's
ServiceAccount and RBAC rules (a token of that ServiceAccount, never admin): every example reconciles
into its children (Deployment or LeaderWorkerSet with the published LWS CRD installed, Service, PDB,
PodMonitor with the Prometheus Operator's published CRD present and absent), status conditions and the
``/scale`` selector; a spec change rolls the Deployment through the real Deployment controller; two
operators with peering never both act; a removed RBAC verb gives a condition and an Event, not a crash.
"""

from __future__ import annotations

import copy
import json
import secrets
import time
from typing import Any

import pytest
import yaml

from moe_eplb.api.validation import check
from moe_eplb.render.objects import render_children
from tests.chart.chart_support import CHART_DIR
from tests.example_manifests import EXAMPLES, load_moeinferences
from tests.kube.chart_install import MONITORING_CRDS, apply, crd_path, one, render, start_chart_operator
from tests.kube.conftest import install_crd, wait_for

GROUP_PATHS = {
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments/{name}",
    "LeaderWorkerSet": "/apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets/{name}",
    "Service": "/api/v1/namespaces/{ns}/services/{name}",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps/{name}",
    "StatefulSet": "/apis/apps/v1/namespaces/{ns}/statefulsets/{name}",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies/{name}",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/{name}",
    "PodMonitor": "/apis/monitoring.coreos.com/v1/namespaces/{ns}/podmonitors/{name}",
    "ScaledObject": "/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects/{name}",
    "HorizontalPodAutoscaler": "/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers/{name}",
}


def moe(ns: str, name: str = "") -> str:
    return f"/apis/eplb.ai/v1alpha1/namespaces/{ns}/moeinferences" + (f"/{name}" if name else "")


def new_namespace(cp: Any) -> str:
    name = f"op-{secrets.token_hex(3)}"
    cp.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name



def create(cp: Any, ns: str, doc: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(doc)
    body["metadata"]["namespace"] = ns
    return cp.request("POST", moe(ns), body)


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}


def expected_children(doc: dict[str, Any], ns: str) -> list[tuple[str, str]]:
    body = copy.deepcopy(doc)
    body["metadata"]["namespace"] = ns
    checked = check(body)
    assert checked.inference is not None, checked.problems
    return [(c["kind"], c["metadata"]["name"]) for c in render_children(checked.inference)]


@pytest.fixture(scope="module")
def chart_release(control_plane, tmp_path_factory) -> dict[str, Any]:
    """The chart installed as release ``moe-eplb`` in ``moe-system`` (cluster-wide mode), with the
    published LeaderWorkerSet CRD; the Prometheus Operator's CRDs are installed by the test that
    needs them present (the first test runs without them)."""
    install_crd(control_plane, crd_path("leaderworkerset.x-k8s.io_leaderworkersets.yaml"))
    install_crd(control_plane, crd_path("keda.sh_scaledobjects.yaml"))  # the autoscaled example renders one
    control_plane.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                         "metadata": {"name": "moe-system"}})
    objs = render("moe-eplb", "moe-system", {}, monitoring=False)
    for path in sorted((CHART_DIR / "crds").glob("*.yaml")):
        install_crd(control_plane, path)
    apply(control_plane, objs)
    return {"objs": objs, "workdir": tmp_path_factory.mktemp("chart-operators")}


def test_chart_objects_are_accepted_by_the_apiserver(control_plane, chart_release) -> None:
    objs = chart_release["objs"]
    kinds = sorted({o["kind"] for o in objs})
    assert {"ClusterRole", "ClusterRoleBinding", "ServiceAccount", "Deployment"} <= set(kinds)
    # the chart's operator Deployment was taken over by the real Deployment controller (a ReplicaSet)
    dep = one(objs, "Deployment")
    path = "/apis/apps/v1/namespaces/moe-system/replicasets?labelSelector=" + ",".join(
        f"{k}={v}" for k, v in dep["spec"]["selector"]["matchLabels"].items())
    assert wait_for(lambda: control_plane.request("GET", path)["items"], what="operator ReplicaSet")
    # without the Prometheus Operator's API the chart renders no ServiceMonitor/PrometheusRule
    assert not {"ServiceMonitor", "PrometheusRule"} & set(kinds)


def test_every_example_reconciles_under_the_charts_rbac(control_plane, chart_release) -> None:
    cp = control_plane
    for name in MONITORING_CRDS:  # absent first: a PodMonitor that cannot be created is skipped, said so
        if cp.get_or_none(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name.split('_', 1)[1][:-5]}.{name.split('_')[0]}"):
            cp.request("DELETE", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name.split('_', 1)[1][:-5]}.{name.split('_')[0]}")
    ns = new_namespace(cp)
    docs = [d for p in sorted(EXAMPLES.glob("*.yaml")) for d in load_moeinferences(p)]
    with start_chart_operator(cp, chart_release["objs"], chart_release["workdir"], pod_name="op-examples",
                              extra_args=("--resync-seconds", "2", "--standalone")) as op:
        for doc in docs:
            create(cp, ns, doc)
        for doc in docs:
            name = doc["metadata"]["name"]
            want = expected_children(doc, ns)
            for kind, child in want:
                if kind == "PodMonitor":
                    continue
                assert wait_for(lambda k=kind, c=child: cp.get_or_none(GROUP_PATHS[k].format(ns=ns, name=c)),
                                timeout=60, what=f"{name}: {kind}/{child}"), op.output()[-3000:]
            obj = wait_for(lambda n=name: (o := cp.request("GET", moe(ns, n))) and (o.get("status") or {}).get("selector")
                           and o, timeout=60, what=f"{name}: status.selector")
            assert conditions(obj)["SpecValid"]["status"] == "True", obj["status"]
            assert conditions(obj)["Ready"]["status"] == "False"  # no kubelet: pods never become ready
            scale = cp.request("GET", moe(ns, name) + "/scale")
            assert scale["status"]["selector"] == obj["status"]["selector"]
            assert scale["spec"]["replicas"] == doc["spec"].get("replicas", 1)
        # now the Prometheus Operator's CRDs arrive: the PodMonitors of the examples that ask for one appear
        with_pm = [(d["metadata"]["name"], c) for d in docs for k, c in expected_children(d, ns) if k == "PodMonitor"]
        assert with_pm, "no example renders a PodMonitor"
        assert all(cp.get_or_none(GROUP_PATHS["PodMonitor"].format(ns=ns, name=c)) is None for _, c in with_pm)
        for name in MONITORING_CRDS:
            install_crd(cp, crd_path(name))
        for owner, child in with_pm:
            pm = wait_for(lambda c=child: cp.get_or_none(GROUP_PATHS["PodMonitor"].format(ns=ns, name=c)), timeout=90,
                          what=f"{owner}: PodMonitor after its CRD was installed")
            assert pm["metadata"]["ownerReferences"][0]["name"] == owner
        assert op.proc.poll() is None


def test_the_chart_with_monitoring_installs_where_the_prometheus_operator_api_is_served(control_plane, chart_release) -> None:
    """Release ``moe-eplb-mon``: rendered for a cluster that serves monitoring.coreos.com/v1 (the
    published CRDs installed), its ServiceMonitor and PrometheusRule are accepted by the apiserver."""
    cp = control_plane
    for name in MONITORING_CRDS:
        install_crd(cp, crd_path(name))
    cp.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "moe-mon"}})
    objs = render("moe-eplb-mon", "moe-mon", {}, monitoring=True)
    kinds = {o["kind"] for o in objs}
    assert {"ServiceMonitor", "PrometheusRule"} <= kinds
    apply(cp, objs)
    rule = one(objs, "PrometheusRule")["metadata"]["name"]
    stored = cp.request("GET", f"/apis/monitoring.coreos.com/v1/namespaces/moe-mon/prometheusrules/{rule}")
    assert stored["spec"]["groups"] and all(g["rules"] for g in stored["spec"]["groups"])
    monitor = one(objs, "ServiceMonitor")["metadata"]["name"]
    assert cp.request("GET", f"/apis/monitoring.coreos.com/v1/namespaces/moe-mon/servicemonitors/{monitor}")


def test_a_spec_change_rolls_the_deployment(control_plane, chart_release) -> None:
    cp = control_plane
    ns = new_namespace(cp)
    doc = load_moeinferences(EXAMPLES / "qwen3-vl-30b-a3b-awq-eplb.yaml")[0]
    name = doc["metadata"]["name"]
    with start_chart_operator(cp, chart_release["objs"], chart_release["workdir"], pod_name="op-roll",
                              extra_args=("--standalone",)):
        create(cp, ns, doc)
        dep_path = GROUP_PATHS["Deployment"].format(ns=ns, name=name)
        dep = wait_for(lambda: cp.get_or_none(dep_path), timeout=60, what="Deployment")
        rs_path = f"/apis/apps/v1/namespaces/{ns}/replicasets"
        wait_for(lambda: len(cp.request("GET", rs_path)["items"]) == 1, what="first ReplicaSet")
        before = dep["metadata"]["generation"]
        cp.request("PATCH", moe(ns, name), {"spec": {"eplb": {"windowSize": 2000}}},
                   content_type="application/merge-patch+json")
        dep = wait_for(lambda: (d := cp.request("GET", dep_path))["metadata"]["generation"] > before and d, timeout=60,
                       what="Deployment patched")
        args = " ".join(dep["spec"]["template"]["spec"]["containers"][0].get("args", []))
        assert '"window_size":2000' in args.replace(" ", "") or "window_size\": 2000" in args or "2000" in args, args
        # the real Deployment controller rolls: a second ReplicaSet for the new template
        wait_for(lambda: len(cp.request("GET", rs_path)["items"]) == 2, timeout=60, what="a new ReplicaSet")


def handled(op: Any) -> list[str]:
    """The objects an operator's handlers ran for (kopf's JSON log lines with an ``object``)."""
    out = []
    for line in op.output().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        obj = record.get("object") or {}
        if obj.get("kind") and ("Handler" in record.get("message", "") or "Timer" in record.get("message", "")):
            out.append(f"{obj['kind']}/{obj.get('namespace', '')}/{obj.get('name')}")
    return out


@pytest.mark.parametrize("together", [False, True], ids=["one-after-the-other", "started-together"])
def test_two_operators_with_peering_never_both_act(control_plane, chart_release, together) -> None:
    """The chart's peering (``MOE_EPLB_PEERING`` set, so mandatory) and seniority priorities: the
    second operator, whether it starts seconds after the first or right after it, runs no handler at
    all while the first is alive. (With kopf's auto-detected peering and random priorities, both
    reconciled for ~0.3 s at start-up here, before the lower one paused.)"""
    cp = control_plane
    ns = new_namespace(cp)
    doc = load_moeinferences(EXAMPLES / "qwen3-30b-a3b-autotune.yaml")[0]
    workdir = chart_release["workdir"]
    tag = "t" if together else "s"
    with start_chart_operator(cp, chart_release["objs"], workdir, pod_name=f"peer-{tag}1") as a:
        # together: 50 ms apart (as two replicas of a Deployment); else the first has announced
        # itself in the ClusterKopfPeering before the second starts
        time.sleep(0.05 if together else 4)
        with start_chart_operator(cp, chart_release["objs"], workdir, pod_name=f"peer-{tag}2") as b:
            time.sleep(6)  # both have read the peering object
            create(cp, ns, doc)
            dep_path = GROUP_PATHS["Deployment"].format(ns=ns, name=doc["metadata"]["name"])
            wait_for(lambda: cp.get_or_none(dep_path), timeout=60, what="Deployment")
            # the Deployment is there: one operator's create handler ran; its log line may come a
            # little later on a loaded machine (after the status patch)
            wait_for(lambda: any(f"/{ns}/" in o for o in handled(a) + handled(b)), timeout=30,
                     what="a handler's log line for the resource")
            time.sleep(3)  # what the newer one would run by now
            logs = {"a": a.output(), "b": b.output()}
            acted = {k: handled(op) for k, op in (("a", a), ("b", b))}
    assert all("(required)" in text.splitlines()[0] for text in logs.values()), logs
    # seniority: the older acts; the newer ran not one handler, for any object in any namespace,
    # and was never resumed (mandatory peering: it starts paused until it has read the peering object)
    assert any(f"/{ns}/" in o for o in acted["a"]), acted["a"]
    assert acted["b"] == [], acted["b"]
    assert "Resuming operations" not in logs["b"], logs["b"][-2000:]


def test_a_removed_rbac_verb_gives_a_condition_not_a_crash(control_plane, chart_release) -> None:
    """Release ``moe-eplb-norbac``: the chart's rules minus ``create`` on Services."""
    cp = control_plane
    release_ns = "moe-norbac"
    cp.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": release_ns}})
    objs = render("moe-eplb-norbac", release_ns, {}, monitoring=False)
    role = one(objs, "ClusterRole")
    for rule in role["rules"]:
        if rule["resources"] == ["services"]:
            rule["verbs"] = [v for v in rule["verbs"] if v != "create"]
    apply(cp, [o for o in objs if o["kind"] != "Deployment"])
    ns = new_namespace(cp)
    doc = load_moeinferences(EXAMPLES / "qwen3-vl-30b-a3b-awq-eplb.yaml")[0]
    name = doc["metadata"]["name"]
    with start_chart_operator(cp, objs, chart_release["workdir"], pod_name="op-norbac",
                              extra_args=("--standalone", "--resync-seconds", "2")) as op:
        create(cp, ns, doc)
        obj = wait_for(lambda: (o := cp.request("GET", moe(ns, name))) and conditions(o).get("Degraded", {}).get("status") == "True"
                       and o, timeout=60, what="Degraded condition")
        message = conditions(obj)["Degraded"]["message"]
        assert "services" in message and "forbidden" in message.lower(), message
        events = cp.request("GET", f"/api/v1/namespaces/{ns}/events?fieldSelector=involvedObject.name={name}")["items"]
        assert any(e["type"] == "Warning" and "services" in e["message"] for e in events), [e["message"] for e in events]
        time.sleep(5)
        assert op.proc.poll() is None, op.output()[-2000:]  # still running: no crash loop
    assert yaml.safe_dump(obj)  # the status is a plain object (kept for the failure report)


def test_the_control_secret_is_made_once_kept_rotated_by_deleting_it_and_gone_with_the_resource(
        control_plane, chart_release) -> None:
    """The operator's control token (controller.control) under the chart's RBAC: the Secret
    ``<name>-control`` appears with a random token and an ownerReference, the pods mount it, later
    reconciles keep the token, a deleted Secret comes back with a new token, and deleting the
    resource deletes it."""
    import base64

    cp = control_plane
    ns = new_namespace(cp)
    doc = load_moeinferences(EXAMPLES / "qwen3-vl-30b-a3b-awq-eplb.yaml")[0]
    name = doc["metadata"]["name"]
    secret_path = f"/api/v1/namespaces/{ns}/secrets/{name}-control"

    def token() -> str | None:
        secret = cp.get_or_none(secret_path)
        return base64.b64decode(secret["data"]["token"]).decode() if secret else None

    with start_chart_operator(cp, chart_release["objs"], chart_release["workdir"], pod_name="op-control",
                              extra_args=("--standalone", "--resync-seconds", "2")) as op:
        uid = create(cp, ns, doc)["metadata"]["uid"]
        first = wait_for(token, timeout=60, what="control Secret")
        assert len(first) >= 40, first  # 32 random bytes, URL-safe base64
        secret = cp.request("GET", secret_path)
        assert secret["metadata"]["ownerReferences"][0]["uid"] == uid
        dep = wait_for(lambda: cp.get_or_none(GROUP_PATHS["Deployment"].format(ns=ns, name=name)), timeout=60,
                       what="Deployment")
        pod = dep["spec"]["template"]["spec"]
        assert {"name": "eplb-control", "secret": {"secretName": f"{name}-control", "optional": True,
                "items": [{"key": "token", "path": "token"}], "defaultMode": 420}} in pod["volumes"]
        # resyncs every 2 s: the token stays what it was
        time.sleep(5)
        assert token() == first
        # deleting the Secret rotates the token
        cp.request("DELETE", secret_path)
        second = wait_for(lambda: (t := token()) and t != first and t, timeout=60, what="a new control Secret")
        assert second != first
        cp.request("DELETE", moe(ns, name))
        wait_for(lambda: cp.get_or_none(secret_path) is None, timeout=60, what="the Secret deleted with the resource")
        assert op.proc.poll() is None, op.output()[-2000:]
