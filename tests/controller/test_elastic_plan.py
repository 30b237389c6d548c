"""The resize of an elastic group as a pure state machine (moe_eplb.controller.elastic_plan): every
path of a grow and a shrink, the failures ending in a known state, a restart of the operator, and a
seeded random walk that never leaves dataParallel half-joined."""

from __future__ import annotations

import random

import pytest

from moe_eplb.api import elastic as el
from moe_eplb.api.elastic import ElasticStatus
from moe_eplb.controller import elastic_plan as plan
from moe_eplb.controller.elastic_plan import ElasticView, PodState, RankReport, advance

FOUNDERS = (PodState("g-0", ready=True, running=True, created=10.0), PodState("g-0-1", ready=True, running=True,
                                                                             created=10.0))


def joiners(*ordinals: int, running: bool = True, ready: bool = False, serving: bool = True) -> tuple[PodState, ...]:
    return tuple(PodState(f"g-join-{j}", ordinal=j, running=running, ready=ready, serving=serving, created=50.0)
                 for j in ordinals)


def view(desired: int = 4, founders=FOUNDERS, joins=(), reports=None, now=100.0, since=90.0, **kw) -> ElasticView:
    return ElasticView(desired=desired, launch=4, data_local=2, founders_expected=2, founders=founders,
                       joiners=joins, reports=reports or {}, now=now, since=since, start_s=60.0, drain_s=5.0, **kw)


def served(**kw) -> RankReport:
    return RankReport(phase="idle", serving=True, in_flight=0.0, **kw)


def test_a_launched_group_is_stable_at_its_launch_size() -> None:
    step = advance(ElasticStatus(4, 8, el.LAUNCHING), view(desired=8))
    assert step.status == ElasticStatus(4, 8, el.STABLE)
    assert step.condition[0] is False and step.scale is None


def test_founders_not_ready_hold_the_group_at_launch() -> None:
    down = (FOUNDERS[0], PodState("g-0-1", ready=False))
    step = advance(ElasticStatus(4, 4, el.LAUNCHING), view(founders=down))
    assert step.status.phase == el.LAUNCHING and step.condition[1] == plan.LAUNCHING


def test_grow_starts_the_new_pods_then_asks_every_old_pod() -> None:
    st = ElasticStatus(4, 4, el.STABLE)
    step = advance(st, view(desired=8))
    assert step.status == ElasticStatus(4, 8, el.STARTING) and step.condition[:2] == (True, plan.GROWING)
    assert step.events == [("Normal", "ResizeStarted", "grow 4 -> 8 ranks (2 -> 4 pods)")]
    assert el.joiner_pods(step.status, 4, 2) == 2 and el.joiner_launch_size(step.status) == 8
    # one new pod not running yet: wait
    step = advance(step.status, view(desired=8, joins=joiners(0) + joiners(1, running=False)))
    assert step.status.phase == el.STARTING and step.scale is None and "1/2 new pods running" in step.condition[2]
    # both run: /scale_elastic_ep to the old pods only
    step = advance(step.status, view(desired=8, joins=joiners(0, 1)))
    assert step.status.phase == el.PREPARING and step.scale == (8, ("g-0", "g-0-1"))


def test_preparing_follows_vllm_and_commits_on_every_old_rank_done() -> None:
    st = ElasticStatus(4, 8, el.PREPARING)
    pending = RankReport(phase="preparing", epoch="e1", requested=8, serving=True, op_state=plan.PENDING)
    step = advance(st, view(desired=8, joins=joiners(0, 1), reports={"g-0": pending, "g-0-1": pending}))
    assert step.status == ElasticStatus(4, 8, el.PREPARING, epoch="e1") and step.scale is None
    committing = RankReport(phase="committing", epoch="e1", requested=8, serving=False, op_state=plan.PENDING)
    done = RankReport(phase="committing", epoch="e1", requested=8, op_state=plan.DONE, op_code=200)
    step = advance(step.status, view(desired=8, joins=joiners(0, 1), reports={"g-0": committing, "g-0-1": done}))
    assert step.status.phase == el.COMMITTING and step.status.data_parallel == 4
    finished = RankReport(phase="completed", epoch="e1", requested=8, op_state=plan.DONE, op_code=200)
    step = advance(step.status, view(desired=8, joins=joiners(0, 1), reports={"g-0": finished, "g-0-1": finished}))
    assert step.status == ElasticStatus(8, 8, el.STABLE, epoch="e1")
    assert step.condition[0] is False and step.events[0][1] == "Resized"
    assert el.joiner_pods(step.status, 4, 2) == 2


def test_an_operator_that_restarted_sends_again_what_no_relay_received() -> None:
    st = ElasticStatus(4, 8, el.PREPARING)
    never = RankReport(phase="idle", serving=True)  # no record of this operation's id
    step = advance(st, view(desired=8, joins=joiners(0, 1), reports={"g-0": never, "g-0-1": never}))
    assert step.scale == (8, ("g-0", "g-0-1"))
    pending = RankReport(phase="preparing", epoch="e", requested=8, op_state=plan.PENDING)
    step = advance(st, view(desired=8, joins=joiners(0, 1), reports={"g-0": pending, "g-0-1": pending}))
    assert step.scale is None  # the relays have it: nothing is sent twice


