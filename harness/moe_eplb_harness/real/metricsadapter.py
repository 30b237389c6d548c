"""prometheus-adapter as the ``custom.metrics.k8s.io`` and ``external.metrics.k8s.io`` APIs of a REAL control plane
(:mod:`moe_eplb_harness.real.controlplane` started with ``aggregator=True``), serving vLLM's metrics from a
real Prometheus to the real HPA controller. Built from its Go module by ``tools/build-go-tool.sh tools/adapter``
(``make kube``); nothing here is emulated.

How it is wired, as on a cluster but on loopback:

- the adapter (``sigs.k8s.io/prometheus-adapter`` v0.12.0) serves TLS on 127.0.0.1 with a
  self-signed certificate for ``prometheus-adapter.kube-system.svc`` (the name the aggregator checks),
  delegates authentication and authorization to the apiserver (admin kubeconfig), trusts the
  apiserver's front-proxy client certificate through ``kube-system/extension-apiserver-authentication``
  and reads Prometheus at ``prometheus_url`` with :func:`adapter_config`'s rules;
- a Service ``kube-system/prometheus-adapter`` of type ``ExternalName`` (``localhost``) stands for it:
  the aggregator proxies an APIService to its Service's cluster IP (no kube-proxy here) or, with
  ``--enable-aggregator-routing``, to an endpoint -- and the apiserver refuses loopback addresses in
  Endpoints and EndpointSlices, while an ExternalName Service is resolved to ``https://<name>:<port>``;
- APIServices ``v1beta1`` and ``v1beta2.custom.metrics.k8s.io`` and ``v1beta1.external.metrics.k8s.io``
  point at that Service, with the certificate as ``caBundle``.

Public entry points: :func:`find_adapter`, :func:`adapter_config` (the metric names it serves:
:func:`moe_eplb.contracts.metric_names.adapter_metric_name`),
:class:`PrometheusAdapter` (``start()`` / ``stop()``, ``pod_metric()``, ``external_metric()``).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import urllib.error
import urllib.parse
from collections.abc import Sequence
from typing import Any

import yaml

from moe_eplb.api.quantity import quantity_number
from moe_eplb.contracts import metric_names, vllm_facts
from moe_eplb_harness.floor import procs
from moe_eplb_harness.floor.procs import free_port
from moe_eplb_harness.real import aggregation
from moe_eplb_harness.real.controlplane import ControlPlane, ControlPlaneError, base64_file, serving_certificate, stop_process

SERVICE_NAMESPACE = "kube-system"
SERVICE_NAME = "prometheus-adapter"
GROUP = "custom.metrics.k8s.io"
EXTERNAL_GROUP = "external.metrics.k8s.io"
#: the API versions the adapter serves; the HPA controller picks the preferred one by discovery
VERSIONS = ("v1beta1", "v1beta2")
API_VERSIONS = tuple((GROUP, v) for v in VERSIONS) + ((EXTERNAL_GROUP, "v1beta1"),)
#: vLLM's series the adapter exposes per pod by default
DEFAULT_SERIES = (vllm_facts.REQUESTS_WAITING,)


def default_adapter_binary() -> pathlib.Path:
    """``$MOE_EPLB_ADAPTER_BIN``, else ``tools/adapter/bin/adapter`` of this checkout."""
    env = os.environ.get("MOE_EPLB_ADAPTER_BIN")
    if env:
        return pathlib.Path(env)
    return pathlib.Path(__file__).resolve().parents[3] / "tools" / "adapter" / "bin" / "adapter"


def find_adapter(path: str | os.PathLike[str] | None = None) -> pathlib.Path | None:
    """The built adapter binary, or ``None``."""
    p = pathlib.Path(path) if path else default_adapter_binary()
    return p if p.is_file() and os.access(p, os.X_OK) else None


def adapter_config(series: Sequence[str] = DEFAULT_SERIES) -> dict[str, Any]:
    """prometheus-adapter's ``--config`` for each vLLM gauge in ``series``:

    - a custom (Pods) metric: per pod, from the ``namespace`` and ``pod`` labels the scrape config (a
      PodMonitor) puts on every series; a pod's value is the sum over its engines (``engine`` label);
    - an external metric of the same name: the sum over the series an HPA's ``selector`` picks in its
      namespace (e.g. ``moeinference: <name>``, the label the PodMonitor copies from the pods).
    """
    rules, external = [], []
    for s in series:
        prefix, _, rest = s.partition(":")
        name = {"matches": f"^{prefix}:({rest})$", "as": f"{prefix}_${{1}}"}
        rules.append({
            "seriesQuery": f'{s}{{namespace!="",pod!=""}}',
            "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
            "name": name, "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
        })
        external.append({
            "seriesQuery": f'{s}{{namespace!="",{metric_names.MOEINFERENCE_LABEL}!=""}}',
            "resources": {"overrides": {"namespace": {"resource": "namespace"}}},
            "name": name, "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>})",
        })
    return {"rules": rules, "externalRules": external}


class PrometheusAdapter(procs.Stoppable):
    """The built prometheus-adapter serving ``custom.metrics.k8s.io`` on ``cp`` from ``prometheus_url``.

    ``cp`` must run with ``aggregator=True``. ``relist_seconds``: how often the adapter lists the
    series Prometheus has (a pod's series is served only after a relist has seen it). Logs go to
    ``workdir/prometheus-adapter.log``.
    """

    def __init__(self, cp: ControlPlane, prometheus_url: str, workdir: str | os.PathLike[str], *,
                 binary: str | os.PathLike[str] | None = None, series: Sequence[str] = DEFAULT_SERIES,
                 relist_seconds: float = 2.0) -> None:
        found = find_adapter(binary)
        if found is None:
            raise ControlPlaneError(f"no prometheus-adapter built at {binary or default_adapter_binary()}: "
                                    "run `make kube` (tools/build-go-tool.sh tools/adapter)")
        aggregation.require(cp)
        self.binary, self.cp, self.prometheus_url = found, cp, prometheus_url
        self.workdir = pathlib.Path(workdir)
        self.series, self.relist_seconds = tuple(series), relist_seconds
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.workdir / "prometheus-adapter.log"

    def start(self, timeout: float = 60.0) -> None:
        """Start the adapter, register its Service and APIServices, and return once the apiserver
        reports them ``Available`` (the aggregator reached the adapter through TLS and front-proxy auth)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        crt, key = serving_certificate(self.workdir, SERVICE_NAME, dns_names=(
            f"{SERVICE_NAME}.{SERVICE_NAMESPACE}.svc", "localhost"))
        config = self.workdir / "adapter-config.yaml"
        config.write_text(yaml.safe_dump(adapter_config(self.series)))
        self.port = free_port()
        kubeconfig = str(self.cp.kubeconfig)
        with open(self.log, "ab") as out:
            self.proc = procs.spawn([
                str(self.binary), "--bind-address=127.0.0.1", f"--secure-port={self.port}",
                f"--tls-cert-file={crt}", f"--tls-private-key-file={key}", f"--cert-dir={self.workdir}",
                f"--lister-kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}", f"--prometheus-url={self.prometheus_url}",
                f"--config={config}", f"--metrics-relist-interval={self.relist_seconds}s", "--v=2"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir)
        self._register(base64_file(crt))
        self._wait_available(timeout)

    def stop(self) -> None:
        """Unregister the APIServices (while the apiserver runs) and stop the adapter."""
        for group, version in API_VERSIONS:
            with contextlib.suppress(urllib.error.URLError, OSError):
                self.cp.request("DELETE", f"/apis/apiregistration.k8s.io/v1/apiservices/{version}.{group}", timeout=5)
        if self.proc is not None:
            stop_process(self.proc)
        self.proc = None

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""

    def pod_metric(self, namespace: str, metric: str, selector: str = "") -> dict[str, float]:
        """``pod -> value`` of a custom metric as the HPA controller reads it (through the aggregator)."""
        query = f"?labelSelector={urllib.parse.quote(selector)}" if selector else ""
        out = self.cp.request("GET", f"/apis/{GROUP}/{VERSIONS[-1]}/namespaces/{namespace}/pods/*/{metric}{query}")
        return {i["describedObject"]["name"]: quantity_number(i["value"]) for i in out.get("items", [])}

    def external_metric(self, namespace: str, metric: str, selector: str = "") -> list[float]:
        """The values of an external metric as the HPA controller reads it (through the aggregator)."""
        query = f"?labelSelector={urllib.parse.quote(selector)}" if selector else ""
        out = self.cp.request("GET", f"/apis/{EXTERNAL_GROUP}/v1beta1/namespaces/{namespace}/{metric}{query}")
        return [quantity_number(i["value"]) for i in out.get("items", [])]

    # -- internals --------------------------------------------------------------------------------
    def _register(self, ca_bundle: str) -> None:
        aggregation.register(self.cp, namespace=SERVICE_NAMESPACE, service=SERVICE_NAME, port=self.port,
                             ca_bundle=ca_bundle, versions=list(API_VERSIONS))

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ControlPlaneError(f"prometheus-adapter exited with status {self.proc.returncode}; "
                                    f"log: {self.log}\n{self.log_tail()}")

    def _wait_available(self, timeout: float) -> None:
        aggregation.wait_available(self.cp, [f"{v}.{g}" for g, v in API_VERSIONS], timeout, alive=self._check_alive,
                                   what=f"adapter log: {self.log}\n{self.log_tail()}")


