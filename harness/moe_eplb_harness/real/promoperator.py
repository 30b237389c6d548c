"""The real Prometheus Operator on a REAL control plane (:mod:`moe_eplb_harness.real.controlplane`), and a real
Prometheus started with the configuration it generates. Built from its Go module by ``make kube``
(``tools/build.sh``: ``github.com/prometheus-operator/prometheus-operator`` v0.94.0, ``cmd/operator``);
nothing here is emulated.

How it is wired, as on a cluster but on loopback:

- the operator runs as a local process with the admin kubeconfig (``$KUBECONFIG``), its web
  endpoint on a free loopback port, and the Prometheus Operator's published CRDs installed (copied
  from its module to ``tools/prometheus-operator/bin/crds`` at build time);
- a ``Prometheus`` resource (:func:`prometheus_resource`, selecting PodMonitors, ServiceMonitors and
  PrometheusRules as kube-prometheus-stack's does) makes the operator write the generated
  configuration into the Secret ``prometheus-<name>`` (``prometheus.yaml.gz``) and the selected
  rules into the ConfigMaps ``prometheus-<name>-rulefiles-<n>``. Its StatefulSet has no kubelet to
  run it; :func:`generated_config` reads that Secret and :func:`rule_files` those ConfigMaps instead;
- :func:`localize` does what the pod's config-reloader sidecar does and rewrites only what a pod
  would find in its mounts and a loopback process does not: the ``$(SHARD)`` and ``$(POD_NAME)``
  placeholders the operator writes are expanded (the reloader expands them from the pod's
  environment: shard 0, pod ``prometheus-<name>-0``), the ``kubernetes_sd_configs`` get the control
  plane's kubeconfig (in a pod: in-cluster credentials from the mounted ServiceAccount), and
  ``rule_files`` point at the folder the rule ConfigMaps were written to (in a pod:
  ``/etc/prometheus/rules/...``). Every scrape config, selector, relabeling and rule is the
  operator's, unchanged;
- :func:`moe_eplb_harness.floor.prometheus.start_prometheus` runs a real Prometheus with it: its service
  discovery lists the pods from the real apiserver (their loopback IPs written by the node agent,
  :mod:`moe_eplb_harness.real.nodeagent`) and scrapes them. That Prometheus is built by ``make kube`` too
  (:func:`prometheus_server`, ``tools/prometheus``: ``github.com/prometheus/prometheus`` at the
  version the operator requires, Prometheus 3.14.0, with its kubernetes service discovery): the
  Debian package's ``prometheus`` 2.42 has no ``kubernetes_sd_configs`` (Debian builds it without
  that plugin).

Public entry points: :func:`find_operator`, :func:`operator_crds`, :func:`prometheus_server`,
:func:`prometheus_release`, :class:`PrometheusOperator`,
:func:`prometheus_resource`, :func:`generated_config`, :func:`rule_files`, :func:`localize`.
"""

from __future__ import annotations

import base64
import gzip
import os
import pathlib
import subprocess
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import yaml

from moe_eplb_harness.floor import procs
from moe_eplb_harness.floor.procs import free_port, poll_ready
from moe_eplb_harness.real.controlplane import ControlPlane, ControlPlaneError

#: where a Prometheus pod mounts the operator's rule ConfigMaps (``/etc/prometheus/rules/<configmap>/``)
POD_RULES_DIR = "/etc/prometheus/rules"
#: files a pod reads from its mounts; a generated config naming one cannot run on loopback unchanged
POD_ONLY_PREFIXES = ("/etc/prometheus/", "/var/run/secrets/")


def _tool_dir() -> pathlib.Path:
    return pathlib.Path(__file__).resolve().parents[3] / "tools" / "prometheus-operator"


def default_operator_binary() -> pathlib.Path:
    """``$MOE_EPLB_PROMETHEUS_OPERATOR_BIN``, else ``tools/prometheus-operator/bin/prometheus-operator``."""
    env = os.environ.get("MOE_EPLB_PROMETHEUS_OPERATOR_BIN")
    return pathlib.Path(env) if env else _tool_dir() / "bin" / "prometheus-operator"


