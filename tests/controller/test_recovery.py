"""The fault-recovery decision and state machine (``moe_eplb.controller.recovery``), pure: what one
tick decides from a group's pods and its ranks' ``/v1/fault_tolerance/status`` readings."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from moe_eplb.api import ft_protocol as ftp
from moe_eplb.api.autotune_status import parse_iso
from moe_eplb.api.recovery_status import (
    DEGRADED,
    FAILED,
    HEALTHY,
    PREPARING,
    RECOVERING,
    RESTORING,
    SENT,
    LostRanks,
    RecoveryStatus,
    parse_recovery_status,
    recovery_status_to_crd,
)
from moe_eplb.api.spec import parse
from moe_eplb.controller import recovery as rec
from moe_eplb.controller.recovery_loop import group_pods, tuning_pause
from moe_eplb.render import control_key
from moe_eplb.render.objects import render_children

V034, V032 = (0, 34, 0), (0, 32, 0)
FACTS = rec.Facts(version=V034, num_experts=16, redundant=16, timeout_s=120.0)
COORD_OK = rec.Coordination(other_ready_groups=1)


def _view(readings: dict[int, str | rec.RankReading], *, data: int = 4, gone: tuple[int, ...] = (),
          unready: tuple[int, ...] = (), group: str = "0", created: float = 0.0) -> rec.GroupView:
    """A group of ``data`` pods of one rank each (LWS worker index = rank); ``gone``: pods absent."""
    pods = {i: rec.PodView(name=f"tiny-{group}" + (f"-{i}" if i else ""), ranks=(i,), ip=f"10.0.0.{i + 1}",
                           ready=i not in unready, running=True, created_by=created)
            for i in range(data) if i not in gone}
    rd = {r: (x if isinstance(x, rec.RankReading) else rec.RankReading(status=x)) for r, x in readings.items()}
    return rec.GroupView(group=group, data=data, tensor=1, pods=pods, readings=rd, leader=pods[0].name if 0 in pods else None)


def _all(status: str, data: int = 4, **kw) -> dict[int, rec.RankReading]:
    return {r: rec.RankReading(status=status, **kw) for r in range(data)}


def _tick(st, view, now, facts=FACTS, coord=COORD_OK, **kw):
    return rec.step(st, view, facts, now, resource="tiny", coord=coord, **kw)


def test_a_healthy_group_is_left_alone() -> None:
    s = _tick(RecoveryStatus(), _view(_all("healthy")), 10.0)
    assert not s.changed and s.send is None and s.status.rounds == ()


def test_a_lost_pod_is_scaled_down_with_one_request_id_once_every_survivor_is_unhealthy() -> None:
    # pod 2 gone; survivors not all unhealthy yet: the round is opened (id drawn, deadline fixed), not sent
    readings = {0: "unhealthy", 1: "healthy", 3: "diagnosing"}
    s = _tick(RecoveryStatus(), _view(readings, gone=(2,)), 100.0)
    (rnd,) = s.status.rounds
    assert rnd.state == PREPARING and rnd.fault_at == 100.0 and rnd.deadline == 220.0 and s.send is None
    assert s.events[0][1] == "FaultDetected" and "1: healthy" in s.waiting and "3: diagnosing" in s.waiting
    assert rec.group_phase(s.status, "0") == RECOVERING
    # all survivors unhealthy: scale_down of rank 2 to ranks 0, 1, 3 -- the same round id
    s2 = _tick(s.status, _view({0: "unhealthy", 1: "unhealthy", 3: "unhealthy"}, gone=(2,)), 104.0)
    assert s2.send is not None and s2.send.request_id == rnd.request_id
    assert s2.send.instruction == ftp.SCALE_DOWN and s2.send.ranks == (0, 1, 3) and s2.send.state == SENT
    assert s2.params == {"removed_dp_ranks": [2]}  # rank 0 (the store master) lives: no new store
    assert s2.send.deadline == 220.0  # the engines' clock started at the fault
    # polled to completion: every survivor healthy -> Succeeded, the group Degraded with rank 2 lost
    s3 = _tick(s2.status, _view({0: "healthy", 1: "healthy", 3: "healthy"}, gone=(2,)), 110.0)
    (done,) = s3.status.rounds
    assert done.result == "Succeeded" and done.finished_at == 110.0
    assert s3.status.lost("0") == (2,) and rec.group_phase(s3.status, "0") == DEGRADED
    assert [e[1] for e in s3.events] == ["RecoveryRoundSucceeded", "RecoveryDegraded"]


def test_losing_the_store_master_names_the_new_lowest_ranks_pod() -> None:
    s = _tick(RecoveryStatus(), _view({1: "unhealthy", 2: "unhealthy", 3: "unhealthy"}, gone=(0,)), 5.0)
    assert s.send is not None and s.send.ranks == (1, 2, 3)
    assert s.params == {"removed_dp_ranks": [0], "dp_master_ip": "10.0.0.2", "dp_store_port": rec.STORE_PORT}
    assert s.send.store_master == f"10.0.0.2:{rec.STORE_PORT}"


def test_the_removed_set_is_cumulative_and_the_store_master_moves_only_when_the_lowest_alive_goes() -> None:
    st = RecoveryStatus(lost_ranks=(LostRanks("0", (0,), ("tiny-0",), 1.0),))
    # a second pod (rank 1, now the lowest alive) goes: removed [0, 1], new master rank 2
    s = _tick(st, _view({2: "unhealthy", 3: "unhealthy"}, gone=(0, 1)), 50.0)
    assert s.params == {"removed_dp_ranks": [0, 1], "dp_master_ip": "10.0.0.3", "dp_store_port": rec.STORE_PORT}
    # rank 3 goes instead: rank 1 stays the master
    s = _tick(st, _view({1: "unhealthy", 2: "unhealthy"}, gone=(0, 3)), 50.0)
    assert s.params == {"removed_dp_ranks": [0, 3]}


def test_a_transient_fault_is_retried_and_a_failed_retry_gets_a_new_round_then_the_mask_decides() -> None:
    s = _tick(RecoveryStatus(), _view(_all("unhealthy")), 0.0)
    assert s.send.instruction == ftp.RETRY and s.send.ranks == (0, 1, 2, 3) and s.params == {}
    first = s.send.request_id
    # vLLM: the retry failed (engines stay unhealthy, ft_state failed with our id): a new round, new id
    failed = _all("unhealthy", ft_state="failed", last_request_id=first, error="[FT] Recovery vote failed")
    s = _tick(s.status, _view(failed), 3.0)
    assert s.status.rounds[0].result == "Failed" and "Recovery vote failed" in s.status.rounds[0].reason
    assert s.send is not None and s.send.instruction == ftp.RETRY and s.send.request_id != first
    assert s.send.attempt == 2 and s.send.deadline == 120.0
    # the second retry fails too: the pods vLLM's mask suspects (EP rank 2 -> DP rank 2) are removed
    mask = (0, 0, 1, 0)
    failed2 = _all("unhealthy", ft_state="failed", last_request_id=s.send.request_id, mask=mask)
    s = _tick(s.status, _view(failed2), 6.0)
    assert s.send.instruction == ftp.SCALE_DOWN and s.params == {"removed_dp_ranks": [2]} and s.send.ranks == (0, 1, 3)


def test_a_stale_failure_of_an_earlier_round_is_not_read_as_this_rounds() -> None:
    s = _tick(RecoveryStatus(), _view(_all("unhealthy")), 0.0)
    stale = _all("unhealthy", ft_state="failed", last_request_id="someone-elses")
    s2 = _tick(s.status, _view(stale), 1.0)
    assert s2.send is None and s2.status.rounds[-1].in_flight


def test_a_second_fault_during_a_round_supersedes_it_and_the_next_round_removes_both() -> None:
    s = _tick(RecoveryStatus(), _view({0: "unhealthy", 1: "unhealthy", 3: "unhealthy"}, gone=(2,)), 10.0)
    first = s.send
    s = replace_sent(s)
    # pod 3 dies while the round runs: superseded; survivors 0, 1 (failed check-in, unhealthy) get a new round
    mid = {0: rec.RankReading("unhealthy", "failed", first.request_id, "Not all engines joined"),
           1: rec.RankReading("unhealthy", "recovering", first.request_id)}
    s2 = _tick(s.status, _view(mid, gone=(2, 3)), 14.0)
    assert s2.status.rounds[0].result == "Superseded" and "[3]" in s2.status.rounds[0].reason
    nxt = s2.status.rounds[-1]
    assert nxt.in_flight and nxt.state == PREPARING and nxt.deadline == first.deadline and nxt.attempt == 2
    assert s2.send is None and "still run an earlier instruction" in s2.waiting  # rank 1 still recovering
    s3 = _tick(s2.status, _view({0: "unhealthy", 1: rec.RankReading("unhealthy", "failed", first.request_id)},
                                gone=(2, 3)), 20.0)
    assert s3.send.instruction == ftp.SCALE_DOWN and s3.params == {"removed_dp_ranks": [2, 3]} and s3.send.ranks == (0, 1)


def replace_sent(s: rec.Step) -> rec.Step:
    """The loop's record after it sent ``s.send`` to every rank (``sentTo``)."""
    import dataclasses

    sent = dataclasses.replace(s.send, sent_to=s.send.ranks)
    return rec.Step(s.status.with_round(sent))


