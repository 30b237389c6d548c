"""Pure parts of the controller: the minimal child patch and the status from children readiness."""

from __future__ import annotations

from moe_eplb.api.problem import Problem
from moe_eplb.controller.reconcile import covers, merge_diff
from moe_eplb.controller.status import (
    invalid_status,
    ready_status,
    restarting,
    status_patch,
    summarize_workloads,
    tuner_degraded_of,
)

EPLB = {"enabled": True, "windowSize": 3000, "stepInterval": 1000, "numRedundantExperts": 8}


def deploy(replicas=2, generation=1, status=None):
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "generation": generation},
            "spec": {"replicas": replicas, "template": {"spec": {"containers": [{"name": "vllm", "image": "a"}]}}},
            "status": status or {}}


def resource(generation=1, status=None):
    return {"metadata": {"name": "m", "namespace": "ns", "generation": generation}, "spec": {}, "status": status or {}}


def test_merge_diff_replicas_only_and_server_defaults_ignored():
    desired = deploy(replicas=3)
    live = deploy(replicas=2)
    live["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "IfNotPresent"  # server default
    live["metadata"]["resourceVersion"] = "9"
    assert merge_diff(desired, live) == {"spec": {"replicas": 3}}
    assert merge_diff(deploy(replicas=2), live) == {}


def test_merge_diff_replaces_changed_lists_whole_and_restores_metadata():
    desired = deploy()
    desired["metadata"]["labels"] = {"a": "1"}
    live = deploy()
    live["metadata"]["labels"] = {"a": "2", "extra": "kept"}
    live["spec"]["template"]["spec"]["containers"].append({"name": "sidecar"})
    patch = merge_diff(desired, live)
    assert patch == {"metadata": {"labels": {"a": "1"}},
                     "spec": {"template": {"spec": {"containers": [{"name": "vllm", "image": "a"}]}}}}


def test_covers_treats_quantities_as_strings_but_not_bools():
    assert covers({"nvidia.com/gpu": "4"}, {"nvidia.com/gpu": 4})
    assert not covers({"x": "True"}, {"x": True})
    assert not covers([1, 2], [1])


def test_workload_summary_and_phases():
    rolling = deploy(replicas=2, generation=2, status={"observedGeneration": 1, "replicas": 2, "readyReplicas": 2,
                                                       "updatedReplicas": 0})
    w = summarize_workloads([rolling])
    assert (w.desired, w.ready, w.rolled_out, w.reported) == (2, 2, False, True)

    pending = ready_status(resource(), [deploy()], eplb=EPLB, ep_size=4, selector="s", endpoint="http://m.ns.svc:8000",
                           now="t0")
    assert pending["phase"] == "Pending" and pending["observedGeneration"] == 1
    assert pending["eplb"] == EPLB and pending["epSize"] == 4 and pending["endpoint"] == "http://m.ns.svc:8000"

    ready = deploy(status={"observedGeneration": 1, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2})
    running = ready_status(resource(status=pending), [ready], eplb=EPLB, ep_size=4, selector="s", endpoint=None,
                           now="t1")
    conds = {c["type"]: c for c in running["conditions"]}
    assert running["phase"] == "Running" and conds["Ready"]["status"] == "True"
    assert conds["Ready"]["lastTransitionTime"] == "t1" and conds["SpecValid"]["lastTransitionTime"] == "t0"
    assert running["readyReplicas"] == 2 and running["replicas"] == 2

    lost = deploy(status={"observedGeneration": 1, "replicas": 2, "readyReplicas": 1, "updatedReplicas": 2})
    degraded = ready_status(resource(status=running), [lost], eplb=EPLB, ep_size=4, selector="s", endpoint=None,
                            now="t2")
    conds = {c["type"]: c for c in degraded["conditions"]}
    assert degraded["phase"] == "Degraded" and conds["Degraded"]["reason"] == "ReplicasUnavailable"

    stuck = deploy(status={"observedGeneration": 1, "replicas": 2, "readyReplicas": 0, "updatedReplicas": 2,
                           "conditions": [{"type": "Progressing", "status": "False",
                                           "reason": "ProgressDeadlineExceeded", "message": "too slow"}]})
    failed = ready_status(resource(), [stuck], eplb=EPLB, ep_size=4, selector="s", endpoint=None)
    assert failed["phase"] == "Degraded" and "ProgressDeadlineExceeded" in failed["message"]


def test_invalid_status_keeps_other_conditions_and_status_patch():
    before = {"phase": "Running", "autotune": {"x": 1},
              "conditions": [{"type": "Tuned", "status": "True"}, {"type": "SpecValid", "status": "True",
                                                                   "lastTransitionTime": "t0"}]}
    st = invalid_status(resource(generation=3, status=before), [Problem("spec.eplb.windowSize", "must be >= 1")],
                        now="t1")
    assert st["phase"] == "Invalid" and st["observedGeneration"] == 3 and st["autotune"] == {"x": 1}
    types = [c["type"] for c in st["conditions"]]
    assert types == ["Tuned", "SpecValid"]
    assert "spec.eplb.windowSize: must be >= 1" in st["conditions"][1]["message"]
    patch = status_patch(before, st)
    assert set(patch) == {"phase", "message", "observedGeneration", "conditions"}
    assert status_patch(st, st) is None


def test_autotune_degraded_record_keeps_degraded_true():
    """After a crash-loop rollback the pods are ready again, but status.autotune.degraded keeps
    Degraded=True (with the tuner's reason and message) until a later change is kept."""
    ready = deploy(status={"observedGeneration": 1, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2})
    msg = "pods crash-looping after applying W=250 I=500 R=4: p-1; restoring W=3000 I=1000 R=8"
    prev = {"autotune": {"degraded": {"time": "2026-12-02T16:00:00Z", "reason": "CrashLoopAfterTuning",
                                      "message": msg}},
            "conditions": [{"type": "Degraded", "status": "True", "reason": "CrashLoopAfterTuning", "message": msg}]}
    st = ready_status(resource(status=prev), [ready], eplb=EPLB, ep_size=4, selector="s", endpoint=None, now="t1",
                      tuner=tuner_degraded_of(prev))
    deg = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert (deg["status"], deg["reason"], deg["message"]) == ("True", "CrashLoopAfterTuning", msg)
    assert st["phase"] == "Degraded" and st["message"] == msg
    assert next(c for c in st["conditions"] if c["type"] == "Ready")["status"] == "True"
    assert st["autotune"] == prev["autotune"]  # carried over untouched
    # cleared by the tuner (a later change kept): Degraded false again, Running
    cleared = ready_status(resource(status={**st, "autotune": {}}), [ready], eplb=EPLB, ep_size=4, selector="s",
                           endpoint=None, now="t2", tuner=tuner_degraded_of({"autotune": {}}))
    deg = next(c for c in cleared["conditions"] if c["type"] == "Degraded")
    assert (deg["status"], deg["reason"]) == ("False", "AsExpected") and cleared["phase"] == "Running"


def test_a_failed_refresh_is_retried_with_capped_exponential_backoff():
    from moe_eplb.controller.reconcile import refresh_wait

    assert refresh_wait(0, 0.1, 0.2, 30.0) == 0.1  # the coalescing delay, before any failure
    assert [refresh_wait(n, 0.1, 0.2, 30.0) for n in (1, 2, 3, 4)] == [0.2, 0.4, 0.8, 1.6]
    assert refresh_wait(20, 0.1, 0.2, 30.0) == 30.0


def test_autoscaling_condition_says_who_scales_and_turns_false_when_removed():
    ready = deploy()
    without = ready_status(resource(), [ready], eplb=EPLB, ep_size=4, selector="s", endpoint=None)
    assert "Autoscaling" not in {c["type"] for c in without["conditions"]}  # never configured: no condition
    on = ready_status(resource(status=without), [ready], eplb=EPLB, ep_size=4, selector="s", endpoint=None,
                      autoscaling=(True, "AutoscalerActive", "KEDA ScaledObject m scales spec.replicas between 1 and 4"))
    cond = next(c for c in on["conditions"] if c["type"] == "Autoscaling")
    assert (cond["status"], cond["reason"]) == ("True", "AutoscalerActive") and "between 1 and 4" in cond["message"]
    off = ready_status(resource(status=on), [ready], eplb=EPLB, ep_size=4, selector="s", endpoint=None)
    cond = next(c for c in off["conditions"] if c["type"] == "Autoscaling")
    assert (cond["status"], cond["reason"]) == ("False", "Disabled")


def test_autoscaling_condition_says_when_the_cluster_lacks_the_autoscalers_kind():
    from moe_eplb.controller.reconcile import _autoscaling_condition

    assert _autoscaling_condition(None, []) is None
    assert _autoscaling_condition("KEDA ScaledObject m scales ...", ["PodMonitor/m"]) == \
        (True, "AutoscalerActive", "KEDA ScaledObject m scales ...")
    ok, reason, message = _autoscaling_condition("KEDA ScaledObject m scales ...", ["ScaledObject/m"])
    assert (ok, reason) == (False, "AutoscalerKindMissing") and "install KEDA, or use spec.autoscaling.backend: HPA" in message


def test_autoscaling_condition_carries_kedas_not_ready_scaled_object():
    from moe_eplb.controller.reconcile import _autoscaling_condition, scaled_object_not_ready

    def so(*conds):
        return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "m"},
                "status": {"conditions": [dict(zip(("type", "status", "reason", "message"), c)) for c in conds]}}

    bad = so(("Ready", "False", "ScaledObjectCheckFailed", "Triggers defined in ScaledObject are not correct"),
             ("Active", "False", "ScalerNotActive", "Scaling is not performed because triggers are not active"))
    assert scaled_object_not_ready(bad) == ("KEDA reports ScaledObject m not Ready (ScaledObjectCheckFailed): "
                                            "Triggers defined in ScaledObject are not correct")
    assert _autoscaling_condition("KEDA ScaledObject m scales ...", [], [deploy(), bad]) == \
        (False, "ScaledObjectNotReady", scaled_object_not_ready(bad))
    # Ready, not reported yet (no status, Unknown): the operator says who scales what
    for fine in (so(("Ready", "True", "ScaledObjectReady", "ScaledObject is defined correctly and is ready for scaling")),
                 so(("Ready", "Unknown", "", "")), {"kind": "ScaledObject", "metadata": {"name": "m"}}):
        assert scaled_object_not_ready(fine) is None
        assert _autoscaling_condition("KEDA ScaledObject m scales ...", [], [fine])[:2] == (True, "AutoscalerActive")
    # the kind missing wins (no live ScaledObject then anyway)
    assert _autoscaling_condition("KEDA ScaledObject m scales ...", ["ScaledObject/m"], [bad])[1] == "AutoscalerKindMissing"
    # in the resource's status: the Autoscaling condition False with KEDA's words, Ready unchanged (the pods)
    status = ready_status(resource(), [deploy(status={"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                                                      "observedGeneration": 1})],
                          eplb=EPLB, ep_size=4, selector="s", endpoint=None,
                          autoscaling=_autoscaling_condition("KEDA ...", [], [bad]))
    cond = next(c for c in status["conditions"] if c["type"] == "Autoscaling")
    assert (cond["status"], cond["reason"]) == ("False", "ScaledObjectNotReady")
    assert "Triggers defined in ScaledObject are not correct" in cond["message"]


def _pod(name, restarts=0, waiting=None, last=None, deleting=False):
    cs = {"name": "vllm", "restartCount": restarts,
          "state": {"waiting": {"reason": waiting}} if waiting else {"running": {}}}
    if last:
        cs["lastState"] = {"terminated": last}
    meta = {"name": name, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    return {"metadata": meta, "status": {"containerStatuses": [cs]}}


def test_restarting_pods_and_groups_name_the_pod():
    assert restarting([_pod("a", 2), _pod("b", 9, deleting=True)]) is None
    reason, msg = restarting([_pod("a", 1), _pod("b", 3, last={"reason": "Error", "exitCode": 137,
                                                              "message": "Liveness probe failed: HTTP 503"})])
    assert reason == "PodRestarting"
    assert msg == "engine pods keep restarting: pod b restarted 3x (last: Error, exit code 137, " \
                  "Liveness probe failed: HTTP 503)"
    assert restarting([_pod("c", 1, waiting="CrashLoopBackOff")])[1] == "engine pods keep restarting: pod c restarted 1x"
    # LWS hides a pod's restarts by recreating its group: the recreations count
    assert restarting([_pod("m-0-1")], ["m-0-1 (group 0 recreated 4x)"]) == (
        "GroupRestarting", "replica groups keep restarting: m-0-1 (group 0 recreated 4x)")


def test_restarts_turn_degraded_and_clear_when_they_stop():
    ready = deploy(status={"observedGeneration": 1, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2})
    restarts = restarting([_pod("m-abc", 4, last={"reason": "Error", "exitCode": 137})])
    st = ready_status(resource(), [ready], eplb=EPLB, ep_size=4, selector="s", endpoint=None, restarts=restarts)
    cond = {c["type"]: c for c in st["conditions"]}
    assert st["phase"] == "Degraded" and cond["Degraded"]["status"] == "True"
    assert cond["Degraded"]["reason"] == "PodRestarting" and "pod m-abc restarted 4x" in cond["Degraded"]["message"]
    assert cond["Ready"]["status"] == "True"  # still serving: degraded, not down
    # a tuner change that crash-looped is the cause: its reason wins over the restarts it made
    tuned = ready_status(resource(), [ready], eplb=EPLB, ep_size=4, selector="s", endpoint=None, restarts=restarts,
                         tuner=("RolledBackAfterCrashLoop", "rolled back"))
    assert {c["type"]: c for c in tuned["conditions"]}["Degraded"]["reason"] == "RolledBackAfterCrashLoop"
    calm = ready_status(resource(status=st), [ready], eplb=EPLB, ep_size=4, selector="s", endpoint=None)
    assert calm["phase"] == "Running"
    assert {c["type"]: c for c in calm["conditions"]}["Degraded"]["status"] == "False"
