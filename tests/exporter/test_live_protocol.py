"""The live-apply exchange's pure rules (moe_eplb.contracts.live_protocol): commands, the guard,
the operator's choice of a safe step, checked against a step-by-step model of vLLM's counter."""

from __future__ import annotations

import json
import random

import pytest

from moe_eplb.contracts import live_protocol as lp


def _counters(now: int, counter: int, interval: int, steps: int) -> dict[int, int]:
    """vLLM's ``expert_rearrangement_step`` before each step's increment (eplb_state.py ``step``:
    ``+= 1``, then ``>= interval`` rearranges and resets it to 0)."""
    out, c = {}, counter
    for k in range(now, now + steps):
        out[k] = c
        c += 1
        if c >= interval:
            c = 0
    return out


def test_safe_step_is_the_first_guarded_step_after_the_lead() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        old, new = rng.randint(2, 120), rng.randint(2, 120)
        counter, now = rng.randint(0, old - 1), rng.randint(0, 500)
        lead, grace = rng.randint(0, 300), rng.randint(0, min(old, new) - 1)
        at = lp.safe_step(now, counter, old, new, lead, grace)
        seen = _counters(now, counter, old, lead + 3 * old + 5)
        assert at >= now + lead
        assert lp.guard_problem(seen[at], grace, old, new) is None
        assert all(lp.guard_problem(seen[k], grace, old, new) is not None for k in range(now + lead, at))


def test_guard_holds_exactly_when_no_interval_rearranges_within_the_grace() -> None:
    # counter 5 at the agreed step: the new interval 8 rearranges 2 steps later (8 - 1 - 5); a rank
    # applying 2 steps late still applies before that step's decision
    assert lp.guard_problem(5, 2, 20, 8) is None
    assert "interval 20 -> 8" in lp.guard_problem(5, 3, 20, 8)
    assert lp.steps_to_rearrangement(5, 8) == 2


def test_commands_are_read_strictly() -> None:
    good = {"id": "x", "op": "prepare", "at_step": 10, "grace_steps": 2, "window_size": 5, "step_interval": 9,
            "expect_window_size": 4, "expect_step_interval": 10}
    cmd = lp.Command.from_mapping(good)
    assert cmd.changes and lp.Command.from_mapping(json.loads(cmd.to_json())) == cmd
    for change, message in (({"op": "apply"}, "op: 'apply'"), ({"window_size": 0}, "window_size: must be > 0"),
                            ({"at_step": "10"}, "at_step: expected a whole number"),
                            ({"protocol": 2}, "protocol 2 is not spoken here"), ({"id": ""}, "id: 1 to 128")):
        with pytest.raises(lp.CommandError, match=message):
            lp.Command.from_mapping({**good, **change})
    with pytest.raises(lp.CommandError, match="grace_steps: required"):
        lp.Command.from_mapping({k: v for k, v in good.items() if k != "grace_steps"})


def test_rank_status_round_trip() -> None:
    s = lp.RankStatus(ep_rank=1, ep_size=2, pid=5, step=40, counter=3, window_size=16, step_interval=32,
                      since_step=30, source=lp.SOURCE_LIVE, command={"id": "a", "state": lp.APPLIED},
                      rearranged_at=(7, 39))
    back = lp.RankStatus.from_mapping(json.loads(s.to_json()))
    assert back == s and back.state_of("a") == lp.APPLIED and back.state_of("b") is None
