"""Who may change a running engine: the check of the operator's control token on the exporter's side.

The operator mounts its per-resource token into every engine container and names the file in
``MOE_EPLB_CONTROL_TOKEN_FILE`` (:mod:`moe_eplb.contracts.k8s_names`, ``CONTROL_*``); a request that
changes the engine must carry ``Authorization: Bearer <token>``. Anything else (no header, another
scheme, a wrong token, or a pod without the file) is refused with a one-line reason, before the
request's body is even read. The file is read at every check, so a rotated Secret takes effect as
soon as the kubelet has refreshed the mount; the comparison takes the same time whatever the guess.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass

from moe_eplb.contracts import k8s_names


@dataclass(frozen=True)
class Refusal:
    """Why a control request was refused: the HTTP status (401 no credential, 403 a wrong one, 503 no
    token configured in this pod) and a one-line reason for the caller."""

    status: int
    reason: str


def _configured_token(token_file: str | None) -> str | None:
    if not token_file:
        return None
    try:
        with open(token_file, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError:
        return None
    return token or None


def check(headers: Mapping[str, str], token_file: str | None = None) -> Refusal | None:
    """None when ``headers`` carry this pod's control token, else the :class:`Refusal`.
    ``token_file`` defaults to ``$MOE_EPLB_CONTROL_TOKEN_FILE``."""
    if token_file is None:
        token_file = os.environ.get(k8s_names.CONTROL_TOKEN_FILE_ENV)
    expected = _configured_token(token_file)
    if expected is None:
        return Refusal(503, f"no control token in this pod ({k8s_names.CONTROL_TOKEN_FILE_ENV} names no "
                            "readable file): control requests are off")
    given = next((v for k, v in headers.items() if k.lower() == k8s_names.CONTROL_AUTH_HEADER.lower()), None)
    scheme = k8s_names.CONTROL_AUTH_SCHEME
    if not given or not given.startswith(scheme + " "):
        return Refusal(401, f"a control request needs '{k8s_names.CONTROL_AUTH_HEADER}: {scheme} <token>' "
                            "(the operator's token)")
    if not hmac.compare_digest(given[len(scheme) + 1:].strip().encode(), expected.encode()):
        return Refusal(403, "the control token does not match this pod's")
    return None