def _executable(p: pathlib.Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


def find_operator(path: str | os.PathLike[str] | None = None) -> pathlib.Path | None:
    """The built operator binary (with its CRDs beside it, ``crds/``) when the Prometheus it
    configures (:func:`prometheus_server`) is built too, or ``None``."""
    p = pathlib.Path(path) if path else default_operator_binary()
    ok = _executable(p) and _executable(prometheus_server()) and any((p.parent / "crds").glob("*.yaml"))
    return p if ok else None


def prometheus_server() -> pathlib.Path:
    """``$MOE_EPLB_PROMETHEUS_SERVER_BIN``, else ``tools/prometheus/bin/prometheus`` (Prometheus 3.14.0
    with the kubernetes service discovery, ``make kube``)."""
    env = os.environ.get("MOE_EPLB_PROMETHEUS_SERVER_BIN")
    return pathlib.Path(env) if env else _tool_dir().parent / "prometheus" / "bin" / "prometheus"


def prometheus_release(server: str | os.PathLike[str]) -> str:
    """``v3.14.0``: the release a ``prometheus`` binary reports (a ``Prometheus``'s ``spec.version``)."""
    out = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=30)
    return "v" + (out.stdout + out.stderr).split("version ", 1)[1].split()[0].split("+")[0]


def operator_crds(binary: str | os.PathLike[str] | None = None) -> list[pathlib.Path]:
    """The Prometheus Operator's published CRDs of the built release (``bin/crds/*.yaml``)."""
    folder = pathlib.Path(binary or default_operator_binary()).parent / "crds"
    return sorted(folder.glob("*.yaml"))


def prometheus_resource(name: str, namespace: str, *, select: Mapping[str, str], version: str,
                        scrape_interval: str = "1s", evaluation_interval: str = "1s") -> dict[str, Any]:
    """A ``Prometheus`` that selects ServiceMonitors, PodMonitors and PrometheusRules labelled
    ``select`` in every namespace (kube-prometheus-stack's selectors: ``release: <its release>``).
    ``version``: the Prometheus release the configuration is generated for (the binary that runs it)."""
    selector = {"matchLabels": dict(select)}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "Prometheus",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"version": version, "replicas": 1, "serviceAccountName": "prometheus",
                     "scrapeInterval": scrape_interval, "evaluationInterval": evaluation_interval,
                     "serviceMonitorSelector": selector, "serviceMonitorNamespaceSelector": {},
                     "podMonitorSelector": selector, "podMonitorNamespaceSelector": {},
                     "ruleSelector": selector, "ruleNamespaceSelector": {}}}


class PrometheusOperator(procs.Stoppable):
    """The operator process (``start()`` / ``stop()``); its log is ``<workdir>/prometheus-operator.log``."""

    def __init__(self, cp: ControlPlane, workdir: str | os.PathLike[str], *,
                 binary: str | os.PathLike[str] | None = None) -> None:
        self.cp = cp
        self.workdir = pathlib.Path(workdir)
        self.binary = pathlib.Path(binary) if binary else default_operator_binary()
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / "prometheus-operator.log"

    def install_crds(self, timeout: float = 60.0) -> list[str]:
        """Install the operator's published CRDs (idempotent) and wait until each is established;
        their names. (Not :meth:`ControlPlane.install_crd`: PyYAML cannot load the AlertmanagerConfig
        CRD, whose enum has a bare ``=``; the names come from controller-gen's file names,
        ``<group>_<plural>.yaml``.)"""
        paths = operator_crds(self.binary)
        args = [a for p in paths for a in ("-f", str(p))]
        out = self.cp.kubectl("apply", "--server-side", "--force-conflicts", *args, timeout=180)
        if out.returncode != 0:
            raise ControlPlaneError(f"the Prometheus Operator's CRDs were refused: {out.stderr.strip()}")
        names = [".".join(reversed(p.stem.split("_", 1))) for p in paths]
        out = self.cp.kubectl("wait", "--for=condition=Established", f"--timeout={int(timeout)}s",
                              *(f"crd/{n}" for n in names), timeout=timeout + 30)
        if out.returncode != 0:
            raise ControlPlaneError(f"the Prometheus Operator's CRDs were not established: {out.stderr.strip()}")
        return names

    def start(self, timeout: float = 60.0) -> PrometheusOperator:
        if find_operator(self.binary) is None:
            raise ControlPlaneError(f"no Prometheus Operator built at {self.binary} (run `make kube`)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        argv = [str(self.binary), f"--web.listen-address=127.0.0.1:{self.port}", "--log-level=info", "--log-format=logfmt"]
        env = {**os.environ, "KUBECONFIG": str(self.cp.kubeconfig)}  # it reads $KUBECONFIG (no flag)
        with open(self.log_path, "wb") as log:
            self.proc = procs.spawn(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

        def ready() -> str | None:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1) as r:
                return None if r.status == 200 else f"HTTP {r.status}"

        def alive() -> None:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"exited ({self.proc.returncode})")

        try:
            why = poll_ready(ready, timeout, alive=alive, interval=0.2)
        except RuntimeError as exc:
            why = str(exc)
        if why is not None:
            self.stop()
            raise ControlPlaneError(f"the Prometheus Operator did not start ({why}): {self.log_tail()}")
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            procs.stop(proc, timeout=10)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def generated_config(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any] | None:
    """The configuration the operator generated for ``Prometheus`` ``namespace/name`` (its Secret
    ``prometheus-<name>``, key ``prometheus.yaml.gz``), or ``None`` while there is none."""
    secret = cp.get_or_none(f"/api/v1/namespaces/{namespace}/secrets/prometheus-{name}")
    data = (secret or {}).get("data") or {}
    if "prometheus.yaml.gz" in data:
        text = gzip.decompress(base64.b64decode(data["prometheus.yaml.gz"])).decode()
    elif "prometheus.yaml" in data:
        text = base64.b64decode(data["prometheus.yaml"]).decode()
    else:
        return None
    return yaml.safe_load(text)


