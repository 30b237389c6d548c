"""Install the Helm chart on the real control plane and run the operator it deploys.

There is no kubelet or container runtime here, so the chart's operator Deployment never gets a
running pod. :func:`start_chart_operator` runs what that pod would run, as that pod would: the
Deployment's container ``command``/``args`` and ``env`` (the ``moe-eplb`` console script of this
checkout's venv), logged in with a token of the chart's ServiceAccount -- so the RBAC rules under
test are the chart's own, never admin's. Ports are moved to free ones (several operators run at once).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import yaml

from moe_eplb_harness.floor import procs
from moe_eplb_harness.floor.procs import free_port
from moe_eplb_harness.real.controlplane import ControlPlane
from tests.chart.chart_support import CHART_DIR

MONITORING_CRDS = ("monitoring.coreos.com_podmonitors.yaml", "monitoring.coreos.com_servicemonitors.yaml",
                   "monitoring.coreos.com_prometheusrules.yaml")


def crd_path(name: str) -> pathlib.Path:
    """A published CRD fetched by ``tools/kube/crds.sh`` (``make kube``)."""
    path = CHART_DIR.parents[1] / "tools" / "kube" / "crds" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `make kube` (tools/kube/crds.sh)")
    return path


def render(release: str, namespace: str, values: dict[str, Any] | None = None, *,
           monitoring: bool = True) -> list[dict[str, Any]]:
    """``helm template RELEASE charts/moe-eplb-operator -n NAMESPACE`` (Helm's Go engine through
    helm-python-sdk) for a cluster that serves the Prometheus Operator's API (``monitoring``) or not."""
    from helm_python import Chart, _native

    chart = Chart.load(str(CHART_DIR))
    opts = {"name": release, "namespace": namespace, "is_install": True,
            "api_versions": ["monitoring.coreos.com/v1"] if monitoring else []}
    out = json.loads(_native.call_string("helm_render", chart._raw(), json.dumps(values or {}), json.dumps(opts)))
    objs: list[dict[str, Any]] = []
    for path, text in sorted(out.items()):
        if not path.endswith("NOTES.txt"):
            objs += [o for o in yaml.safe_load_all(text) if o]
    for obj in objs:
        if obj["kind"] not in ("ClusterRole", "ClusterRoleBinding", "Namespace"):
            obj["metadata"].setdefault("namespace", namespace)
    return objs


def apply(cp: ControlPlane, objs: list[dict[str, Any]], *, manager: str = "helm") -> None:
    """Server-side apply the objects as admin (what ``helm install`` does, in one go)."""
    out = cp.kubectl("apply", "--server-side", f"--field-manager={manager}", "--force-conflicts", "-f", "-",
                     input_text=yaml.safe_dump_all(objs), timeout=120)
    if out.returncode != 0:
        raise AssertionError(f"kubectl apply failed: {out.stderr}")


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, (kind, [o["metadata"]["name"] for o in found])
    return found[0]


class ChartOperator:
    """One operator process started from the chart's Deployment (see the module doc)."""

    def __init__(self, proc: subprocess.Popen[bytes], log: pathlib.Path, metrics_port: int, health_port: int) -> None:
        self.proc, self.log, self.metrics_port, self.health_port = proc, log, metrics_port, health_port

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        procs.stop(self.proc, timeout=15)


@contextlib.contextmanager
def start_chart_operator(cp: ControlPlane, objs: list[dict[str, Any]], workdir: pathlib.Path, *,
                         pod_name: str = "moe-eplb-operator-0", extra_env: dict[str, str] | None = None,
                         extra_args: tuple[str, ...] = ()) -> Iterator[ChartOperator]:
    """Run the chart's operator container as a local process under its ServiceAccount's token."""
    deploy = one(objs, "Deployment")
    namespace = deploy["metadata"]["namespace"]
    pod = deploy["spec"]["template"]["spec"]
    sa = pod["serviceAccountName"]
    container = next(c for c in pod["containers"] if c["name"] == "operator")
    token = cp.service_account_token(namespace, sa)
    workdir.mkdir(parents=True, exist_ok=True)
    kubeconfig = cp.write_kubeconfig(workdir / f"{pod_name}.kubeconfig", token, user=f"system:serviceaccount:{namespace}:{sa}",
                                     namespace=namespace)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_EPLB_")}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[item["name"]] = pod_name
        elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[item["name"]] = namespace
    metrics_port, health_port = free_port(), free_port()
    env.update({"MOE_EPLB_METRICS_PORT": str(metrics_port), "MOE_EPLB_HEALTH_PORT": str(health_port),
                "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"})
    env.update(extra_env or {})
    # the container's command is the moe-eplb console script; here the one of the test's Python
    exe = pathlib.Path(sys.executable).with_name(container["command"][0])
    argv = [str(exe), *container.get("args", []), *extra_args]
    log = workdir / f"{pod_name}.log"
    with open(log, "wb") as out:
        proc = procs.spawn(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    op = ChartOperator(proc, log, metrics_port, health_port)
    try:
        yield op
    finally:
        op.stop()


def wait_log(op: ChartOperator, words: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = op.output()
        if words in text:
            return text
        if op.proc.poll() is not None:
            raise AssertionError(f"operator exited ({op.proc.returncode}) before logging {words!r}:\n{text[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"operator did not log {words!r} within {timeout} s:\n{op.output()[-3000:]}")
