"""``spec.engine.podTemplate`` on a REAL control plane: the generated PodSpec schema is what this
kube-apiserver serves for core/v1; every example's children (with their overlays) are accepted by a
server-side dry-run and then created, the LeaderWorkerSet under its published CRD; and the restricted
Pod Security example's pods pass the apiserver's PodSecurity admission while the same pods without the
overlay do not. (The overlay's admission cases are in tests/kube/test_admission.py.)"""

from __future__ import annotations

import copy
import json
import urllib.error
from typing import Any

import pytest
import yaml

from moe_eplb.api.crd import openapi_schema
from moe_eplb.api.validation import check
from moe_eplb.render.objects import render_children
from moe_eplb_harness.real.controlplane import apply_objects
from scripts import gen_podspec_schema as gen
from tests.example_manifests import EXAMPLES, load_moeinferences
from tests.kube.chart_install import MONITORING_CRDS, crd_path
from tests.kube.conftest import install_crd
from tests.require import missing

EXAMPLE_DOCS = [(p.name, i, d) for p in sorted(EXAMPLES.glob("*.yaml")) for i, d in enumerate(load_moeinferences(p))]


@pytest.fixture(scope="module")
def published_crds(control_plane) -> None:
    """The published CRDs of the children's kinds (LeaderWorkerSet, PodMonitor, KEDA's ScaledObject)."""
    names = ("leaderworkerset.x-k8s.io_leaderworkersets.yaml", "keda.sh_scaledobjects.yaml", MONITORING_CRDS[0])
    try:
        paths = [crd_path(n) for n in names]
    except FileNotFoundError as exc:
        missing(str(exc))
    for path in paths:
        install_crd(control_plane, path)


@pytest.fixture(scope="module")
def served(control_plane) -> dict[str, Any]:
    return control_plane.request("GET", "/openapi/v3/api/v1")


def test_the_apiservers_openapi_generates_the_committed_schema(served) -> None:
    """The core group's OpenAPI v3 as this kube-apiserver serves it gives the committed block
    (regenerate with ``python scripts/gen_podspec_schema.py``)."""
    assert gen.crd_block(gen.CRD_YAML.read_text(encoding="utf-8")) == gen.block_yaml(served)


def test_regenerate_is_idempotent(served, tmp_path) -> None:
    target = tmp_path / "crd.yaml"
    target.write_text(gen.CRD_YAML.read_text(encoding="utf-8"))
    assert gen.regenerate(served, target) is False
    target.write_text(target.read_text().replace("hostNetwork:", "hostNetwerk:", 1))
    assert gen.regenerate(served, target) is True
    assert target.read_text() == gen.CRD_YAML.read_text(encoding="utf-8")


def test_every_podspec_field_of_the_release_is_in_the_crd(served) -> None:
    upstream = set(served["components"]["schemas"][gen.POD_SPEC]["properties"])
    node = openapi_schema()["properties"]["spec"]["properties"]["engine"]["properties"]["podTemplate"]
    assert set(node["properties"]["spec"]["properties"]) == upstream
    assert {"containers", "volumes", "tolerations", "affinity", "securityContext", "priorityClassName"} <= upstream


