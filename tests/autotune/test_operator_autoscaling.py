"""Operator-in-the-loop: the tuner waits for the replica autoscaler. The real operator renders an
autoscaling/v2 HPA for spec.autoscaling; the test plays the HPA controller by writing the HPA's
status (at maxReplicas, wanting more, requests waiting): the evaluation defers with reason
WaitingForAutoscaler and an Event, nothing restarts; once the queue is empty the change is applied,
and the rollout records the replica count it started with (the HPA's minReplicas is held there
while pods restart, and released once the new pods are ready)."""

from __future__ import annotations

import asyncio

import pytest

from moe_eplb_harness.cluster.world import SimWorld

from .conftest import NAME, NS, SCALE, autotune_status, cond, events, resource, template_hash, wait_for, workload_of

pytestmark = pytest.mark.integration  # the real operator, an emulated API server and simulated engine pods

HPA_PATH = f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers/{NAME}"


def _decision(res: dict) -> str | None:
    return (autotune_status(res).get("lastEvaluation") or {}).get("decision")


async def test_tuner_waits_while_the_autoscaler_is_at_max_with_requests_waiting(workload, kind):
    world = SimWorld(workload=workload, scale=SCALE, startup_seconds=60.0, tick_seconds=0.2)
    async with world.run():
        res = resource(kind)
        api = "External" if kind == "LeaderWorkerSet" else "Pods"
        res["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 2, "backend": "HPA", "hpa": {"metricsApi": api}}
        res["spec"]["monitoring"] = {"podMonitor": {"enabled": True}}
        await world.start_operator()
        await world.apply(res)
        for _ in range(200):  # the operator creates the HPA
            if await world.cluster.get_or_none(HPA_PATH) is not None:
                break
            await asyncio.sleep(0.05)
        kind_of_metric = api.lower()
        busy = {"currentReplicas": 2, "desiredReplicas": 2,
                "currentMetrics": [{"type": api, kind_of_metric: {"metric": {"name": "vllm_num_requests_waiting"},
                                                                  "current": {"averageValue": "4"}}}],
                "conditions": [{"type": "ScalingLimited", "status": "True", "reason": "TooManyReplicas",
                                "message": "the desired replica count is more than the maximum replica count"}]}
        await world.cluster.patch(HPA_PATH + "/status", {"status": busy})
        await wait_for(world, lambda r: r.get("status", {}).get("phase") == "Running" or None, timeout=15)
        hash0 = template_hash(await workload_of(world, kind))

        got = await wait_for(world, lambda r: _decision(r) == "Defer" and r, timeout=40)
        reason = autotune_status(got)["lastEvaluation"]["reason"]
        assert "at maxReplicas (2) with 4 requests waiting per replica" in reason, reason
        assert cond(got, "Tuned")["reason"] == "WaitingForAutoscaler"
        assert "rollout" not in autotune_status(got) and "override" not in autotune_status(got)
        assert template_hash(await workload_of(world, kind)) == hash0
        assert "WaitingForAutoscaler" in [e["reason"] for e in await events(world)]

        # the queue drains: the next evaluation applies, and the rollout holds the HPA's minimum at 2
        idle = {**busy, "currentMetrics": [{"type": api, kind_of_metric: {
            "metric": {"name": "vllm_num_requests_waiting"}, "current": {"averageValue": "0"}}}],
            "conditions": [{"type": "ScalingLimited", "status": "False", "reason": "DesiredWithinRange"}]}
        await world.cluster.patch(HPA_PATH + "/status", {"status": idle})
        got = await wait_for(world, lambda r: _decision(r) == "Apply" and r, timeout=40)
        assert autotune_status(got)["rollout"]["replicas"] == 2

        for _ in range(100):  # re-rendered from the rollout record
            if (await world.cluster.get(HPA_PATH))["spec"]["minReplicas"] == 2:
                break
            await asyncio.sleep(0.1)
        assert (await world.cluster.get(HPA_PATH))["spec"]["minReplicas"] == 2

        # the new pods are ready (Observing): nothing restarts any more, the autoscaler's own minimum is back
        await wait_for(world, lambda r: (autotune_status(r).get("rollout") or {}).get("phase") in ("Observing", None)
                       and r, timeout=60)
        for _ in range(100):
            if (await world.cluster.get(HPA_PATH))["spec"]["minReplicas"] == 1:
                break
            await asyncio.sleep(0.1)
        assert (await world.cluster.get(HPA_PATH))["spec"]["minReplicas"] == 1

