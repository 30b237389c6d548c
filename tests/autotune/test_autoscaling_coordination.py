"""The tuner and the replica autoscaler (spec.autoscaling), each rule as a pure test on typed values:

1. no tuner rollout starts while the replica count is changing, for observeSeconds after the
   autoscaler scaled, or while it sits at maxReplicas with requests waiting (Defer, Tuned reason
   WaitingForAutoscaler, one WaitingForAutoscaler Event per wait);
2. a rollout in progress keeps its capacity rule when the autoscaler changes the count: the rollout
   records the count it started with and the rendered autoscaler keeps at least that many replicas
   while pods restart (scale-out allowed, scale-in held);
3. replicas younger than the judging window are not judged (the window starts at the youngest);
4. the autoscaler's state is read from the HorizontalPodAutoscaler's status (ours or KEDA's).
"""

from __future__ import annotations

import dataclasses

import yaml

from moe_eplb.api.autotune_status import (
    AutotuneStatus,
    DataWindow,
    Measurement,
    autotune_status_to_crd,
    parse_iso,
)
from moe_eplb.api.knobs import Knobs
from moe_eplb.api.spec import AutotuneSpec, parse
from moe_eplb.controller import decisions as d
from moe_eplb.controller import rollout as r
from moe_eplb.controller.workload import quantity_value, scaling_state
from moe_eplb.render.autoscaler import autoscaler, rollout_min_replicas
from tests.example_manifests import EXAMPLES, load_moeinferences

T0 = 1_800_000_000.0
CUR = Knobs(1000, 3000, 0)
NEW = Knobs(3000, 1000, 8)
CFG = AutotuneSpec(mode="Apply", observe_s=600.0)


def evaluate(scaling, state=AutotuneStatus(), now=T0):
    answer = d.TunerAnswer(recommendation=NEW, wants_change=True, reason="test", gain=0.05, breakdown={})
    return d.evaluate(CFG, state, now=now, generation=3, current=CUR, spec_eplb=CUR,
                      data_window=DataWindow(buckets=20, steps=4000, source="prometheus"), answer=answer,
                      baseline=Measurement(balancedness=0.8), from_hash="h-old", scaling=scaling)


def steady(**kw) -> d.ScalingState:
    return d.ScalingState(**{"desired": 3, "running": 3, "max_replicas": 6, "hpa_desired": 3,
                             "last_scale_time": T0 - 3600, **kw})


def test_steady_autoscaler_lets_the_rollout_start_and_records_the_count():
    out = evaluate(steady())
    assert out.decision == d.APPLY and out.status.rollout.replicas == 3
    assert not any(e[1] == "WaitingForAutoscaler" for e in out.events)


def test_no_rollout_while_the_replica_count_is_changing():
    for scaling, words in ((steady(desired=4), "the replica count is changing (3 -> 4)"),
                           (steady(hpa_desired=5), "the autoscaler wants 5, 3 set")):
        out = evaluate(scaling)
        assert out.decision == d.DEFER and words in out.reason, out.reason
        assert out.status.rollout is None and out.status.override is None
        assert out.conditions["Tuned"][:2] == ("True", "WaitingForAutoscaler")
        assert [e[:2] for e in out.events] == [("Normal", "WaitingForAutoscaler")]


def test_a_scale_out_is_named_as_the_reason_even_while_its_pods_are_not_ready():
    answer = d.TunerAnswer(recommendation=NEW, wants_change=True, reason="test", gain=0.05, breakdown={})
    out = d.evaluate(CFG, AutotuneStatus(), now=T0, generation=3, current=CUR, spec_eplb=CUR, data_window=None,
                     answer=answer, workload_blocker="pods are rolling or not all ready",
                     scaling=steady(desired=4))
    assert out.decision == d.DEFER and "the replica count is changing (3 -> 4)" in out.reason
    assert out.conditions["Tuned"][1] == "WaitingForAutoscaler"
    out = d.evaluate(CFG, AutotuneStatus(), now=T0, generation=3, current=CUR, spec_eplb=CUR, data_window=None,
                     answer=answer, workload_blocker="pods are rolling or not all ready", scaling=steady())
    assert "pods are rolling" in out.reason and out.conditions["Tuned"][1] == "Deferred"


def test_no_rollout_until_the_new_replicas_settled():
    out = evaluate(steady(last_scale_time=T0 - 100))
    assert out.decision == d.DEFER and "changed the replica count 100s ago; waiting 500s more" in out.reason
    assert evaluate(steady(last_scale_time=T0 - 601)).decision == d.APPLY


def test_no_rollout_at_max_replicas_with_requests_waiting():
    at_max = steady(desired=6, running=6, hpa_desired=6)
    out = evaluate(dataclasses.replace(at_max, waiting=3.5))
    assert out.decision == d.DEFER and "at maxReplicas (6) with 3.5 requests waiting" in out.reason
    assert "raise spec.autoscaling.maxReplicas" in out.reason
    out = evaluate(dataclasses.replace(at_max, limited=True))  # any metric: the HPA wants more than max
    assert out.decision == d.DEFER and "at maxReplicas (6) with demand beyond it" in out.reason
    assert evaluate(dataclasses.replace(at_max, waiting=0.0)).decision == d.APPLY  # at max, nobody waits
    assert evaluate(None).decision == d.APPLY  # no autoscaler: nothing to wait for


