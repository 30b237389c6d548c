"""The simulated engine reports a function of simulated time alone (issue 19, the demo's flake on a
loaded machine): its replay task advances when the event loop gets to it -- every 0.1 s on an idle
machine, in chunks of many simulated seconds on a busy one -- and what a pod serves at a simulated
time (load, steps, rank tokens, step-time and KV telemetry) must not depend on that chunking, or
the operator's calibration and the tuner's decision change with the machine's load."""

from __future__ import annotations

import numpy as np
import pytest

from moe_eplb.api.knobs import Knobs
from moe_eplb.eplb.workload import synth
from moe_eplb_harness.engines.engine import EngineRun, EngineSettings, SimClock, SimulatedEngine
from moe_eplb_harness.engines.physics import TrueCost


def _values(text: str, skip: tuple[str, ...] = ()) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and not line.startswith(skip):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def _engine(trace, use_async: bool, pods: int) -> SimulatedEngine:
    settings = EngineSettings("example/tiny-moe", ep_size=4, knobs=Knobs(window_size=100, step_interval=40,
                                                                          num_redundant_experts=4), num_nodes=pods)
    true = TrueCost(use_async=use_async, kv_demand=1.2, step_noise=0.05, outlier_share=0.3, prefix_reuse=0.5)
    eng = SimulatedEngine(trace, settings, SimClock(scale=50.0, epoch=0.0, workload_start=0.0),
                          EngineRun(seed=3, true_cost=true, pods=pods))
    eng.ready, eng.started_wall = True, 1.0
    eng.advance_to(0.0)
    return eng


@pytest.mark.parametrize("use_async,pods", [(True, 1), (False, 2)])
def test_what_a_pod_reports_does_not_depend_on_the_replay_chunks(use_async, pods):
    trace = synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=0.25,
                           bucket_seconds=15.0, seed=1, peak_steps_per_second=20.0)
    idle, busy = _engine(trace, use_async, pods), _engine(trace, use_async, pods)
    rng = np.random.default_rng(0)
    t_busy = 0.0
    for t in np.arange(100.0, 800.0, 100.0):  # the scrapes
        for x in np.arange(t - 100.0, t, 2.5)[1:]:  # an idle machine: a chunk every 2.5 simulated s
            idle.advance_to(float(x))
        idle.advance_to(float(t))
        while t_busy < t:  # a loaded one: chunks of 5-70 s
            t_busy = min(float(t), t_busy + float(rng.uniform(5.0, 70.0)))
            busy.advance_to(t_busy)
        assert idle.replay.rearrangements > 0 or t < 300
        for k in range(pods):
            # the step-time histogram's buckets: an async copy's time is spread over its chunk's steps
            a = _values(idle.exposition(k).decode(), skip=("moe_eplb_step_duration_seconds_bucket",))
            b = _values(busy.exposition(k).decode(), skip=("moe_eplb_step_duration_seconds_bucket",))
            assert a.keys() == b.keys()
            diff = {key: (a[key], b[key]) for key in a if not np.isclose(a[key], b[key], rtol=1e-9, atol=1e-9)}
            assert not diff, f"t={t}: {len(diff)} of {len(a)} values differ, e.g. {list(diff.items())[:5]}"
    assert idle.preemptions > 0 and idle.prefix_hits > 0  # the noisy telemetry was exercised
