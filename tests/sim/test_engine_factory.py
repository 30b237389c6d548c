"""The fake kubelet's engine-factory hook (``FakeKubelet(engine_factory=...)``, ``SimWorld.engine_factory``):
what a factory is given (the parsed settings and the rendered pod spec), how the kubelet uses the
engine it returns (start, ports in the Pod object, readiness, stop on a roll), for a Deployment and
for a LeaderWorkerSet group. The real-engine demo (harness/moe_eplb_harness/vllm_engine/closed_loop.py) stands on it."""

from __future__ import annotations

import copy
import json

import pytest

pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")
pytest.importorskip("kmock", reason="the test extra (kmock) is not installed")

from moe_eplb.api.knobs import Knobs  # noqa: E402
from moe_eplb_harness.cluster.world import SimWorld  # noqa: E402
from moe_eplb_harness.floor.pods import EngineRequest  # noqa: E402
from tests.autotune.conftest import NAME, NS, RESOURCE  # noqa: E402
from tests.polling import eventually

pytestmark = pytest.mark.integration


class FakeEngine:
    """A stand-in engine: records its life, becomes ready when told to."""

    def __init__(self, request: EngineRequest, port: int) -> None:
        self.request = request
        self.settings = request.settings
        self.ports = [port + k for k in range(request.pods)]
        self.ready = False
        self.started = self.stopped = False

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True
        self.ready = False


class Factory:
    def __init__(self) -> None:
        self.engines: list[FakeEngine] = []

    def __call__(self, request: EngineRequest) -> FakeEngine:
        engine = FakeEngine(request, 40000 + 10 * len(self.engines))
        self.engines.append(engine)
        return engine


def _eplb_config(pod_spec: dict) -> dict:
    (c,) = [c for c in pod_spec["containers"] if c["name"] == "vllm"]
    args = list(c["args"])
    return json.loads(args[args.index("--eplb-config") + 1])


@pytest.mark.parametrize("kind", ["Deployment", "LeaderWorkerSet"])
async def test_factory_engines_run_the_rendered_pods(kind):
    res = copy.deepcopy(RESOURCE)
    res["spec"]["replicas"] = 1
    res["spec"]["autotune"] = {"mode": "Off"}
    if kind == "LeaderWorkerSet":
        res["spec"]["parallelism"] = {"tensor": 1, "data": 4, "nodes": 2}
    factory = Factory()
    world = SimWorld(workload={}, scale=1.0, tick_seconds=0.2, kubelet_poll=0.05, engine_factory=factory)
    pods_path = f"/api/v1/namespaces/{NS}/pods"
    async with world.run():
        await world.start_operator()
        await world.apply(res)
        await eventually(lambda: len(factory.engines) == 1, timeout=20.0)
        first = factory.engines[0]
        req = first.request
        # the request: parsed settings, the instance, and the rendered pod spec to run
        assert (req.instance, req.namespace, req.pods) == (NAME, NS, 2 if kind == "LeaderWorkerSet" else 1)
        assert req.settings.knobs == Knobs(1000, 3000, 0) and req.settings.ep_size == 4
        assert _eplb_config(req.pod_spec)["window_size"] == 1000
        assert first.started and not first.stopped
        # the Pod objects carry the engine's ports; not ready until the engine is
        async def pods_with_status():  # the kubelet writes the Pod objects after the engine started
            got = await world.cluster.list(pods_path, f"eplb.ai/name={NAME}")
            return got if len(got) == req.pods and all("status" in p for p in got) else None
        pods = await eventually(pods_with_status, timeout=20.0)
        ports = sorted(p["containerPort"] for pod in pods for c in pod["spec"]["containers"]
                       for p in c.get("ports", []) if p["name"] == "eplb-metrics")
        assert ports == sorted(first.ports)
        assert not any(c["status"] == "True" for pod in pods for c in pod["status"]["conditions"] if c["type"] == "Ready")
        first.ready = True

        async def all_ready():
            got = await world.cluster.list(pods_path, f"eplb.ai/name={NAME}")
            return len(got) == req.pods and all(
                c.get("status") == "True" for pod in got for c in (pod.get("status") or {}).get("conditions") or [{}]
                if c.get("type", "Ready") == "Ready")
        await eventually(all_ready, timeout=20.0)
        assert sorted(t["port"] for t in world.kubelet.targets()) == sorted(first.ports)

        # a new template: the kubelet stops the old engine and asks for one running the new args
        edited = {"enabled": True, "windowSize": 250, "stepInterval": 500, "numRedundantExperts": 4}
        await world.cluster.patch(world.cluster.moeinference_path(NS, NAME), {"spec": {"eplb": edited}})
        await eventually(lambda: len(factory.engines) == 2, timeout=20.0)
        second = factory.engines[1]
        assert second.request.settings.knobs == Knobs(250, 500, 4)
        assert _eplb_config(second.request.pod_spec) == {**_eplb_config(req.pod_spec), "window_size": 250,
                                                         "step_interval": 500, "num_redundant_experts": 4}
        await eventually(lambda: first.stopped, timeout=20.0)  # maxUnavailable 1: the old pod goes first
        second.ready = True
        await eventually(all_ready, timeout=20.0)
        assert len(factory.engines) == 2  # nothing else was started
    assert second.stopped  # the world's end stops the running engine


async def test_a_factory_error_is_a_crash_at_start_up():
    def factory(request: EngineRequest):
        raise ValueError("8 experts + 3 redundant is not divisible by the EP size 2")

    res = copy.deepcopy(RESOURCE)
    res["spec"]["replicas"] = 1
    res["spec"]["autotune"] = {"mode": "Off"}
    world = SimWorld(workload={}, scale=1.0, tick_seconds=0.2, kubelet_poll=0.05, engine_factory=factory)
    async with world.run():
        await world.start_operator()
        await world.apply(res)

        async def crashed():
            got = await world.cluster.list(f"/api/v1/namespaces/{NS}/pods", f"eplb.ai/name={NAME}")
            statuses = (got[0].get("status") or {}).get("containerStatuses") if got else None
            return bool(statuses) and statuses[0]["started"] is False
        await eventually(crashed, timeout=20.0)
        assert [p for _, p in world.kubelet.running() if p.crash]
