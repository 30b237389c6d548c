"""The simulated engines' fault tolerance (``moe_eplb_harness.engines.fault_tolerance``) against the
operator's pure recovery decisions, over the same JSON the HTTP routes carry: no cluster, a manual
clock. The kube tier (tests/kube/test_fault_tolerance_real.py) runs the same with real pods."""

from __future__ import annotations

import json

import pytest

from moe_eplb.api import ft_protocol as ftp
from moe_eplb.api.recovery_status import RecoveryStatus
from moe_eplb.controller import recovery as rec
from moe_eplb.controller.recovery_client import reading_of
from moe_eplb_harness.engines.fault_tolerance import FtConfig, GroupFaultTolerance, config_from_argv

V034 = (0, 34, 0)
HOSTS = {r: f"10.0.0.{r + 1}" for r in range(4)}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _group(**kw) -> tuple[GroupFaultTolerance, Clock]:
    clock = Clock()
    cfg = FtConfig(version=kw.pop("version", V034), data=4, timeout_s=kw.pop("timeout_s", 60.0), detect_s=2.0,
                   recover_s=1.0, **kw)
    return GroupFaultTolerance(cfg, clock, hosts=HOSTS), clock


def _status(g: GroupFaultTolerance, rank: int) -> rec.RankReading:
    code, body = g.answer(rank, "GET", ftp.status_path(g.cfg.version), {}, b"")
    return reading_of(json.loads(body), rank) if code == 200 else rec.RankReading()


def _view(g: GroupFaultTolerance, gone: tuple[int, ...] = ()) -> rec.GroupView:
    pods = {r: rec.PodView(name=f"p{r}", ranks=(r,), ip=HOSTS[r], ready=True, running=True)
            for r in range(4) if r not in gone}
    return rec.GroupView(group="0", data=4, tensor=1, pods=pods, readings={r: _status(g, r) for r in pods},
                         leader="p0" if 0 in pods else None)


def _send(g: GroupFaultTolerance, s: rec.Step, headers: dict | None = None) -> dict[int, int]:
    body = json.dumps(ftp.apply_body(s.send.instruction, s.send.request_id, s.params)).encode()
    return {r: g.answer(r, "POST", ftp.apply_path(g.cfg.version), headers or {}, body)[0] for r in s.send.ranks}


def _run(g: GroupFaultTolerance, clock: Clock, *, gone=(), until: float = 30.0, facts=None, st=None,
         skip_ranks: tuple[int, ...] = ()) -> tuple[RecoveryStatus, list[str]]:
    """The operator's ticks every 0.5 s against the group until its round ends (or ``until``)."""
    facts = facts or rec.Facts(version=g.cfg.version, num_experts=16, redundant=16, timeout_s=g.cfg.timeout_s)
    st, events = st or RecoveryStatus(), []
    end = clock.t + until
    while clock.t < end:
        s = rec.step(st, _view(g, gone), facts, clock.t, resource="tiny", coord=rec.Coordination())
        st = s.status
        events += [e[1] for e in s.events]
        if s.send is not None:
            body = json.dumps(ftp.apply_body(s.send.instruction, s.send.request_id, s.params)).encode()
            for r in s.send.ranks:
                if r not in skip_ranks:
                    assert g.answer(r, "POST", ftp.apply_path(g.cfg.version), {}, body)[0] == 202
        if s.finished and s.finished[-1].result in ("Succeeded", "TimedOut") or rec.group_phase(st, "0") == "Failed":
            break
        clock.t += 0.5
    return st, events


def test_a_lost_pod_is_detected_scaled_down_and_the_survivors_serve_again() -> None:
    g, clock = _group()
    clock.t += 10
    assert g.serving() and g.served()[0] == 80  # 4 ranks x 2 requests/s x 10 s
    g.lose([2])
    assert not g.serving() and _status(g, 1).status == ftp.HEALTHY  # stuck in a collective, not yet noticed
    clock.t += 2.2
    assert _status(g, 1).status == ftp.DIAGNOSING
    clock.t += 0.5
    r = _status(g, 1)
    assert r.status == ftp.UNHEALTHY and r.mask == (0, 0, 1, 0)
    st, events = _run(g, clock, gone=(2,))
    assert events[:2] == ["FaultDetected", "RecoveryRoundSent"] and "RecoveryRoundSucceeded" in events
    assert g.dead == {2} and g.serving() and st.lost("0") == (2,)
    assert g.log == [f"[FT] Engine {r} scale_down complete: removed [2], cumulative dead_dp_ranks=[2]" for r in (0, 1, 3)]
    before = g.served()[0]
    clock.t += 10
    assert g.served()[0] - before == 60 and g.served()[1] == 12  # 3 survivors serve; 3 x 4 requests aborted


def test_losing_rank_0_moves_the_store_master_to_the_new_lowest_ranks_pod() -> None:
    g, clock = _group()
    g.lose([0])
    clock.t += 3
    st, events = _run(g, clock, gone=(0,))
    (rnd,) = st.rounds
    assert rnd.store_master == f"{HOSTS[1]}:{rec.STORE_PORT}" and rnd.result == "Succeeded" and g.dead == {0}