def test_the_operation_id_is_the_target_and_the_start() -> None:
    assert plan.op_id(ElasticStatus(4, 8, el.PREPARING), 1234.9) == "dp8-1234"


def test_a_failure_in_prepare_rolls_back_to_the_old_size_serving() -> None:
    st = ElasticStatus(4, 8, el.PREPARING, epoch="e")
    bad = RankReport(phase="failed", epoch="e", error="new rank failed", requested=8, serving=True,
                     op_state=plan.DONE, op_code=500, op_detail="Scale failed")
    step = advance(st, view(desired=8, joins=joiners(0, 1), reports={"g-0": bad, "g-0-1": bad}))
    assert step.status.phase == el.ROLLING_BACK and step.status.data_parallel == 4
    assert "500: Scale failed" in step.status.last_error and "vLLM: new rank failed" in step.status.last_error
    assert el.joiner_pods(step.status, 4, 2) == 0  # the new pods are removed
    # the new pods still there: wait
    step = advance(step.status, view(desired=8, joins=joiners(0, 1), reports={"g-0": bad, "g-0-1": bad}))
    assert step.status.phase == el.ROLLING_BACK and "removing g-join-0, g-join-1" in step.condition[2]
    step = advance(step.status, view(desired=8, reports={"g-0": bad, "g-0-1": bad}))
    assert step.status.phase == el.FAILED and step.status.data_parallel == 4
    assert step.condition[:2] == (False, plan.FAILED) and step.events[0][1] == "RolledBack"


def test_a_failed_target_is_tried_again_after_the_backoff_and_a_new_one_at_once() -> None:
    st = ElasticStatus(4, 8, el.FAILED, last_error="x")
    step = advance(st, view(desired=8, since=100.0, now=100.0 + el.RETRY_AFTER_S - 1))
    assert step.status.phase == el.FAILED and "tried again in 1s" in step.condition[2]
    assert advance(st, view(desired=8, since=100.0, now=100.0 + el.RETRY_AFTER_S + 1)).status.phase == el.STARTING
    assert advance(st, view(desired=6, since=100.0, now=101.0)).status == ElasticStatus(4, 6, el.STARTING,
                                                                                        last_error="x")


def test_a_failure_that_left_old_ranks_paused_restarts_the_group() -> None:
    st = ElasticStatus(4, 8, el.COMMITTING, epoch="e")
    paused = RankReport(phase="failed", epoch="e", requested=8, serving=False, op_state=plan.DONE, op_code=500,
                        op_detail="Scale failed")
    step = advance(st, view(desired=8, joins=joiners(0, 1), reports={"g-0": paused, "g-0-1": paused}, since=90.0))
    assert step.status.phase == el.RESTARTING_GROUP and "paused" in step.status.last_error
    assert step.restart == ("g-0", "g-0-1")  # the founders older than the operation
    assert el.joiner_pods(step.status, 4, 2) == 0
    # recreated founders (newer than the operation), the joiners gone: the launch size serves
    new = tuple(PodState(p.name, ready=True, running=True, created=95.0) for p in FOUNDERS)
    step = advance(step.status, view(desired=8, founders=new, since=90.0))
    assert step.status == ElasticStatus(4, 8, el.FAILED, epoch="e", last_error=st.last_error or step.status.last_error)
    assert step.events[0][1] == "GroupRestarted"


def test_an_operation_past_its_deadline_restarts_the_group() -> None:
    st = ElasticStatus(4, 8, el.PREPARING, epoch="e")
    pending = RankReport(phase="preparing", epoch="e", requested=8, serving=True, op_state=plan.PENDING)
    v = view(desired=8, joins=joiners(0, 1), reports={"g-0": pending, "g-0-1": pending}, since=0.0)
    v = ElasticView(**{**v.__dict__, "now": plan.deadline(v) + 1})
    step = advance(st, v)
    assert step.status.phase == el.RESTARTING_GROUP and "did not finish within" in step.status.last_error


def test_new_pods_that_never_start_roll_back_naming_why() -> None:
    st = ElasticStatus(4, 8, el.STARTING)
    stuck = (PodState("g-join-0", ordinal=0, running=False, stuck="Unschedulable: 0/4 nodes have 2 nvidia.com/gpu free"),)
    step = advance(st, view(desired=8, joins=stuck, since=0.0, now=30.0))
    assert step.status.phase == el.STARTING and "Unschedulable" in step.condition[2]
    step = advance(st, view(desired=8, joins=stuck, since=0.0, now=61.0))
    assert step.status.phase == el.ROLLING_BACK and "did not start within 60s" in step.status.last_error