def rule_files(cp: ControlPlane, namespace: str, name: str) -> dict[str, dict[str, str]]:
    """The rule ConfigMaps the operator wrote for ``Prometheus`` ``namespace/name``:
    ``{configmap name: {file name: rules YAML}}``."""
    listed = cp.request("GET", f"/api/v1/namespaces/{namespace}/configmaps")
    prefix = f"prometheus-{name}-rulefiles-"
    return {cm["metadata"]["name"]: dict(cm.get("data") or {}) for cm in listed.get("items", [])
            if cm["metadata"]["name"].startswith(prefix)}


def _pod_paths(node: Any, where: str = "") -> list[str]:
    """``where: path`` of every string naming a file a pod would read from its mounts."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _pod_paths(v, f"{where}.{k}" if where else str(k))]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _pod_paths(v, f"{where}[{i}]")]
    if isinstance(node, str) and node.startswith(POD_ONLY_PREFIXES):
        return [f"{where}: {node}"]
    return []


def _expand(node: Any, env: Mapping[str, str]) -> Any:
    """``$(NAME)`` replaced by ``env[NAME]`` in every string (the config-reloader's expansion)."""
    if isinstance(node, dict):
        return {k: _expand(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_expand(v, env) for v in node]
    if isinstance(node, str):
        for name, value in env.items():
            node = node.replace(f"$({name})", value)
    return node


def localize(config: Mapping[str, Any], cp: ControlPlane, rules: Mapping[str, Mapping[str, str]],
             workdir: str | os.PathLike[str], *, name: str = "k8s") -> dict[str, Any]:
    """The generated ``config`` of ``Prometheus`` ``name`` with what a pod has and a loopback process
    has not supplied (see the module doc): the config-reloader's ``$(SHARD)``/``$(POD_NAME)``,
    kubeconfig for service discovery, the rule files written under ``workdir``. Raises
    ControlPlaneError naming any other pod-only file the configuration still refers to."""
    work = pathlib.Path(workdir)
    out = _expand(yaml.safe_load(yaml.safe_dump(dict(config))), {"SHARD": "0", "POD_NAME": f"prometheus-{name}-0"})
    for sc in out.get("scrape_configs") or []:
        for sd in sc.get("kubernetes_sd_configs") or []:
            if "api_server" in sd or "kubeconfig_file" in sd:
                raise ControlPlaneError(f"scrape config {sc.get('job_name')}: unexpected apiserver settings {sd}")
            sd["kubeconfig_file"] = str(cp.kubeconfig)  # in a pod: the in-cluster ServiceAccount
    local_rules = work / "rules"
    for cm, files in rules.items():
        (local_rules / cm).mkdir(parents=True, exist_ok=True)
        for fname, text in files.items():
            (local_rules / cm / fname).write_text(text)
    out["rule_files"] = [str(local_rules / pathlib.Path(f).relative_to(POD_RULES_DIR))
                         if f.startswith(POD_RULES_DIR + "/") else f for f in out.get("rule_files") or []]
    left = _pod_paths(out)
    if left:
        raise ControlPlaneError("the generated configuration names files only a pod has: " + "; ".join(left))
    return out