def test_a_round_past_the_deadline_times_out_and_the_failed_group_is_restarted_at_once() -> None:
    s = replace_sent(_tick(RecoveryStatus(), _view({0: "unhealthy", 1: "unhealthy", 3: "unhealthy"}, gone=(2,)), 0.0))
    s = _tick(s.status, _view({0: rec.RankReading("unhealthy", "recovering")}, gone=(2,)), 121.0)
    assert s.status.rounds[0].result == "TimedOut" and rec.group_phase(s.status, "0") == FAILED
    # a failed group serves nothing: restarted without waiting for capacity
    s = _tick(s.status, _view({}, gone=(2,), unready=(0, 1, 3)), 122.0, coord=rec.Coordination())
    assert s.restart == "tiny-0" and rec.group_phase(s.status, "0") == RESTORING


def test_a_failed_scale_down_vote_leaves_the_engines_dead_and_the_group_failed() -> None:
    s = replace_sent(_tick(RecoveryStatus(), _view({0: "unhealthy", 1: "unhealthy", 3: "unhealthy"}, gone=(2,)), 0.0))
    s = _tick(s.status, _view(_all("dead", data=4), gone=(2,)), 9.0)
    assert s.status.rounds[0].result == "Failed" and "dead" in s.status.rounds[0].reason
    assert rec.group_phase(s.status, "0") == FAILED


