"""The REAL LeaderWorkerSet controller (``sigs.k8s.io/lws``, built by ``tools/build-go-tool.sh tools/lws``) run
against a :class:`~moe_eplb_harness.real.controlplane.ControlPlane` on loopback. Not an emulation.

What running it outside a cluster takes (all done by :class:`LwsController`):

- a kubeconfig: the control plane's admin one (``KUBECONFIG``);
- its ``--config`` file (``config.lws.x-k8s.io/v1alpha1`` ``Configuration``): leader election off,
  metrics and health probes on free loopback ports, ``internalCertManagement`` disabled and the
  webhook server on ``127.0.0.1:<port>`` with a certificate made here
  (:func:`~moe_eplb_harness.real.controlplane.serving_certificate`) (the
  controller otherwise writes its own into a Secret and patches in-cluster webhook Services);
- its webhooks registered: the published ``config/webhook/manifests.yaml`` of the module (copied to
  ``tools/lws/bin/webhook-manifests.yaml`` by the build) with each ``clientConfig.service`` rewritten
  to ``clientConfig.url: https://127.0.0.1:<port><path>`` and this CA as ``caBundle``. The webhooks
  must run: the pod webhook is what puts the group labels (``group-index``, ``worker-index``,
  ``group-key``), the size annotation and the ``LWS_*`` env on the pods of a group, and the LWS
  webhook defaults and validates the LeaderWorkerSet itself;
- kube-controller-manager's ``statefulset-controller`` (LWS writes a leader StatefulSet per LWS and
  a worker StatefulSet per group; the StatefulSet controller makes the pods).

Public entry points: :func:`find_lws_binary`, :class:`LwsController` (``start(plane)``, ``stop()``).
"""

from __future__ import annotations

import base64
import os
import pathlib
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any

import yaml

from moe_eplb_harness.floor import procs
from moe_eplb_harness.floor.procs import free_port, poll_ready
from moe_eplb_harness.real.controlplane import (
    ControlPlane,
    ControlPlaneError,
    serving_certificate,
    stop_process,
)

BINARY = "lws-controller"
MANIFESTS = "webhook-manifests.yaml"
#: kube-controller-manager controllers the real LWS controller needs beyond the default ones
CONTROLLERS = ("statefulset-controller",)
#: the webhook paths of its published manifests (v0.8.0); all must be served before they are registered
WEBHOOK_PATHS = ("/mutate--v1-pod", "/validate--v1-pod", "/mutate-leaderworkerset-x-k8s-io-v1-leaderworkerset",
                 "/validate-leaderworkerset-x-k8s-io-v1-leaderworkerset")


def default_lws_bin_dir() -> pathlib.Path:
    """``$MOE_EPLB_LWS_BIN``, else ``tools/lws/bin`` of the checkout this package lives in."""
    env = os.environ.get("MOE_EPLB_LWS_BIN")
    if env:
        return pathlib.Path(env)
    return pathlib.Path(__file__).resolve().parents[3] / "tools" / "lws" / "bin"


def find_lws_binary(folder: str | os.PathLike[str] | None = None) -> pathlib.Path | None:
    """The built controller (with its webhook manifests beside it), or ``None``."""
    base = pathlib.Path(folder) if folder else default_lws_bin_dir()
    binary = base / BINARY
    if binary.is_file() and os.access(binary, os.X_OK) and (base / MANIFESTS).is_file():
        return binary
    return None


def webhook_configurations(manifests: str, url: str, ca_pem: bytes) -> list[dict[str, Any]]:
    """The published webhook configurations with every webhook pointed at ``url`` + its path and
    trusting ``ca_pem`` (everything else -- rules, failure policy, names -- unchanged)."""
    out = []
    for doc in yaml.safe_load_all(manifests):
        if not doc:
            continue
        for hook in doc.get("webhooks") or []:
            service = (hook.get("clientConfig") or {}).get("service") or {}
            if "path" not in service:
                raise ControlPlaneError(f"webhook {hook.get('name')}: no clientConfig.service.path to rewrite")
            hook["clientConfig"] = {"url": url.rstrip("/") + service["path"],
                                    "caBundle": base64.b64encode(ca_pem).decode()}
        out.append(doc)
    return out