def test_vllms_checks_refuse_a_wrong_round() -> None:
    g, clock = _group()
    g.lose([0])
    clock.t += 3
    path = ftp.apply_path(V034)
    bad = {
        b'{"instruction": "retry"}': "'request_id' must be a non-empty string",
        b'{"instruction": "reboot", "request_id": "x"}': "Invalid instruction",
        b'{"instruction": "retry", "params": [], "request_id": "x"}': "'params' must be an object",
        b'[1]': "must be a JSON object",
    }
    for body, why in bad.items():
        code, out = g.answer(1, "POST", path, {}, body)
        assert code == 400 and why in out.decode()
    # scale_down of the store master without the new store's address: vLLM's sentinel refuses it
    code, _ = g.answer(1, "POST", path, {}, json.dumps(ftp.apply_body("scale_down", "r1", {"removed_dp_ranks": [0]})).encode())
    r = _status(g, 1)
    assert code == 202 and r.ft_state == ftp.FAILED and "dp_store_port and dp_master_ip required" in r.error
    # naming the receiver itself
    g.answer(3, "POST", path, {}, json.dumps(ftp.apply_body("scale_down", "r2", {"removed_dp_ranks": [3]})).encode())
    assert "Invalid removed_dp_ranks [3]" in _status(g, 3).error


def test_a_round_that_does_not_reach_every_survivor_fails_its_check_in_and_the_next_one_succeeds() -> None:
    g, clock = _group()
    g.lose([2])
    clock.t += 3
    st, events = _run(g, clock, gone=(2,), until=11.0, skip_ranks=(3,))
    assert "RecoveryRoundFailed" in events and "Not all engines joined" in st.rounds[0].reason
    st, events = _run(g, clock, gone=(2,), st=st)
    assert st.rounds[-1].result == "Succeeded" and st.rounds[-1].attempt == 2 and g.dead == {2}


def test_a_transient_fault_is_retried_and_a_failed_retry_is_retried_again() -> None:
    g, clock = _group()
    g.transient(fail_retries=1)
    clock.t += 1
    st, events = _run(g, clock)
    assert [r.instruction for r in st.rounds] == ["retry", "retry"]
    assert [r.result for r in st.rounds] == ["Failed", "Succeeded"] and "Recovery vote failed" in st.rounds[0].reason
    assert g.dead == set() and g.serving() and st.lost_ranks == ()


def test_a_second_fault_during_the_vote_fails_the_scale_down_and_the_engines_are_dead() -> None:
    g, clock = _group(timeout_s=60.0)
    g.lose([2])
    clock.t += 3
    facts = rec.Facts(version=V034, num_experts=16, redundant=16, timeout_s=60.0)
    s = rec.step(RecoveryStatus(), _view(g, (2,)), facts, clock.t, resource="tiny", coord=rec.Coordination())
    assert set(_send(g, s).values()) == {202}
    clock.t += 0.5
    g.lose([3])  # checked in already; lost before the vote
    clock.t += 1.0
    assert {_status(g, r).status for r in (0, 1)} == {ftp.DEAD}


def test_no_instruction_in_time_and_the_engines_exit() -> None:
    g, clock = _group(timeout_s=20.0)
    g.lose([1])
    clock.t += 22.0 + 2.0
    g.advance()
    assert g.exited and "No recovery within 20s" in g.exited


def test_vllms_api_key_guards_the_v1_routes_only() -> None:
    g, _ = _group(api_keys=("user", "operator-token"))
    path = ftp.status_path(V034)
    assert g.answer(0, "GET", path, {}, b"")[0] == 401
    assert g.answer(0, "GET", path, {"Authorization": "Bearer nope"}, b"")[0] == 401
    assert g.answer(0, "GET", path, {"Authorization": "Bearer operator-token"}, b"")[0] == 200
    old, _ = _group(version=(0, 32, 0), api_keys=("user",))
    assert old.answer(0, "GET", ftp.status_path((0, 32, 0)), {}, b"")[0] == 200  # /fault_tolerance: not guarded


@pytest.mark.parametrize("argv, timeout, keys", [
    (["vllm", "serve", "m", "--data-parallel-size", "4", "--enable-fault-tolerance"], 120.0, ()),
    (["vllm", "serve", "m", "--data-parallel-size", "4", "--enable-fault-tolerance", "--fault-tolerance-config",
      '{"engine_recovery_timeout_sec": 30}', "--api-key", "tok", "user", "--port", "8000"], 30.0, ("tok", "user")),
])
def test_the_config_comes_from_the_pods_argv(argv, timeout, keys) -> None:
    cfg = config_from_argv(argv, V034)
    assert cfg.data == 4 and cfg.timeout_s == timeout and cfg.api_keys == keys
    assert config_from_argv(["vllm", "serve", "m"], V034) is None
