"""Contract with vLLM's own fault-tolerance code: every path, body field, status code, state name and
instruction the recovery loop relies on (``moe_eplb.api.ft_protocol``), and the loop's rounds driven
through vLLM's OWN FastAPI router (``entrypoints/serve/fault_tolerance/api_router.py``), its client
(``AsyncMPClient.handle_fault`` / ``get_status``), its ``--api-key`` middleware and its engine
sentinel's checks -- with a stub engine core underneath (no engine runs).

Runs on the installed CPU wheel (0.32: ``retry`` only, no ``/v1``) and, through
``tests/test_vllm_sources.py``, on 0.33's and 0.34's Python sources: whatever ``import vllm`` finds is
the release checked. Skipped without vLLM (marker ``vllm``; failed where ``MOE_EPLB_REQUIRE_VLLM=1``)."""

from __future__ import annotations

import asyncio
import inspect
import json
import queue
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from moe_eplb.api import ft_protocol as ftp
from moe_eplb.api.versions import parse_version
from moe_eplb.controller import recovery as rec
from moe_eplb.controller.recovery_client import accepted_id, reading_of

try:
    import vllm
except ImportError:  # skipped by the marker (failed in CI): tests/conftest.py
    vllm = None
pytestmark = pytest.mark.vllm
VERSION = parse_version(vllm.__version__) if vllm is not None else (0, 0, 0)
V034 = VERSION >= ftp.V1_PREFIX_SINCE


def _router():
    from vllm.entrypoints.serve.fault_tolerance import api_router

    return api_router


async def _asgi(app, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> tuple[int, bytes]:
    """One request through an ASGI app (FastAPI), its background tasks included."""
    hdrs = [(b"content-type", b"application/json")] + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "root_path": "", "scheme": "http", "query_string": b"", "headers": hdrs,
             "client": ("10.0.0.99", 40000), "server": ("10.0.0.1", 8000)}
    sent = False
    out: dict = {"status": 0, "body": b""}

    async def receive():
        nonlocal sent
        if sent:
            await asyncio.sleep(3600)
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")

    await app(scope, receive, send)
    return out["status"], out["body"]


class _EngineCore:
    """Stands in for the engine core behind vLLM's client: records the instruction, answers as told."""

    def __init__(self, success: bool = True, reason: str | None = None) -> None:
        self.calls: list = []
        self.success, self.reason = success, reason

    async def call_utility_async(self, method: str, *args):
        self.calls.append((method, args))
        req = args[0]
        return {"request_id": req.request_id, "success": self.success, "reason": self.reason}


def _client(rank: int, core: _EngineCore, status: str = "unhealthy"):
    """vLLM's ``AsyncMPClient`` fault-tolerance methods on a stub holding one engine's cached status."""
    from vllm.v1.engine.core_client import AsyncMPClient

    c = SimpleNamespace(engine_ranks_managed=[rank], call_utility_async=core.call_utility_async,
                        _engine_status={rank: {"id": rank, "status": status, "fault_info": "RuntimeError"}})
    c.handle_fault = AsyncMPClient.handle_fault.__get__(c)
    c.get_status = AsyncMPClient.get_status.__get__(c)
    return c


def _app(client, keys: list[str] | None = None):
    from fastapi import FastAPI

    app = FastAPI()
    _router().register_fault_tolerance_api_router(app)
    app.state.engine_client = client
    if keys:
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

        app.add_middleware(AuthenticationMiddleware, tokens=keys)
    return app


def test_the_routes_and_instructions_are_the_releases() -> None:
    router = _router()
    paths = {r.path: sorted(r.methods) for r in router.router.routes}
    assert paths == {ftp.apply_path(VERSION): ["POST"], ftp.status_path(VERSION): ["GET"]}
    allowed = getattr(router, "ALLOWED_FT_INSTRUCTIONS", None) or router._ALLOWED_INSTRUCTIONS
    assert set(allowed) == {i for i in ftp.INSTRUCTION_SINCE if ftp.has(i, VERSION)}
    assert ftp.guarded_by_api_key(VERSION) == V034


def test_vllms_router_takes_the_operators_round_and_its_client_keeps_what_the_loop_reads() -> None:
    core = _EngineCore()
    app = _app(_client(2, core))
    params = ftp.scale_down_params([0], ("10.0.0.2", rec.STORE_PORT)) if V034 else {}
    instruction = ftp.SCALE_DOWN if V034 else ftp.RETRY
    body = json.dumps(ftp.apply_body(instruction, "moe-eplb-tiny-g0-a1-0001", params)).encode()
    code, out = asyncio.run(_asgi(app, "POST", ftp.apply_path(VERSION), body))
    assert code == ftp.ACCEPTED
    ((method, (req,)),) = core.calls  # the background task ran vLLM's client -> the engine core
    assert method == "handle_fault_tolerance" and req.instruction == instruction and req.params == params
    if V034:  # the round's id is the operator's, echoed in the 202
        assert req.request_id == "moe-eplb-tiny-g0-a1-0001" == accepted_id(out.decode())
    else:  # 0.32/0.33 draw one per API server; the 202 names it (the loop records it: acceptedIds)
        assert req.request_id == accepted_id(out.decode()) and req.request_id != "moe-eplb-tiny-g0-a1-0001"
    code, out = asyncio.run(_asgi(app, "GET", ftp.status_path(VERSION)))
    status = json.loads(out)
    assert code == 200 and status["schema_version"] == 1 and status["total_engines"] == 1
    r = reading_of(status, 2)
    assert r.status == ftp.UNHEALTHY
    if V034:  # the client marks the running instruction until the engine pushes its new status
        assert r.ft_state == ftp.RECOVERING and r.last_request_id == "moe-eplb-tiny-g0-a1-0001"


