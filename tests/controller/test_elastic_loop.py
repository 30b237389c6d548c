"""The elastic loop's reading of what it observes (pods, relay answers) and of what it writes (the status
patch), the status the reconciler shows for an elastic group, and the tuner's view of a resize."""

from __future__ import annotations

from moe_eplb.api import elastic as el
from moe_eplb.api.elastic import ElasticStatus
from moe_eplb.api.spec import parse
from moe_eplb.contracts import k8s_names
from moe_eplb.controller import elastic_plan as plan
from moe_eplb.controller.decisions import scaling_blocker
from moe_eplb.controller.elastic import pod_state, rank_report, record_patch, status_fields, tuner_blocker
from moe_eplb.controller.workload import elastic_scaling
from tests.api.test_api_elastic import example

RELAY = {
    "ranks": [{"url": "http://127.0.0.1:8000", "status": {"is_scaling_elastic_ep": True, "phase": "preparing",
                                                          "epoch": "e1", "error": None,
                                                          "requested_data_parallel_size": 32},
               "serving": True, "inFlight": 2.0},
              {"url": "http://127.0.0.1:8001", "status": None, "serving": False, "inFlight": 1.0}],
    "operations": {"dp32-100": {"target": 32, "ranks": [{"url": "u0", "state": "done", "code": 200},
                                                        {"url": "u1", "state": "pending", "code": None}]},
                   "dp24-50": {"target": 24, "ranks": [{"url": "u0", "state": "done", "code": 408,
                                                        "detail": "Scale failed due to request drain timeout"}]}},
}


def test_a_relay_answer_for_one_operation() -> None:
    r = rank_report(RELAY, "dp32-100")
    assert (r.phase, r.epoch, r.requested) == ("preparing", "e1", 32)
    assert r.serving is False and r.in_flight == 3.0  # one rank paused: the pod does not serve
    assert (r.op_state, r.op_code) == (plan.PENDING, None)
    bad = rank_report(RELAY, "dp24-50")
    assert (bad.op_state, bad.op_code, bad.op_detail) == (plan.DONE, 408, "Scale failed due to request drain timeout")
    assert rank_report(RELAY, "dp16-1").op_state is None  # another operation's answers are never taken


def test_pod_state_reads_what_the_plan_needs() -> None:
    pod = {"metadata": {"name": "x-join-3", "creationTimestamp": "2026-01-01T00:00:00Z",
                        "labels": {k8s_names.ELASTIC_ROLE_LABEL: "joiner", k8s_names.SERVING_LABEL: "false"}},
           "status": {"conditions": [{"type": "Ready", "status": "False"},
                                     {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                      "message": "0/4 nodes are available"}]}}
    st = pod_state(pod)
    assert (st.name, st.ordinal, st.ready, st.running, st.serving) == ("x-join-3", 3, False, False, False)
    assert st.stuck == "Unschedulable: 0/4 nodes are available" and st.created > 1.7e9
    founder = pod_state({"metadata": {"name": "x-0", "labels": {k8s_names.ELASTIC_ROLE_LABEL: "founder"}},
                         "status": {"containerStatuses": [{"name": "vllm", "state": {"running": {}}}]}})
    assert founder.ordinal == -1 and founder.running and founder.serving


def test_the_status_patch_sets_the_record_and_keeps_the_transition_time() -> None:
    inf = parse(example(data_parallel=16, target_data_parallel=32, phase=el.STARTING))
    inf = type(inf)(**{**inf.__dict__, "conditions": (
        {"type": "Ready", "status": "True"},
        {"type": "Resizing", "status": "True", "reason": "Growing", "message": "m", "lastTransitionTime": "T0"})})
    step = plan.Step(ElasticStatus(16, 32, el.PREPARING), (True, plan.GROWING, "asked"))
    patch = record_patch(inf, step, "T1")
    assert patch["elastic"] == {"dataParallel": 16, "targetDataParallel": 32, "phase": "Preparing", "epoch": None,
                                "lastError": None}
    resizing = patch["conditions"][1]
    assert patch["conditions"][0] == {"type": "Ready", "status": "True"}
    assert (resizing["message"], resizing["lastTransitionTime"]) == ("asked", "T0")  # the operation's start
    done = record_patch(inf, plan.Step(ElasticStatus(32, 32, el.STABLE), (False, plan.STABLE, "32 ranks serve")), "T2")
    assert done["conditions"][1]["lastTransitionTime"] == "T2"


def test_the_reconciler_shows_pods_ep_size_and_the_redundancy_now() -> None:
    inf = parse(example(data_parallel=24, target_data_parallel=24, phase=el.STABLE))
    lws = {"kind": "LeaderWorkerSet", "status": {"readyReplicas": 1}}
    sts = {"kind": "StatefulSet", "status": {"readyReplicas": 1}}
    assert status_fields(inf, [lws, sts]) == {"replicas": 3, "readyReplicas": 3, "epSize": 24,
                                              "numRedundantExperts": 176}
    assert status_fields(inf, [{"kind": "LeaderWorkerSet", "status": {}}, sts])["readyReplicas"] == 1


def test_the_tuner_waits_for_a_resize_and_a_resize_for_the_tuner() -> None:
    growing = parse(example(data_parallel=16, target_data_parallel=32, phase=el.PREPARING))
    scaling = elastic_scaling(growing)
    assert (scaling.running, scaling.desired, scaling.max_replicas) == (2, 4, 4)
    assert scaling_blocker(scaling, 0.0, 600.0) == "the replica count is changing (2 -> 4)"
    assert elastic_scaling(parse(example(data_parallel=16, target_data_parallel=16, phase=el.STABLE))).desired == 2
    assert tuner_blocker(growing) is None
