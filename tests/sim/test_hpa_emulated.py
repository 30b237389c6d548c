"""The emulated HPA controller's algorithm (moe_eplb_harness.emulated.hpa: the HPA's recommendation with its
tolerance, the behavior's stabilization windows and rate policies, the ScalingLimited reasons) and
the autoscale scenario's summary (moe_eplb_harness.demo.autoscale.summary_record): pure, no processes."""

from __future__ import annotations

import pytest

from moe_eplb_harness.demo import autoscale as A
from moe_eplb_harness.emulated.hpa import LIMIT_MESSAGES, SERIES, limit, recommend, stabilize

UP = {"scaleUp": {"stabilizationWindowSeconds": 0, "selectPolicy": "Max",
                  "policies": [{"type": "Pods", "value": 1, "periodSeconds": 15}]},
      "scaleDown": {"stabilizationWindowSeconds": 300, "selectPolicy": "Max",
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 600}]}}


@pytest.mark.parametrize("current,value,target,ttype,ready,want", [
    (1, 95.0, 10, "AverageValue", 1, 10),  # 95 waiting on one pod, 10 per replica -> 10 replicas
    (2, 21.0, 10, "AverageValue", 2, 2),  # 10.5 per pod: within the 10 % tolerance, no change
    (3, 0.0, 10, "AverageValue", 3, 0),  # nothing waits: as few as the bounds allow
    (2, 1.5, 1.0, "Value", 2, 3),  # a Value target scales the count by value / target
    (4, 0.95, 1.0, "Value", 4, 4),
])
def test_recommendation(current, value, target, ttype, ready, want):
    assert recommend(current, value, target, ttype, ready) == want


def test_recommendation_refuses_a_zero_target():
    with pytest.raises(ValueError, match="target"):
        recommend(1, 1.0, 0.0, "AverageValue", 1)


def test_stabilization_windows():
    recs = [(0.0, 3), (100.0, 1)]
    assert stabilize(3, recs, 200.0, up_window=0, down_window=300) == 3  # the 3 of t=0 holds the count
    assert stabilize(3, recs, 350.0, up_window=0, down_window=300) == 1  # out of the window: scale down
    assert stabilize(1, [(0.0, 5), (10.0, 2)], 10.0, up_window=60, down_window=300) == 2  # up: the smallest
    assert stabilize(1, [(0.0, 5), (10.0, 2)], 10.0, up_window=0, down_window=300) == 2


def test_rate_and_bounds_with_the_real_controllers_reasons():
    assert limit(1, 10, [], 100.0, UP, min_replicas=1, max_replicas=3) == (2, "ScaleUpLimit")
    assert limit(2, 10, [(95.0, 1)], 100.0, UP, min_replicas=1, max_replicas=3) == (2, "ScaleUpLimit")  # spent
    assert limit(2, 10, [(80.0, 1)], 100.0, UP, min_replicas=1, max_replicas=3) == (3, "TooManyReplicas")
    assert limit(3, 3, [], 100.0, UP, min_replicas=1, max_replicas=3) == (3, "DesiredWithinRange")
    assert limit(3, 0, [], 100.0, UP, min_replicas=1, max_replicas=3) == (2, "ScaleDownLimit")
    assert limit(2, 0, [], 100.0, {}, min_replicas=1, max_replicas=3) == (1, "TooFewReplicas")
    assert set(LIMIT_MESSAGES) == {"ScaleUpLimit", "TooManyReplicas", "ScaleDownLimit", "TooFewReplicas",
                                   "DesiredWithinRange"}


def test_the_emulated_controller_reads_the_names_the_rendered_hpa_uses():
    from moe_eplb.contracts.metric_names import adapter_metric_name
    from moe_eplb.render.autoscaler import hpa_metric_name

    res = A.resource()
    from moe_eplb.api.validation import check

    checked = check(res)
    assert checked.problems == []
    assert hpa_metric_name(checked.inference) in {adapter_metric_name(s) for s in SERIES}


def _evaluation(at: float, decision: str, reason: str) -> dict:
    return {"at_s": at, "decision": decision, "reason": reason, "recommended": {"windowSize": 1000, "stepInterval": 3000,
                                                                                "numRedundantExperts": 0}, "gain": 0.03}


def test_summary_of_the_scenario():
    rec = A.AutoscaleRecord(scale_events=[{"at_s": 400.0, "from": 1, "to": 2}, {"at_s": 1000.0, "from": 2, "to": 3}])
    rec.evaluations = [
        _evaluation(300.0, "NoData", "TooLittleData: ..."),
        _evaluation(1300.0, "Defer", "window 1000 ... deferred: the autoscaler changed the replica count 300s ago; "
                                     "waiting 900s more for the new replicas to settle"),
        _evaluation(1600.0, "Defer", "window 1000 ... deferred: cooldown: last change 10s ago"),
        _evaluation(2250.0, "NoData", "ScrapeGaps: ..."),  # not a judgment: the next one is the decision
        _evaluation(2300.0, "Apply", "applying window 1000, interval 3000, redundant 0"),
    ]
    s = A.summary_record(rec, api="emulated", load_source="prometheus", autoscaler="x", observe_s=1200.0,
                         final={"spec": {"replicas": 3}})
    assert s["settled_at_s"] == 2200.0 and s["replicas"] == {"start": 1, "max": 3, "end": 3}
    assert [d["at_s"] for d in s["deferrals"]] == [1300.0]  # the cooldown deferral is not the autoscaler's
    assert s["decision_after_settling"]["decision"] == "Apply" and s["decision_after_settling"]["at_s"] == 2300.0
    assert s["rollouts_started"] == [{"at_s": 2300.0, "to": "1000/3000/0"}]
    assert s["rollouts_started_while_scaling"] == 0
    rec.evaluations.append(_evaluation(1500.0, "Apply", "applying ..."))
    s = A.summary_record(rec, api="emulated", load_source="prometheus", autoscaler="x", observe_s=1200.0, final={})
    assert s["rollouts_started_while_scaling"] == 1


def test_traffic_splits_over_the_ready_replicas():
    assert A.demand(0.0) == A.DEMAND_BEFORE and A.demand(A.RISE_AT_S + A.RAMP_S) == A.DEMAND_AFTER
    assert A.per_replica_demand(A.RISE_AT_S + A.RAMP_S, 0) == A.DEMAND_AFTER
    assert A.per_replica_demand(A.RISE_AT_S + A.RAMP_S, A.MAX_REPLICAS) == pytest.approx(A.DEMAND_AFTER / A.MAX_REPLICAS)
    # one replica cannot hold the risen traffic (0.97 of a cache is full); maxReplicas can
    assert A.DEMAND_AFTER > 0.97 and A.DEMAND_AFTER / A.MAX_REPLICAS < 0.97
