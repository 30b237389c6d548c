"""The real-engine demo's pieces that need no engine (``make demo-vllm-cpu`` runs the whole loop,
about 4 minutes, outside the suite; see docs/demo.md): the loop's resource is a valid MoEInference
that renders the starting EPLB config, and the summary reports the judged change from the status
history the operator wrote."""

from __future__ import annotations

import time

from moe_eplb.api.autotune_status import iso as format_iso
from moe_eplb.api.validation import check
from moe_eplb_harness.vllm_engine import closed_loop as cl


def test_the_loops_resource_is_valid_and_starts_at_the_tiers_settings():
    res = cl.resource("http://127.0.0.1:9090")
    checked = check(res)
    assert checked.problems == []
    inf = checked.inference
    assert inf.effective.knobs.window_size == 16 and inf.effective.knobs.step_interval == 32
    assert inf.effective.knobs.num_redundant_experts == 2
    assert inf.autotune.mode == "Apply" and inf.autotune.evaluation_interval_s == 30
    # the tiny model's true expert size (gate, up, down; float32), not a catalog guess
    assert res["spec"]["model"]["moe"]["bytesPerExpert"] == 3 * 128 * 64 * 4
    assert res["spec"]["monitoring"]["podMonitor"] == {"enabled": False}
    # overrides reach the autotune block
    assert cl.resource("http://p", observeSeconds=10)["spec"]["autotune"]["observeSeconds"] == 10


class _Load:
    ok, failed = 120, 3


class _Factory:
    engines: list = []


def test_the_summary_reports_the_judged_change_with_its_measured_gain():
    t0 = time.time() - 100
    judged = {"action": "Kept", "reason": "kept", "startedAt": format_iso(t0 + 40), "predictedGain": 0.05,
              "from": {"windowSize": 16, "stepInterval": 32, "numRedundantExperts": 2},
              "to": {"windowSize": 1000, "stepInterval": 3000, "numRedundantExperts": 0},
              "baseline": {"balancedness": 0.8, "tokensPerSecond": 100.0},
              "measured": {"balancedness": 0.9, "tokensPerSecond": 90.0}}
    s = cl.build_summary(t0, None, [{"decision": "Apply"}], _Factory(), _Load(), judged, None, "0.32.0")
    c = s["applied_change"]
    assert c["from"] == {"window_size": 16, "step_interval": 32, "num_redundant_experts": 2}
    assert c["to"] == {"window_size": 1000, "step_interval": 3000, "num_redundant_experts": 0}
    assert abs(c["at_s"] - 40.0) < 1.0
    assert c["measured_gain"] == 0.125 and c["outcome"] == "Kept"
    assert (c["tokens_per_second_before"], c["tokens_per_second_after"]) == (100.0, 90.0)
    assert s["completed"] is True and s["requests"] == {"ok": 120, "failed": 3} and s["engine_restarts"] == 0
    # an error, or no judged change, is not a completed run
    assert cl.build_summary(t0, None, [], _Factory(), _Load(), judged, "TimeoutError: x", "0.32.0")["completed"] is False
    assert cl.build_summary(t0, None, [], _Factory(), _Load(), None, None, "0.32.0")["applied_change"] is None
