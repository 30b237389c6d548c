"""The user's path with the real Helm CLI (``helm`` v4.3.2, built from ``helm.sh/helm/v4`` by ``make
kube``) on a real control plane of its own (``helm install`` creates CRDs and ``helm uninstall``
leaves them; the shared plane's other tests must not see that): ``helm install`` without the
Prometheus Operator's API, the steps of docs/chart.md's *Upgrading* from the previous chart version
(a changed CRD) once that API is served, ``helm test``, ``helm uninstall`` (what stays) and
``helm install`` again, with the chart's operator (run from the release's own manifest, under its
ServiceAccount) reconciling a MoEInference throughout.

The previous chart version is the chart as it was before the last commit that changed its CRD
(``git archive <that commit>^ charts/moe-eplb-operator``); without git history (a shallow clone) it
is the current chart with one printer column taken out of its CRD (:func:`previous_chart`).
"""

from __future__ import annotations

import copy
import json
import pathlib
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from moe_eplb_harness.real.controlplane import ControlPlane, control_plane, find_binaries
from moe_eplb_harness.real.helmcli import Helm, find_helm
from tests.chart.chart_support import CHART_DIR
from tests.kube.chart_install import MONITORING_CRDS, crd_path, start_chart_operator
from tests.kube.conftest import tiny_resource, wait_for
from tests.require import missing

pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")

REPO = CHART_DIR.parents[1]
CHART_REL = CHART_DIR.relative_to(REPO)
CRD_REL = CHART_REL / "crds" / "moeinferences.eplb.ai.yaml"
CRD_NAME = "moeinferences.eplb.ai"
RELEASE, NS, APP_NS = "moe-eplb", "moe-system", "team-a"
MOE = f"/apis/eplb.ai/v1alpha1/namespaces/{APP_NS}/moeinferences/tiny"
CHILD = f"/apis/apps/v1/namespaces/{APP_NS}/deployments/tiny"
CRD_PATH = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}"

RESOURCE: dict[str, Any] = tiny_resource("tiny", APP_NS, replicas=1)


def previous_chart(dest: pathlib.Path) -> tuple[pathlib.Path, str]:
    """The previous chart version with a changed CRD, written under ``dest``; and what it is."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout

    dest.mkdir(parents=True, exist_ok=True)
    try:
        commit = git("log", "-n1", "--no-merges", "--format=%H", "--", str(CRD_REL)).strip()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", f"{commit}^", str(CHART_REL)],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        # the operator this test runs under the old release is today's code: it gets today's RBAC
        # rules (a real upgrade changes the image and the rules together); the CRD stays the old one
        shutil.copy(CHART_DIR / "files" / "rbac-rules.yaml", dest / CHART_REL / "files" / "rbac-rules.yaml")
        return dest / CHART_REL, f"the chart at {commit[:12]}^ (before its CRD last changed), today's RBAC rules"
    except (subprocess.CalledProcessError, FileNotFoundError):  # no git history here
        shutil.copytree(CHART_DIR, dest / CHART_REL)
        crd = yaml.safe_load((dest / CRD_REL).read_text())
        crd["spec"]["versions"][0]["additionalPrinterColumns"].pop()
        (dest / CRD_REL).write_text(yaml.safe_dump(crd, sort_keys=False))
        return dest / CHART_REL, "the current chart with one printer column less in its CRD"


@pytest.fixture(scope="module")
def plane(tmp_path_factory) -> Iterator[ControlPlane]:
    absent = []
    if find_binaries() is None:
        absent.append("no control plane built (run `make kube`)")
    if find_helm() is None:
        absent.append("no helm built at tools/helm/bin/helm (run `make kube`)")
    if absent:
        missing("; ".join(absent))
    with control_plane(tmp_path_factory.mktemp("helm-plane")) as cp:
        yield cp


def served_crd(cp: ControlPlane) -> dict[str, Any]:
    return cp.request("GET", CRD_PATH)["spec"]["versions"]


def file_crd(path: pathlib.Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())["spec"]["versions"]



def child_replicas(cp: ControlPlane, n: int) -> bool:
    child = cp.get_or_none(CHILD)
    return child is not None and child["spec"]["replicas"] == n


def set_replicas(cp: ControlPlane, n: int) -> None:
    cp.request("PATCH", MOE, {"spec": {"replicas": n}}, content_type="application/merge-patch+json")


def value_keys(chart: pathlib.Path) -> set[str]:
    """Dotted paths of every value the chart's values.yaml sets."""
    def walk(node: Any, prefix: str) -> set[str]:
        if isinstance(node, dict) and node:
            return {k for key, v in node.items() for k in walk(v, f"{prefix}{key}.")}
        return {prefix[:-1]}

    return walk(yaml.safe_load((chart / "values.yaml").read_text()), "")


def release(helm: Helm) -> dict[str, Any]:
    (rel,) = json.loads(helm.ok("list", "-n", NS, "-o", "json"))
    return rel


