"""vLLM's fault-tolerance protocol, as the operator drives it (facts read from the releases' code;
pure). ``tests/controller/test_recovery_vllm_contract.py`` checks every name here against the
release it runs on (0.32's wheel, 0.33's and 0.34's sources) and drives vLLM's own router with them.

Sources (paths inside the ``vllm`` package):

* ``entrypoints/serve/fault_tolerance/api_router.py``: ``POST <prefix>/fault_tolerance/apply``
  ``{"instruction", "params", "request_id"}`` answers 202 at once (400 on a bad body) and runs the
  recovery in the background; ``GET <prefix>/fault_tolerance/status`` returns the API server's cached
  view of its engines. 0.32/0.33: no prefix, ``retry`` only, the server draws the ``request_id``;
  0.34: the ``/v1`` prefix (so ``--api-key`` guards it), ``retry`` and ``scale_down``, and a
  client-given non-empty ``request_id`` that every engine of one round must share.
* ``v1/engine/core_client.py`` (``AsyncMPClient.get_status`` / ``handle_fault``): the status is
  ``{"schema_version": 1, "total_engines", "engines": [entry]}``; an entry is what the engine core
  last pushed (``{"id", "status"}``; ``fault_info`` and, 0.34, ``mask`` while unhealthy) plus the
  client's ``ft_state`` (``recovering`` while an instruction runs, ``failed`` after one failed),
  ``last_ft_request_id`` and ``ft_error``. A push replaces the entry: a recovered engine shows
  ``{"id", "status": "healthy"}`` again. A second instruction while one runs is refused there
  ("another recovery is in progress") without touching the state.
* ``v1/fault_tolerance/engine_core_sentinel.py``: on a fault the engine aborts its requests, goes
  ``diagnosing`` (0.34) then ``unhealthy`` (``dead`` when its executor failed) and waits
  ``engine_recovery_timeout_sec`` (``--fault-tolerance-config``, 120 s by default) for an
  instruction, else re-raises and exits. An instruction is accepted only while ``unhealthy``. Every
  alive engine must check in to the round (keys namespaced by the ``request_id``) within 10 s
  (``_ROUND_CHECKIN_TIMEOUT_SEC``, 0.34), else the round fails and can be sent again. The engines
  vote: a failed ``retry`` leaves them ``unhealthy`` (retryable); a failed ``scale_down`` turns them
  ``dead`` ("full restart required"). ``scale_down`` params: ``removed_dp_ranks`` (the engines keep
  the cumulative dead set; the request must add at least one rank, must not name the receiver, and
  must leave one alive), and ``dp_master_ip`` + ``dp_store_port`` when the lowest alive rank (the
  data-parallel store's master) is removed: the new lowest alive rank hosts the store there.
"""

from __future__ import annotations

import json

from moe_eplb.api.versions import Version

#: the first release with each instruction (``ALLOWED_FT_INSTRUCTIONS`` / ``_ALLOWED_INSTRUCTIONS``)
RETRY, SCALE_DOWN = "retry", "scale_down"
INSTRUCTION_SINCE: dict[str, Version] = {RETRY: (0, 32, 0), SCALE_DOWN: (0, 34, 0)}
#: 0.34 moved the routes under ``/v1`` and made the caller name the round
V1_PREFIX_SINCE: Version = (0, 34, 0)
CLIENT_REQUEST_ID_SINCE: Version = (0, 34, 0)

APPLY_PATH, STATUS_PATH = "/fault_tolerance/apply", "/fault_tolerance/status"
#: the apply route's answer to an accepted instruction (the recovery runs after it)
ACCEPTED = 202
BAD_REQUEST = 400
#: body fields of the apply route, and the scale_down params
FIELD_INSTRUCTION, FIELD_PARAMS, FIELD_REQUEST_ID = "instruction", "params", "request_id"
PARAM_REMOVED = "removed_dp_ranks"
PARAM_MASTER_IP, PARAM_STORE_PORT = "dp_master_ip", "dp_store_port"

#: an engine's ``status`` (``EngineStatusType`` names, lower case) and the client's ``ft_state``
HEALTHY, DIAGNOSING, UNHEALTHY, DEAD = "healthy", "diagnosing", "unhealthy", "dead"
RECOVERING, FAILED = "recovering", "failed"
#: keys of a status entry
KEY_ENGINES, KEY_ID, KEY_STATUS, KEY_MASK, KEY_FAULT = "engines", "id", "status", "mask", "fault_info"
KEY_FT_STATE, KEY_LAST_REQUEST, KEY_FT_ERROR = "ft_state", "last_ft_request_id", "ft_error"

#: ``FaultToleranceConfig.engine_recovery_timeout_sec``'s default and its flag
DEFAULT_RECOVERY_TIMEOUT_S = 120
CONFIG_FLAG, CONFIG_TIMEOUT_KEY = "--fault-tolerance-config", "engine_recovery_timeout_sec"
#: how long every alive engine has to check in to a round (0.34 ``_ROUND_CHECKIN_TIMEOUT_SEC``)
ROUND_CHECKIN_S = 10.0

#: vLLM's ``--api-key`` guard (``entrypoints/serve/middleware/authenticate.py``): the path prefixes
#: it checks (the 0.34 routes are under ``/v1``; /scale_elastic_ep, /health, /metrics are not)
API_KEY_GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
API_KEY_FLAG, API_KEY_ENV = "--api-key", "VLLM_API_KEY"


def prefix(version: Version) -> str:
    """The routes' prefix on release ``version``."""
    return "/v1" if version >= V1_PREFIX_SINCE else ""


def apply_path(version: Version) -> str:
    return prefix(version) + APPLY_PATH


def status_path(version: Version) -> str:
    return prefix(version) + STATUS_PATH


def has(instruction: str, version: Version) -> bool:
    """Whether release ``version`` accepts ``instruction``."""
    since = INSTRUCTION_SINCE.get(instruction)
    return since is not None and version >= since


def guarded_by_api_key(version: Version) -> bool:
    """Whether vLLM's ``--api-key`` covers the fault-tolerance routes on ``version``."""
    return any(apply_path(version).startswith(p) for p in API_KEY_GUARDED_PREFIXES)


def apply_body(instruction: str, request_id: str, params: dict | None = None) -> dict:
    """The body of one instruction of a round (the ``request_id`` is ignored before 0.34)."""
    return {FIELD_INSTRUCTION: instruction, FIELD_PARAMS: dict(params or {}), FIELD_REQUEST_ID: request_id}


def scale_down_params(removed: list[int] | tuple[int, ...], store: tuple[str, int] | None) -> dict:
    """``scale_down``'s params: the removed data-parallel ranks, and the new store master's address
    when the lowest alive rank is among them."""
    params: dict = {PARAM_REMOVED: sorted(int(r) for r in removed)}
    if store is not None:
        params[PARAM_MASTER_IP], params[PARAM_STORE_PORT] = store[0], int(store[1])
    return params


def recovery_timeout_arg(seconds: int) -> list[str]:
    """``--fault-tolerance-config '{"engine_recovery_timeout_sec": N}'``."""
    return [CONFIG_FLAG, json.dumps({CONFIG_TIMEOUT_KEY: int(seconds)})]


def ep_mask_to_dp_ranks(mask: list | tuple, tensor: int) -> tuple[int, ...]:
    """The data-parallel ranks an unhealthy engine's all2all ``mask`` suspects (0.34: one bit per EP
    rank, 1 = excluded; each DP rank owns ``tensor`` consecutive EP ranks)."""
    tp = max(1, int(tensor))
    return tuple(sorted({i // tp for i, bit in enumerate(mask) if bit}))
