"""The operator's control token: the Secret every engine pod mounts, and the header of a request
that changes a running engine (the names are :mod:`moe_eplb.contracts.k8s_names`' ``CONTROL_*``).

The reconciler makes the Secret once per resource (:func:`ensure_secret`, before the workload whose
pods mount it) with a token drawn here, and never patches it: deleting it rotates the token (the next
reconcile draws a new one; the exporter reads the mounted file at every request). The code that
sends requests to engine pods reads the token with :func:`read_token` and sends :func:`auth_header`.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from moe_eplb.api.spec import MoEInference
from moe_eplb.contracts import k8s_names
from moe_eplb.controller.k8s import ApiError, KubeClient
from moe_eplb.render.objects import control_secret

#: random bytes of a token (256 bits, URL-safe base64 in the Secret)
TOKEN_BYTES = 32


def new_token() -> str:
    """A fresh random control token."""
    return secrets.token_urlsafe(TOKEN_BYTES)


async def ensure_secret(client: KubeClient, inf: MoEInference) -> bool:
    """Create the control Secret of ``inf`` unless it exists; True when this call created it. A Secret
    created meanwhile by another replica (409) is kept: its token is the one in force."""
    name = k8s_names.control_secret_name(inf.name)
    if await client.get("v1", "Secret", inf.namespace, name) is not None:
        return False
    try:
        await client.create(control_secret(inf, new_token()))
    except ApiError as exc:
        if exc.status != 409:
            raise
        return False
    return True


async def delete_secret(client: KubeClient, resource_meta: dict[str, Any]) -> bool:
    """Delete the control Secret of a MoEInference being deleted, if it is the one the operator made
    for it (its ownerReference names the resource's uid); True when deleted."""
    ns, name = resource_meta["namespace"], k8s_names.control_secret_name(resource_meta["name"])
    secret = await client.get("v1", "Secret", ns, name)
    owners = (secret or {}).get("metadata", {}).get("ownerReferences") or []
    if not any(o.get("uid") == resource_meta.get("uid") for o in owners):
        return False
    return await client.delete("v1", "Secret", ns, name)


def token_of(secret: dict[str, Any]) -> str | None:
    """The token a Secret holds (``data`` is base64, as the API server stores it); None without one."""
    data = (secret.get("data") or {}).get(k8s_names.CONTROL_TOKEN_KEY)
    if data:
        return base64.b64decode(data).decode()
    return (secret.get("stringData") or {}).get(k8s_names.CONTROL_TOKEN_KEY) or None


async def read_token(client: KubeClient, namespace: str, resource_name: str) -> str | None:
    """The control token of the MoEInference ``namespace/resource_name``; None before its first reconcile."""
    secret = await client.get("v1", "Secret", namespace, k8s_names.control_secret_name(resource_name))
    return token_of(secret) if secret is not None else None


def auth_header(token: str) -> dict[str, str]:
    """The header that carries the token on a control request to an engine pod."""
    return {k8s_names.CONTROL_AUTH_HEADER: f"{k8s_names.CONTROL_AUTH_SCHEME} {token}"}