@pytest.mark.parametrize("facts, why", [
    (rec.Facts(version=V032, num_experts=16, redundant=16, timeout_s=120.0), "has no scale_down"),
    (rec.Facts(version=V034, num_experts=16, redundant=4, timeout_s=120.0), "more expert slots than the 4 redundant"),
])
def test_a_scale_down_vllm_cannot_do_is_not_sent(facts, why) -> None:
    s = _tick(RecoveryStatus(), _view({0: "unhealthy", 1: "unhealthy", 3: "unhealthy"}, gone=(2,)), 0.0, facts=facts)
    assert s.send is None and s.status.rounds[0].result == "Failed" and why in s.status.rounds[0].reason
    assert rec.group_phase(s.status, "0") == FAILED


def test_no_round_opens_while_the_tuner_replaces_pods_on_purpose() -> None:
    s = _tick(RecoveryStatus(), _view(_all("unhealthy")), 0.0, busy="a tuner rollout is Rolling")
    assert s.status.rounds == () and s.send is None


@pytest.mark.parametrize("coord, blocked", [
    (rec.Coordination(other_ready_groups=1), None),
    (rec.Coordination(other_ready_groups=0), "no other replica group is ready"),
    (rec.Coordination(other_ready_groups=1, tuner="a tuner rollout is Observing"), "the tuner is busy"),
    (rec.Coordination(other_ready_groups=1, autoscaler="the replica count is changing (1 -> 2)"), "the autoscaler"),
    (rec.Coordination(other_ready_groups=2, restoring_groups=1), "another replica group is being restarted"),
])
def test_a_degraded_group_is_restarted_only_at_a_planned_moment(coord, blocked) -> None:
    st = RecoveryStatus(lost_ranks=(LostRanks("0", (2,), ("tiny-0-2",), 1.0),))
    s = _tick(st, _view({0: "healthy", 1: "healthy", 3: "healthy"}, gone=(2,)), 50.0, coord=coord)
    if blocked is None:
        assert s.restart == "tiny-0" and s.status.lost_entry("0").restoring_since == 50.0
        assert s.events[0][1] == "RestoreStarted"
    else:
        assert s.restart is None and blocked in s.waiting


