"""A small async Kubernetes client for the controller: get, list, create, merge-patch, delete, Events.

Why aiohttp and not the official ``kubernetes`` client: kopf already runs on aiohttp in the same
event loop, so this adds no dependency and no threads; objects stay plain dicts (what the pure
renderer produces and the emulator stores) with no model (de)serialisation; and an async client
keeps a hundred concurrent reconciles cheap in memory (the operator's RSS target is < 150 MB).
``kubernetes_asyncio`` is not a dependency, and the official client is blocking (it would need
``asyncio.to_thread`` for every call). Credentials come from kopf's own login (a
``kopf.ConnectionInfo`` from the service account or the kubeconfig), so kopf and this client always
talk to the same server as the same user.

Every call is recorded in :attr:`KubeClient.calls` as ``(verb, group, plural, subresource)``, the
same shape as the RBAC rules in :mod:`moe_eplb.controller.rbac`.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import logging
import os
import ssl
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from moe_eplb import __version__
from moe_eplb.contracts.k8s_names import API_GROUP, API_VERSION, KIND, PLURAL

USER_AGENT = f"moe-eplb/{__version__}"
log = logging.getLogger("moe_eplb.k8s")


@dataclass(frozen=True)
class Kind:
    """Where a kind lives in the API: ``group`` ('' for core), ``version``, ``plural``; ``kind`` its
    name in objects; ``child``: the renderer may produce it (pruned when no longer rendered)."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    child: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:  # no namespace: all namespaces (lists and watches)
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
        if subresource:
            base += f"/{subresource}"
        return base


#: Every kind the controller reads or writes (the children first, in the order they are pruned).
_ALL: tuple[Kind, ...] = (
    # the live-settings ConfigMap (render.objects.live_configmap): a child like the others
    Kind("", "v1", "configmaps", "ConfigMap", child=True),
    Kind("apps", "v1", "deployments", "Deployment", child=True),
    Kind("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", "LeaderWorkerSet", child=True),
    Kind("", "v1", "services", "Service", child=True),
    Kind("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", child=True),
    Kind("monitoring.coreos.com", "v1", "podmonitors", "PodMonitor", child=True),
    Kind("keda.sh", "v1alpha1", "scaledobjects", "ScaledObject", child=True),
    Kind("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler", child=True),
    # an elastic group's joining pods and the NetworkPolicy of its ports (render.elastic)
    Kind("apps", "v1", "statefulsets", "StatefulSet", child=True),
    Kind("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", child=True),
    Kind(API_GROUP, API_VERSION, PLURAL, KIND),
    Kind("", "v1", "events", "Event"),
    # read (list) by the autotune loop: readiness, crash loops, exporter ports of the engine pods
    Kind("", "v1", "pods", "Pod"),
    # the control token's Secret (controller.control): created once, read by the pod clients
    Kind("", "v1", "secrets", "Secret"),
    # kopf's peering objects (controller.peering announces a replica before it acts)
    Kind("kopf.dev", "v1", "clusterkopfpeerings", "ClusterKopfPeering", namespaced=False),
    Kind("kopf.dev", "v1", "kopfpeerings", "KopfPeering"),
)

#: Every kind the controller reads or writes, by (apiVersion, kind).
KINDS: dict[tuple[str, str], Kind] = {(k.api_version, k.kind): k for k in _ALL}

#: The child kinds the renderer may produce (listed when pruning children no longer rendered).
CHILD_KINDS: tuple[tuple[str, str], ...] = tuple((k.api_version, k.kind) for k in _ALL if k.child)


def kind_of(api_version: str, kind: str) -> Kind:
    """The :class:`Kind` for an object's ``apiVersion``/``kind``; ``KeyError`` names unknown ones."""
    try:
        return KINDS[(api_version, kind)]
    except KeyError:
        raise KeyError(f"the controller does not know {kind} ({api_version}); add it to controller.k8s.KINDS "
                       "and controller.rbac.RBAC_RULES") from None


