"""A user's kubectl session on a REAL control plane: the CRD (``crds/`` and the chart's copy) installs,
``kubectl apply`` (client-side, with the server's OpenAPI validation), ``apply --server-side``,
``--dry-run=server``, ``get moe`` columns, ``describe moe``, ``scale moe``, and ``delete`` with the
dependents garbage-collected by the real garbage collector. kubectl is built from the same Kubernetes
release as the server (``tools/kube/build.sh``)."""

from __future__ import annotations

import copy
import pathlib

import pytest
import yaml

from tests.example_manifests import EXAMPLES, load_moeinferences
from tests.kube.conftest import CRD_FILE, REPO, install_crd, wait_for

SEED_FILE = EXAMPLES / "qwen3-vl-30b-a3b-awq-eplb.yaml"
CHART_CRDS = REPO / "charts" / "moe-eplb-operator" / "crds"


def in_namespace(path: pathlib.Path, ns: str, tmp: pathlib.Path) -> pathlib.Path:
    """The example file with every document moved to namespace ``ns`` (examples say ``default``)."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for d in docs:
        d.setdefault("metadata", {})["namespace"] = ns
    out = tmp / path.name
    out.write_text(yaml.safe_dump_all(docs))
    return out


def moe_path(ns: str, name: str = "") -> str:
    return f"/apis/eplb.ai/v1alpha1/namespaces/{ns}/moeinferences" + (f"/{name}" if name else "")


def test_the_crd_installs_with_its_printer_columns_and_subresources(control_plane) -> None:
    crd = control_plane.request("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/moeinferences.eplb.ai")
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"]["labelSelectorPath"] == ".status.selector"
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names[:3] == ["Model", "EP", "Redundant"] and "Balancedness" in names
    # the apiserver kept every CEL rule (none dropped, none refused for cost)
    ours = next(d for d in yaml.safe_load_all(CRD_FILE.read_text()) if d)["spec"]["versions"][0]
    assert _rule_count(version["schema"]) == _rule_count(ours["schema"]) > 30


def _rule_count(node) -> int:
    if isinstance(node, dict):
        return len(node.get("x-kubernetes-validations", [])) + sum(_rule_count(v) for v in node.values())
    if isinstance(node, list):
        return sum(_rule_count(v) for v in node)
    return 0


def test_the_charts_crds_install_and_equal_crds_folder(control_plane) -> None:
    for path in sorted(CHART_CRDS.glob("*.yaml")):
        install_crd(control_plane, path)
    chart_copy = [d for d in yaml.safe_load_all((CHART_CRDS / CRD_FILE.name).read_text()) if d]
    assert chart_copy == [d for d in yaml.safe_load_all(CRD_FILE.read_text()) if d]
    peering = control_plane.request("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/kopfpeerings.kopf.dev")
    assert peering["spec"]["scope"] == "Namespaced"


def test_apply_client_side_then_server_side_then_dry_run(control_plane, kube_ns, tmp_path) -> None:
    seed_file = in_namespace(SEED_FILE, kube_ns, tmp_path)
    out = control_plane.kubectl("apply", "-n", kube_ns, "-f", str(seed_file))
    assert out.returncode == 0, out.stderr
    assert "moeinference.eplb.ai/qwen3-vl-30b created" in out.stdout
    # the same file again, server-side: kubectl's client-side apply manager and SSA coexist
    out = control_plane.kubectl("apply", "--server-side", "-n", kube_ns, "-f", str(seed_file))
    assert out.returncode == 0, out.stderr
    assert "serverside-applied" in out.stdout
    # a bad change is refused by the server at dry-run, with the field named, and nothing stored
    bad = copy.deepcopy(load_moeinferences(seed_file)[0])
    bad["spec"]["eplb"]["numRedundantExperts"] = 7
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    out = control_plane.kubectl("apply", "--dry-run=server", "-n", kube_ns, "-f", str(path))
    assert out.returncode != 0
    assert "spec.eplb.numRedundantExperts" in out.stderr and "divisible" in out.stderr
    stored = control_plane.request("GET", moe_path(kube_ns, "qwen3-vl-30b"))
    assert stored["spec"]["eplb"]["numRedundantExperts"] == 8
    # a typo is refused by kubectl's strict field validation against the server's schema
    typo = copy.deepcopy(load_moeinferences(seed_file)[0])
    typo["spec"]["eplb"]["windowsize"] = 10
    path.write_text(yaml.safe_dump(typo))
    out = control_plane.kubectl("apply", "-n", kube_ns, "-f", str(path))
    assert out.returncode != 0 and 'unknown field "spec.eplb.windowsize"' in out.stderr


def test_server_side_apply_conflicts_with_another_manager(control_plane, kube_ns, tmp_path) -> None:
    seed_file = in_namespace(SEED_FILE, kube_ns, tmp_path)
    out = control_plane.kubectl("apply", "--server-side", "--field-manager=alice", "-n", kube_ns, "-f", str(seed_file))
    assert out.returncode == 0, out.stderr
    doc = copy.deepcopy(load_moeinferences(seed_file)[0])
    doc["spec"]["eplb"]["windowSize"] = 1000
    out = control_plane.kubectl("apply", "--server-side", "--field-manager=bob", "-n", kube_ns, "-f", "-",
                                input_text=yaml.safe_dump(doc))
    assert out.returncode != 0 and "conflict" in out.stderr.lower() and ".spec.eplb.windowSize" in out.stderr


def test_get_describe_scale_delete(control_plane, kube_ns, tmp_path) -> None:
    seed_file = in_namespace(SEED_FILE, kube_ns, tmp_path)
    assert control_plane.kubectl("apply", "-n", kube_ns, "-f", str(seed_file)).returncode == 0
    # what the operator writes through /status (printer columns and /scale read it)
    status = {"status": {"epSize": 4, "eplb": {"numRedundantExperts": 8, "windowSize": 3000, "stepInterval": 1000},
                         "balancedness": 0.93, "phase": "Running", "replicas": 1, "readyReplicas": 1,
                         "selector": "eplb.ai/inference=qwen3-vl-30b",
                         "conditions": [{"type": "Ready", "status": "True", "reason": "Ready", "message": "ok",
                                         "lastTransitionTime": "2026-12-01T00:00:00Z"}]}}
    control_plane.request("PATCH", moe_path(kube_ns, "qwen3-vl-30b") + "/status", status,
                          content_type="application/merge-patch+json")
    out = control_plane.kubectl("get", "moe", "-n", kube_ns)
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()[:2]
    assert header.split() == ["NAME", "MODEL", "EP", "REDUNDANT", "WINDOW", "INTERVAL", "BALANCEDNESS", "DESIRED",
                              "READY-REPLICAS", "READY", "AGE"]
    assert row.split()[:10] == ["qwen3-vl-30b", "cpatonn/Qwen3-VL-30B-A3B-Instruct-AWQ-4bit", "4", "8", "3000", "1000",
                                "0.93", "1", "1", "True"]
    wide = control_plane.kubectl("get", "moe", "-n", kube_ns, "-o", "wide").stdout
    assert "PHASE" in wide.splitlines()[0] and "MAX" in wide.splitlines()[0] and "Running" in wide
    described = control_plane.kubectl("describe", "moe", "qwen3-vl-30b", "-n", kube_ns).stdout
    assert "Kind:         MoEInference" in described and "Num Redundant Experts:  8" in described
    # /scale: kubectl scale writes spec.replicas; the Scale reports the status selector
    out = control_plane.kubectl("scale", "moe", "qwen3-vl-30b", "-n", kube_ns, "--replicas=3")
    assert out.returncode == 0, out.stderr
    scale = control_plane.request("GET", moe_path(kube_ns, "qwen3-vl-30b") + "/scale")
    assert scale["spec"]["replicas"] == 3 and scale["status"]["selector"] == "eplb.ai/inference=qwen3-vl-30b"
    assert control_plane.request("GET", moe_path(kube_ns, "qwen3-vl-30b"))["spec"]["replicas"] == 3
    # delete: a dependent (ownerReference to the resource) is collected by the real garbage collector
    owner = control_plane.request("GET", moe_path(kube_ns, "qwen3-vl-30b"))
    ref = {"apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference", "name": "qwen3-vl-30b",
           "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
    control_plane.request("POST", f"/api/v1/namespaces/{kube_ns}/configmaps", {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "child", "ownerReferences": [ref]}})
    out = control_plane.kubectl("delete", "moe", "qwen3-vl-30b", "-n", kube_ns, "--wait=true", "--timeout=60s")
    assert out.returncode == 0, out.stderr
    gone = wait_for(lambda: _absent(control_plane, f"/api/v1/namespaces/{kube_ns}/configmaps/child"), timeout=60,
                    what="owned ConfigMap garbage-collected")
    assert gone


def _absent(cp, path: str) -> bool:
    import urllib.error

    try:
        cp.request("GET", path)
        return False
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return True
        raise


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: pathlib.Path(p).name)
def test_every_example_applies_with_kubectl(control_plane, kube_ns, path, tmp_path) -> None:
    out = control_plane.kubectl("apply", "--dry-run=server", "-n", kube_ns, "-f", str(in_namespace(path, kube_ns, tmp_path)))
    assert out.returncode == 0, out.stderr