def test_a_restore_ends_when_every_pod_is_new_ready_and_every_rank_healthy() -> None:
    st = RecoveryStatus(lost_ranks=(LostRanks("0", (2,), ("tiny-0-2",), 1.0, restoring_since=50.0),))
    # the old survivors fault as their leader goes: no round, the restart is in progress
    s = _tick(st, _view({1: "unhealthy"}, gone=(0, 2, 3)), 51.0)
    assert s.send is None and s.status.rounds == () and "restarting" in s.waiting
    s = _tick(st, _view(_all("healthy"), created=60.0, unready=(3,)), 70.0)
    assert s.status.lost_ranks and rec.group_phase(s.status, "0") == RESTORING
    s = _tick(st, _view(_all("healthy"), created=60.0), 75.0)
    assert s.status.lost_ranks == () and rec.group_phase(s.status, "0") == HEALTHY
    assert s.events[0][1] == "RecoveryRestored"


def test_elastic_groups_restart_too_because_no_vllm_release_readmits_scaled_down_ranks() -> None:
    assert rec.GROW_BACK_AFTER_SCALE_DOWN_SINCE is None
    assert rec.restore_mode(rec.Facts(version=V034, num_experts=16, redundant=16, timeout_s=120, elastic=True)) == "restart"


def test_status_round_trips_and_the_condition_names_each_group() -> None:
    s = _tick(RecoveryStatus(), _view({0: "unhealthy", 1: "unhealthy", 3: "unhealthy"}, gone=(0,)), 0.0)
    s = _tick(RecoveryStatus(), _view({1: "unhealthy", 2: "unhealthy", 3: "unhealthy"}, gone=(0,)), 0.0)
    st = rec.overall(s.status, ["0", "1"])
    raw = recovery_status_to_crd(st)
    assert set(raw) == {"phase", "lostRanks", "rounds"} and raw["phase"] == RECOVERING
    (r,) = raw["rounds"]
    assert r["requestId"].startswith("moe-eplb-tiny-g0-a1-") and r["state"] == "Sent" and r["removedRanks"] == [0]
    assert r["faultAt"].endswith("Z") and "finishedAt" not in r
    back = parse_recovery_status(copy.deepcopy(raw))
    assert back.rounds == st.rounds and back.phase == RECOVERING and not back.problems
    status, reason, message = rec.condition(st, {"1": "restart waits: x"})
    assert (status, reason) == ("False", RECOVERING) and "group 0: round" in message and "group 1: restart waits" in message
    assert rec.condition(RecoveryStatus(), {})[0] == "True"
    # a malformed record is dropped and named, never acted on
    bad = parse_recovery_status({"phase": "Recovering", "rounds": [{"requestId": "x", "group": "0", "ranks": "no"}]})
    assert bad.rounds == () and bad.problems and "rounds[0]" in bad.problems[0]


FT_RESOURCE = {
    "apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference", "metadata": {"name": "tiny", "namespace": "ns"},
    "spec": {"model": {"name": "example/tiny-moe", "architecture": "Qwen3MoeForCausalLM",
                       "moe": {"numExperts": 16, "numMoeLayers": 4, "topK": 2, "numExpertGroups": 1,
                               "bytesPerExpert": 1048576}},
             "engine": {"image": "vllm/vllm-openai:v0.34.0"},
             "parallelism": {"tensor": 1, "data": 4, "nodes": 2, "all2allBackend": "deepep_low_latency"},
             "faultTolerance": {"enabled": True, "rankFailuresToSurvive": 2, "recoveryTimeoutSeconds": 90},
             "eplb": {"enabled": True, "numRedundantExperts": 16}, "autotune": {"mode": "Off"}}}