def test_a_failed_instruction_is_recorded_as_the_loop_reads_it() -> None:
    core = _EngineCore(success=False, reason="[FT] Recovery vote failed")
    client = _client(1, core)
    app = _app(client)
    body = json.dumps(ftp.apply_body(ftp.RETRY, "rid-1")).encode()
    code, out = asyncio.run(_asgi(app, "POST", ftp.apply_path(VERSION), body))
    r = reading_of(json.loads(asyncio.run(_asgi(app, "GET", ftp.status_path(VERSION)))[1]), 1)
    assert code == 202 and r.status == ftp.UNHEALTHY and r.error == "[FT] Recovery vote failed"
    assert r.last_request_id == accepted_id(out.decode())
    if V034:
        assert r.ft_state == ftp.FAILED and r.last_request_id == "rid-1"
        # a second instruction while one runs is refused by vLLM's client and leaves its state alone
        client._engine_status[1]["ft_state"] = ftp.RECOVERING
        res = asyncio.run(client.handle_fault(_request(ftp.RETRY, "rid-2")))
        assert not res.success and "another recovery is in progress" in res.reason and len(core.calls) == 1


def _request(instruction: str, rid: str, params: dict | None = None):
    from vllm.v1.fault_tolerance.utils import FaultToleranceRequest

    return FaultToleranceRequest(instruction=instruction, params=dict(params or {}), request_id=rid)


@pytest.mark.parametrize("body, why", [
    (b"[1]", "Request body must be a JSON object."),
    (b'{"params": {}}', "'instruction' is required."),
    (b'{"instruction": "reboot", "request_id": "x"}', "Invalid instruction: 'reboot'."),
    (b'{"instruction": "retry", "params": [], "request_id": "x"}', "'params' must be an object."),
])
def test_vllms_router_refuses_a_malformed_body(body, why) -> None:
    code, out = asyncio.run(_asgi(_app(_client(0, _EngineCore())), "POST", ftp.apply_path(VERSION), body))
    assert code == ftp.BAD_REQUEST and why in out.decode()


def test_a_round_without_a_request_id_is_refused_from_034() -> None:
    body = b'{"instruction": "retry", "params": {}}'
    code, out = asyncio.run(_asgi(_app(_client(0, _EngineCore())), "POST", ftp.apply_path(VERSION), body))
    assert (code, V034) in ((400, True), (202, False))


@pytest.mark.skipif(not V034, reason="the fault-tolerance routes are under /v1 (vLLM's --api-key guard) from 0.34")
def test_vllms_api_key_refuses_a_stranger_and_takes_the_operators_token() -> None:
    core = _EngineCore()
    app = _app(_client(0, core), keys=["user-key", "operator-token"])
    body = json.dumps(ftp.apply_body(ftp.RETRY, "r")).encode()
    path = ftp.apply_path(VERSION)
    assert asyncio.run(_asgi(app, "POST", path, body))[0] == 401
    assert asyncio.run(_asgi(app, "POST", path, body, {"Authorization": "Bearer nope"}))[0] == 401
    assert asyncio.run(_asgi(app, "GET", ftp.status_path(VERSION)))[0] == 401
    assert not core.calls
    assert asyncio.run(_asgi(app, "POST", path, body, {"Authorization": "Bearer operator-token"}))[0] == 202
    # any of vLLM's keys opens every /v1 path: a user's key can send a round too (docs/resource.md says so)
    assert asyncio.run(_asgi(app, "POST", path, body, {"Authorization": "Bearer user-key"}))[0] == 202
    from vllm.entrypoints.serve.middleware import authenticate

    assert tuple(authenticate.GUARDED_PREFIX) == ftp.API_KEY_GUARDED_PREFIXES


def _sentinel(rank: int, data: int, dead: set[int]):
    """vLLM's engine sentinel with its recovery collectives stubbed: what runs is its own checks."""
    from vllm.v1.engine import EngineStatusType
    from vllm.v1.fault_tolerance.engine_core_sentinel import EngineCoreSentinel

    s = object.__new__(EngineCoreSentinel)
    s.engine_index, s._initial_dp_size, s._dead_dp_ranks = rank, data, set(dead)
    s.parallel_config = SimpleNamespace(data_parallel_rank=rank)
    s.status_type, s.fault_info = EngineStatusType.UNHEALTHY, "RuntimeError"
    s.resumed = threading.Event()
    s.engine = SimpleNamespace(output_queue=queue.Queue())
    s.rounds = []
    s._prepare_round = lambda req, dead_ranks=None: s.rounds.append((req.request_id, sorted(dead_ranks or ())))
    s._recover_and_vote = lambda req, terminal: None
    return s


