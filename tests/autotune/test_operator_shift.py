"""The workload-shift watch (:mod:`moe_eplb.controller.shift`) through a real Prometheus on an
accelerated clock, as the demo runs it: the real kopf operator, simulated engine pods replaying a
chat -> math workload that shifts half-way, Prometheus scraping every 2 wall seconds, the clock 100x.

The watch's windows are a tenth of the evaluation interval, 180 clock seconds = 1.8 wall seconds
here: under one scrape interval, so a window read alone holds no counter increase. Each read spans at
least two scrapes (400 clock seconds, overlapping the windows before it); the test fails when the
watch reads nothing (no evaluation cites a shift) or dates the shift wrongly (its evaluation reads load
from before the shift, or far after it)."""

from __future__ import annotations

import asyncio

import pytest

from moe_eplb.eplb.workload import synth
from moe_eplb_harness.cluster.world import SimWorld
from tests.require import prometheus_tools

from .conftest import resource

pytestmark = [pytest.mark.integration, pytest.mark.prometheus]

HOURS, SHIFT_AT = 1.5, 0.5
SHIFT_S = HOURS * 3600 * SHIFT_AT  # the workload's shift, seconds into the trace
INTERVAL = 1800  # evaluationIntervalSeconds: the watch samples every 180 s


async def test_a_shift_is_evaluated_on_the_load_since_it_through_prometheus_at_100x():
    prometheus_tools()
    trace = synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=HOURS,
                           bucket_seconds=15, seed=1, shift_at=SHIFT_AT)
    evaluations: list[tuple[float, object]] = []

    def observer(kind, inf, record):
        if kind == "evaluation":
            evaluations.append((world.clock.workload_seconds(), record))

    world = SimWorld(workload=trace, scale=100.0, startup_seconds=60.0, prometheus=True, scrape_interval=2.0,
                     tick_seconds=0.2, observer=observer, bucket_seconds=60.0, lookback_seconds=1800.0)
    async with world.run():
        await world.start_operator()
        # Recommend: no change restarts the watch, so only the workload moves balancedness
        res = resource("Deployment", mode="Recommend", evaluationIntervalSeconds=INTERVAL)
        res["spec"]["monitoring"] = {"prometheusUrl": world.prometheus_url}
        await world.apply(res)
        assert world.autotune is not None
        start = world.clock.workload_start
        while world.clock.workload_seconds() < HOURS * 3600 * 0.9 and not any(
                e.reason.startswith("workload shift") for _, e in evaluations):
            await asyncio.sleep(0.5)
    shifted = [(t, e) for t, e in evaluations if e.reason.startswith("workload shift")]
    assert shifted, [(round(t), e.decision, e.reason[:80]) for t, e in evaluations]
    t, ev = shifted[0]
    assert ev.decision == "Recommend", ev.reason
    # dated where the workload shifted (the watch's windows are 180 s apart; the detection and the
    # dating land on the window grid), and read from there on only
    since = ev.data_window.start - start
    assert SHIFT_S - 180 <= since <= SHIFT_S + 540, (since, ev.reason)
    # the words say balancedness fell; evaluated once the load since held 3 of the read's 400 s buckets
    before, after = (float(x) for x in ev.reason.split("balancedness ")[1].split(" (")[0].split(" -> "))
    assert before - after >= 0.05, ev.reason
    assert ev.data_window.buckets >= 2 and t - SHIFT_S <= 2400, (t, ev.data_window)
