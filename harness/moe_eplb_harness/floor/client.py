"""The harness's one apiserver client, the same on both backends (the emulation,
:mod:`moe_eplb_harness.emulated.kubeapi`, and the real control plane, :mod:`moe_eplb_harness.real.realapi`).

Where to connect and with which credentials is the product's own
:class:`moe_eplb.controller.k8s.Connection` (server, bearer token, CA): the operator a world starts gets
the same. The calls are by URL path (``/apis/apps/v1/namespaces/ns/deployments``), so a scenario can
reach what the product's kind-based :class:`~moe_eplb.controller.k8s.KubeClient` has no kind for (Nodes,
Namespaces, subresources, raw patches with any content type); an error is an
:class:`aiohttp.ClientResponseError` whose ``message`` is the apiserver's ``Status`` as JSON, so tests
can assert on its ``reason`` and ``message``.

The simulated kubelets (:mod:`moe_eplb_harness.emulated.kubelet`, :mod:`moe_eplb_harness.real.nodeagent`) and
the emulated HPA controller call the API through it too.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import attrs

from moe_eplb.contracts.k8s_names import API_GROUP, API_VERSION, PLURAL
from moe_eplb.controller.k8s import Connection

__all__ = ["ClusterClient", "Connection", "open_session"]


@contextlib.asynccontextmanager
async def open_session(connection: Connection, *, user_agent: str = "moe-eplb-sim",
                       timeout: float | None = None) -> AsyncIterator[aiohttp.ClientSession]:
    """An aiohttp session with ``connection``'s credentials (its headers and TLS context).

    No keep-alive (``force_close``): an embedded kopf operator, when it stops, cancels every task
    spawned in the loop during its run, which includes an emulated server's handlers of idle
    keep-alive connections (a pooled connection would then hang); a stalled request of a poll loop is
    retried on its next pass instead of waiting on a dead connection."""
    ssl = connection.ssl_context()
    headers = {"User-Agent": user_agent, "Accept": "application/json", **connection.headers()}
    connector = aiohttp.TCPConnector(force_close=True, ssl=ssl if ssl else False)
    async with aiohttp.ClientSession(headers=headers, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        yield session


@attrs.define
class ClusterClient:
    """A running apiserver seen through one aiohttp session: ``url``, ``kubeconfig`` (a path, for
    kubectl and kopf), ``connection`` (its credentials) and async calls over real HTTP."""

    url: str
    kubeconfig: str
    session: aiohttp.ClientSession
    connection: Connection

    async def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                      params: Mapping[str, str] | None = None, *, missing_ok: bool = False) -> Any:
        """One call; the decoded answer. ``missing_ok``: ``None`` for a 404 instead of raising."""
        data = None if body is None else json.dumps(body)
        async with self.session.request(method, self.url + path, data=data, params=params,
                                        headers={"Content-Type": content_type}) as resp:
            payload = await resp.json(content_type=None)
            if resp.status == 404 and missing_ok:
                return None
            if resp.status >= 400:
                raise aiohttp.ClientResponseError(resp.request_info, resp.history, status=resp.status,
                                                  message=json.dumps(payload))
            return payload

    async def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, dict(body))

    async def get(self, path: str) -> dict[str, Any]:
        return await self.request("GET", path)

    async def get_or_none(self, path: str) -> dict[str, Any] | None:
        return await self.request("GET", path, missing_ok=True)

    async def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        return (await self.request("GET", path, params=params))["items"]

    async def patch(self, path: str, patch: Any, *, json_patch: bool = False) -> dict[str, Any]:
        ctype = "application/json-patch+json" if json_patch else "application/merge-patch+json"
        return await self.request("PATCH", path, patch, content_type=ctype)

    async def delete(self, path: str) -> dict[str, Any]:
        return await self.request("DELETE", path)

    def moeinference_path(self, namespace: str, name: str | None = None) -> str:
        base = f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{namespace}/{PLURAL}"
        return f"{base}/{name}" if name else base