def children_in(cp: Any, ns: str, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Create the MoEInference in ``ns`` and render its children (owned by it, in ``ns``)."""
    body = copy.deepcopy(doc)
    body["metadata"]["namespace"] = ns
    created = cp.request("POST", f"/apis/eplb.ai/v1alpha1/namespaces/{ns}/moeinferences", body)
    checked = check(created)
    assert checked.inference is not None and checked.problems == [], checked.problems
    return render_children(checked.inference)


@pytest.mark.parametrize(("name", "index", "doc"), EXAMPLE_DOCS, ids=[f"{n}[{i}]" for n, i, _ in EXAMPLE_DOCS])
def test_example_children_dry_run_then_created(control_plane, published_crds, kube_ns, name, index, doc) -> None:
    cp = control_plane
    kids = children_in(cp, kube_ns, doc)
    text = yaml.safe_dump_all(kids)
    dry = cp.kubectl("apply", "--server-side", "--dry-run=server", "--field-manager=moe-eplb", "-f", "-",
                     input_text=text, timeout=120)
    assert dry.returncode == 0, (name, dry.stderr)
    real = apply_objects(cp, kids, field_manager="moe-eplb")
    assert real.returncode == 0, (name, real.stderr)
    for kid in kids:
        if kid["kind"] in ("Deployment", "LeaderWorkerSet"):
            group = "apps/v1" if kid["kind"] == "Deployment" else "leaderworkerset.x-k8s.io/v1"
            plural = kid["kind"].lower() + "s"
            got = cp.request("GET", f"/apis/{group}/namespaces/{kube_ns}/{plural}/{kid['metadata']['name']}")
            # what the apiserver stored is what was rendered: nothing of the overlay pruned
            if kid["kind"] == "Deployment":
                templates = [(kid["spec"]["template"], got["spec"]["template"])]
            else:
                lw, glw = kid["spec"]["leaderWorkerTemplate"], got["spec"]["leaderWorkerTemplate"]
                templates = [(lw["leaderTemplate"], glw["leaderTemplate"]), (lw["workerTemplate"], glw["workerTemplate"])]
            for want, have in templates:
                for c_want in want["spec"]["containers"]:
                    c_have = next(c for c in have["spec"]["containers"] if c["name"] == c_want["name"])
                    for key in ("env", "envFrom", "securityContext", "volumeMounts"):
                        if key in c_want:
                            assert c_have[key] == _with_defaults(c_want[key], c_have[key]), (name, key)
                for key in ("labels", "annotations"):
                    assert want["metadata"].get(key, {}).items() <= have["metadata"].get(key, {}).items()


def _with_defaults(want: Any, have: Any) -> Any:
    """``want`` with the keys the apiserver defaults (e.g. ``fieldRef.apiVersion``) taken from ``have``."""
    if isinstance(want, dict) and isinstance(have, dict):
        return {**{k: v for k, v in have.items() if k not in want}, **{k: _with_defaults(v, have.get(k)) for k, v in want.items()}}
    if isinstance(want, list) and isinstance(have, list) and len(want) == len(have):
        return [_with_defaults(w, h) for w, h in zip(want, have)]
    return want


def _restricted_pod(cp: Any, ns: str, doc: dict[str, Any]) -> tuple[int, str]:
    kids = children_in(cp, ns, doc)
    template = next(k for k in kids if k["kind"] == "Deployment")["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "engine", **template["metadata"]},
           "spec": template["spec"]}
    try:
        cp.request("POST", f"/api/v1/namespaces/{ns}/pods?dryRun=All", pod)
        return 201, ""
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}").get("message", "")


def test_restricted_example_passes_pod_security_admission(control_plane) -> None:
    cp = control_plane
    path = EXAMPLES / "qwen3-30b-a3b-restricted.yaml"
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    namespace = next(d for d in docs if d["kind"] == "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    ns = "psa-" + namespace["metadata"]["name"]
    cp.request("POST", "/api/v1/namespaces", {**namespace, "metadata": {**namespace["metadata"], "name": ns}})
    try:
        doc = load_moeinferences(path)[0]
        code, message = _restricted_pod(cp, ns, doc)
        assert code == 201, message
        plain = copy.deepcopy(doc)
        plain["metadata"]["name"] = "without-overlay"
        del plain["spec"]["engine"]["podTemplate"]
        code, message = _restricted_pod(cp, ns, plain)
        assert code == 403 and "violates PodSecurity" in message and "restricted" in message, (code, message)
    finally:
        cp.request("DELETE", f"/api/v1/namespaces/{ns}")


def test_client_side_apply_can_record_the_crd(control_plane) -> None:
    """A client-side ``kubectl apply`` records the whole CRD in an annotation (256 kB at most): the
    generated schema leaves it room (docs/resource.md says so)."""
    from tests.kube.conftest import CRD_FILE

    out = control_plane.kubectl("apply", "--dry-run=server", "-f", str(CRD_FILE), timeout=120)
    assert out.returncode == 0, out.stderr
