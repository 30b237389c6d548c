"""The autotune loop pauses after a fault-tolerance scale-down: vLLM 0.34 reports it only in a log
line of each surviving engine core, which :class:`ScaleDownWatch` reads from the engine pods' logs
(a pod's log whole once, then what was written since; a pod that logged it pauses tuning while it
lives)."""

from __future__ import annotations

import asyncio

from moe_eplb.api import wide_ep
from moe_eplb.api.spec import parse
from moe_eplb.controller.k8s import ApiError
from moe_eplb.controller.scale_down import ScaleDownWatch
from tests.api.test_api_vllm_034 import deepseek

#: vLLM 0.34's format string (``v1/fault_tolerance/engine_core_sentinel.py``, ``EngineCoreSentinel.scale_down``),
#: rendered by the logger with ``%`` as vLLM does: ``sorted()`` sets print as Python lists.
VLLM_FORMAT = "[FT] Engine %d scale_down complete: removed %s, cumulative dead_dp_ranks=%s"
PREFIX = "(EngineCore_DP3 pid=812) INFO 11-20 10:02:11 [engine_core_sentinel.py:311] "


def line(engine: int, removed: list[int], cumulative: list[int]) -> str:
    return PREFIX + VLLM_FORMAT % (engine, sorted(removed), sorted(cumulative))


class PodLogs:
    """The one API the watch uses (``pods/log``), serving texts by pod name (a test double: the real
    apiserver has no kubelet behind it to serve logs)."""

    def __init__(self, logs: dict[str, str]) -> None:
        self.logs, self.calls = logs, []

    async def pod_log(self, namespace, name, *, container=None, since_seconds=None) -> str:
        self.calls.append((name, since_seconds))
        if name not in self.logs:
            raise ApiError(404, "NotFound", f"pods {name!r} not found")
        return self.logs[name]


def pod(name: str, uid: str, phase: str = "Running") -> dict:
    return {"metadata": {"name": name, "uid": uid}, "status": {"phase": phase}}


def test_the_log_line_is_parsed() -> None:
    text = "\n".join(["INFO something else", line(3, [5], [5]), line(4, [6, 7], [5, 6, 7])])
    assert wide_ep.scale_downs_in_log(text) == [(3, (5,)), (4, (6, 7))]
    assert wide_ep.scale_downs_in_log("[FT] Engine 3 status -> HEALTHY") == []


def test_pauses_while_the_pod_that_logged_it_lives_and_resumes_when_replaced() -> None:
    inf = parse(deepseek(32))
    watch, logs = ScaleDownWatch(), PodLogs({"leader": "INFO serving\n", "worker-1": "INFO serving\n"})
    pods = [pod("leader", "u0"), pod("worker-1", "u1")]
    assert asyncio.run(watch.paused(logs, inf, pods, 1000.0)) is None
    assert logs.calls == [("leader", None), ("worker-1", None)]  # whole logs the first time
    logs.logs["worker-1"] = line(1, [5], [5]) + "\n"
    reason = asyncio.run(watch.paused(logs, inf, pods, 1300.0))
    assert reason is not None and "worker-1 (ranks [5])" in reason and "EPLB no longer rebalances" in reason
    assert logs.calls[-1] == ("worker-1", 305)  # only what was written since the last read (+5 s overlap)
    logs.logs["worker-1"] = "INFO serving\n"  # the line is older than the next read: still paused
    assert asyncio.run(watch.paused(logs, inf, pods, 1600.0)) is not None
    restarted = [pod("leader", "u0"), pod("worker-1", "u9")]  # new pod: the engines balance again
    assert asyncio.run(watch.paused(logs, inf, restarted, 1900.0)) is None


def test_only_with_fault_tolerance_on_034_and_unreadable_logs_do_not_pause() -> None:
    logs = PodLogs({"leader": line(0, [1], [1])})
    old = parse(deepseek(32, **{"spec.engine.image": "vllm/vllm-openai:v0.33.0",
                                "spec.faultTolerance": {"enabled": True, "rankFailuresToSurvive": 0}}))
    assert asyncio.run(ScaleDownWatch().paused(logs, old, [pod("leader", "u0")], 10.0)) is None
    off = parse(deepseek(32, **{"spec.faultTolerance": {"enabled": False}}))
    assert asyncio.run(ScaleDownWatch().paused(logs, off, [pod("leader", "u0")], 10.0)) is None
    assert logs.calls == []
    on = parse(deepseek(32))
    assert asyncio.run(ScaleDownWatch().paused(logs, on, [pod("gone", "u5"), pod("leader", "u0", "Pending")], 10.0)) is None
    assert asyncio.run(ScaleDownWatch().paused(logs, on, [pod("leader", "u0")], 10.0)) is not None
