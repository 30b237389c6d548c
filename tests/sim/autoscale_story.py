"""What ``moe-eplb demo --scenario autoscale`` must show, asserted on its ``--summary`` (used by the
emulated run in tests/sim/test_demo_autoscale.py and the real control plane's in
tests/kube/test_demo_autoscale_real.py)."""

from __future__ import annotations

from moe_eplb_harness.demo import autoscale as A


def assert_autoscale_story(summary: dict, log: str) -> None:
    """A traffic rise, a scale-out, the tuner deferring while the replica count changes and the new
    replicas settle, no rollout started meanwhile, and a decision (Apply) once settled -- unless the
    autoscaler, at its max, still has requests waiting (the other reason a rollout waits)."""
    events = summary["scale_events"]
    # the scale-out: after the rise, one replica at a time (scaleUp: 1 per period) up to maxReplicas
    assert events, f"no scale event\n{log}"
    assert events[0]["from"] == 1 and events[0]["at_s"] > summary["traffic_rise_at_s"], (events, log)
    assert all(e["to"] > e["from"] for e in events), (events, log)
    assert summary["replicas"]["max"] == summary["replicas"]["end"] == A.MAX_REPLICAS, (summary["replicas"], log)
    settled = summary["settled_at_s"]
    assert settled == events[-1]["at_s"] + A.resource()["spec"]["autotune"]["observeSeconds"]
    # the tuner deferred for the autoscaler, only while scaling or settling, with the rule's reason
    deferrals = summary["deferrals"]
    assert deferrals, f"the tuner never deferred for the autoscaler\n{log}"
    for d in deferrals:
        assert events[0]["at_s"] <= d["at_s"], (d, events, log)
        if d["at_s"] < settled:
            assert any(w in d["reason"] for w in ("the replica count is changing", "the autoscaler changed the replica "
                                                  "count", "the autoscaler is at maxReplicas")), d
        else:  # settled: only the autoscaler at its max with requests waiting still holds a rollout back
            assert "the autoscaler is at maxReplicas" in d["reason"], (d, log)
    assert any(d["at_s"] < settled for d in deferrals), (deferrals, settled, log)
    # no rollout started before the scale-out had settled; the first decision after settling applies
    assert summary["rollouts_started_while_scaling"] == 0, (summary["rollouts_started"], log)
    assert all(r["at_s"] >= settled for r in summary["rollouts_started"]), (summary["rollouts_started"], log)
    # (NoData -- e.g. scrape gaps on a loaded machine -- and a wait at maxReplicas may come between)
    after = summary["decision_after_settling"]
    assert after is not None and after["at_s"] >= settled, (after, log)
    if after["decision"] == "Defer":
        assert "the autoscaler is at maxReplicas" in after["reason"], (after, log)
    else:
        assert after["decision"] == "Apply", (after, log)
    assert summary["rollouts_started"] and summary["rollouts_started"][0]["at_s"] >= after["at_s"], log