def config_document(*, webhook_port: int, cert_dir: str, metrics_port: int, health_port: int) -> dict[str, Any]:
    """The controller's ``--config``: no leader election, no internal cert management, loopback ports."""
    return {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1", "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": cert_dir},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
    }


class LwsController:
    """The real LWS controller process with its webhooks served and registered (see module doc).
    ``workdir``: its certificate, config file and log (``self.log``)."""

    def __init__(self, binary: pathlib.Path, workdir: str | os.PathLike[str]) -> None:
        self.binary = binary
        self.workdir = pathlib.Path(workdir)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.workdir / "lws-controller.log"
        self.webhook_port = self.health_port = self.metrics_port = 0
        self.started_s = 0.0

    def start(self, plane: ControlPlane, timeout: float = 60.0) -> None:
        """Start it against ``plane`` and register its webhooks; return once the webhook server
        answers (so a LeaderWorkerSet created next is defaulted, and its pods labelled)."""
        t0 = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        certs = self.workdir / "certs"
        # controller-runtime's webhook server reads tls.crt and tls.key from its certDir
        serving_certificate(certs, "tls", dns_names=("localhost",))
        self.webhook_port, self.metrics_port, self.health_port = free_port(), free_port(), free_port()
        config = self.workdir / "config.yaml"
        config.write_text(yaml.safe_dump(config_document(
            webhook_port=self.webhook_port, cert_dir=str(certs), metrics_port=self.metrics_port,
            health_port=self.health_port)))
        env = dict(os.environ, KUBECONFIG=str(plane.kubeconfig))
        with open(self.log, "ab") as out:
            self.proc = procs.spawn([str(self.binary), f"--config={config}", "--zap-log-level=info"],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=self.workdir, env=env)
        self._wait_webhook(certs / "tls.crt", timeout - (time.monotonic() - t0))
        manifests = (self.binary.parent / MANIFESTS).read_text()
        docs = webhook_configurations(manifests, f"https://127.0.0.1:{self.webhook_port}",
                                      (certs / "tls.crt").read_bytes())
        out = plane.kubectl("apply", "--server-side", "--field-manager=moe-eplb-tests", "-f", "-",
                            input_text=yaml.safe_dump_all(docs), timeout=60)
        if out.returncode != 0:
            raise ControlPlaneError(f"the LWS webhook configurations were refused: {out.stderr.strip()}")
        self.started_s = time.monotonic() - t0

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        self.proc = None

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ControlPlaneError(f"lws-controller exited with status {self.proc.returncode}; log: {self.log}\n"
                                    + self.log_tail())

    def log_tail(self, lines: int = 30) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def metrics(self) -> str:
        """Its Prometheus metrics (controller-runtime's: reconciles, webhook requests)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            return resp.read().decode()

    # -- internals --------------------------------------------------------------------------------
    def _wait_webhook(self, ca: pathlib.Path, timeout: float) -> None:
        """Until the health probe says ready and the webhook server serves every path with our CA."""
        import ssl

        ctx = ssl.create_default_context(cafile=str(ca))

        def ready() -> str | None:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2) as resp:
                if resp.status != 200:
                    return f"readyz {resp.status}"
            # the handlers are registered once the controllers are set up: until then a path is 404
            for path in WEBHOOK_PATHS:
                try:
                    urllib.request.urlopen(f"https://127.0.0.1:{self.webhook_port}{path}", context=ctx, timeout=2)
                except urllib.error.HTTPError as exc:
                    if exc.code == 404:
                        return f"webhook {path} not served yet"
            return None

        last = poll_ready(ready, timeout, alive=self.check_alive)
        if last is not None:
            raise ControlPlaneError(f"lws-controller not ready in time ({last}); log: {self.log}\n" + self.log_tail())
