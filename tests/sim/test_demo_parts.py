"""The demo's own parts (no cluster): its resources render as a Deployment and a LeaderWorkerSet,
its DeepSeek-V3 workload turns a few experts hot at the shift without changing the traffic, and
``--summary`` writes exactly the documented keys."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from moe_eplb.api.spec import parse
from moe_eplb.cli import main
from moe_eplb.eplb.workload.trace import LoadTrace
from moe_eplb.render.objects import render_children
from moe_eplb_harness.demo import tuning as D


def test_the_demo_runs_one_deployment_and_one_leaderworkerset():
    kinds = {r["metadata"]["name"]: {c["kind"] for c in render_children(parse(r))} for r in (D.QWEN, D.DEEPSEEK)}
    assert "Deployment" in kinds["qwen3-vl-demo"] and "LeaderWorkerSet" not in kinds["qwen3-vl-demo"]
    assert "LeaderWorkerSet" in kinds["deepseek-v3-demo"] and "Deployment" not in kinds["deepseek-v3-demo"]
    ds = parse(D.DEEPSEEK)
    assert (ds.parallelism.ep_size, ds.parallelism.nodes, ds.moe_shape.num_moe_layers, ds.moe_shape.num_experts) == (
        32, 4, 58, 256)


def test_hot_experts_concentrate_load_from_the_shift_and_keep_each_bucket_total():
    rng = np.random.default_rng(0)
    trace = LoadTrace(load=rng.integers(1, 20, (40, 3, 16)).astype(float), bucket_steps=np.full(40, 10),
                      bucket_seconds=15.0)
    hot = D.hot_experts(trace, from_second=300.0, experts=2, factor=6.0, ramp_seconds=60.0)
    np.testing.assert_allclose(hot.load.sum(axis=(1, 2)), trace.load.sum(axis=(1, 2)))
    np.testing.assert_array_equal(hot.load[:20], trace.load[:20])  # before the shift: untouched
    share = hot.load[30:].sum(axis=0) / hot.load[30:].sum(axis=(0, 2))[:, None]
    base = trace.load[30:].sum(axis=0) / trace.load[30:].sum(axis=(0, 2))[:, None]
    top2 = np.sort(share / base, axis=1)[:, -2:]
    assert np.all(top2 > 3.0)  # two experts per layer draw far more than before


def test_summary_has_exactly_the_documented_keys():
    result = {"name": "x", "kind": "LeaderWorkerSet", "mode": "Apply", "label": "l", "ep": 32, "final": {},
              "evaluations": 3, "balancedness": {"tuned": 0.9, "untuned": 0.8, "after_shift_tuned": 0.85,
                                                 "after_shift_untuned": 0.7},
              "applied_changes": [{"at_s": 10.0, "window_size": 100, "step_interval": 1000,
                                   "num_redundant_experts": 32, "measured_gain": 0.1, "kept": True, "reason": "r"}],
              "experiments": [{"arms": [{"arm": "trial", "replicas": 1, "windowSize": 100, "stepInterval": 1000,
                                         "numRedundantExperts": 32}], "objective": "step_time", "started_s": 1.0,
                               "ended_s": 2.0, "estimate": 0.03, "ci_low": 0.01, "ci_high": 0.05,
                               "verdict": "promoted", "learned": [], "extra": "dropped"}],
              "live_changes": [{"at_s": 3.0, "from": {"window_size": 1000, "step_interval": 3000},
                                "to": {"window_size": 100, "step_interval": 250}, "step": 4200, "extra": "dropped"}]}
    s = D.summary_record(5400.0, {"x": result}, api="emulated", load_source="direct")
    assert set(s) == {"shift_at_s", "api", "load_source", "resources"} and s["shift_at_s"] == 5400.0
    assert (s["api"], s["load_source"]) == ("emulated", "direct")
    with pytest.raises(ValueError, match="load_source"):
        D.summary_record(5400.0, {"x": result}, api="emulated", load_source="pods")
    (r,) = s["resources"]
    assert set(r) == {"name", "kind", "mode", "applied_changes", "live_changes", "experiments", "balancedness"}
    assert r["live_changes"] == [{"at_s": 3.0, "from": {"window_size": 1000, "step_interval": 3000},
                                  "to": {"window_size": 100, "step_interval": 250}, "step": 4200}]
    assert set(r["experiments"][0]) == {"arms", "objective", "started_s", "ended_s", "estimate", "ci_low", "ci_high",
                                        "verdict", "learned"}
    assert set(r["applied_changes"][0]) == {"at_s", "window_size", "step_interval", "num_redundant_experts",
                                            "measured_gain", "kept"}
    assert set(r["balancedness"]) == {"tuned", "untuned", "after_shift_tuned", "after_shift_untuned"}


def test_live_changes_of_the_status():
    at = {"liveChanges": [{"at": "2026-12-06T05:00:00.000000Z", "from": {"windowSize": 1000, "stepInterval": 3000,
                                                                      "numRedundantExperts": 0},
                           "to": {"windowSize": 500, "stepInterval": 1000, "numRedundantExperts": 0}, "step": 77,
                           "reason": "r"}]}
    start = D.parse_iso("2026-12-06T04:00:00Z")
    assert D.live_changes_of(at, start) == [{"at_s": 3600.0, "from": {"window_size": 1000, "step_interval": 3000},
                                             "to": {"window_size": 500, "step_interval": 1000}, "step": 77}]
    assert D.live_changes_of({}, start) == []


def test_experiments_of_the_status():
    at = {"experiments": [{"phase": "Promoting", "trial": {"arm": "trial", "knobs": {"windowSize": 3000,
          "stepInterval": 1000, "numRedundantExperts": 8}, "replicas": 1}, "control": {"arm": "control", "knobs":
          {"windowSize": 1000, "stepInterval": 3000, "numRedundantExperts": 0}, "replicas": 1},
          "startedAt": "2026-01-01T00:10:00Z", "endedAt": "2026-01-01T00:40:00Z", "objective": "step_time",
          "estimate": 0.03, "ciLow": 0.02, "ciHigh": 0.04, "verdict": "promoted", "learned": []}]}
    (e,) = D.experiments_of(at, D.parse_iso("2026-01-01T00:00:00Z"))
    assert (e["started_s"], e["ended_s"], e["verdict"], e["ci_low"]) == (600.0, 2400.0, "promoted", 0.02)
    assert [a["arm"] for a in e["arms"]] == ["trial", "control"] and e["arms"][0]["numRedundantExperts"] == 8
    assert "promoted" in D.experiment_line(at["experiments"][0]) and "+3.00%" in D.experiment_line(at["experiments"][0])


def test_demo_command_offers_summary():
    out = CliRunner().invoke(main, ["demo", "--help"])
    assert out.exit_code == 0 and "--summary" in out.output


def test_a_failure_says_what_failed_on_the_last_line(tmp_path):
    """A failed demo ends with one line naming the exception, its message (or that it had none) and
    where it was raised, exit 1 -- never a bare warning."""
    try:
        raise TimeoutError()
    except TimeoutError as exc:
        line = D.failure_line(exc, 153.2)
    assert line.startswith("moe-eplb demo: FAILED after 153 s: TimeoutError: no message (at test_demo_parts.py:")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = CliRunner().invoke(main, ["demo", "--no-prometheus", "--out", str(blocker / "report")])
    assert out.exit_code == 1, out.output
    last = out.output.strip().splitlines()[-1]
    assert last.startswith("moe-eplb demo: FAILED after ") and "NotADirectoryError" in last and str(blocker) in last