def _pod(name: str, group: str, worker: int, ip: str, ready: bool = True) -> dict:
    return {"metadata": {"name": name, "uid": name, "creationTimestamp": "2026-01-01T00:00:00Z",
                         "labels": {"leaderworkerset.sigs.k8s.io/group-index": group,
                                    "leaderworkerset.sigs.k8s.io/worker-index": str(worker)}},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_groups_come_from_the_lws_labels_with_every_ranks_api_server() -> None:
    inf = parse(FT_RESOURCE)
    pods = [_pod("tiny-0", "0", 0, "10.0.0.1"), _pod("tiny-0-1", "0", 1, "10.0.0.2", ready=False),
            _pod("tiny-1", "1", 0, "10.0.1.1")]
    groups = group_pods(inf, pods)
    assert sorted(groups) == ["0", "1"]
    view, eps = groups["0"]
    assert view.leader == "tiny-0" and view.pods[1].ranks == (2, 3) and not view.pods[1].ready
    # two ranks a pod: vLLM's supervisor serves rank start+i on port 8000+i
    assert [(e.rank, e.ip, e.port) for e in eps] == [(0, "10.0.0.1", 8000), (1, "10.0.0.1", 8001),
                                                     (2, "10.0.0.2", 8000), (3, "10.0.0.2", 8001)]
    # group 1 lacks its worker: its ranks 2, 3 count as lost
    assert rec.lost_ranks(groups["1"][0]) == ((2, 3), ("#1",))
    facts = __import__("moe_eplb.controller.recovery_loop", fromlist=["facts_of"]).facts_of(inf)
    assert facts.timeout_s == 90.0 and facts.version == V034 and facts.num_experts == 16 and facts.redundant == 16


def test_a_restore_ends_although_creation_timestamps_count_whole_seconds_on_a_faster_clock() -> None:
    """Kubernetes stamps ``creationTimestamp`` in whole seconds: a pod created 0.4 s after its group's
    restart began carries a stamp from before it (by 0.5 s of wall, 5 s of a 10x clock). The
    restore still ends once the group is whole, ready and healthy."""
    inf = parse(FT_RESOURCE)
    stamp = parse_iso("2026-01-01T00:00:00Z")
    to_clock = lambda wall: stamp + (wall - stamp) * 10.0  # noqa: E731 -- the simulation's 10x clock
    restoring_since = to_clock(stamp + 0.5)
    pods = [_pod("tiny-0", "0", 0, "10.0.0.1"), _pod("tiny-0-1", "0", 1, "10.0.0.2")]  # created at +0.9 s
    view, _ = group_pods(inf, pods, to_clock)["0"]
    view = replace(view, readings=_all("healthy"))
    assert all(p.created_by == to_clock(stamp + 1.0) for p in view.pods.values())
    st = RecoveryStatus(lost_ranks=(LostRanks("0", (), (), restoring_since - 10.0, restoring_since=restoring_since),))
    s = _tick(st, view, restoring_since + 20.0)
    assert s.status.lost_ranks == () and s.events[0][1] == "RecoveryRestored", s.waiting
    # a pod whose stamp's second ended before the restart began is an old one: still restoring
    old = [_pod("tiny-0", "0", 0, "10.0.0.1"), {**_pod("tiny-0-1", "0", 1, "10.0.0.2"), "metadata": {
        **_pod("tiny-0-1", "0", 1, "10.0.0.2")["metadata"], "creationTimestamp": "2025-12-31T23:59:59Z"}}]
    view, _ = group_pods(inf, old, to_clock)["0"]
    s = _tick(st, replace(view, readings=_all("healthy")), restoring_since + 20.0)
    assert rec.group_phase(s.status, "0") == RESTORING and "1/2 new pods" in s.waiting


def test_the_engines_get_the_recovery_timeout_and_the_token_joins_a_users_api_key_only() -> None:
    def vllm_args(resource: dict) -> tuple[list[str], list[dict]]:
        lws = next(c for c in render_children(parse(resource)) if c["kind"] == "LeaderWorkerSet")
        c = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
        return c["args"], c["env"]

    args, env = vllm_args(FT_RESOURCE)
    i = args.index("--fault-tolerance-config")
    assert args[i + 1] == '{"engine_recovery_timeout_sec": 90}' and "--api-key" not in args
    assert not any(e["name"] == "MOE_EPLB_CONTROL_TOKEN" for e in env)  # no key: vLLM's guard stays off
    with_key = copy.deepcopy(FT_RESOURCE)
    with_key["spec"]["engine"]["extraArgs"] = ["--api-key", "user-key"]
    args, env = vllm_args(with_key)
    k = args.index("--api-key")
    assert args[k:k + 3] == ["--api-key", "$(MOE_EPLB_CONTROL_TOKEN)", "user-key"] and args.count("--api-key") == 1
    tok = next(e for e in env if e["name"] == "MOE_EPLB_CONTROL_TOKEN")
    assert tok["valueFrom"] == {"secretKeyRef": {"name": "tiny-control", "key": "token"}}  # not optional
    env_key = copy.deepcopy(FT_RESOURCE)
    env_key["spec"]["engine"]["env"] = [{"name": "VLLM_API_KEY", "value": "k"}]
    args = vllm_args(env_key)[0]
    k = args.index("--api-key")
    assert args[k:k + 3] == ["--api-key", "$(VLLM_API_KEY)", "$(MOE_EPLB_CONTROL_TOKEN)"]
    old = copy.deepcopy(with_key)
    old["spec"]["engine"]["image"] = "vllm/vllm-openai:v0.33.0"
    old["spec"]["faultTolerance"]["rankFailuresToSurvive"] = 0
    assert control_key.mode(parse(old)) is None  # 0.33's routes are outside /v1: vLLM's key never guards them


def test_the_tuner_pauses_while_a_group_recovers_or_runs_degraded() -> None:
    res = copy.deepcopy(FT_RESOURCE)
    assert tuning_pause(parse(res)) is None
    res["status"] = {"faultTolerance": {"phase": "Degraded", "lostRanks": [{"group": "0", "ranks": [2, 3]}],
                                        "rounds": []}}
    why = tuning_pause(parse(res))
    assert why.startswith("paused: the operator scaled down") and "group 0 ranks [2, 3]" in why
    res["status"]["faultTolerance"]["phase"] = "Recovering"
    assert "fault recovery is Recovering" in tuning_pause(parse(res))


def test_a_restarted_operator_resends_a_round_only_to_survivors_it_did_not_reach_and_only_on_034() -> None:
    s = _tick(RecoveryStatus(), _view({0: "unhealthy", 1: "unhealthy", 3: "unhealthy"}, gone=(2,)), 10.0)
    rnd = s.send  # written Sent, then the operator died before recording sentTo
    reached = {0: rec.RankReading("unhealthy", "recovering", rnd.request_id), 1: rec.RankReading("unhealthy"),
               3: rec.RankReading("unhealthy", "recovering", rnd.request_id)}
    again = _tick(s.status, _view(reached, gone=(2,)), 12.0)
    assert again.send is not None and again.send.request_id == rnd.request_id and "[1]" in again.waiting
    assert again.params == {"removed_dp_ranks": [2]}
    old = rec.Facts(version=V032, num_experts=16, redundant=16, timeout_s=120.0)
    s = _tick(RecoveryStatus(), _view(_all("unhealthy")), 10.0, facts=old)
    assert s.send.instruction == ftp.RETRY
    quiet = _tick(s.status, _view(_all("unhealthy")), 12.0, facts=old)
    assert quiet.send is None  # 0.32's client shows no running instruction: never sent twice


def test_before_034_a_failure_is_matched_by_the_id_the_server_answered_with() -> None:
    import dataclasses

    old = rec.Facts(version=V032, num_experts=16, redundant=16, timeout_s=120.0)
    s = _tick(RecoveryStatus(), _view(_all("unhealthy")), 10.0, facts=old)
    sent = dataclasses.replace(s.send, sent_to=(0, 1, 2, 3), accepted_ids=("srv-a", "srv-b", "srv-c", "srv-d"))
    st = s.status.with_round(sent)
    stale = {r: rec.RankReading("unhealthy", None, "srv-old", "an earlier failure") for r in range(4)}
    assert _tick(st, _view(stale), 11.0, facts=old).status.rounds[-1].in_flight
    failed = {**stale, 2: rec.RankReading("unhealthy", None, "srv-c", "RuntimeError: boom")}
    out = _tick(st, _view(failed), 12.0, facts=old)
    assert out.status.rounds[0].result == "Failed" and "boom" in out.status.rounds[0].reason
    assert out.send is not None and out.send.attempt == 2