def test_shrink_drains_the_highest_pods_then_asks_every_old_pod_and_retires_them() -> None:
    st = ElasticStatus(8, 8, el.STABLE)
    all_in = joiners(0, 1, ready=True)
    step = advance(st, view(desired=4, joins=all_in))
    assert step.status == ElasticStatus(8, 4, el.DRAINING) and step.condition[1] == plan.SHRINKING
    busy = {"g-join-0": served(), "g-join-1": RankReport(serving=True, in_flight=3.0)}
    step = advance(step.status, view(desired=4, joins=all_in, reports=busy, since=98.0))
    assert step.serving == {"g-join-0": False, "g-join-1": False} and step.scale is None
    # at most drainSeconds (5 s here): then it goes ahead
    assert advance(step.status, view(desired=4, joins=all_in, reports=busy, since=90.0)).scale is not None
    drained = {n: served() for n in ("g-0", "g-0-1", "g-join-0", "g-join-1")}
    out = joiners(0, 1, ready=True, serving=False)
    step = advance(step.status, view(desired=4, joins=out, reports=drained))
    assert step.status.phase == el.PREPARING and step.scale == (4, ("g-0", "g-0-1", "g-join-0", "g-join-1"))
    assert el.joiner_pods(step.status, 4, 2) == 2  # the retiring pods stay until committed
    done = {n: RankReport(phase="completed", epoch="s", requested=4, op_state=plan.DONE, op_code=200) for n in drained}
    step = advance(step.status, view(desired=4, joins=out, reports=done))
    assert step.status == ElasticStatus(4, 4, el.RETIRING, epoch="s") and el.joiner_pods(step.status, 4, 2) == 0
    step = advance(step.status, view(desired=4, joins=out))
    assert step.status.phase == el.RETIRING
    assert advance(step.status, view(desired=4)).status == ElasticStatus(4, 4, el.STABLE, epoch="s")


def test_no_resize_starts_while_the_tuner_rolls_out() -> None:
    step = advance(ElasticStatus(4, 4, el.STABLE), view(desired=8, blocker="the tuner's rollout is Rolling"))
    assert step.status == ElasticStatus(4, 8, el.STABLE) and step.condition[1] == plan.WAITING


def test_founders_lost_mid_resize_relaunch_the_group_at_its_launch_size() -> None:
    down = (FOUNDERS[0], PodState("g-0-1", ready=False))
    step = advance(ElasticStatus(6, 8, el.PREPARING), view(desired=8, founders=down))
    assert step.status.phase == el.LAUNCHING and step.status.data_parallel == 4
    assert "founding pods restarted during the resize" in step.status.last_error
    assert step.events[0][:2] == ("Warning", "GroupRestarted")


def test_with_fault_tolerance_a_stable_group_leaves_lost_founders_to_recovery() -> None:
    down = (FOUNDERS[0], PodState("g-0-1", ready=False))
    step = advance(ElasticStatus(8, 8, el.STABLE), view(desired=8, founders=down, fault_tolerance=True))
    assert step.status == ElasticStatus(8, 8, el.STABLE)


@pytest.mark.parametrize("seed", range(20))
def test_a_random_walk_never_half_joins(seed: int) -> None:
    """Whatever the relays report, in whatever order, dataParallel is only ever the size before or the
    target of the operation, changes only when every old pod's request ended 200, and never drops below
    the launch size."""
    rng = random.Random(seed)
    st = ElasticStatus(4, 4, el.STABLE)
    for _ in range(60):
        desired = rng.choice([4, 6, 8])
        dp = st.data_parallel
        names = [p.name for p in FOUNDERS] + [f"g-join-{j}" for j in range(3)]
        reports = {n: RankReport(phase=rng.choice(el.VLLM_PHASES), epoch="e", requested=rng.choice([4, 6, 8]),
                                 serving=rng.choice([True, True, False, None]), in_flight=rng.choice([0.0, 1.0]),
                                 op_state=rng.choice([None, plan.PENDING, plan.DONE]),
                                 op_code=rng.choice([200, 200, 500])) for n in names}
        joins = joiners(*range(rng.choice([0, 1, 2])), running=rng.choice([True, False]))
        new = tuple(PodState(p.name, ready=True, running=True, created=rng.choice([0.0, 200.0])) for p in FOUNDERS)
        before = st
        step = advance(st, view(desired=desired, founders=new, joins=joins, reports=reports,
                                since=100.0, now=rng.choice([101.0, 5000.0])))
        st = step.status
        assert st.data_parallel >= 4
        if st.data_parallel != dp:
            old = [p.name for p in FOUNDERS] + [f"g-join-{j}" for j in range((dp - 4) // 2)]
            completed = all(reports[n].op_state == plan.DONE and reports[n].op_code == 200 for n in old)
            assert (completed and st.data_parallel == before.target_data_parallel) or \
                (st.data_parallel == 4 and st.phase in (el.FAILED, el.LAUNCHING)), (before, st)