@pytest.mark.skipif(not V034, reason="scale_down is new in vLLM 0.34")
def test_vllms_sentinel_accepts_the_operators_scale_down_and_commits_the_cumulative_set() -> None:
    # the loop's decision for a group of 4 that lost rank 0 (the store master), then rank 1 (master again)
    def view(gone):
        pods = {r: rec.PodView(name=f"p{r}", ranks=(r,), ip=f"10.0.0.{r + 1}", ready=True, running=True)
                for r in range(4) if r not in gone}
        return rec.GroupView("0", 4, 1, pods, {r: rec.RankReading(ftp.UNHEALTHY) for r in pods})

    facts = rec.Facts(version=VERSION, num_experts=16, redundant=16, timeout_s=120.0)
    for committed, gone in (((), (0,)), ((0,), (0, 1))):
        d = rec.decide(view(gone), committed, facts, attempt=1)
        assert d.instruction == ftp.SCALE_DOWN
        for rank in d.ranks:
            s = _sentinel(rank, 4, set(committed))
            out = s.scale_down(_request(ftp.SCALE_DOWN, "rid", d.params()))
            assert out.success and s._dead_dp_ranks == set(d.removed)
        # vLLM refuses the same round without the new store master's address
        s = _sentinel(d.ranks[0], 4, set(committed))
        with pytest.raises(ValueError, match="dp_store_port and dp_master_ip required"):
            s.scale_down(_request(ftp.SCALE_DOWN, "rid", {ftp.PARAM_REMOVED: list(d.removed)}))
    # and a round that names the receiver, or adds no rank
    with pytest.raises(ValueError, match="Invalid removed_dp_ranks"):
        _sentinel(2, 4, set()).scale_down(_request(ftp.SCALE_DOWN, "rid", {ftp.PARAM_REMOVED: [2]}))
    with pytest.raises(ValueError, match="Invalid removed_dp_ranks"):
        _sentinel(2, 4, {3}).scale_down(_request(ftp.SCALE_DOWN, "rid", {ftp.PARAM_REMOVED: [3]}))


def test_the_engines_push_the_fields_and_states_the_loop_reads() -> None:
    from vllm.v1.engine import EngineStatusType

    names = {t.name.lower() for t in EngineStatusType}
    assert {ftp.HEALTHY, ftp.UNHEALTHY, ftp.DEAD} <= names and (ftp.DIAGNOSING in names) == V034
    s = _sentinel(3, 4, set())
    if V034:
        s._push_status([0, 0, 1, 0])
    else:
        s._push_status()
    _, outputs = s.engine.output_queue.get_nowait()
    payload = outputs.utility_output.result.result
    r = reading_of({"engines": [payload]}, 3)
    assert r.status == ftp.UNHEALTHY and payload["fault_info"] == "RuntimeError"
    if V034:  # 1 marks a masked (lost) EP rank: the loop removes the DP rank owning it
        assert r.mask == (0, 0, 1, 0) and ftp.ep_mask_to_dp_ranks(r.mask, 1) == (2,)
        from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase

        doc = " ".join(inspect.getdoc(All2AllManagerBase.query_active_mask).split())
        assert "0 marks a live rank and 1 marks a masked (dead/unreachable) rank" in doc


def test_the_recovery_timeout_the_operator_renders_is_vllms() -> None:
    from vllm.config.fault_tolerance import FaultToleranceConfig

    flag, value = ftp.recovery_timeout_arg(90)
    assert flag == ftp.CONFIG_FLAG and FaultToleranceConfig(**json.loads(value)).engine_recovery_timeout_sec == 90
    assert FaultToleranceConfig().engine_recovery_timeout_sec == ftp.DEFAULT_RECOVERY_TIMEOUT_S
    if V034:
        from vllm.v1.fault_tolerance import engine_core_sentinel

        assert engine_core_sentinel._ROUND_CHECKIN_TIMEOUT_SEC == ftp.ROUND_CHECKIN_S


@pytest.mark.skipif(not V034, reason="external elastic EP and scale_down meet only in 0.34")
def test_no_release_grows_an_elastic_group_back_over_scaled_down_ranks() -> None:
    """``rec.GROW_BACK_AFTER_SCALE_DOWN_SINCE`` is None because 0.34's elastic resize returns at once
    for the size the group started with (which a scale_down leaves in the config), and the fault
    sentinel keeps its dead set to itself."""
    src = (Path(vllm.__file__).parent / "v1" / "engine" / "async_llm.py").read_text()
    assert "if old_data_parallel_size == new_data_parallel_size:" in src
    sentinel = (Path(vllm.__file__).parent / "v1" / "fault_tolerance" / "engine_core_sentinel.py").read_text()
    assert "elastic" not in sentinel and rec.GROW_BACK_AFTER_SCALE_DOWN_SINCE is None
