"""The ``RebalanceFailed`` condition and Event: the autotune loop reads the exporter's
``moe_eplb_rebalance_failures_total`` from the pods (a real exporter collector served over HTTP) and
writes the condition through the real client to the emulated API server."""

from __future__ import annotations

import types

import numpy as np
import pytest
from prometheus_client.exposition import generate_latest

from moe_eplb.contracts import k8s_names, metric_names
from moe_eplb.exporter import snapshot as snap
from moe_eplb.exporter.collector import PodCollector
from moe_eplb.exporter.server import make_registry
from moe_eplb.metrics import health
from tests.example_manifests import EXAMPLES, load_moeinferences
from tests.exposition_server import serve_exposition


def _write_worker(directory, failures: int | None, rank: int = 0) -> None:
    L, E, EP = 2, 4, 2
    snap.write(str(directory), snap.WorkerSnapshot(pid=100 + rank, time=0.0, models=[snap.ModelSnapshot(
        name="served", ep_rank=rank, ep_size=EP, expert_tokens=np.ones((L, E)), rank_tokens=np.ones((L, EP)),
        replicas=np.ones((L, E), np.int64), steps=5, rebalance_failures=failures)]))


class _Exporter:
    """A pod's exporter: the real collector over a snapshot directory, on a loopback port."""

    def __init__(self, directory):
        registry = make_registry(PodCollector(str(directory)))
        self.server = serve_exposition(lambda: generate_latest(registry))
        self.port = self.server.server_address[1]

    def close(self):
        self.server.shutdown()


def test_exposition_and_history():
    text = ("# TYPE moe_eplb_rebalance_failures_total counter\n"
            'moe_eplb_rebalance_failures_total{model_name="a"} 2\n'
            'moe_eplb_engine_steps_total{model_name="a"} 9\n')
    assert health.failures_from_exposition(text) == {"a": 2.0}
    h = health.FailureHistory()
    h.remember(10.0, {("p0", "a"): 0.0, ("p1", "a"): 1.0})  # p1 seen first with a failure: it counts
    h.remember(20.0, {("p0", "a"): 1.0, ("p1", "a"): 1.0})  # p0 went up
    h.remember(30.0, {("p0", "a"): 0.0})  # p0's exporter restarted: not a failure
    assert h.recent(30.0, 100.0) == {"a": 2.0}
    assert h.recent(115.0, 100.0) == {"a": 1.0}  # the one at t=10 left the window
    assert h.recent(200.0, 100.0) == {}
    status, reason, message = health.rebalance_condition({"a": 2.0}, 900)
    assert (status, reason) == ("True", "AsyncWorkerFailed") and "2 for model a" in message
    assert health.rebalance_condition({}, 900)[:2] == ("False", "NoFailures")


class _Clock:
    """The loop's clock, moved by the test."""

    scale = 1.0

    def __init__(self):
        self.t = 1_000_000.0

    def now(self):
        return self.t

    def to_wall(self, t):
        return t


class _Prom:
    """What PrometheusClient.query returns for the failures query (an instant vector)."""

    def __init__(self):
        self.queries = []

    def query(self, q, time=None):
        self.queries.append((q, time))
        return {"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {"model_name": "a"}, "value": [time or 0, "1"]},
            {"metric": {"model_name": "b"}, "value": [time or 0, "0"]}]}}


def test_prometheus_query_counts_the_window():
    prom = _Prom()
    assert health.failures_prometheus(prom, "ns", "inf", 900, at=1000.0) == {"a": 1.0}
    (q, at), = prom.queries
    assert q.startswith(f"sum by (model_name) (increase({metric_names.REBALANCE_FAILURES}{{")
    assert 'moeinference="inf"' in q and q.endswith("[900s]))") and at == 1000.0


@pytest.mark.integration
async def test_failure_sets_the_condition_and_an_event_then_recovers(emulated_cluster, tmp_path):
    from moe_eplb.api.spec import parse
    from moe_eplb.controller import rebalance
    from moe_eplb.controller.autotune import AutotuneLoop
    from moe_eplb.controller.autotune_settings import AutotuneSettings
    from moe_eplb.controller.k8s import Connection, KubeClient

    body = load_moeinferences(EXAMPLES / "qwen3-vl-30b-a3b-awq-eplb.yaml")[0]
    body["metadata"]["namespace"] = "default"
    body["spec"].get("monitoring", {}).pop("prometheusUrl", None)
    pod_dir = tmp_path / "pod"
    pod_dir.mkdir()
    _write_worker(pod_dir, 0)
    exporter = _Exporter(pod_dir)
    wall = [0.0]
    try:
        async with KubeClient(Connection(server=emulated_cluster.url, token="t")) as client:
            created = await client.create(body)
            await client.create({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "engine-0", "namespace": "default",
                             "labels": {k8s_names.NAME_LABEL: body["metadata"]["name"]}},
                "spec": {"containers": [{"name": "vllm", "image": "x", "ports": [
                    {"name": k8s_names.EXPORTER_PORT_NAME, "containerPort": exporter.port}]}]}})
            await client.patch("v1", "Pod", "default", "engine-0", {"status": {
                "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}, subresource="status")
            clock = _Clock()
            loop = AutotuneLoop(types.SimpleNamespace(client=client), AutotuneSettings(clock=clock))
            loop.rebalance = rebalance.RebalanceWatch(loop.settings, wall=lambda: wall[0])

            async def tick():
                fresh = await client.get("eplb.ai/v1alpha1", "MoEInference", "default", created["metadata"]["name"])
                return await loop.tick(parse(fresh)), fresh

            result, _ = await tick()
            assert result != "rebalance:AsyncWorkerFailed"  # no failure: no condition written
            _write_worker(pod_dir, 1)  # vLLM's async worker failed on this pod
            _write_worker(pod_dir, 1, rank=1)  # every rank raised it: still one failure
            result, _ = await tick()
            assert result is None or not result.startswith("rebalance:"), "checked again before CHECK_SECONDS"
            wall[0] += rebalance.CHECK_SECONDS
            result, _ = await tick()
            assert result == "rebalance:AsyncWorkerFailed"
            _, stored = await tick()
            cond = next(c for c in stored["status"]["conditions"] if c["type"] == "RebalanceFailed")
            assert cond["status"] == "True" and cond["reason"] == "AsyncWorkerFailed"
            assert "1 for model served" in cond["message"]
            events = await client.list("v1", "Event", "default")
            assert any(e.get("reason") == "RebalanceFailed" and e.get("type") == "Warning" for e in events)
            # the window passes without a new failure: the condition clears, once
            clock.t += rebalance.WINDOW_SECONDS + 1
            wall[0] += rebalance.CHECK_SECONDS
            result, _ = await tick()
            assert result == "rebalance:NoFailures"
            wall[0] += rebalance.CHECK_SECONDS
            result, stored = await tick()
            assert result is None or not result.startswith("rebalance:")
            cond = next(c for c in stored["status"]["conditions"] if c["type"] == "RebalanceFailed")
            assert cond["status"] == "False"
    finally:
        exporter.close()
