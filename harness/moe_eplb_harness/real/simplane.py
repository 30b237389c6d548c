"""The real control plane as a simulated cluster runs on it (``SimWorld(api="real")``): etcd,
kube-apiserver, kube-controller-manager and kube-scheduler (:mod:`moe_eplb_harness.real.controlplane`), the
project's CRDs installed, and the real LeaderWorkerSet controller with its webhooks
(:mod:`moe_eplb_harness.real.lwscontroller`) where chosen.

A world starts its own (:func:`start`) and stops it at its end; or it runs on one that a test
session started once (``SimWorld(shared_plane=...)``, the ``sim_plane`` fixture of the test suite):
the world then keeps to itself on it -- its own namespace, its own Nodes (deleted at its end), its
resources and namespace deleted at its end (:meth:`SimPlane.clean_namespace`) -- so
worlds one after another on one plane do not see each other.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import secrets
import time
import urllib.error
from typing import Any

from moe_eplb.contracts import k8s_names
from moe_eplb_harness.real.controlplane import (
    DEFAULT_CONTROLLERS,
    HPA_CONTROLLER,
    ControlPlane,
    ControlPlaneError,
    find_binaries,
    project_crds,
)


@dataclasses.dataclass
class SimPlane:
    """A running control plane with the project's CRDs (``lws``: the real LWS controller runs on it,
    ``lws_controller``; ``aggregator``: the aggregation layer is configured, for prometheus-adapter)."""

    plane: ControlPlane
    lws_controller: Any = None
    aggregator: bool = False

    @property
    def hpa(self) -> bool:
        """Whether kube-controller-manager runs its HPA controller on this plane."""
        return HPA_CONTROLLER in self.plane.controllers

    @property
    def lws(self) -> str:
        """Which LeaderWorkerSet controller a world on this plane runs: ``real`` or ``emulated``."""
        return "real" if self.lws_controller is not None else "emulated"

    def stop(self) -> None:
        """Stop the LWS controller, then the control plane (its workdir is kept)."""
        try:
            if self.lws_controller is not None:
                self.lws_controller.stop()
        finally:
            self.plane.stop()

    def new_namespace(self, prefix: str = "w") -> str:
        """Create a namespace of a fresh name; return once its default ServiceAccount exists (pods of
        its workloads are refused until then)."""
        name = f"{prefix}-{secrets.token_hex(4)}"
        self.plane.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                          "metadata": {"name": name}})
        deadline = time.monotonic() + 30
        while True:
            try:
                self.plane.request("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")
                return name
            except urllib.error.HTTPError as exc:
                if exc.code != 404 or time.monotonic() > deadline:
                    raise ControlPlaneError(f"no default ServiceAccount in namespace {name} within 30 s") from exc
            time.sleep(0.1)

    def clean_namespace(self, namespace: str) -> None:
        """What a world leaves in ``namespace`` goes: its MoEInferences are deleted at once (the
        finalizers of their operator, which is gone, dropped first), the namespace is deleted
        (nothing new can be created in it from then on), and its pods are deleted at once (their
        kubelet, the world's node agent, is gone: nothing else would confirm their deletion). Does
        not wait for the namespace to go."""
        cp = self.plane
        path = f"/apis/{k8s_names.API}/namespaces/{namespace}/{k8s_names.PLURAL}"
        for item in (cp.request("GET", path).get("items") or []):
            name = item["metadata"]["name"]
            try:
                if item["metadata"].get("finalizers"):
                    cp.request("PATCH", f"{path}/{name}", {"metadata": {"finalizers": None}},
                               content_type="application/merge-patch+json")
                # gone now, not when the namespace controller gets to it: the next world's operator
                # (cluster-wide) must not pick it up meanwhile
                cp.request("DELETE", f"{path}/{name}")
            except urllib.error.HTTPError as exc:
                if exc.code != 404:
                    raise
        try:
            cp.request("DELETE", f"/api/v1/namespaces/{namespace}")
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
        cp.request("DELETE", f"/api/v1/namespaces/{namespace}/pods",
                   {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})


def start(workdir: str | os.PathLike[str], *, lws: bool, aggregator: bool = False, hpa: bool = True) -> SimPlane:
    """Start the built control plane (with kube-scheduler) in ``workdir``, install the project's CRDs
    and, with ``lws``, the real LeaderWorkerSet controller (``workdir/lws``); ``hpa``: whether
    kube-controller-manager runs its HPA controller (not where an emulated one scales). Blocking
    (seconds)."""
    from moe_eplb_harness.real import lwscontroller

    bins = find_binaries()
    if bins is None:
        raise ControlPlaneError("no control plane built: run `make kube` (tools/kube/build.sh)")
    controllers = (*DEFAULT_CONTROLLERS, *lwscontroller.CONTROLLERS) if lws else DEFAULT_CONTROLLERS
    if not hpa:
        controllers = tuple(c for c in controllers if c != HPA_CONTROLLER)
    plane = ControlPlane(bins, workdir, scheduler=True, aggregator=aggregator, controllers=controllers)
    out = SimPlane(plane, aggregator=aggregator)
    try:
        plane.start()
        for path in project_crds():
            plane.install_crd(path)
        if lws:
            binary = lwscontroller.find_lws_binary()
            if binary is None:
                raise ControlPlaneError(f"no LeaderWorkerSet controller built in {lwscontroller.default_lws_bin_dir()}")
            out.lws_controller = lwscontroller.LwsController(binary, pathlib.Path(workdir) / "lws")
            out.lws_controller.start(plane)
    except BaseException:
        out.stop()
        raise
    return out
