"""What the simulated engines add for issue 40 (``TrueCost``'s realism) and the in-process fleet the
experiment benchmark drives (``moe_eplb_harness.engines.fleet``): the counters it hands the arm
tracker are the ones ``/metrics`` carries, the realism is opt-in and a function of simulated time
alone, a pod's speed belongs to its GPUs, a cold start warms up, the noise is correlated from tick
to tick, a skewed router splits the traffic unevenly, and a live change of the interval changes the
rearrangements' cadence."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moe_eplb.api.knobs import Knobs
from moe_eplb.eplb.tuning.experiment import bucket_difference
from moe_eplb.eplb.workload import synth
from moe_eplb.metrics.arms import ArmTracker, arm_bucket, counters_from_exposition
from moe_eplb_harness.engines.engine import EngineRun, EngineSettings, SimClock, SimulatedEngine
from moe_eplb_harness.engines.fleet import Fleet
from moe_eplb_harness.engines.physics import TrueCost

KNOBS = Knobs(1000, 3000, 0)


@pytest.fixture(scope="module")
def trace():
    return synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=1.0, bucket_seconds=15.0,
                          seed=1, peak_tokens_per_step=3000.0)


def _diffs(fleet: Fleet, start: float, end: float) -> np.ndarray:
    tracker, out = ArmTracker(), []
    for t in np.arange(start, end, 15.0):
        fleet.advance(float(t))
        pair = tracker.bucket(float(t), fleet.counters(), [fleet.names[0]], [fleet.names[1]], gpus_per_replica=4)
        if pair is not None:
            d = bucket_difference(*pair, batch_tolerance=1.0)
            out.append(d[1] if d else np.nan)
    return np.array(out)


def test_the_fleets_counters_are_what_metrics_carries(trace):
    fleet = Fleet(trace, KNOBS, replicas=2, ep_size=4, true=TrueCost(), seed=1)
    fleet.advance(300.0)
    prev = {n: counters_from_exposition(e.exposition().decode()) for n, e in zip(fleet.names, fleet.engines)}
    ours_prev = fleet.counters()
    fleet.advance(315.0)
    cur = {n: counters_from_exposition(e.exposition().decode()) for n, e in zip(fleet.names, fleet.engines)}
    ours = fleet.counters()
    for name in fleet.names:
        for key, value in ours[name].items():
            assert cur[name][key] == pytest.approx(value, rel=1e-9), key
        assert set(ours[name]) == set(cur[name]), set(cur[name]) ^ set(ours[name])
    pod = [fleet.names[0]]
    # the same bucket, the served balancedness (from the tokens per rank and layer) included
    bucket = arm_bucket(ours_prev, ours, pod, gpus_per_replica=4)
    assert bucket == arm_bucket(prev, cur, pod, gpus_per_replica=4)
    assert 0.5 < bucket.balancedness <= 1.0


def test_identical_pods_by_default(trace):
    """Without the realism two pods differ by their independent noise alone: no bias, no correlation."""
    d = _diffs(Fleet(trace, KNOBS, replicas=2, ep_size=4, true=TrueCost(outlier_share=0.0), seed=2), 300, 2100)
    assert abs(np.nanmean(d)) < 0.008 and abs(np.corrcoef(d[1:], d[:-1])[0, 1]) < 0.2


def test_a_pods_speed_belongs_to_its_gpus(trace):
    true = TrueCost(pod_speed_sd=0.05)
    speeds = [true.pod_traits(k)[0] for k in range(50)]
    assert 0.03 < float(np.std(np.log(speeds))) < 0.07 and true.pod_traits(7) == true.pod_traits(7)
    assert TrueCost().pod_traits(7) == (1.0, 1.0)
    fleet = Fleet(trace, KNOBS, replicas=2, ep_size=4, true=true, seed=3)
    before = fleet.engines[0].speed
    fleet.restart(0, KNOBS, 300.0)
    assert fleet.engines[0].speed == before  # a new pod on the same GPUs
    fleet.restart(0, KNOBS, 600.0, same_gpus=False)
    assert fleet.engines[0].speed != before
    slow = Fleet(trace, KNOBS, replicas=2, ep_size=4, true=TrueCost(outlier_share=0.0), seed=3, speeds={0: 0.97})
    d = _diffs(slow, 300, 1500)
    assert np.nanmean(d) == pytest.approx(math.log(0.97), abs=0.006)  # pod 0's steps 3 % longer


def test_a_restarted_pod_serves_later_and_cold(trace):
    true = TrueCost(outlier_share=0.0, cold_start_penalty=0.10, cold_start_tau_s=100.0)
    fleet = Fleet(trace, KNOBS, replicas=2, ep_size=4, true=true, seed=4, startup_s=120.0)
    fleet.advance(300.0)
    fleet.restart(0, KNOBS, 300.0)
    fleet.advance(400.0)
    assert fleet.names[0] not in fleet.serving()
    d = _diffs(fleet, 420.0, 1500.0)
    assert np.nanmean(d[:4]) < -0.05  # its first minute ~10 % slower
    assert abs(np.nanmean(d[-30:])) < 0.01  # warm after a few minutes


def test_correlated_noise_and_a_skewed_router(trace):
    ar = _diffs(Fleet(trace, KNOBS, replicas=2, ep_size=4, true=TrueCost(outlier_share=0.0, noise_autocorr=0.6),
                      seed=5), 300, 3000)
    assert np.corrcoef(ar[1:], ar[:-1])[0, 1] > 0.35
    skew = Fleet(trace, KNOBS, replicas=2, ep_size=4, true=TrueCost(outlier_share=0.0, router_skew_sd=0.1,
                                                                    router_drift_sd=0.01), seed=6)
    skew.advance(300.0)
    a, b = (e.traffic_factor for e in skew.engines)
    assert a != b
    tracker = ArmTracker()
    ratios = []
    for t in np.arange(315.0, 2400.0, 15.0):
        skew.advance(float(t))
        pair = tracker.bucket(float(t), skew.counters(), [skew.names[0]], [skew.names[1]], gpus_per_replica=4)
        if pair:
            ratios.append(math.log(pair[0].tokens_per_step / pair[1].tokens_per_step))
    assert abs(np.mean(ratios) - math.log(a / b)) < 0.03 and np.std(ratios) > 0.002  # skewed, drifting


def test_live_apply_changes_the_rearrangement_cadence(trace):
    fleet = Fleet(trace, KNOBS, replicas=2, ep_size=4, true=TrueCost(), seed=7)
    fleet.advance(600.0)
    before = [e.replay.rearrangements for e in fleet.engines]
    fleet.apply_live(0, Knobs(1000, 500, 0))
    fleet.advance(1800.0)
    after = [e.replay.rearrangements - b for e, b in zip(fleet.engines, before)]
    assert after[0] > 4 * after[1] and fleet.knobs(0) == Knobs(1000, 500, 0)
    with pytest.raises(ValueError, match="redundant experts needs a restart"):
        fleet.apply_live(1, Knobs(1000, 3000, 4))


def test_the_realism_is_a_function_of_simulated_time(trace):
    """Issue 19's rule holds with every realism knob on: chunked in 2.5 s or 5-70 s steps, the
    engine reports the same."""
    true = TrueCost(pod_speed_sd=0.03, cold_start_penalty=0.1, noise_autocorr=0.4, router_skew_sd=0.05,
                    router_drift_sd=0.03, step_noise=0.05)
    settings = EngineSettings("example/tiny-moe", ep_size=4, knobs=KNOBS)

    def engine():
        e = SimulatedEngine(trace, settings, SimClock(scale=50.0, epoch=0.0, workload_start=0.0),
                            EngineRun(seed=3, true_cost=true))
        e.ready = True
        e.advance_to(0.0)
        return e

    idle, busy = engine(), engine()
    rng = np.random.default_rng(0)
    t_busy = 0.0
    for t in np.arange(100.0, 900.0, 100.0):
        for x in np.arange(t - 100.0, t, 2.5)[1:]:
            idle.advance_to(float(x))
        idle.advance_to(float(t))
        while t_busy < t:
            t_busy = min(float(t), t_busy + float(rng.uniform(5.0, 70.0)))
            busy.advance_to(t_busy)
        assert idle.step_hist.total == pytest.approx(busy.step_hist.total, rel=1e-9)
        assert idle.tokens_hist.total == pytest.approx(busy.tokens_hist.total, rel=1e-9)
