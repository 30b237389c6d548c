"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager (and
optionally kube-scheduler), built from Kubernetes' own Go modules by ``tools/kube/build.sh``.

This is the real thing, not an emulation: the CRD's structural schema, CEL rules and their cost
budget, printer columns, ``/status`` and ``/scale``, server-side apply, RBAC, admission, and the real
garbage-collector, namespace, service-account, Deployment, ReplicaSet and HPA controllers. What it
does not have is a kubelet or a container runtime: pods stay ``Pending`` unless something binds them
and reports their status (``moe_eplb_harness.real.nodeagent`` can).

Used by the test suite's ``kube`` tier (``tests/kube``) and by ``moe-eplb demo`` when the binaries
are built. Public entry points:

- :func:`find_binaries` -- where the built binaries are (``$MOE_EPLB_KUBE_BIN``, else
  ``tools/kube/bin`` of this checkout), or ``None``;
- :class:`ControlPlane` -- ``with ControlPlane(binaries, workdir) as cp:`` starts etcd, the apiserver
  and the controller manager (ready in seconds), writes an admin kubeconfig (``cp.kubeconfig``) and
  stops everything on exit; ``cp.logs`` holds each process's log file. ``aggregator=True`` also
  configures the aggregation layer (a front-proxy CA and client certificate, the ``requestheader``
  flags), so an extension API server such as prometheus-adapter can be registered with an APIService
  (:mod:`moe_eplb_harness.real.metricsadapter`);
- :func:`serving_certificate` -- a self-signed serving certificate for such an extension server.

Only the standard library here: the TLS material is made with the ``openssl`` command, HTTP calls use
``urllib``; the async client the tests share with the emulation is :class:`moe_eplb_harness.real.realapi.RealCluster`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.resources
import json
import os
import pathlib
import secrets
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import yaml

from moe_eplb.api.crd import CRD_FILE
from moe_eplb_harness.floor import procs
from moe_eplb_harness.floor.procs import free_port, poll_ready

#: the binaries ``tools/kube/build.sh`` builds, by role
BINARY_NAMES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")

#: the controllers of kube-controller-manager the project relies on (names as its ``--controllers``
#: takes them in 1.36): ownerReference garbage collection, namespace deletion, default service
#: accounts and their tokens, Deployment -> ReplicaSet -> Pod, and the HPA controller (``/scale``;
#: a world with the emulated one runs without it: moe_eplb_harness/emulated/hpa.py)
HPA_CONTROLLER = "horizontal-pod-autoscaler-controller"
DEFAULT_CONTROLLERS = (
    "garbage-collector-controller", "namespace-controller", "serviceaccount-controller",
    "serviceaccount-token-controller", "deployment-controller", "replicaset-controller",
    HPA_CONTROLLER, "disruption-controller", "endpointslice-controller",
)

ADMIN_USER = "moe-eplb-admin"

#: the common name of the client certificate the apiserver's aggregator proxies requests with
#: (``--requestheader-allowed-names``); extension API servers trust it through the
#: ``kube-system/extension-apiserver-authentication`` ConfigMap the apiserver publishes
FRONT_PROXY_CLIENT = "front-proxy-client"


class ControlPlaneError(RuntimeError):
    """A control-plane process failed to start or to become ready (the message names its log)."""