def test_the_wait_event_is_posted_once_per_wait():
    first = evaluate(steady(desired=4))
    again = evaluate(steady(desired=5), state=first.status, now=T0 + 300)
    assert again.decision == d.DEFER and not again.events
    other = evaluate(dataclasses.replace(steady(desired=6, running=6, hpa_desired=6), waiting=2.0),
                     state=again.status, now=T0 + 600)
    assert [e[1] for e in other.events] == ["WaitingForAutoscaler"]


def test_a_rollout_keeps_its_capacity_rule_when_the_autoscaler_changes_the_count():
    """The rollout started at 3 replicas: while it restarts pods the rendered autoscaler keeps >= 3
    (the autoscaler may still add replicas; it may not take the capacity the rollout counts on)."""
    out = evaluate(steady())
    res = load_moeinferences(EXAMPLES / "qwen3-30b-a3b-autoscaled.yaml")[0]
    res["spec"]["replicas"] = 3
    res["status"] = {"autotune": autotune_status_to_crd(out.status)}
    inf = parse(yaml.safe_load(yaml.safe_dump(res)))
    assert inf.status.rollout.phase == r.ROLLING and rollout_min_replicas(inf) == 3
    assert autoscaler(inf)["spec"]["minReplicaCount"] == 3
    # the autoscaler scales out to 5 meanwhile: the floor stays the rollout's, and the rollout
    # waits for all 5 replicas on the new template before it observes
    res["spec"]["replicas"] = 5
    inf = parse(res)
    assert rollout_min_replicas(inf) == 3
    view = r.WorkloadView(3, False, "h-new", spec_eplb=CUR, replicas=5)
    assert not r.advance(CFG, out.status, view, now=T0 + 60).changed
    observing = r.advance(CFG, out.status, dataclasses.replace(view, settled=True), now=T0 + 120).status
    assert observing.rollout.phase == r.OBSERVING
    res["status"] = {"autotune": autotune_status_to_crd(observing)}
    assert rollout_min_replicas(parse(res)) == 1  # pods no longer restart: the autoscaler's own minimum


def _observing(ready_at=T0):
    out = evaluate(steady())
    ro = dataclasses.replace(out.status.rollout, phase=r.OBSERVING, ready_at=ready_at, to_hash="h-new")
    return out.status.replace(rollout=ro)


def test_replicas_younger_than_the_window_are_not_judged():
    st = _observing()
    assert r.measurement_window(CFG, st, T0 + 600) == (T0, T0 + 600)
    # the autoscaler added a replica 300 s after the pods were ready: judged 600 s after that
    assert r.measurement_window(CFG, st, T0 + 600, newest_replica_at=T0 + 300) is None
    assert r.measurement_window(CFG, st, T0 + 900, newest_replica_at=T0 + 300) == (T0 + 300, T0 + 900)
    view = r.WorkloadView(3, True, "h-new", spec_eplb=CUR, newest_replica_at=T0 + 300)
    worse = Measurement(balancedness=0.5)  # would roll back if it were judged
    assert not r.advance(CFG, st, view, now=T0 + 700, measured=worse).changed
    s = r.advance(CFG, st, view, now=T0 + 900, measured=Measurement(balancedness=0.85))
    assert s.needs_measurement == (T0 + 300, T0 + 900) and s.status.history[-1].action == "Kept"


def test_an_autoscaler_that_keeps_adding_replicas_ends_in_an_unmeasured_keep():
    st = _observing()
    view = r.WorkloadView(3, True, "h-new", spec_eplb=CUR, newest_replica_at=T0 + 1200)
    s = r.advance(CFG, st, view, now=T0 + 1261)
    assert s.status.rollout is None and s.conditions["Tuned"][:2] == ("True", "KeptUnmeasured")
    assert "the autoscaler kept adding replicas" in s.status.history[-1].reason


def test_scaling_state_from_the_hpa_status():
    hpa = {"status": {"desiredReplicas": 6, "currentReplicas": 6, "lastScaleTime": "2027-01-15T08:00:00Z",
                      "currentMetrics": [{"type": "External", "external": {
                          "metric": {"name": "vllm_num_requests_waiting"},
                          "current": {"averageValue": "1500m"}}}],
                      "conditions": [{"type": "ScalingLimited", "status": "True", "reason": "TooManyReplicas"}]}}
    s = scaling_state(6, 6, 6, "RequestsWaiting", hpa)
    assert (s.hpa_desired, s.limited, s.waiting) == (6, True, 1.5)
    assert s.last_scale_time == parse_iso("2027-01-15T08:00:00Z")
    assert "at maxReplicas (6)" in d.scaling_blocker(s, s.last_scale_time + 700, 600)
    assert scaling_state(3, 2, 6, "KVCacheUsage", None) == d.ScalingState(3, 2, 6)
    assert quantity_value("3") == 3.0 and quantity_value("250m") == 0.25 and quantity_value("x") is None
