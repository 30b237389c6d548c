"""The Helm CLI (``helm``, built from ``helm.sh/helm/v4`` v4.3.2 by ``make kube``: ``tools/build.sh``)
against a REAL control plane (:mod:`moe_eplb_harness.real.controlplane`): the commands a user types
(``helm install``, ``upgrade``, ``test``, ``uninstall``, ``get manifest``), with the control plane's
admin kubeconfig and Helm's cache, config and data folders in a work folder of their own (so a
test never reads or writes the user's ``~/.config/helm``).

Public entry points: :func:`find_helm`, :class:`Helm`.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
from typing import Any

import yaml

from moe_eplb_harness.real.controlplane import ControlPlane, ControlPlaneError


def default_helm_binary() -> pathlib.Path:
    """``$MOE_EPLB_HELM_BIN``, else ``tools/helm/bin/helm`` of this checkout."""
    env = os.environ.get("MOE_EPLB_HELM_BIN")
    if env:
        return pathlib.Path(env)
    return pathlib.Path(__file__).resolve().parents[3] / "tools" / "helm" / "bin" / "helm"


def find_helm(path: str | os.PathLike[str] | None = None) -> pathlib.Path | None:
    """The built ``helm`` binary, or ``None``."""
    p = pathlib.Path(path) if path else default_helm_binary()
    return p if p.is_file() and os.access(p, os.X_OK) else None


class Helm:
    """``helm`` run against ``cp`` as admin. :meth:`run` returns the finished process (text);
    :meth:`ok` raises ControlPlaneError quoting its output when it fails."""

    def __init__(self, cp: ControlPlane, workdir: str | os.PathLike[str], *,
                 binary: str | os.PathLike[str] | None = None) -> None:
        self.cp = cp
        self.workdir = pathlib.Path(workdir)
        self.binary = pathlib.Path(binary) if binary else default_helm_binary()

    def env(self) -> dict[str, str]:
        home = self.workdir / "helm-home"
        return {**{k: v for k, v in os.environ.items() if not k.startswith("HELM_")},
                "KUBECONFIG": str(self.cp.kubeconfig), "HELM_CACHE_HOME": str(home / "cache"),
                "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}

    def run(self, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
        if find_helm(self.binary) is None:
            raise ControlPlaneError(f"no helm built at {self.binary} (run `make kube`)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        return subprocess.run([str(self.binary), *args], capture_output=True, text=True, env=self.env(),
                              cwd=self.workdir, timeout=timeout)

    def ok(self, *args: str, timeout: float = 180.0) -> str:
        out = self.run(*args, timeout=timeout)
        if out.returncode != 0:
            raise ControlPlaneError(f"helm {' '.join(args)} failed ({out.returncode}): {out.stderr}{out.stdout}")
        return out.stdout

    def manifest(self, release: str, namespace: str) -> list[dict[str, Any]]:
        """The objects of ``release`` as installed (``helm get manifest``), each with its namespace."""
        text = self.ok("get", "manifest", release, "-n", namespace)
        objs = [o for o in yaml.safe_load_all(text) if o]
        for obj in objs:
            if obj["kind"] not in ("ClusterRole", "ClusterRoleBinding", "Namespace", "ClusterKopfPeering"):
                obj["metadata"].setdefault("namespace", namespace)
        return objs