@dataclasses.dataclass(frozen=True)
class Binaries:
    """Paths of the built binaries (``scheduler`` and ``kubectl`` may be absent)."""

    etcd: pathlib.Path
    apiserver: pathlib.Path
    controller_manager: pathlib.Path
    scheduler: pathlib.Path | None
    kubectl: pathlib.Path | None
    folder: pathlib.Path

    def version(self) -> str:
        """The apiserver's ``--version`` line, e.g. ``Kubernetes v1.36.3``."""
        out = subprocess.run([str(self.apiserver), "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip()


def default_bin_dir() -> pathlib.Path:
    """``$MOE_EPLB_KUBE_BIN``, else ``tools/kube/bin`` of the checkout this package lives in."""
    env = os.environ.get("MOE_EPLB_KUBE_BIN")
    if env:
        return pathlib.Path(env)
    return pathlib.Path(__file__).resolve().parents[3] / "tools" / "kube" / "bin"


def find_binaries(folder: str | os.PathLike[str] | None = None) -> Binaries | None:
    """The built control plane in ``folder`` (default :func:`default_bin_dir`), or ``None`` when
    etcd, kube-apiserver or kube-controller-manager is missing there."""
    base = pathlib.Path(folder) if folder else default_bin_dir()

    def path(name: str) -> pathlib.Path | None:
        p = base / name
        return p if p.is_file() and os.access(p, os.X_OK) else None

    etcd, apiserver, kcm = path("etcd"), path("kube-apiserver"), path("kube-controller-manager")
    if not (etcd and apiserver and kcm):
        return None
    return Binaries(etcd=etcd, apiserver=apiserver, controller_manager=kcm, scheduler=path("kube-scheduler"),
                    kubectl=path("kubectl"), folder=base)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM a child's process group, SIGKILL it after 10 s, and reap it (nothing when it already
    exited); :func:`moe_eplb_harness.floor.procs.stop`."""
    procs.stop(proc)


def kubeconfig_dict(server: str, ca_file: str | os.PathLike[str], token: str, *, user: str = "admin",
                    namespace: str = "default") -> dict[str, Any]:
    """A kubeconfig (as a dict) for ``server`` with the CA file and a bearer token."""
    ca = base64_file(ca_file)
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": user, "preferences": {},
        "clusters": [{"name": "moe-eplb-kube", "cluster": {"server": server, "certificate-authority-data": ca}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "moe-eplb-kube", "user": user, "namespace": namespace}}],
    }


def base64_file(path: str | os.PathLike[str]) -> str:
    import base64

    return base64.b64encode(pathlib.Path(path).read_bytes()).decode()


class ControlPlane(procs.Stoppable):
    """etcd + kube-apiserver + kube-controller-manager (+ kube-scheduler) on loopback.

    ``workdir``: where data, keys, kubeconfigs and logs go (kept after :meth:`stop`, so a failed
    test's logs can be read). ``controllers``: kube-controller-manager's ``--controllers``.
    ``scheduler``: also run kube-scheduler (pods then need Nodes to be scheduled on).
    ``aggregator``: configure the aggregation layer (front-proxy CA, client certificate and the
    ``--requestheader-*`` / ``--proxy-client-*`` flags) for extension API servers behind APIServices.
    """

    def __init__(self, binaries: Binaries, workdir: str | os.PathLike[str], *,
                 controllers: Sequence[str] = DEFAULT_CONTROLLERS, scheduler: bool = False,
                 extra_apiserver_args: Sequence[str] = (), aggregator: bool = False) -> None:
        self.binaries = binaries
        self.workdir = pathlib.Path(workdir)
        self.controllers = tuple(controllers)
        self.with_scheduler = scheduler and binaries.scheduler is not None
        self.extra_apiserver_args = tuple(extra_apiserver_args)
        self.aggregator = aggregator
        self.admin_token = secrets.token_hex(16)
        self.port = 0
        self.url = ""
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, pathlib.Path] = {}
        self.started_s = 0.0

    # -- paths ------------------------------------------------------------------------------------
    @property
    def ca_file(self) -> pathlib.Path:
        """The apiserver's self-signed serving certificate (it is its own CA)."""
        return self.workdir / "certs" / "apiserver.crt"

    @property
    def kubeconfig(self) -> pathlib.Path:
        """The admin kubeconfig (``system:masters``)."""
        return self.workdir / "admin.kubeconfig"

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, timeout: float = 90.0) -> None:
        """Start etcd, the apiserver and the controller manager; return once the apiserver is ready
        and the ``default`` namespace and its ServiceAccount exist."""
        t0 = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "certs").mkdir(exist_ok=True)
        self._keys()
        etcd_port, peer_port = free_port(), free_port()
        self._spawn("etcd", [
            str(self.binaries.etcd), "--data-dir", str(self.workdir / "etcd"), "--unsafe-no-fsync",
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer_port}", "--log-level", "warn"])
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self._spawn("kube-apiserver", [
            str(self.binaries.apiserver), f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", f"--secure-port={self.port}", "--advertise-address=127.0.0.1",
            f"--cert-dir={self.workdir / 'certs'}", "--tls-cert-file", str(self.ca_file),
            "--tls-private-key-file", str(self.workdir / "certs" / "apiserver.key"),
            "--service-cluster-ip-range=10.0.0.0/24", "--allow-privileged=true",
            "--authorization-mode=RBAC", f"--token-auth-file={self.workdir / 'tokens.csv'}",
            f"--service-account-issuer={self.url}/",
            f"--service-account-key-file={self.workdir / 'sa.pub'}",
            f"--service-account-signing-key-file={self.workdir / 'sa.key'}",
            "--enable-priority-and-fairness=false", "--profiling=false", "--v=1",
            *self._aggregator_args(), *self.extra_apiserver_args])
        self._write_kubeconfig(self.kubeconfig, self.admin_token, user="admin")
        self._wait_ready(timeout - (time.monotonic() - t0))
        self._spawn("kube-controller-manager", [
            str(self.binaries.controller_manager), f"--kubeconfig={self.kubeconfig}",
            f"--controllers={','.join(self.controllers)}",
            f"--service-account-private-key-file={self.workdir / 'sa.key'}",
            f"--root-ca-file={self.ca_file}", "--use-service-account-credentials=true",
            "--leader-elect=false", "--secure-port=0", "--concurrent-gc-syncs=5",
            "--horizontal-pod-autoscaler-sync-period=5s", "--v=1"])
        if self.with_scheduler and self.binaries.scheduler is not None:
            self._spawn("kube-scheduler", [
                str(self.binaries.scheduler), f"--kubeconfig={self.kubeconfig}", "--leader-elect=false",
                "--secure-port=0", "--v=1"])
        self._wait_default_service_account(timeout - (time.monotonic() - t0))
        self.started_s = time.monotonic() - t0

    def stop(self) -> None:
        """Stop every process (controller manager and scheduler first, etcd last); keep the workdir."""
        for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                stop_process(proc)

    def check_alive(self) -> None:
        """Raise :class:`ControlPlaneError` naming the process and its log if one has exited."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise ControlPlaneError(f"{name} exited with status {proc.returncode}; log: {self.logs[name]}\n"
                                        + self.log_tail(name))

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.logs.get(name)
        if not path or not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # -- credentials ------------------------------------------------------------------------------
    def write_kubeconfig(self, path: str | os.PathLike[str], token: str, *, user: str = "user",
                         namespace: str = "default") -> pathlib.Path:
        """Write a kubeconfig for this apiserver with ``token`` (e.g. a ServiceAccount's)."""
        return self._write_kubeconfig(pathlib.Path(path), token, user=user, namespace=namespace)

    def service_account_token(self, namespace: str, name: str, *, seconds: int = 3600) -> str:
        """A bound token for ServiceAccount ``namespace/name`` (TokenRequest API), to act as it."""
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": seconds}}
        out = self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token", body)
        return str(out["status"]["token"])

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def request(self, method: str, path: str, body: Any = None, *, token: str | None = None,
                content_type: str = "application/json", timeout: float = 30.0) -> Any:
        """One blocking API call as admin (or ``token``); raises ``urllib.error.HTTPError`` on >= 400."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {token or self.admin_token}", "Content-Type": content_type,
            "Accept": "application/json"})
        with urllib.request.urlopen(req, context=self.ssl_context(), timeout=timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def get_or_none(self, path: str) -> Any:
        """GET ``path`` as admin; None when the object is not there (404), other errors raise."""
        try:
            return self.request("GET", path)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def kubectl(self, *args: str, kubeconfig: str | os.PathLike[str] | None = None, input_text: str | None = None,
                check: bool = False, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run the built kubectl (same release as the server) against this control plane."""
        if self.binaries.kubectl is None:
            raise ControlPlaneError(f"no kubectl in {self.binaries.folder}: run tools/kube/build.sh")
        env = dict(os.environ, KUBECONFIG=str(kubeconfig or self.kubeconfig), KUBECACHEDIR=str(self.workdir / "kubecache"))
        return subprocess.run([str(self.binaries.kubectl), *args], input=input_text, capture_output=True, text=True,
                              env=env, timeout=timeout, check=check)

    def install_crd(self, path: str | os.PathLike[str], timeout: float = 30.0) -> list[str]:
        """``kubectl apply --server-side`` a CRD file (one or more CRDs) and wait until the apiserver
        serves each (``Established`` and ``NamesAccepted``); their names."""
        out = self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path), timeout=120)
        if out.returncode != 0:
            raise ControlPlaneError(f"the CRD in {path} was refused: {out.stderr.strip()}")
        names = [d["metadata"]["name"] for d in yaml.safe_load_all(pathlib.Path(path).read_text())
                 if d and d.get("kind") == "CustomResourceDefinition"]
        deadline = time.monotonic() + timeout
        for name in names:
            while True:
                obj = self.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
                conds = {c["type"]: c["status"] for c in (obj.get("status") or {}).get("conditions") or []}
                if conds.get("Established") == "True" and conds.get("NamesAccepted") == "True":
                    break
                if time.monotonic() > deadline:
                    raise ControlPlaneError(f"CRD {name} not established within {timeout} s: {conds}")
                time.sleep(0.1)
        return names

    # -- internals --------------------------------------------------------------------------------
    def _aggregator_args(self) -> list[str]:
        """The aggregation layer's flags: the apiserver proxies to an APIService's server with the
        front-proxy client certificate and the user in ``X-Remote-*`` headers, which the extension
        server trusts because the certificate chains to ``--requestheader-client-ca-file``."""
        if not self.aggregator:
            return []
        certs = self.workdir / "certs"
        return [f"--requestheader-client-ca-file={certs / 'front-proxy-ca.crt'}",
                f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
                "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={certs / 'front-proxy-client.crt'}",
                f"--proxy-client-key-file={certs / 'front-proxy-client.key'}"]

    def _front_proxy_keys(self, openssl: str) -> None:
        """The front-proxy CA and the client certificate it signs (CN ``front-proxy-client``)."""
        certs = self.workdir / "certs"
        if (certs / "front-proxy-client.crt").exists():
            return
        run = lambda *a: subprocess.run([openssl, *a], check=True, capture_output=True, timeout=60)  # noqa: E731
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30", "-subj", "/CN=moe-eplb-front-proxy-ca",
            "-keyout", str(certs / "front-proxy-ca.key"), "-out", str(certs / "front-proxy-ca.crt"),
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={FRONT_PROXY_CLIENT}",
            "-keyout", str(certs / "front-proxy-client.key"), "-out", str(certs / "front-proxy-client.csr"))
        ext = certs / "front-proxy-client.ext"
        ext.write_text("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                       "extendedKeyUsage=clientAuth\n")
        run("x509", "-req", "-in", str(certs / "front-proxy-client.csr"), "-CA", str(certs / "front-proxy-ca.crt"),
            "-CAkey", str(certs / "front-proxy-ca.key"), "-CAcreateserial", "-days", "30", "-extfile", str(ext),
            "-out", str(certs / "front-proxy-client.crt"))

    def _keys(self) -> None:
        """The service-account signing key pair, the apiserver's serving certificate (for 127.0.0.1
        and localhost, so clients can verify it) and the static admin token."""
        openssl = shutil.which("openssl")
        if openssl is None:
            raise ControlPlaneError("the openssl command is needed to make the control plane's keys")
        run = lambda *a: subprocess.run([openssl, *a], check=True, capture_output=True, timeout=60)  # noqa: E731
        if not (self.workdir / "sa.key").exists():
            run("genrsa", "-out", str(self.workdir / "sa.key"), "2048")
            run("rsa", "-in", str(self.workdir / "sa.key"), "-pubout", "-out", str(self.workdir / "sa.pub"))
        if not self.ca_file.exists():
            run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30", "-subj", "/CN=moe-eplb-kube-apiserver",
                "-keyout", str(self.workdir / "certs" / "apiserver.key"), "-out", str(self.ca_file),
                "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost,IP:10.0.0.1,DNS:kubernetes.default.svc",
                "-addext", "basicConstraints=critical,CA:TRUE")
        if self.aggregator:
            self._front_proxy_keys(openssl)
        (self.workdir / "tokens.csv").write_text(f'{self.admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = self.workdir / f"{name}.log"
        self.logs[name] = log
        with open(log, "ab") as out:
            self.procs[name] = procs.spawn(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           cwd=self.workdir)

    def _write_kubeconfig(self, path: pathlib.Path, token: str, *, user: str, namespace: str = "default") -> pathlib.Path:
        path.write_text(yaml.safe_dump(kubeconfig_dict(self.url, self.ca_file, token, user=user, namespace=namespace)))
        path.chmod(0o600)
        return path

    def _wait_ready(self, timeout: float) -> None:
        def ready() -> str | None:
            req = urllib.request.Request(self.url + "/readyz", headers={"Authorization": f"Bearer {self.admin_token}"})
            with urllib.request.urlopen(req, context=self.ssl_context(), timeout=5) as resp:
                return None if resp.status == 200 else f"readyz {resp.status}"

        last = poll_ready(ready, timeout, alive=self.check_alive)
        if last is not None:
            raise ControlPlaneError(f"kube-apiserver not ready in time ({last}); log: {self.logs['kube-apiserver']}\n"
                                    + self.log_tail("kube-apiserver"))

    def _wait_default_service_account(self, timeout: float) -> None:
        def found() -> None:
            self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")  # 404 (HTTPError) until then

        if poll_ready(found, timeout, alive=self.check_alive) is not None:
            raise ControlPlaneError("the default ServiceAccount did not appear (is the serviceaccount controller "
                                    f"running?); log: {self.logs['kube-controller-manager']}\n"
                                    + self.log_tail("kube-controller-manager"))


def serving_certificate(folder: str | os.PathLike[str], name: str, dns_names: Sequence[str] = (),
                        ips: Sequence[str] = ("127.0.0.1",)) -> tuple[pathlib.Path, pathlib.Path]:
    """A self-signed serving certificate (its own CA: the ``caBundle`` of an APIService) for
    ``dns_names`` and ``ips``, as ``(folder/name.crt, folder/name.key)``; kept if already there."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ControlPlaneError("the openssl command is needed to make a serving certificate")
    base = pathlib.Path(folder)
    base.mkdir(parents=True, exist_ok=True)
    crt, key = base / f"{name}.crt", base / f"{name}.key"
    if not crt.exists():
        sans = ",".join([f"DNS:{d}" for d in dns_names] + [f"IP:{i}" for i in ips])
        subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30", "-subj", f"/CN={name}",
                        "-keyout", str(key), "-out", str(crt), "-addext", f"subjectAltName={sans}",
                        "-addext", "basicConstraints=critical,CA:TRUE"], check=True, capture_output=True, timeout=60)
    return crt, key


@contextlib.contextmanager
def control_plane(workdir: str | os.PathLike[str], binaries: Binaries | None = None,
                  **kwargs: Any) -> Iterator[ControlPlane]:
    """``with control_plane(tmpdir) as cp:`` -- start the built control plane (see :class:`ControlPlane`)."""
    bins = binaries or find_binaries()
    if bins is None:
        raise ControlPlaneError(f"no control plane built in {default_bin_dir()}: run `make kube` (tools/kube/build.sh)")
    with ControlPlane(bins, workdir, **kwargs) as cp:
        yield cp


def apply_objects(cp: ControlPlane, objects: Sequence[Mapping[str, Any]], *, field_manager: str = "moe-eplb-tests",
                  kubeconfig: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
    """``kubectl apply --server-side`` the objects (a multi-document YAML) as admin (or ``kubeconfig``)."""
    text = yaml.safe_dump_all([dict(o) for o in objects])
    return cp.kubectl("apply", "--server-side", f"--field-manager={field_manager}", "--force-conflicts", "-f", "-",
                      input_text=text, kubeconfig=kubeconfig, timeout=120)


def project_crds() -> list[pathlib.Path]:
    """The CRDs a cluster running moe-eplb has: the MoEInference CRD (package data), kopf's peering
    CRDs (the chart's copy), and the LeaderWorkerSet CRD (the published one fetched by
    ``tools/kube/crds.sh``, else the trimmed copy the emulation serves)."""
    here = pathlib.Path(__file__).resolve()
    repo = here.parents[3]
    out = [pathlib.Path(str(importlib.resources.files("moe_eplb.api").joinpath(CRD_FILE))),
           repo / "charts" / "moe-eplb-operator" / "crds" / "kopfpeerings.kopf.dev.yaml"]
    published = repo / "tools" / "kube" / "crds" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
    out.append(published if published.exists() else here.parents[1] / "floor" / "lws_crd.yaml")
    return [p for p in out if p.exists()]
