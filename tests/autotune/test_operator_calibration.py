"""Closed loop with calibration: simulated engines produce telemetry from hidden true cost parameters
(:class:`moe_eplb.sim.telemetry.TrueCost`, given to the fake kubelet only); the real operator reads it
(from a real Prometheus, or by scraping the pods), calibrates its cost model and records the
calibration in ``status.autotune.lastEvaluation.calibration`` and its metrics."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from moe_eplb.sim.telemetry import TrueCost
from moe_eplb.sim.world import SimWorld, prometheus_binary

from .conftest import NAME, NS, SCALE, autotune_status, resource, wait_for

pytestmark = pytest.mark.integration

TRUE = TrueCost(moe_time_share=0.6, kv_demand=0.5, kv_throughput_elasticity=0.0, use_async=False, sync_stall_s=1.2,
                bytes_per_expert=1048576)


def _calibration(res: dict) -> dict:
    return (autotune_status(res).get("lastEvaluation") or {}).get("calibration") or {}


def _measured_share(res: dict):
    """The resource once an evaluation measured the share on a long enough window (early ones see
    only a few buckets and keep the default or carry a wide uncertainty)."""
    params = _calibration(res).get("parameters") or {}
    p, stall = params.get("moe_time_share") or {}, params.get("sync_stall_s") or {}
    ok = p.get("source") == "measured" and p.get("uncertainty", 1) < 0.05 and stall.get("source") == "measured"
    return res if ok else None


@pytest.mark.parametrize("source", ["prometheus", "pods"])
async def test_operator_calibrates_from_simulated_telemetry(workload, source):
    if source == "prometheus" and prometheus_binary() is None:
        pytest.skip("no Prometheus binary")
    # The operator's buckets match the workload's 15 simulated seconds (Prometheus: two scrapes of
    # 0.075 s wall), so the imbalance it measures is the one the engines' step times follow (a
    # coarser bucket averages imbalance away and measures a smaller effective share; docs/tuner.md),
    # and a rearrangement every ~500 s leaves most buckets on one placement.
    world = SimWorld(workload=workload, scale=SCALE, startup_seconds=60.0, tick_seconds=0.1, true_cost=TRUE,
                     prometheus=source == "prometheus", scrape_interval=0.075, bucket_seconds=15.0)
    async with world.run():
        op = await world.start_operator()
        if world.prometheus_url:
            from moe_eplb.controller.settings import OperatorSettings

            op["controller"].settings = OperatorSettings(prometheus_url=world.prometheus_url)
        res = resource(mode="Recommend")
        res["spec"]["replicas"] = 1  # one engine: the rank loads summed over pods are its own
        res["spec"]["eplb"]["stepInterval"] = 10000
        await world.apply(res)
        got = await wait_for(world, _measured_share, timeout=90)
        cal = _calibration(got)
        share = cal["parameters"]["moe_time_share"]
        assert abs(share["value"] - TRUE.moe_time_share) <= 0.1, cal
        assert 0 < share["uncertainty"] < 0.05
        assert cal["useAsync"] is False
        stall = cal["parameters"]["sync_stall_s"]
        assert stall["source"] == "measured" and stall["value"] == pytest.approx(TRUE.sync_stall_s, rel=0.15), stall
        kv = cal["parameters"]["kv_throughput_elasticity"]
        assert kv["source"] == "measured" and kv["value"] <= 0.05, kv
        assert "moe_time_share" in cal["measured"]
        assert got["status"]["autotune"]["lastEvaluation"]["dataWindow"]["source"] == source
        labels = {"namespace": NS, "name": NAME, "parameter": "moe_time_share"}
        assert REGISTRY.get_sample_value("moe_eplb_calibration_value", {**labels, "source": "measured"}) \
            == pytest.approx(share["value"], rel=1e-4)
        assert REGISTRY.get_sample_value("moe_eplb_calibration_value", {**labels, "source": "default"}) is None
        assert REGISTRY.get_sample_value("moe_eplb_calibration_uncertainty", labels) == pytest.approx(
            share["uncertainty"], rel=1e-4)