class ApiError(Exception):
    """A Kubernetes API error: ``status`` (HTTP code), ``reason`` (e.g. Conflict), ``message``."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


@dataclass
class Connection:
    """Where and how to connect: built from a ``kopf.ConnectionInfo`` (duck-typed, same fields)."""

    server: str
    token: str | None = None
    scheme: str | None = None
    username: str | None = None
    password: str | None = None
    ca_path: str | None = None
    ca_data: str | bytes | None = None
    insecure: bool | None = None
    certificate_path: str | None = None
    certificate_data: str | bytes | None = None
    private_key_path: str | None = None
    private_key_data: str | bytes | None = None

    @classmethod
    def from_info(cls, info: Any) -> Connection:
        fields = cls.__dataclass_fields__
        return cls(**{k: getattr(info, k, None) for k in fields})

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        if self.insecure:
            return False
        ctx = ssl.create_default_context(cafile=self.ca_path or None,
                                         cadata=_pem(self.ca_data) if self.ca_data else None)
        if self.certificate_path or self.certificate_data:
            cert = self.certificate_path or _tmpfile(_pem(self.certificate_data))
            key = self.private_key_path or (_tmpfile(_pem(self.private_key_data)) if self.private_key_data else None)
            ctx.load_cert_chain(cert, key)
        return ctx

    def headers(self) -> dict[str, str]:
        if self.token:
            return {"Authorization": f"{self.scheme or 'Bearer'} {self.token}"}
        if self.username and self.password:
            raw = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
            return {"Authorization": f"Basic {raw}"}
        return {}


def _pem(data: str | bytes | None) -> str:
    """kopf passes certificate data either as PEM text or base64 of it (as in kubeconfigs)."""
    text = data.decode() if isinstance(data, bytes) else (data or "")
    return text if "-----BEGIN" in text else base64.b64decode(text).decode()


def _tmpfile(text: str) -> str:
    fd, path = tempfile.mkstemp(prefix="moe-eplb-", suffix=".pem")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


class KubeClient:
    """Async calls against one API server. Use as ``async with KubeClient(conn) as client``."""

    def __init__(self, connection: Connection, *, field_manager: str = "moe-eplb",
                 timeout_s: float = 30.0) -> None:
        self.connection = connection
        self.field_manager = field_manager
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.calls: list[tuple[str, str, str, str | None]] = []
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> KubeClient:
        await self.open()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def open(self) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self.connection.ssl_context(), limit=64)
            self._session = aiohttp.ClientSession(base_url=None, connector=connector, timeout=self.timeout,
                                                  headers={"User-Agent": USER_AGENT, **self.connection.headers()})

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, verb: str, method: str, kind: Kind, path: str, *, subresource: str | None = None,
                    body: Any = None, params: Mapping[str, str] | None = None,
                    content_type: str = "application/json", raw: bool = False) -> Any:
        await self.open()
        assert self._session is not None
        self.calls.append((verb, kind.group, kind.plural, subresource))
        data = None if body is None else json.dumps(body)
        try:
            async with self._session.request(method, self.connection.server.rstrip("/") + path, data=data,
                                             params=dict(params or {}),
                                             headers={"Content-Type": content_type}) as resp:
                text = await resp.text()
                status, reason = resp.status, resp.reason
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # unreachable or slow: retryable
            raise ApiError(503, "Unavailable", f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        try:
            payload = json.loads(text) if text else {}
        except json.JSONDecodeError:
            payload = {"message": text}
        if status >= 400:
            if not isinstance(payload, dict):
                payload = {"message": text}
            raise ApiError(status, str(payload.get("reason", reason)), str(payload.get("message", text))[:2000])
        return text if raw else payload

    # ---- verbs ----------------------------------------------------------------------------------
    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or ``None`` when it does not exist."""
        k = kind_of(api_version, kind)
        try:
            return await self._call("get", "GET", k, k.path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, api_version: str, kind: str, namespace: str | None,
                   label_selector: str | None = None, field_selector: str | None = None) -> list[dict[str, Any]]:
        """Objects of a kind in a namespace (all namespaces with ``None``), filtered by labels and fields."""
        k = kind_of(api_version, kind)
        params = {"labelSelector": label_selector} if label_selector else {}
        if field_selector:
            params["fieldSelector"] = field_selector
        result = await self._call("list", "GET", k, k.path(namespace), params=params)
        return list(result.get("items") or [])

    async def pod_log(self, namespace: str | None, name: str, *, container: str | None = None,
                      since_seconds: int | None = None) -> str:
        """A pod's log (``pods/log``) as text: its container's, the last ``since_seconds`` only when given."""
        k = kind_of("v1", "Pod")
        params = {"container": container} if container else {}
        if since_seconds is not None:
            params["sinceSeconds"] = str(max(1, int(since_seconds)))
        return await self._call("get", "GET", k, k.path(namespace, name, "log"), subresource="log",
                                params=params, raw=True)

    def _params(self, dry_run: bool) -> dict[str, str]:
        return {"fieldManager": self.field_manager, **({"dryRun": "All"} if dry_run else {})}

    async def create(self, obj: Mapping[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        """POST the object; ``ApiError`` with status 409 if it already exists. ``dry_run``: the
        server runs every check (admission, validation) and keeps nothing."""
        k = kind_of(obj["apiVersion"], obj["kind"])
        ns = obj.get("metadata", {}).get("namespace")
        return await self._call("create", "POST", k, k.path(ns), body=dict(obj), params=self._params(dry_run))

    async def patch(self, api_version: str, kind: str, namespace: str | None, name: str,
                    patch: Mapping[str, Any], *, subresource: str | None = None,
                    dry_run: bool = False) -> dict[str, Any]:
        """JSON merge patch (RFC 7386). Put ``metadata.resourceVersion`` in the patch to make it
        conditional (409 Conflict when the object changed meanwhile). ``dry_run`` as in create."""
        k = kind_of(api_version, kind)
        return await self._call("patch", "PATCH", k, k.path(namespace, name, subresource), subresource=subresource,
                                body=dict(patch), content_type="application/merge-patch+json",
                                params=self._params(dry_run))

    async def patch_status(self, api_version: str, kind: str, namespace: str | None, name: str,
                           status: Mapping[str, Any], *, resource_version: str | None) -> bool:
        """Merge-patch ``status`` into the object's status subresource, conditional on
        ``resource_version``: False when the object changed meanwhile (409) or is gone (404), so the
        caller redoes its work on fresh data; other errors raise."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": dict(status)}
        try:
            await self.patch(api_version, kind, namespace, name, body, subresource="status")
        except ApiError as exc:
            if exc.status in (409, 404):
                return False
            raise
        return True

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str,
                     *, propagation: str = "Background") -> bool:
        """Delete (dependents by ``propagation``); ``False`` if it was already gone."""
        k = kind_of(api_version, kind)
        try:
            await self._call("delete", "DELETE", k, k.path(namespace, name),
                             body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation})
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise

    async def post_event(self, involved: Mapping[str, Any], *, type: str, reason: str, message: str,
                         component: str = "moe-eplb") -> None:
        """Post a core/v1 Event about ``involved`` (shown by ``kubectl describe``)."""
        meta = involved.get("metadata", {})
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        ns = meta.get("namespace") or "default"
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta.get('name')}.{time.time_ns():x}", "namespace": ns},
            "involvedObject": {"apiVersion": involved.get("apiVersion"), "kind": involved.get("kind"),
                               "name": meta.get("name"), "namespace": ns, "uid": meta.get("uid"),
                               "resourceVersion": meta.get("resourceVersion")},
            "type": type, "reason": reason, "message": message[:1024],
            "source": {"component": component}, "reportingComponent": component,
            "reportingInstance": os.environ.get("HOSTNAME", component),
            "firstTimestamp": now[:19] + "Z", "lastTimestamp": now[:19] + "Z", "count": 1, "action": reason,
        }
        await self.create(event)

    async def try_post_event(self, involved: Mapping[str, Any], *, type: str, reason: str, message: str) -> bool:
        """:meth:`post_event`, best effort: an Event that cannot be posted is logged, never raised (False)."""
        try:
            await self.post_event(involved, type=type, reason=reason, message=message)
        except Exception as exc:  # an Event is best effort
            meta = involved.get("metadata", {})
            log.warning("could not post event %s about %s/%s: %s", reason, meta.get("namespace"), meta.get("name"), exc)
            return False
        return True
