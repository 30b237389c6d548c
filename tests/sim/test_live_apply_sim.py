"""Live apply on the SIMULATED engines: the operator's own ``apply_live`` over HTTP against the
simulated pods' ``/eplb/settings`` route (:mod:`moe_eplb_harness.engines.live_route`), and the
simulated replay's schedule against vLLM's counter rule. The real engine's test is
tests/vllm_engine/test_engine_live_apply.py."""

from __future__ import annotations

import asyncio

import pytest

from moe_eplb.api.knobs import Knobs
from moe_eplb.contracts import live_protocol as lp
from moe_eplb.controller.live import LivePod, apply_live
from moe_eplb.eplb.workload import synth
from moe_eplb_harness.engines.engine import EngineRun, EngineSettings, SimClock, SimulatedEngine, SimulatedEplb

TOKEN = "sim-token"


@pytest.fixture(scope="module")
def trace():
    return synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=0.5,
                          bucket_seconds=15, seed=2, shift_at=0.5)


def test_replay_follows_vllms_counter_from_the_agreed_step(trace):
    """At the agreed step the interval changes and vLLM's counter is kept: the next rearrangement
    comes when the counter reaches the new interval (the plugin's semantics on the real engine)."""
    rp = SimulatedEplb(trace.num_layers, trace.num_experts, EngineSettings("m", ep_size=4, knobs=Knobs(50, 100, 0)))
    rp.run(trace.load[0], 130)  # rearranged at step 24 (100 // 4 = 25 steps in) and 124
    assert list(rp.rearranged_steps) == [24, 124]
    rp.schedule_live(140, Knobs(30, 40, 0))
    rp.run(trace.load[1], 200)
    counter_at = 140 - 125  # steps since the rearrangement at step 124
    first = 140 + 40 - 1 - counter_at
    assert list(rp.rearranged_steps) == [24, 124, *range(first, 330, 40)]
    assert rp.live_done[140][0] == lp.APPLIED and rp.s.knobs == Knobs(30, 40, 0) and rp.since_step == 140
    # within the grace of a rearrangement: refused by the guard, nothing changes
    rp.schedule_live(rp.next_rearrange - 2, Knobs(20, 30, 0), grace_steps=5)
    rp.run(trace.load[2], 40)
    assert rp.live_done[max(rp.live_done)][0] == lp.REFUSED and rp.s.knobs == Knobs(30, 40, 0)


@pytest.mark.integration
async def test_operator_applies_live_to_a_simulated_pod(trace):
    clock = SimClock.started_now(scale=100.0)
    eng = SimulatedEngine(trace, EngineSettings("example/tiny-moe", ep_size=4, knobs=Knobs(200, 600, 0)), clock,
                          EngineRun(startup_seconds=0.0, tick=0.02))
    port = await eng.start()
    pod = LivePod("tiny-0", f"http://127.0.0.1:{port}", "tiny-0", 4)
    try:
        await asyncio.sleep(1.5)  # the pod's step rate is known after a second
        no_token = await apply_live([pod], TOKEN, Knobs(100, 300, 0), Knobs(200, 600, 0), confirm_seconds=5)
        assert not no_token.ok and "HTTP 503" in no_token.reason and eng.replay.s.knobs == Knobs(200, 600, 0)
        eng.control_token = TOKEN
        wrong = await apply_live([pod], "guess", Knobs(100, 300, 0), Knobs(200, 600, 0), confirm_seconds=5)
        assert not wrong.ok and "HTTP 403" in wrong.reason
        stale = await apply_live([pod], TOKEN, Knobs(100, 300, 0), Knobs(250, 600, 0))
        assert not stale.ok and "runs window 200, interval 600" in stale.reason
        done = await apply_live([pod], TOKEN, Knobs(100, 300, 0), Knobs(200, 600, 0))
        assert done.ok, done
        assert eng.settings.knobs == Knobs(100, 300, 0) and eng.replay.since_step == done.step
        assert all(s == lp.APPLIED for rep in done.engines for s in rep.states.values())
        assert b'window_size="100",step_interval="300"' in eng.exposition()
        # without an expectation (an interleaved block: the pods run either arm) the change goes
        # from what the ranks report running
        back = await apply_live([pod], TOKEN, Knobs(200, 600, 0), None)
        assert back.ok, back
        assert eng.settings.knobs == Knobs(200, 600, 0)
    finally:
        await eng.stop()
