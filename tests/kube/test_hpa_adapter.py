"""The real HPA controller scales a MoEInference through ``/scale`` on vLLM's waiting requests, read
from a real Prometheus through prometheus-adapter (issue 20, part 4), as a Pods metric
(``custom.metrics.k8s.io``, per pod) and as an External metric (``external.metrics.k8s.io``, the
MoEInference's series by its ``moeinference`` label) -- the two shapes of ``spec.autoscaling``'s HPA. Every part is real except the
GPU nodes and engines: kube-apiserver with the aggregation layer, kube-controller-manager's HPA
controller (5 s sync), kube-scheduler, the operator, Prometheus scraping the simulated engine pods
(each on its own loopback IP, vLLM's ``vllm:num_requests_waiting`` per pod) and prometheus-adapter
v0.12.0 built from its Go module (``make kube``).

The engines' waiting requests come from the KV-cache pressure of the deployment's truth
(:class:`moe_eplb_harness.engines.physics.TrueCost`, ``kv_demand``): low at first (nothing waits, the HPA holds
1 replica), then raised as a traffic rise would (:meth:`SimWorld.set_true_cost`).
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from moe_eplb.api.quantity import quantity_number as quantity
from moe_eplb.contracts.metric_names import MOEINFERENCE_LABEL, adapter_metric_name
from moe_eplb.contracts.vllm_facts import REQUESTS_WAITING
from moe_eplb.eplb.workload import synth
from moe_eplb_harness.cluster.world import SimWorld
from moe_eplb_harness.engines.physics import TrueCost
from tests.kube.conftest import tiny_resource
from tests.polling import eventually

pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")

NAME = "tiny"
METRIC = adapter_metric_name(REQUESTS_WAITING)  # vllm_num_requests_waiting
TARGET = 10  # waiting requests per replica
MAX_REPLICAS = 3


def hpa_path(ns: str) -> str:
    return f"/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers"


def moe_path(ns: str) -> str:
    return f"/apis/eplb.ai/v1alpha1/namespaces/{ns}/moeinferences/{NAME}"


#: the autotune tier's small MoE (4 MoE layers x 16 experts, top-2, EP 4), one replica, autotune Off
RESOURCE: dict[str, Any] = tiny_resource(NAME, "default", replicas=1)

#: the series of the MoEInference, as the PodMonitor labels them (the External metric's selector)
EXTERNAL_SELECTOR = f"{MOEINFERENCE_LABEL}={NAME}"


def hpa(metrics_api: str, ns: str) -> dict[str, Any]:
    """The HPA the operator renders for ``spec.autoscaling`` with backend HPA and a Pods or External metric."""
    target = {"type": "AverageValue", "averageValue": str(TARGET)}
    metric: dict[str, Any] = {"name": METRIC}
    if metrics_api == "External":
        metric["selector"] = {"matchLabels": {MOEINFERENCE_LABEL: NAME}}
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": NAME, "namespace": ns},
        "spec": {
            "scaleTargetRef": {"apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference", "name": NAME},
            "minReplicas": 1, "maxReplicas": MAX_REPLICAS,
            "metrics": [{"type": metrics_api, metrics_api.lower(): {"metric": metric, "target": target}}],
        },
    }


#: how the test waits for the HPA's, the adapter's and Prometheus' steps (tests.polling.eventually)
WAIT = {"timeout": 60.0, "interval": 0.25}


def current_average(hpa: dict[str, Any]) -> float | None:
    """The HPA's current value of its metric (per replica), None before it has read one."""
    for m in (hpa.get("status") or {}).get("currentMetrics") or []:
        key = m.get("type", "").lower()
        if key in ("pods", "external") and m[key]["metric"]["name"] == METRIC:
            return quantity(m[key]["current"]["averageValue"])
    return None


async def served(adapter: Any, ns: str, metrics_api: str, pod_selector: str) -> list[float]:
    """What the adapter serves the HPA now: the value of each pod (Pods), or the MoEInference's total
    (External)."""
    if metrics_api == "Pods":
        return list((await asyncio.to_thread(adapter.pod_metric, ns, METRIC, pod_selector)).values())
    return await asyncio.to_thread(adapter.external_metric, ns, METRIC, EXTERNAL_SELECTOR)


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


