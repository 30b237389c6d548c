"""Serving an API through the real control plane's aggregation layer, as prometheus-adapter and KEDA's
metrics API server are served here: an ``ExternalName`` Service to loopback and one ``APIService``
per group/version (its ``caBundle`` the server's own certificate), then waiting until the
apiserver reports every one ``Available``. Blocking calls on :meth:`ControlPlane.request`.
"""

from __future__ import annotations

import time
import urllib.error
from collections.abc import Callable
from typing import Any

from moe_eplb_harness.real.controlplane import ControlPlane, ControlPlaneError

APISERVICES = "/apis/apiregistration.k8s.io/v1/apiservices"


def require(cp: ControlPlane) -> None:
    """Raise unless ``cp`` runs with the aggregation layer."""
    if not cp.aggregator:
        raise ControlPlaneError("the control plane runs without the aggregation layer: start it with aggregator=True")


def put(cp: ControlPlane, collection: str, name: str, body: dict[str, Any]) -> None:
    """Create ``body`` as ``name`` in ``collection``, or replace the object there (a Namespace that
    exists is left as it is)."""
    try:
        old = cp.request("GET", f"{collection}/{name}")
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            raise
        cp.request("POST", collection, body)
        return
    if body["kind"] == "Namespace":
        return
    body = dict(body, metadata=dict(body["metadata"], resourceVersion=old["metadata"]["resourceVersion"]))
    cp.request("PUT", f"{collection}/{name}", body)


def register(cp: ControlPlane, *, namespace: str, service: str, port: int, ca_bundle: str,
             versions: list[tuple[str, str]]) -> list[str]:
    """The loopback Service ``namespace/service`` and one APIService per ``(group, version)``
    (``versionPriority`` 100, 101, ... in that order); returns the APIServices' names."""
    put(cp, "/api/v1/namespaces", namespace, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    put(cp, f"/api/v1/namespaces/{namespace}/services", service, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": service, "namespace": namespace},
        "spec": {"type": "ExternalName", "externalName": "localhost",
                 "ports": [{"name": "https", "port": port, "protocol": "TCP"}]}})
    names = []
    for i, (group, version) in enumerate(versions):
        name = f"{version}.{group}"
        put(cp, APISERVICES, name, {
            "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": name},
            "spec": {"group": group, "version": version, "groupPriorityMinimum": 100, "versionPriority": 100 + i,
                     "service": {"namespace": namespace, "name": service, "port": port}, "caBundle": ca_bundle}})
        names.append(name)
    return names


def wait_available(cp: ControlPlane, names: list[str], timeout: float, *, alive: Callable[[], None],
                   what: str) -> None:
    """Until every APIService of ``names`` is ``Available``; ``alive()`` raises when the server behind
    them has exited; on timeout a :class:`ControlPlaneError` with their conditions and ``what`` (the
    server's log, for the reader)."""
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        alive()
        for name in names:
            found = (cp.request("GET", f"{APISERVICES}/{name}").get("status") or {}).get("conditions") or []
            last[name] = next((c for c in found if c["type"] == "Available"), None)
        if all(c and c["status"] == "True" for c in last.values()):
            return
        time.sleep(0.2)
    raise ControlPlaneError(f"the APIServices {', '.join(names)} are not Available within {timeout} s ({last}); {what}")