def test_helm_cli_install_upgrade_test_uninstall(plane, tmp_path) -> None:
    cp, helm = plane, Helm(plane, tmp_path / "helm")
    old_chart, which = previous_chart(tmp_path / "previous")
    assert file_crd(old_chart / "crds" / "moeinferences.eplb.ai.yaml") != file_crd(CHART_DIR / "crds" / "moeinferences.eplb.ai.yaml"), which

    # 1. helm install (the previous version), no Prometheus Operator API: CRDs from crds/, no monitoring objects
    notes = helm.ok("install", RELEASE, str(old_chart), "-n", NS, "--create-namespace")
    assert "No ServiceMonitor" in notes and "No PrometheusRule" in notes, notes
    assert served_crd(cp) == file_crd(old_chart / "crds" / "moeinferences.eplb.ai.yaml"), which
    objs = helm.manifest(RELEASE, NS)
    assert not {"ServiceMonitor", "PrometheusRule"} & {o["kind"] for o in objs}
    assert release(helm)["status"] == "deployed" and release(helm)["revision"] == "1"
    cp.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": APP_NS}})
    with start_chart_operator(cp, objs, tmp_path / "op1", pod_name="op-v1", extra_args=("--standalone",)) as op:
        cp.request("POST", MOE.rsplit("/", 1)[0], copy.deepcopy(RESOURCE))
        assert wait_for(lambda: child_replicas(cp, 1), timeout=60, what="the MoEInference's Deployment"), op.output()[-3000:]

        # 2. the Prometheus Operator's CRDs arrive; docs/chart.md's upgrade: CRDs by kubectl, then helm upgrade
        for name in MONITORING_CRDS:
            cp.install_crd(crd_path(name))
        # Helm created the CRDs and owns their fields: without --force-conflicts this apply is refused
        # ("conflict with \"helm\": .spec.versions"); docs/chart.md says so
        out = cp.kubectl("apply", "--server-side", "-f", str(CHART_DIR / "crds"))
        assert out.returncode != 0 and 'conflict with "helm"' in out.stderr, out.stderr
        out = cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART_DIR / "crds"))
        assert out.returncode == 0, out.stderr
        assert served_crd(cp) == file_crd(CHART_DIR / "crds" / "moeinferences.eplb.ai.yaml")
        # --reuse-values keeps the old release's values without the new chart's defaults: a value the
        # new version added is missing and values.schema.json refuses the upgrade (docs say so)
        added = value_keys(CHART_DIR) - value_keys(old_chart)
        out = helm.run("upgrade", RELEASE, str(CHART_DIR), "-n", NS, "--reuse-values")
        if added:
            assert out.returncode != 0 and "missing propert" in out.stderr, (sorted(added), out.stderr)
        else:
            helm.ok("rollback", RELEASE, "1", "-n", NS)
        helm.ok("upgrade", RELEASE, str(CHART_DIR), "-n", NS, "--reset-then-reuse-values")
        assert release(helm)["status"] == "deployed"
        objs = helm.manifest(RELEASE, NS)
        kinds = {o["kind"] for o in objs}
        assert {"ServiceMonitor", "PrometheusRule"} <= kinds  # auto: the API is served now
        for o in objs:
            if o["kind"] in ("ServiceMonitor", "PrometheusRule"):
                assert cp.request("GET", f"/apis/monitoring.coreos.com/v1/namespaces/{NS}/{o['kind'].lower()}s/"
                                  f"{o['metadata']['name']}")
        set_replicas(cp, 2)  # the old operator still serves until its replacement starts
        assert wait_for(lambda: child_replicas(cp, 2), timeout=60, what="scaled by the old operator"), op.output()[-3000:]
    with start_chart_operator(cp, objs, tmp_path / "op2", pod_name="op-v2", extra_args=("--standalone",)) as op:
        set_replicas(cp, 3)
        assert wait_for(lambda: child_replicas(cp, 3), timeout=60, what="scaled by the upgraded operator"), op.output()[-3000:]

        # 3. helm test: the chart ships no test hooks
        out = helm.run("test", RELEASE, "-n", NS)
        assert out.returncode == 0, out.stderr
        assert not (CHART_DIR / "templates" / "tests").exists()

    # 4. helm uninstall: the CRDs, the MoEInference and its engine stay; the release's objects go
    helm.ok("uninstall", RELEASE, "-n", NS)
    assert served_crd(cp) == file_crd(CHART_DIR / "crds" / "moeinferences.eplb.ai.yaml")
    assert cp.get_or_none("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/clusterkopfpeerings.kopf.dev")
    assert cp.get_or_none(MOE) is not None and child_replicas(cp, 3)
    dep = next(o for o in objs if o["kind"] == "Deployment")["metadata"]["name"]
    role = next(o for o in objs if o["kind"] == "ClusterRole")["metadata"]["name"]
    assert wait_for(lambda: cp.get_or_none(f"/apis/apps/v1/namespaces/{NS}/deployments/{dep}") is None
                    and cp.get_or_none(f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{role}") is None,
                    what="the release's objects deleted")

    # 5. helm install again, the CRDs already there and the monitoring API served: it adopts the MoEInference
    notes = helm.ok("install", RELEASE, str(CHART_DIR), "-n", NS)
    assert "No ServiceMonitor" not in notes and "No PrometheusRule" not in notes, notes
    objs = helm.manifest(RELEASE, NS)
    with start_chart_operator(cp, objs, tmp_path / "op3", pod_name="op-v3", extra_args=("--standalone",)) as op:
        set_replicas(cp, 1)
        assert wait_for(lambda: child_replicas(cp, 1), timeout=60, what="scaled after reinstall"), op.output()[-3000:]
