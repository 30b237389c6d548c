"""The async client the tests and the demo use on a real control plane
(:class:`moe_eplb.sim.controlplane.ControlPlane`): the same calls as the emulation's
:class:`moe_eplb.sim.kubeapi.EmulatedCluster` (``request``, ``create``, ``get``, ``get_or_none``,
``list``, ``patch``, ``delete``, ``moeinference_path``, ``url``, ``kubeconfig``), so one scenario
runs on either. Errors raise :class:`aiohttp.ClientResponseError` with the apiserver's ``Status``
as the message, as the emulation's client does.
"""

from __future__ import annotations

import contextlib
import json
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import attrs

from moe_eplb.k8s_names import API_GROUP, API_VERSION, PLURAL
from moe_eplb.sim.controlplane import ControlPlane


@attrs.define
class RealCluster:
    """A running real control plane seen through one aiohttp session (admin, or ``token``)."""

    plane: ControlPlane
    url: str
    kubeconfig: str
    session: aiohttp.ClientSession
    token: str

    #: the emulation exposes its emulator as ``api``; a real cluster has none (tests that need
    #: fault injection or emulator internals are emulation-only)
    api: None = None

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/json", params: Mapping[str, str] | None = None) -> Any:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type, "Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        async with self.session.request(method, self.url + path, data=data, params=params, headers=headers) as resp:
            payload = await resp.json(content_type=None)
            if resp.status >= 400:
                raise aiohttp.ClientResponseError(resp.request_info, resp.history, status=resp.status,
                                                  message=json.dumps(payload))
            return payload

    async def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, dict(body))

    async def get(self, path: str) -> dict[str, Any]:
        return await self.request("GET", path)

    async def get_or_none(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.get(path)
        except aiohttp.ClientResponseError as exc:
            if exc.status == 404:
                return None
            raise

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


@contextlib.asynccontextmanager
async def real_cluster(plane: ControlPlane, *, token: str | None = None) -> AsyncIterator[RealCluster]:
    """An aiohttp session on ``plane`` (admin by default) as a :class:`RealCluster`."""
    ctx: ssl.SSLContext = plane.ssl_context()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, force_close=True),
                                     headers={"User-Agent": "moe-eplb-tests"}) as session:
        yield RealCluster(plane=plane, url=plane.url, kubeconfig=str(plane.kubeconfig), session=session,
                          token=token or plane.admin_token)
