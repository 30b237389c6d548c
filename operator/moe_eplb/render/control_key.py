"""The operator's control token among vLLM's API keys, where vLLM's own guard is on (pure).

vLLM has one guard for its HTTP routes: ``--api-key`` (or ``VLLM_API_KEY``), a list of keys, any of
which opens every path under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
(``entrypoints/serve/middleware/authenticate.py``). 0.34 put the fault-tolerance routes under
``/v1`` (:func:`moe_eplb.api.ft_protocol.guarded_by_api_key`), so where a resource already runs with
an API key the operator's recovery rounds would be refused without one. Turning the guard on where
the user has none would refuse every user request without a key, so the operator never does; where
the user has one it adds its control token to vLLM's keys:

* ``--api-key K ...`` in ``spec.engine.extraArgs``: the token becomes the first value of that flag
  (``--api-key $(MOE_EPLB_CONTROL_TOKEN) K ...``; vLLM reads one list, the last ``--api-key`` wins);
* ``VLLM_API_KEY`` in ``spec.engine.env`` (vLLM reads it only without ``--api-key``):
  ``--api-key $(VLLM_API_KEY) $(MOE_EPLB_CONTROL_TOKEN)``, the same keys plus the token.

``$(MOE_EPLB_CONTROL_TOKEN)`` is the env var :func:`env` adds from the control Secret (Kubernetes
expands it; the reference is not optional, so a pod never starts with the literal text as a key).
vLLM reads its keys once at start: a rotated Secret reaches vLLM at the pods' next restart.
"""

from __future__ import annotations

from typing import Any

from moe_eplb.api import ft_protocol as ftp
from moe_eplb.api.spec import MoEInference
from moe_eplb.contracts import k8s_names

TOKEN_REF = f"$({k8s_names.CONTROL_TOKEN_ENV})"
ARGS, ENV = "args", "env"


def mode(inf: MoEInference) -> str | None:
    """``args`` (the user's ``--api-key`` in extraArgs), ``env`` (their ``VLLM_API_KEY``) or None (no
    API key, or no route of the operator's behind vLLM's guard)."""
    version = inf.engine.version
    if not inf.fault_tolerance.enabled or version is None or not ftp.guarded_by_api_key(version):
        return None
    if any(a == ftp.API_KEY_FLAG or a.startswith(ftp.API_KEY_FLAG + "=") for a in inf.engine.extra_args):
        return ARGS
    if any(e.get("name") == ftp.API_KEY_ENV for e in inf.engine.env):
        return ENV
    return None


def extra_args(inf: MoEInference) -> list[str]:
    """``spec.engine.extraArgs`` with the token among vLLM's keys (unchanged without an API key)."""
    args = list(inf.engine.extra_args)
    m = mode(inf)
    if m == ENV:
        return args + [ftp.API_KEY_FLAG, f"$({ftp.API_KEY_ENV})", TOKEN_REF]
    if m != ARGS:
        return args
    out: list[str] = []
    for a in args:
        if a == ftp.API_KEY_FLAG:
            out += [a, TOKEN_REF]
        elif a.startswith(ftp.API_KEY_FLAG + "="):
            out += [ftp.API_KEY_FLAG, TOKEN_REF, a.split("=", 1)[1]]
        else:
            out.append(a)
    return out


def env(inf: MoEInference) -> list[dict[str, Any]]:
    """The token's env var, from the control Secret, where :func:`mode` adds it to vLLM's keys."""
    if mode(inf) is None:
        return []
    return [{"name": k8s_names.CONTROL_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
        "name": k8s_names.control_secret_name(inf.name), "key": k8s_names.CONTROL_TOKEN_KEY}}}]
