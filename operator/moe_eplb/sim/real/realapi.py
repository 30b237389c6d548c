"""The async client the tests and the demo use on a real control plane
(:class:`moe_eplb.sim.controlplane.ControlPlane`): the same calls as the emulation's
:class:`moe_eplb.sim.kubeapi.EmulatedCluster` (``request``, ``create``, ``get``, ``get_or_none``,
``list``, ``patch``, ``delete``, ``moeinference_path``, ``url``, ``kubeconfig``), so one scenario
runs on either. Errors raise :class:`aiohttp.ClientResponseError` with the apiserver's ``Status``
as the message, as the emulation's client does.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator

import aiohttp
import attrs

from moe_eplb.sim.controlplane import ControlPlane
from moe_eplb.sim.kubeapi import EmulatedCluster


@attrs.define
class RealCluster(EmulatedCluster):
    """A running real control plane seen through one aiohttp session (admin, or ``token``): the
    emulation's client calls (:class:`~moe_eplb.sim.kubeapi.EmulatedCluster`), the credentials in the
    session's headers. ``api`` (the emulator, for fault injection and internals) is ``None``: tests
    that need it are emulation-only."""

    plane: ControlPlane
    token: str


@contextlib.asynccontextmanager
async def real_cluster(plane: ControlPlane, *, token: str | None = None) -> AsyncIterator[RealCluster]:
    """An aiohttp session on ``plane`` (admin by default) as a :class:`RealCluster`."""
    ctx: ssl.SSLContext = plane.ssl_context()
    token = token or plane.admin_token
    headers = {"User-Agent": "moe-eplb-tests", "Authorization": f"Bearer {token}", "Accept": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, force_close=True),
                                     headers=headers) as session:
        yield RealCluster(api=None, url=plane.url, kubeconfig=str(plane.kubeconfig), session=session,
                          plane=plane, token=token)
