"""The real KEDA (v2.18.0, built from its Go module by ``make kube``) scales a MoEInference with
``spec.autoscaling``'s default backend: the operator renders the ScaledObject, KEDA's operator makes
its HPA on the MoEInference's ``/scale``, and kube-controller-manager's HPA controller scales it on
KEDA's external metric -- KEDA's metrics server (``external.metrics.k8s.io`` through the aggregation
layer) asking KEDA's operator, which runs the rendered PromQL on a real Prometheus scraping the
simulated engine pods (vLLM's ``vllm:num_requests_waiting``). With ``minReplicas: 0`` KEDA itself
takes the resource to zero when nothing waits, and wakes it on the first request waiting at the
gateway in front of the engines (``spec.autoscaling.keda.activationQuery`` on a gateway's queue
series: at zero no engine reports vLLM's metric). What KEDA reports back (the ScaledObject's ``Ready``
condition) shows in the MoEInference's ``Autoscaling`` condition.

Every part is real except the GPU nodes and engines (:mod:`moe_eplb_harness.real.nodeagent`) and the gateway's queue series; the engines'
waiting requests come from the deployment's truth (``TrueCost.kv_demand``), raised as a traffic
rise would (:meth:`SimWorld.set_true_cost`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import json
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from moe_eplb.api.quantity import quantity_number as quantity
from moe_eplb.contracts.k8s_names import KEDA_HPA_PREFIX
from moe_eplb.eplb.workload import synth
from moe_eplb_harness.cluster.world import SimWorld
from moe_eplb_harness.engines.physics import TrueCost
from moe_eplb_harness.floor.procs import free_port
from moe_eplb_harness.real import simplane
from moe_eplb_harness.real.keda import Keda
from tests.kube.conftest import tiny_resource
from tests.polling import eventually

pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")

NAME = "tiny"
TARGET = 10  # waiting requests per replica group
MAX_REPLICAS = 3
HPA_NAME = KEDA_HPA_PREFIX + NAME
WAIT = {"timeout": 90.0, "interval": 0.25}
POLL = 5  # KEDA's pollingInterval (s)
COOLDOWN = 40  # seconds, with minReplicas 0: scaleDown.stabilizationWindowSeconds, KEDA's cooldownPeriod

#: the autotune tier's small MoE on one Deployment (4 pods of EP 4 per replica), autotune Off, and
#: autoscaling with the default backend (KEDA): fast enough for a test (KEDA polls every 5 s; two
#: groups a second up; down at once)
RESOURCE: dict[str, Any] = tiny_resource(
    NAME, autoscaling={"minReplicas": 1, "maxReplicas": MAX_REPLICAS,
                       "metric": {"type": "RequestsWaiting", "target": TARGET},
                       "scaleUp": {"replicas": 2, "periodSeconds": 1},
                       "scaleDown": {"stabilizationWindowSeconds": 0, "replicas": 3, "periodSeconds": 1},
                       "keda": {"pollingIntervalSeconds": POLL}})


@contextlib.asynccontextmanager
async def keda_world(min_replicas: int) -> AsyncIterator[tuple[SimWorld, Keda, dict[str, Any]]]:
    """A control plane with the aggregation layer and KEDA, a world on it with Prometheus, the
    operator, and the resource applied (``spec.monitoring.prometheusUrl``: that Prometheus)."""
    workload = synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=1,
                              bucket_seconds=15, seed=1)
    with tempfile.TemporaryDirectory(prefix="moe-eplb-keda-") as tmp:
        sp = await asyncio.to_thread(simplane.start, tmp, lws=False, aggregator=True)
        keda = Keda(sp.plane, f"{tmp}/keda")
        try:
            await asyncio.to_thread(keda.start)
            world = SimWorld(workload=workload, api="real", lws="emulated", prometheus=True, scrape_interval=0.5,
                             scale=100.0, startup_seconds=60.0, true_cost=TrueCost(kv_demand=0.2), shared_plane=sp)
            async with world.run():
                await world.start_operator()
                resource = copy.deepcopy(RESOURCE)
                resource["spec"]["autoscaling"]["minReplicas"] = min_replicas
                if min_replicas == 0:  # KEDA's cooldown before it scales to zero (and after creation)
                    resource["spec"]["autoscaling"]["scaleDown"]["stabilizationWindowSeconds"] = COOLDOWN
                    # what wakes it from zero: the queue in front of the engines (a gateway's series)
                    resource["spec"]["autoscaling"]["keda"]["activationQuery"] = f"sum({GATEWAY_SERIES})"
                resource["spec"]["monitoring"] = {"prometheusUrl": world.prometheus_url}
                await world.apply(resource)
                try:
                    yield world, keda, resource
                except BaseException:
                    print("--- keda-operator log ---\n" + keda.log_tail("keda-operator", 60))
                    print("--- keda-adapter log ---\n" + keda.log_tail("keda-adapter", 30))
                    raise
        finally:
            await asyncio.to_thread(keda.stop)
            await asyncio.to_thread(sp.stop)


async def test_keda_scales_moeinference_on_waiting_requests_from_prometheus(keda_parts) -> None:
    async with keda_world(min_replicas=1) as (world, keda, _):
        ns, cluster = world.namespace, world.cluster
        so_path = f"/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects/{NAME}"
        hpa_path = f"/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers/{HPA_NAME}"
        moe_path = cluster.moeinference_path(ns, NAME)

        # the operator renders the ScaledObject; KEDA accepts it and makes its HPA on our /scale
        so = await eventually(lambda: _condition_true(cluster, so_path, "Ready"), what="the ScaledObject Ready", **WAIT)
        assert so["metadata"]["ownerReferences"][0]["kind"] == "MoEInference"
        assert so["status"]["scaleTargetKind"] == "eplb.ai/v1alpha1.MoEInference"
        hpa = await eventually(lambda: cluster.get_or_none(hpa_path), what="KEDA's HPA", **WAIT)
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference", "name": NAME}
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, MAX_REPLICAS)
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "External" and metric["external"]["target"] == {"type": "AverageValue",
                                                                                  "averageValue": str(TARGET)}
        # the HPA behavior the operator asked for, carried over by KEDA
        assert hpa["spec"]["behavior"]["scaleUp"]["policies"] == [{"type": "Pods", "value": 2, "periodSeconds": 1}]
        metric_name = metric["external"]["metric"]["name"]

        # 1. nothing waits: the HPA controller reads KEDA's metric (through the aggregator) and holds 1
        quiet = await eventually(lambda: _hpa_reading(cluster, hpa_path), what="the HPA reading KEDA's metric", **WAIT)
        assert quiet["status"]["desiredReplicas"] == 1
        assert _conditions(quiet)["ScalingActive"]["reason"] == "ValidMetricFound"
        assert _current(quiet) < TARGET
        served = await asyncio.to_thread(keda.external_metric, ns, metric_name, NAME)
        assert len(served) == 1 and served[0] < TARGET, served
        status = (await cluster.get(moe_path))["status"]
        cond = _conditions({"status": status})["Autoscaling"]
        assert (cond["status"], cond["reason"]) == ("True", "AutoscalerActive"), cond

        # 2. a traffic rise: requests wait, the rendered query sees them in Prometheus, KEDA serves
        # the value and the HPA controller scales the MoEInference through /scale to maxReplicas
        world.set_true_cost(TrueCost(kv_demand=2.0))
        promql = await eventually(lambda: _prometheus_above(world, ns), what="the rendered query above target", **WAIT)
        assert promql > TARGET
        scaled = await eventually(lambda: _replicas_at_least(cluster, moe_path, MAX_REPLICAS),
                                  what=f"spec.replicas == {MAX_REPLICAS}", **WAIT)
        assert scaled["spec"]["replicas"] == MAX_REPLICAS
        hpa = await cluster.get(hpa_path)
        assert hpa["status"]["desiredReplicas"] == MAX_REPLICAS
        assert _conditions(hpa)["ScalingLimited"]["reason"] == "TooManyReplicas"
        deploy = f"/apis/apps/v1/namespaces/{ns}/deployments/{NAME}"
        await eventually(lambda: _field_is(cluster, deploy, MAX_REPLICAS), what="the Deployment scaled", **WAIT)
        so = await cluster.get(so_path)
        assert _conditions(so)["Active"]["status"] == "True"


async def test_keda_scales_moeinference_to_zero_and_its_not_ready_shows_in_status(keda_parts) -> None:
    async with keda_world(min_replicas=0) as (world, _keda, _):
        ns, cluster = world.namespace, world.cluster
        so_path = f"/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects/{NAME}"
        moe_path = cluster.moeinference_path(ns, NAME)
        so = await eventually(lambda: _condition_true(cluster, so_path, "Ready"), what="the ScaledObject Ready", **WAIT)
        assert so["spec"]["minReplicaCount"] == 0
        assert so["spec"]["triggers"][0]["metadata"]["activationThreshold"] == "0"
        assert so["spec"]["cooldownPeriod"] == COOLDOWN
        created = datetime.datetime.fromisoformat(so["metadata"]["creationTimestamp"].replace("Z", "+00:00")).timestamp()
        # nothing waits: KEDA's first polls find the trigger inactive, but a resource just created
        # keeps its replica while its engines load: not before the cooldown does KEDA take it to zero
        so = await eventually(lambda: _condition_is(cluster, so_path, "Active", "False"), what="Active False", **WAIT)
        assert _conditions(so)["Active"]["reason"] == "ScalerCooldown", _conditions(so)["Active"]
        await asyncio.sleep(POLL)  # one more poll: before the fix KEDA scaled to zero at its first
        early = time.time() - created
        assert early < COOLDOWN - 5, f"too slow to tell: {early:.0f} s after creation"
        assert (await cluster.get(moe_path))["spec"]["replicas"] == 1, f"scaled to zero {early:.0f} s after creation"
        zero = await eventually(lambda: _replicas_at_most(cluster, moe_path, 0), what="spec.replicas == 0", **WAIT)
        assert zero["spec"]["replicas"] == 0 and time.time() - created >= COOLDOWN - 1
        deploy = f"/apis/apps/v1/namespaces/{ns}/deployments/{NAME}"
        await eventually(lambda: _field_is(cluster, deploy, 0), what="the Deployment at zero", **WAIT)

        # at zero no engine runs, so nothing reports a waiting request: a traffic rise does not
        # activate KEDA (the rendered query has no series; KEDA reads that as 0), the resource stays at zero
        world.set_true_cost(TrueCost(kv_demand=2.0))
        await asyncio.sleep(3 * POLL)
        so = await cluster.get(so_path)
        assert _conditions(so)["Active"]["status"] == "False", _conditions(so)["Active"]
        assert (await cluster.get(moe_path))["spec"]["replicas"] == 0
        assert await _prometheus_values(world, ns) == []  # no engine, no series
        # the first request waits at the gateway in front of the engines: the activation query
        # (spec.autoscaling.keda.activationQuery) sees it, KEDA activates and wakes the resource; its
        # engines report the waiting requests and its HPA scales on to maxReplicas
        with gateway_queue(world) as queue:
            queue.set(1)
            so = await eventually(lambda: _condition_is(cluster, so_path, "Active", "True"), what="KEDA active", **WAIT)
            assert _conditions(so)["Active"]["reason"] == "ScalerActive"
            woke = await eventually(lambda: _replicas_at_least(cluster, moe_path, 1), what="woken from zero", **WAIT)
            assert woke["spec"]["replicas"] >= 1
            up = await eventually(lambda: _replicas_at_least(cluster, moe_path, MAX_REPLICAS), what="maxReplicas",
                                  **WAIT)
            assert up["spec"]["replicas"] == MAX_REPLICAS
            queue.set(0)

        # KEDA's word reaches the resource: with a Prometheus address nothing answers at (a user's
        # edit), KEDA's trigger fails, the ScaledObject is not Ready, and the MoEInference's
        # Autoscaling condition carries KEDA's reason and message
        dead = f"http://127.0.0.1:{free_port()}"
        await cluster.patch(moe_path, {"spec": {"monitoring": {"prometheusUrl": dead}}})
        cond = await eventually(lambda: _autoscaling(cluster, moe_path, "False"), what="Autoscaling False from KEDA",
                                **WAIT)
        assert cond["reason"] == "ScaledObjectNotReady", cond
        assert cond["message"].startswith(f"KEDA reports ScaledObject {NAME} not Ready (TriggerError)"), cond
        # and back: Prometheus reachable again, KEDA Ready, the condition True
        await cluster.patch(moe_path, {"spec": {"monitoring": {"prometheusUrl": world.prometheus_url}}})
        cond = await eventually(lambda: _autoscaling(cluster, moe_path, "True"), what="Autoscaling True again", **WAIT)
        assert cond["reason"] == "AutoscalerActive", cond


#: a gateway's queue in front of the engines (a stand-in for the series your gateway or router exports)
GATEWAY_SERIES = "gateway_requests_waiting"


@contextlib.contextmanager
def gateway_queue(world: SimWorld) -> Iterator[Gauge]:
    """A gateway's queue series served on loopback and scraped by the world's Prometheus."""
    registry = CollectorRegistry()
    gauge = Gauge(GATEWAY_SERIES, "requests waiting at the gateway for an engine", registry=registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        assert world.prom is not None
        world.prom.add_target(f"127.0.0.1:{port}", job="gateway")
        yield gauge
    finally:
        server.shutdown()
        thread.join(5)


async def _prometheus_values(world: SimWorld, ns: str) -> list[float]:
    """The values of the ScaledObject's rendered PromQL in the world's Prometheus now."""
    so = await world.cluster.get(f"/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects/{NAME}")
    promql = so["spec"]["triggers"][0]["metadata"]["query"]
    url = f"{world.prometheus_url}/api/v1/query?query={urllib.parse.quote(promql)}"
    body = await asyncio.to_thread(lambda: json.load(urllib.request.urlopen(url, timeout=5)))
    return [float(r["value"][1]) for r in body["data"]["result"]]


async def _prometheus_above(world: SimWorld, ns: str) -> float | None:
    """The value of the rendered PromQL, once above target."""
    values = await _prometheus_values(world, ns)
    return values[0] if values and values[0] > TARGET else None


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def _current(hpa: dict[str, Any]) -> float | None:
    for m in (hpa.get("status") or {}).get("currentMetrics") or []:
        if m.get("type") == "External":
            return quantity(m["external"]["current"]["averageValue"])
    return None


async def _condition_is(cluster: Any, path: str, kind: str, status: str) -> dict[str, Any] | None:
    obj = await cluster.get_or_none(path)
    return obj if obj and _conditions(obj).get(kind, {}).get("status") == status else None


async def _condition_true(cluster: Any, path: str, kind: str) -> dict[str, Any] | None:
    return await _condition_is(cluster, path, kind, "True")


async def _hpa_reading(cluster: Any, path: str) -> dict[str, Any] | None:
    obj = await cluster.get(path)
    return obj if _current(obj) is not None else None


async def _replicas_at_least(cluster: Any, path: str, n: int) -> dict[str, Any] | None:
    obj = await cluster.get(path)
    return obj if obj["spec"]["replicas"] >= n else None


async def _replicas_at_most(cluster: Any, path: str, n: int) -> dict[str, Any] | None:
    obj = await cluster.get(path)
    return obj if obj["spec"].get("replicas") is not None and obj["spec"]["replicas"] <= n else None


async def _field_is(cluster: Any, path: str, n: int) -> bool:
    return (await cluster.get(path))["spec"]["replicas"] == n


async def _autoscaling(cluster: Any, path: str, status: str) -> dict[str, Any] | None:
    cond = _conditions(await cluster.get(path)).get("Autoscaling") or {}
    return cond if cond.get("status") == status else None
