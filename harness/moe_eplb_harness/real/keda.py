"""KEDA -- the default backend of ``spec.autoscaling`` -- on a REAL control plane
(:mod:`moe_eplb_harness.real.controlplane` started with ``aggregator=True``): its operator turns the
ScaledObject the moe-eplb operator renders into an HPA on the MoEInference's ``/scale`` (and scales
from and to zero itself), and its metrics API server serves that HPA's external metric to the real
HPA controller. Built from ``github.com/kedacore/keda/v2`` v2.18.0 by ``tools/build-go-tool.sh
tools/keda`` (``make kube``); nothing here is emulated.

How it is wired, as KEDA's own manifests do on a cluster but on loopback:

- KEDA's CRDs (every kind its operator watches: ``tools/kube/crds.sh`` copies them from the same Go
  module) are installed;
- one self-signed certificate (its own CA: ``ca.crt`` = ``tls.crt``) for the Services' names,
  ``localhost`` and 127.0.0.1 is both the gRPC mTLS pair between the metrics server and the
  operator (KEDA reads ``ca.crt``/``tls.crt``/``tls.key`` from ``--cert-dir``; its own certificate
  rotation, ``--enable-cert-rotation``, is off) and the metrics server's serving certificate (the
  APIService's ``caBundle``);
- both run with the control plane's loopback admin kubeconfig (``KUBECONFIG``), as the other
  controllers here do, not with KEDA's ClusterRoles; ``WATCH_NAMESPACE`` empty (all namespaces),
  ``KEDA_CLUSTER_OBJECT_NAMESPACE``/``POD_NAMESPACE`` ``keda``; no leader election;
- the metrics server (``keda-adapter``) serves TLS on 127.0.0.1, delegates authentication and
  authorization to the apiserver and reaches the operator's gRPC metrics service at 127.0.0.1;
- an ``ExternalName`` Service ``keda/keda-metrics-apiserver`` (``localhost``) and the APIService
  ``v1beta1.external.metrics.k8s.io`` point the aggregator at it (see
  :mod:`moe_eplb_harness.real.metricsadapter` for why ExternalName).

``external.metrics.k8s.io`` has one server per cluster: KEDA and prometheus-adapter's external
rules do not run on one control plane together.

Public entry points: :func:`find_keda`, :func:`crd_files`, :class:`Keda` (``start()``/``stop()``,
``scaled_object()``, ``hpa()``, ``external_metric()``).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import subprocess
import urllib.error
import urllib.parse
from typing import Any

from moe_eplb.contracts import k8s_names
from moe_eplb_harness.floor import procs
from moe_eplb_harness.floor.procs import free_port
from moe_eplb_harness.real import aggregation
from moe_eplb_harness.real.controlplane import ControlPlane, ControlPlaneError, base64_file, serving_certificate, stop_process

VERSION = "v2.18.0"
MODULE = "github.com/kedacore/keda/v2"
NAMESPACE = "keda"
OPERATOR_SERVICE = "keda-operator"
SERVICE_NAME = "keda-metrics-apiserver"
EXTERNAL_GROUP, EXTERNAL_VERSION = "external.metrics.k8s.io", "v1beta1"
APISERVICE = f"{EXTERNAL_VERSION}.{EXTERNAL_GROUP}"
#: every CRD KEDA's operator watches (it stops when one is not served), as ``tools/kube/crds.sh`` names them
CRD_NAMES = ("keda.sh_scaledobjects.yaml", "keda.sh_scaledjobs.yaml", "keda.sh_triggerauthentications.yaml",
             "keda.sh_clustertriggerauthentications.yaml", "eventing.keda.sh_cloudeventsources.yaml",
             "eventing.keda.sh_clustercloudeventsources.yaml")
BINARIES = ("keda-operator", "keda-adapter")

_REPO = pathlib.Path(__file__).resolve().parents[3]


def default_keda_bin_dir() -> pathlib.Path:
    """``$MOE_EPLB_KEDA_BIN_DIR``, else ``tools/keda/bin`` of this checkout."""
    env = os.environ.get("MOE_EPLB_KEDA_BIN_DIR")
    return pathlib.Path(env) if env else _REPO / "tools" / "keda" / "bin"


def find_keda(folder: str | os.PathLike[str] | None = None) -> tuple[pathlib.Path, pathlib.Path] | None:
    """``(operator, metrics server)`` binaries built in ``folder``, or None when either is missing."""
    base = pathlib.Path(folder) if folder else default_keda_bin_dir()
    found = [base / b for b in BINARIES]
    if all(p.is_file() and os.access(p, os.X_OK) for p in found):
        return found[0], found[1]
    return None


def crd_files() -> list[pathlib.Path]:
    """KEDA's CRDs: those ``tools/kube/crds.sh`` fetched, else (a checkout whose ``tools/kube/crds``
    predates the extension) the same files from KEDA's Go module in Go's module cache."""
    fetched = _REPO / "tools" / "kube" / "crds"
    cache = _module_dir()
    out = []
    for name in CRD_NAMES:
        path = fetched / name
        if not path.exists() and cache is not None:
            path = cache / "config" / "crd" / "bases" / name
        if not path.exists():
            raise ControlPlaneError(f"KEDA's CRD {name} is missing from {fetched}: run `make kube` (tools/kube/crds.sh)")
        out.append(path)
    return out


def _module_dir() -> pathlib.Path | None:
    go = shutil.which("go")
    if go is None:
        return None
    try:
        out = subprocess.run([go, "env", "GOMODCACHE"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    path = pathlib.Path(out.stdout.strip()) / "github.com" / "kedacore" / "keda" / f"v2@{VERSION}"
    return path if path.is_dir() else None


class Keda(procs.Stoppable):
    """The built KEDA operator and metrics API server on ``cp`` (which must run with
    ``aggregator=True``). Logs go to ``workdir/keda-operator.log`` and ``workdir/keda-adapter.log``."""

    def __init__(self, cp: ControlPlane, workdir: str | os.PathLike[str], *,
                 bin_dir: str | os.PathLike[str] | None = None) -> None:
        found = find_keda(bin_dir)
        if found is None:
            raise ControlPlaneError(f"no KEDA built in {bin_dir or default_keda_bin_dir()}: "
                                    "run `make kube` (tools/build-go-tool.sh tools/keda)")
        aggregation.require(cp)
        self.operator_binary, self.adapter_binary = found
        self.cp = cp
        self.workdir = pathlib.Path(workdir)
        self.port = 0
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def log(self, name: str) -> pathlib.Path:
        return self.workdir / f"{name}.log"

    def log_tail(self, name: str = "keda-operator", lines: int = 30) -> str:
        path = self.log(name)
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def start(self, timeout: float = 90.0) -> None:
        """Install KEDA's CRDs, start the operator and the metrics server, register the APIService and
        return once the apiserver reports it ``Available``."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for path in crd_files():
            self.cp.install_crd(path)
        certs = self.workdir / "certs"
        names = [f"{s}.{NAMESPACE}.svc" for s in (OPERATOR_SERVICE, SERVICE_NAME)]
        crt, key = serving_certificate(certs, "tls", dns_names=(*names, *(n + ".cluster.local" for n in names), "localhost"))
        shutil.copyfile(crt, certs / "ca.crt")
        grpc_port = free_port()
        env = dict(os.environ, KUBECONFIG=str(self.cp.kubeconfig), WATCH_NAMESPACE="",
                   KEDA_CLUSTER_OBJECT_NAMESPACE=NAMESPACE, POD_NAMESPACE=NAMESPACE)
        self._spawn("keda-operator", [
            str(self.operator_binary), f"--metrics-bind-address=127.0.0.1:{free_port()}",
            f"--health-probe-bind-address=127.0.0.1:{free_port()}",
            f"--metrics-service-bind-address=127.0.0.1:{grpc_port}", f"--cert-dir={certs}",
            "--leader-elect=false", "--zap-log-level=info"], env)
        self.port = free_port()
        kubeconfig = str(self.cp.kubeconfig)
        self._spawn("keda-adapter", [
            str(self.adapter_binary), "--bind-address=127.0.0.1", f"--secure-port={self.port}",
            f"--tls-cert-file={crt}", f"--tls-private-key-file={key}", f"--cert-dir={certs}",
            f"--lister-kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}", f"--port={free_port()}",
            f"--metrics-service-address=127.0.0.1:{grpc_port}", "--zap-log-level=info"], env)
        self._register(base64_file(crt))
        self._wait_available(timeout)

    def stop(self) -> None:
        """Unregister the APIService (while the apiserver runs) and stop both processes."""
        with contextlib.suppress(urllib.error.URLError, OSError):
            self.cp.request("DELETE", f"/apis/apiregistration.k8s.io/v1/apiservices/{APISERVICE}", timeout=5)
        for proc in self.procs.values():
            stop_process(proc)
        self.procs.clear()

    def check_alive(self) -> None:
        """Raise with the log's tail if the operator or the metrics server has exited."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise ControlPlaneError(f"{name} exited with status {proc.returncode}; log: {self.log(name)}\n"
                                        f"{self.log_tail(name)}")

    # -- reads, as the HPA controller and a user see them -------------------------------------------
    def scaled_object(self, namespace: str, name: str) -> dict[str, Any]:
        group, version = k8s_names.KEDA_API_VERSION.split("/")
        return self.cp.request("GET", f"/apis/{group}/{version}/namespaces/{namespace}/scaledobjects/{name}")

    def hpa(self, namespace: str, name: str) -> dict[str, Any]:
        """The HorizontalPodAutoscaler KEDA made for ScaledObject ``name`` (``keda-hpa-<name>``)."""
        return self.cp.request("GET", f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers/"
                                      f"{k8s_names.KEDA_HPA_PREFIX}{name}")

    def external_metric(self, namespace: str, metric: str, scaled_object: str) -> list[float]:
        """The values KEDA's metrics server gives the HPA for ``metric`` (e.g. ``s0-prometheus``) of
        ``scaled_object``, read through the aggregator as the HPA controller reads them."""
        from moe_eplb.api.quantity import quantity_number as quantity

        selector = urllib.parse.quote(f"scaledobject.keda.sh/name={scaled_object}")
        out = self.cp.request("GET", f"/apis/{EXTERNAL_GROUP}/{EXTERNAL_VERSION}/namespaces/{namespace}/{metric}"
                                     f"?labelSelector={selector}")
        return [quantity(i["value"]) for i in out.get("items", [])]

    # -- internals --------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        with open(self.log(name), "ab") as out:
            self.procs[name] = procs.spawn(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           cwd=self.workdir, env=env)

    def _register(self, ca_bundle: str) -> None:
        aggregation.register(self.cp, namespace=NAMESPACE, service=SERVICE_NAME, port=self.port, ca_bundle=ca_bundle,
                             versions=[(EXTERNAL_GROUP, EXTERNAL_VERSION)])

    def _wait_available(self, timeout: float) -> None:
        aggregation.wait_available(self.cp, [APISERVICE], timeout, alive=self.check_alive,
                                   what=f"keda-adapter log: {self.log('keda-adapter')}\n{self.log_tail('keda-adapter')}")