@pytest.mark.parametrize("metrics_api", ["Pods", "External"])
async def test_hpa_scales_moeinference_on_waiting_requests_via_prometheus_adapter(hpa_adapter_parts, real_control_plane,
                                                                                  metrics_api) -> None:
    workload = synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=1,
                              bucket_seconds=15, seed=1)
    world = SimWorld(workload=workload, api="real", prometheus=True, metrics_adapter=True, scrape_interval=0.5,
                     scale=100.0, startup_seconds=60.0, true_cost=TrueCost(kv_demand=0.2), shared_plane=real_control_plane)
    async with world.run():
        assert world.backend.on_shared, "the session's control plane has the real HPA controller and the aggregation layer"
        cluster, adapter, ns = world.cluster, world.adapter, world.namespace
        await world.start_operator()
        await world.apply(copy.deepcopy(RESOURCE))
        selector = await eventually(lambda: _status(cluster, ns, "selector"), what="the /scale selector", **WAIT)
        await eventually(lambda: _ready_targets(world, 1), what="1 ready pod in Prometheus", **WAIT)
        await cluster.create(hpa_path(ns), hpa(metrics_api, ns))

        # 1. little KV-cache pressure: nothing waits; the HPA reads the metric and holds 1 replica
        quiet = await eventually(lambda: _hpa_with_metric(cluster, ns), what="the HPA reading the metric", **WAIT)
        assert current_average(quiet) < TARGET
        assert quiet["status"]["desiredReplicas"] == 1
        assert conditions(quiet)["ScalingActive"]["status"] == "True"
        assert conditions(quiet)["ScalingActive"]["reason"] == "ValidMetricFound"
        now = await served(adapter, ns, metrics_api, selector)
        assert len(now) == 1 and now[0] < TARGET, now  # one pod, or the one total
        assert (await cluster.get(moe_path(ns)))["spec"]["replicas"] == 1

        # 2. a traffic rise fills the caches: requests wait, the HPA scales the MoEInference via /scale
        world.set_true_cost(TrueCost(kv_demand=2.0))
        now = await eventually(lambda: _served_above(adapter, ns, metrics_api, selector),
                               what="waiting requests above target through the adapter", **WAIT)
        assert len(now) == 1 and now[0] > TARGET, now
        scaled = await eventually(lambda: _replicas_at_least(cluster, ns, MAX_REPLICAS),
                                  what=f"spec.replicas == {MAX_REPLICAS}", **WAIT)
        assert scaled["spec"]["replicas"] == MAX_REPLICAS
        status = await cluster.get(f"{hpa_path(ns)}/{NAME}")
        assert status["status"]["desiredReplicas"] == MAX_REPLICAS
        assert current_average(status) > TARGET
        assert conditions(status)["ScalingLimited"]["status"] == "True"  # wants more than maxReplicas
        assert conditions(status)["ScalingLimited"]["reason"] == "TooManyReplicas"
        # the operator carries the count to the Deployment, and the simulated nodes run the new pods
        await eventually(lambda: _deployment_replicas(cluster, ns, MAX_REPLICAS), what=f"the Deployment at {MAX_REPLICAS} replicas", **WAIT)
        await eventually(lambda: _ready_targets(world, MAX_REPLICAS), what=f"{MAX_REPLICAS} ready pods in Prometheus", **WAIT)
        status = await eventually(lambda: _hpa_current_replicas(cluster, ns, MAX_REPLICAS), what="the HPA seeing every pod",
                                  **WAIT)
        assert status["status"]["desiredReplicas"] == MAX_REPLICAS
        assert current_average(status) > TARGET
        assert (await cluster.get(moe_path(ns)))["status"]["replicas"] == MAX_REPLICAS


async def _status(cluster: Any, ns: str, key: str) -> Any:
    return ((await cluster.get(moe_path(ns))).get("status") or {}).get(key)


async def _ready_targets(world: SimWorld, n: int) -> list[dict]:
    targets = [t for t in world.kubelet.targets() if t["moeinference"] == NAME]
    return targets if len(targets) == n else []


async def _hpa_with_metric(cluster: Any, ns: str) -> dict[str, Any] | None:
    obj = await cluster.get(f"{hpa_path(ns)}/{NAME}")
    return obj if current_average(obj) is not None else None


async def _deployment_replicas(cluster: Any, ns: str, n: int) -> bool:
    return (await cluster.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{NAME}"))["spec"]["replicas"] == n


async def _served_above(adapter: Any, ns: str, metrics_api: str, selector: str) -> list[float] | None:
    now = await served(adapter, ns, metrics_api, selector)
    return now if now and all(v > TARGET for v in now) else None


async def _replicas_at_least(cluster: Any, ns: str, n: int) -> dict[str, Any] | None:
    res = await cluster.get(moe_path(ns))
    return res if res["spec"]["replicas"] >= n else None


async def _hpa_current_replicas(cluster: Any, ns: str, n: int) -> dict[str, Any] | None:
    obj = await cluster.get(f"{hpa_path(ns)}/{NAME}")
    status = obj.get("status") or {}
    return obj if status.get("currentReplicas") == n and current_average(obj) is not None else None
