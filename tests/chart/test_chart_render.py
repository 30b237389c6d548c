"""The Helm chart renders and lints cleanly (helm-python-sdk: Helm's own Go code, no binary) for the
default, namespaced and monitoring-off value sets, and every rendered object validates strictly."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from moe_eplb.contracts import k8s_names
from moe_eplb.controller.rbac import NAMESPACED_MODE_CLUSTER_RULES, RBAC_RULES, grants
from tests.chart.chart_support import (
    BARE_CLUSTER,
    CHART_DIR,
    PROMETHEUS_OPERATOR,
    RELEASE,
    RELEASE_NS,
    ROOT,
    VALUE_SETS,
    helm,
    render_chart,
    render_manifests,
)

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
K8S_VERSION = "1.32.0"
MONITORING_KINDS = {"ServiceMonitor", "PrometheusRule"}
PEERING_KINDS = {"KopfPeering", "ClusterKopfPeering"}


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_lint_is_clean(value_set):
    report = helm().lint(str(CHART_DIR), VALUE_SETS[value_set], strict=True, namespace=RELEASE_NS)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report.get("errors", [])
    assert report["total_charts_linted"] == 1
    assert not problems, problems


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_object_validates_strictly(render, value_set):
    objs = render(VALUE_SETS[value_set])
    assert objs
    for o in objs:
        if o["kind"] in MONITORING_KINDS | PEERING_KINDS:
            continue  # custom resources: checked structurally below
        try:
            kv.validate(o, K8S_VERSION, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{value_set}: {o['kind']}/{o['metadata']['name']}: {exc}")
        meta = o["metadata"]
        assert meta["labels"]["app.kubernetes.io/part-of"] == "moe-eplb"
        if o["kind"] not in {"ClusterRole", "ClusterRoleBinding"}:
            assert meta["namespace"], f"{o['kind']}/{meta['name']} has no namespace"


def test_validation_catches_a_bad_object(render):
    dep = one(render(), "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy_typo"] = "x"
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, K8S_VERSION, strict=True)


def test_crds_validate_and_match_the_top_level_crds(chart):
    crds = {c["filename"]: yaml.safe_load_all(c["data"]) for c in chart.crds}
    docs = [d for stream in crds.values() for d in stream if d]
    names = {d["metadata"]["name"] for d in docs}
    assert {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"} <= names
    for d in docs:
        kv.validate(d, K8S_VERSION, strict=True)
    top = ROOT / "crds"
    shipped = sorted(p.name for p in top.glob("*.yaml")) if top.exists() else []
    if not shipped:
        pytest.skip("crds/ at the top level is empty (the MoEInference CRD has not landed yet)")
    for name in shipped:
        copy = CHART_DIR / "crds" / name
        assert copy.exists(), f"charts/moe-eplb-operator/crds/{name} missing: run python scripts/gen_chart.py"
        assert copy.read_text() == (top / name).read_text(), \
            f"charts/moe-eplb-operator/crds/{name} differs from crds/{name}: run python scripts/gen_chart.py"
    assert "moeinferences.eplb.ai" in names


def test_deployment_is_hardened_and_highly_available(render):
    objs = render()
    dep = one(objs, "Deployment")
    spec = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 2
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    (c,) = spec["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert c["command"] == ["moe-eplb"] and c["args"] == ["run"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": k8s_names.OPERATOR_METRICS_PORT, "health": 8081}
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp"}
    assert c["image"] == "ghcr.io/moe-eplb/operator:0.1.0"
    pdb = one(objs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert spec["serviceAccountName"] == one(objs, "ServiceAccount")["metadata"]["name"]


def env_of(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def test_operator_env_contract(render):
    env = env_of(render())
    assert env["MOE_EPLB_PROMETHEUS_URL"] == ""  # none: the operator reads the pods' exporters directly
    assert env["MOE_EPLB_NAMESPACES"] == ""
    assert env["MOE_EPLB_PEERING"] == "moe-eplb"
    assert env["MOE_EPLB_METRICS_PORT"] == str(k8s_names.OPERATOR_METRICS_PORT)
    assert env["MOE_EPLB_HEALTH_PORT"] == "8081"
    assert env["MOE_EPLB_LOG_LEVEL"] == "INFO" and env["MOE_EPLB_LOG_FORMAT"] == "json"
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    # the tuning defaults are the CRD's (per MoEInference), not an operator-wide setting
    assert not any(k.startswith("MOE_EPLB_AUTOTUNE") for k in env)
    env = env_of(render({"operator": {"prometheusUrl": "http://prom:9090", "watchNamespaces": ["a", "b"]},
                         "peering": {"enabled": False}, "replicaCount": 1}))
    assert env["MOE_EPLB_NAMESPACES"] == "a,b"
    assert env["MOE_EPLB_PEERING"] == ""
    assert env["MOE_EPLB_PROMETHEUS_URL"] == "http://prom:9090"


def test_cluster_wide_mode_objects(render):
    objs = render()
    assert not by_kind(objs, "Role") and not by_kind(objs, "RoleBinding")
    crb = one(objs, "ClusterRoleBinding")
    assert crb["roleRef"]["name"] == one(objs, "ClusterRole")["metadata"]["name"]
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": RELEASE_NS}]
    peering = one(objs, "ClusterKopfPeering")
    assert peering["apiVersion"] == "kopf.dev/v1" and peering["metadata"]["name"] == "moe-eplb"


def test_namespaced_mode_objects(render):
    objs = render(VALUE_SETS["namespaced"])
    roles, bindings = by_kind(objs, "Role"), by_kind(objs, "RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for b in bindings:
        assert b["subjects"][0]["namespace"] == RELEASE_NS and b["roleRef"]["kind"] == "Role"
    peerings = by_kind(objs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert not by_kind(objs, "ClusterKopfPeering")
    assert env_of(objs)["MOE_EPLB_NAMESPACES"] == "team-a,team-b"


def test_monitoring_objects_are_consistent(render):
    objs = render()
    svc = one(objs, "Service")
    sm = one(objs, "ServiceMonitor")
    dep = one(objs, "Deployment")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert ep["honorLabels"] is True  # the tuner's namespace/name labels must survive
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [RELEASE_NS]
    rule = one(objs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    for g in rule["spec"]["groups"]:
        assert set(g) == {"name", "rules"}
        for r in g["rules"]:
            assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}
            assert r["labels"]["severity"] in {"critical", "warning", "info"}
            assert r["annotations"]["summary"] and r["annotations"]["description"]
    down = next(r for g in rule["spec"]["groups"] for r in g["rules"] if r["alert"] == "MoEEPLBOperatorDown")
    assert f'job="{svc["metadata"]["name"]}"' in down["expr"]  # the ServiceMonitor's job label


def test_monitoring_off_renders_no_monitoring_objects(render):
    objs = render(VALUE_SETS["monitoring-off"])
    kinds = {o["kind"] for o in objs}
    assert not kinds & MONITORING_KINDS
    assert not by_kind(objs, "ConfigMap")
    assert "Deployment" in kinds and "Service" in kinds


def test_bare_cluster_installs_cleanly(chart, render):
    """On a cluster without the Prometheus Operator CRDs the default install renders no
    ServiceMonitor/PrometheusRule (Helm would refuse the whole release: "no matches for kind"), and
    every object it does render is of a built-in API (kubernetes-validate knows the kind) or of a CRD
    the chart itself installs from crds/."""
    objs = render(api_versions=BARE_CLUSTER)
    assert not {o["kind"] for o in objs} & MONITORING_KINDS
    own_crds = {(d["spec"]["group"], v["name"], d["spec"]["names"]["kind"])
                for c in chart.crds for d in yaml.safe_load_all(c["data"]) if d for v in d["spec"]["versions"]}
    for o in objs:
        group, _, version = o["apiVersion"].rpartition("/")
        if (group, version, o["kind"]) in own_crds:
            continue
        kv.validate(o, K8S_VERSION, strict=True)  # raises for a kind the built-in schemas lack
    assert {"Deployment", "Service", "ClusterKopfPeering", "ConfigMap"} <= {o["kind"] for o in objs}
    notes = render_manifests(chart, api_versions=BARE_CLUSTER)["moe-eplb-operator/templates/NOTES.txt"]
    assert "No ServiceMonitor for the operator's own metrics (metrics.serviceMonitor.enabled=auto, and the " \
           "cluster does not serve monitoring.coreos.com/v1)" in notes
    assert "No PrometheusRule" in notes


def test_the_guard_asks_for_the_api_version_not_a_kind_or_another_group(render):
    """Only monitoring.coreos.com/v1 itself switches them on (Has on the group/version)."""
    for served in (("monitoring.coreos.com/v1alpha1",), ("monitoring.coreos.com/v1/PodMonitor",),
                   ("example.com/v1",)):
        assert not {o["kind"] for o in render(api_versions=served)} & MONITORING_KINDS, served
    assert {o["kind"] for o in render(api_versions=PROMETHEUS_OPERATOR)} >= MONITORING_KINDS


def test_prometheus_operator_cluster_renders_them_with_the_configured_labels(render):
    release = {"release": "kube-prometheus-stack"}
    objs = render({"metrics": {"serviceMonitor": {"labels": release}},
                   "prometheusRule": {"labels": release}}, api_versions=PROMETHEUS_OPERATOR)
    for kind in MONITORING_KINDS:
        labels = one(objs, kind)["metadata"]["labels"]
        assert labels["release"] == "kube-prometheus-stack", kind
        assert labels["app.kubernetes.io/part-of"] == "moe-eplb"
    alerts = {r["alert"] for g in one(objs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]}
    assert "MoEEPLBOperatorDown" in alerts  # the ServiceMonitor is there, so is its alert


@pytest.mark.parametrize("served", [BARE_CLUSTER, PROMETHEUS_OPERATOR])
def test_explicit_values_win_over_the_cluster(render, served):
    forced = render(VALUE_SETS["monitoring-forced"], api_versions=served)
    assert {o["kind"] for o in forced} >= MONITORING_KINDS
    off = render({"metrics": {"serviceMonitor": {"enabled": False}}, "prometheusRule": {"enabled": False}},
                 api_versions=served)
    assert not {o["kind"] for o in off} & MONITORING_KINDS
    # the rule without the ServiceMonitor: no operator-down alert (nothing would scrape the operator)
    rule_only = render({"metrics": {"serviceMonitor": {"enabled": False}}, "prometheusRule": {"enabled": True}},
                       api_versions=served)
    alerts = {r["alert"] for g in one(rule_only, "PrometheusRule")["spec"]["groups"] for r in g["rules"]}
    assert alerts and "MoEEPLBOperatorDown" not in alerts


def test_schema_takes_auto_true_false_only(chart):
    for good in ("auto", True, False):
        render_chart(chart, {"metrics": {"serviceMonitor": {"enabled": good}}, "prometheusRule": {"enabled": good}})
    for bad in ("yes", "Auto", 1, None):
        with pytest.raises(helm().HelmValuesError, match="enabled"):
            render_chart(chart, {"prometheusRule": {"enabled": bad}})


def test_dashboards_ship_as_sidecar_configmaps(render):
    cms = by_kind(render(), "ConfigMap")
    assert sorted(k for cm in cms for k in cm["data"]) == sorted(
        p.name for p in (CHART_DIR / "dashboards").glob("*.json"))
    for cm in cms:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        (name, text), = cm["data"].items()
        assert json.loads(text) == json.loads((CHART_DIR / "dashboards" / name).read_text())
        assert len(text.encode()) < 1_000_000  # ConfigMap limit


def test_schema_rejects_bad_values(chart):
    errors = helm().HelmValuesError
    for bad, field in (({"replicaCount": 0}, "replicaCount"),
                       ({"operator": {"watchNamespaces": ["Team_A"]}}, "watchNamespaces"),
                       ({"operator": {"prometheusUrl": "prometheus:9090"}}, "prometheusUrl"),
                       ({"prometheusRule": {"balancednessFor": "ten minutes"}}, "balancednessFor"),
                       ({"replicas": 2}, "replicas")):
        with pytest.raises(errors, match=field):
            render_chart(chart, bad)


def test_ha_without_peering_is_refused(chart):
    with pytest.raises(helm().HelmError, match="peering"):
        render_chart(chart, {"peering": {"enabled": False}})


def test_values_are_documented_field_by_field():
    """Every leaf key of values.yaml has a comment right above it, or an ancestor has one (for
    Kubernetes-typed blocks such as resources and securityContext)."""
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    keys: list[tuple[int, str, bool]] = []  # (indent, line, comment right above)
    undocumented = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "- ")) or ":" not in stripped:
            continue
        indent = len(line) - len(line.lstrip())
        commented = i > 0 and lines[i - 1].strip().startswith("#")
        keys = [k for k in keys if k[0] < indent]  # the ancestors
        ancestor_commented = any(k[2] for k in keys)
        keys.append((indent, stripped, commented))
        leaf = not stripped.endswith(":")
        if leaf and not (commented or ancestor_commented):
            undocumented.append(stripped)
    assert not undocumented, f"undocumented values: {undocumented}"
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert set(defaults) <= set(schema["properties"])


def test_cluster_wide_rbac_is_exactly_the_operators_rules(render):
    objs = render()
    assert one(objs, "ClusterRole")["rules"] == RBAC_RULES


def test_namespaced_rbac_grants_the_same_calls_per_namespace(render):
    objs = render(VALUE_SETS["namespaced"])
    cluster = set(grants(one(objs, "ClusterRole")["rules"]))
    roles = by_kind(objs, "Role")
    per_ns = [set(grants(r["rules"])) for r in roles]
    assert per_ns[0] == per_ns[1]
    expected = {(g, "kopfpeerings" if r == "clusterkopfpeerings" else r, v) for g, r, v in grants(RBAC_RULES)}
    expected |= set(grants(NAMESPACED_MODE_CLUSTER_RULES))
    assert cluster | per_ns[0] == expected  # nothing more, nothing less
    assert cluster == ({("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")}
                       | {("", "namespaces", v) for v in ("list", "watch")})
    assert set(grants(NAMESPACED_MODE_CLUSTER_RULES)) <= cluster  # kopf's namespace observer, cluster-wide
    assert not per_ns[0] & set(grants(NAMESPACED_MODE_CLUSTER_RULES))
    assert not any(r in {"customresourcedefinitions", "clusterkopfpeerings"} for _, r, _ in per_ns[0])


def test_generated_chart_files_are_up_to_date():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_chart", ROOT / "scripts" / "gen_chart.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    stale = [str(p.relative_to(ROOT)) for p, text in gen.render_all().items()
             if not p.exists() or p.read_text() != text]
    assert not stale, f"stale generated files {stale}: run python scripts/gen_chart.py"


def test_image_digest_and_existing_service_account(render, chart):
    objs = render({"image": {"digest": "sha256:" + "a" * 64},
                   "serviceAccount": {"create": False, "name": "my-sa"}, "peering": {"create": False}})
    spec = one(objs, "Deployment")["spec"]["template"]["spec"]
    assert spec["containers"][0]["image"] == "ghcr.io/moe-eplb/operator@sha256:" + "a" * 64
    assert spec["serviceAccountName"] == "my-sa"
    assert not by_kind(objs, "ServiceAccount") and not by_kind(objs, "ClusterKopfPeering")
    assert one(objs, "ClusterRoleBinding")["subjects"][0]["name"] == "my-sa"
    with pytest.raises(helm().HelmError, match="serviceAccount.name is required"):
        render_chart(chart, {"serviceAccount": {"create": False}})
