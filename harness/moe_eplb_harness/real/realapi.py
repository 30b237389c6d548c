"""The async client the tests and the demo use on a real control plane
(:class:`moe_eplb_harness.real.controlplane.ControlPlane`): the harness's one apiserver client
(:class:`moe_eplb_harness.floor.client.ClusterClient`: ``request``, ``create``, ``get``, ``get_or_none``,
``list``, ``patch``, ``delete``, ``moeinference_path``, ``url``, ``kubeconfig``, ``connection``) with
the plane's credentials, so one scenario runs on either backend. Errors raise
:class:`aiohttp.ClientResponseError` with the apiserver's ``Status`` as the message.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import attrs

from moe_eplb_harness.floor.client import ClusterClient, Connection, open_session
from moe_eplb_harness.real.controlplane import ControlPlane


@attrs.define
class RealCluster(ClusterClient):
    """A running real control plane seen through one aiohttp session (admin, or ``token``)."""

    plane: ControlPlane
    token: str


def plane_connection(plane: ControlPlane, token: str | None = None) -> Connection:
    """Where and how to reach ``plane`` (admin by default): its URL, a bearer token and its CA."""
    return Connection(server=plane.url, token=token or plane.admin_token, ca_path=str(plane.ca_file))


@contextlib.asynccontextmanager
async def real_cluster(plane: ControlPlane, *, token: str | None = None) -> AsyncIterator[RealCluster]:
    """An aiohttp session on ``plane`` (admin by default) as a :class:`RealCluster`."""
    connection = plane_connection(plane, token)
    async with open_session(connection, user_agent="moe-eplb-tests") as session:
        yield RealCluster(url=plane.url, kubeconfig=str(plane.kubeconfig), session=session, connection=connection,
                          plane=plane, token=str(connection.token))
