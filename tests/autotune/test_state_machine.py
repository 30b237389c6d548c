"""Pure unit tests of the autotune decision and the rollout state machine (no I/O)."""

from __future__ import annotations

import pytest
from moe_eplb.controller import decisions as d
from moe_eplb.controller import rollout as r

T0 = 1_800_000_000.0
CUR = {"windowSize": 1000, "stepInterval": 3000, "numRedundantExperts": 0}
NEW = {"windowSize": 3000, "stepInterval": 1000, "numRedundantExperts": 8}


def _res(**autotune):
    return {"metadata": {"generation": 3}, "spec": {"autotune": {"mode": "Apply", **autotune}}}


def _tune(target=NEW, gain=0.05, decision="change"):
    return {
        "recommendation": {
            "window_size": target["windowSize"],
            "step_interval": target["stepInterval"],
            "num_redundant_experts": target["numRedundantExperts"],
            "predicted_gain": gain,
            "breakdown": {"balance": gain + 0.01, "restart": -0.01},
            "decision": decision,
            "reason": "test",
        },
        "candidates": [],
        "baselines": {},
    }


def _evaluate(cfg, state, now=T0, **kw):
    args = dict(now=now, generation=3, current=CUR, current_override=None,
                data_window={"buckets": 20, "steps": 4000, "source": "prometheus"}, tune=_tune(),
                baseline={"balancedness": 0.8}, from_hash="h-old")
    args.update(kw)
    return d.evaluate(cfg, state, **args)


def test_config_defaults_and_quantity():
    cfg = d.autotune_config(_res(memoryBudgetPerGpu="8Gi", bounds={"numRedundantExperts": {"max": 16}}))
    assert cfg.mode == "Apply"
    assert cfg.memory_budget_bytes == 8 * 2**30
    assert cfg.bounds == {"numRedundantExperts": (0, 16)}
    assert (cfg.evaluation_interval_s, cfg.cooldown_s, cfg.max_restarts_per_day) == (300, 3600, 4)
    assert (cfg.min_gain, cfg.rollback_tolerance, cfg.observe_s) == (0.02, 0.02, 600)
    assert d.autotune_config({"spec": {}}).mode == "Off"


@pytest.mark.parametrize("field,value,needle", [
    ("mode", "Auto", "spec.autotune.mode"),
    ("memoryBudgetPerGpu", "lots", "spec.autotune.memoryBudgetPerGpu"),
    ("cooldownSeconds", -1, "spec.autotune.cooldownSeconds"),
    ("bounds", {"windowSize": {"min": 10, "max": 5}}, "spec.autotune.bounds.windowSize"),
])
def test_config_errors_name_the_field(field, value, needle):
    with pytest.raises(d.AutotuneSpecError, match=needle.replace(".", r"\.")):
        d.autotune_config(_res(**{field: value}))


def test_apply_starts_rollout_with_override_and_budget_entry():
    cfg = d.autotune_config(_res())
    out = _evaluate(cfg, {})
    assert out.decision == d.APPLY and out.started_rollout
    at = out.autotune
    assert at["override"] == {**NEW, "specGeneration": 3}
    assert at["rollout"]["phase"] == r.ROLLING and at["rollout"]["from"] == CUR and at["rollout"]["to"] == NEW
    assert at["rollout"]["fromHash"] == "h-old"
    assert len(at["restarts"]) == 1 and at["lastChangeTime"] == d.iso(T0)
    ev = at["lastEvaluation"]
    assert ev["decision"] == "Apply" and ev["recommended"] == NEW and ev["predictedGain"] == 0.05
    assert ev["gainBreakdown"] == {"balance": 0.06, "restart": -0.01}
    assert out.conditions["Tuned"][1] == "Applying"


def test_apply_records_spec_eplb_in_override_and_rollout():
    spec = {"windowSize": 1000, "stepInterval": 3000, "numRedundantExperts": 0}
    out = _evaluate(d.autotune_config(_res()), {}, spec_eplb=spec)
    assert out.autotune["override"] == {**NEW, "specGeneration": 3, "specEplb": spec}
    assert out.autotune["rollout"]["specEplb"] == spec


def test_recommend_mode_writes_recommendation_only():
    cfg = d.autotune_config(_res(mode="Recommend"))
    out = _evaluate(cfg, {})
    assert out.decision == d.RECOMMEND
    assert "override" not in out.autotune and "rollout" not in out.autotune
    assert out.autotune["recommendation"]["windowSize"] == 3000


def test_keep_when_gain_below_min_gain_or_tuner_says_keep():
    cfg = d.autotune_config(_res(minGain=0.1))
    assert _evaluate(cfg, {}).decision == d.KEEP
    cfg = d.autotune_config(_res())
    assert _evaluate(cfg, {}, tune=_tune(decision="keep")).decision == d.KEEP
    assert _evaluate(cfg, {}, tune=_tune(target=CUR, gain=0.0)).decision == d.KEEP


def test_cooldown_and_restart_budget_defer():
    cfg = d.autotune_config(_res(cooldownSeconds=3600, maxRestartsPerDay=2))
    state = {"lastChangeTime": d.iso(T0 - 600), "restarts": [d.iso(T0 - 600)]}
    out = _evaluate(cfg, state)
    assert out.decision == d.DEFER and "cooldown" in out.reason and "override" not in out.autotune
    # cooldown over, but two restarts in the last 24 h spend the budget
    state = {"lastChangeTime": d.iso(T0 - 7200), "restarts": [d.iso(T0 - 7200), d.iso(T0 - 9000)]}
    out = _evaluate(cfg, state)
    assert out.decision == d.DEFER and "restart budget" in out.reason
    # restarts older than a day do not count
    state = {"lastChangeTime": d.iso(T0 - 7200), "restarts": [d.iso(T0 - 7200), d.iso(T0 - 90000)]}
    out = _evaluate(cfg, state)
    assert out.decision == d.APPLY and out.autotune["restarts"] == [d.iso(T0 - 7200), d.iso(T0)]


def test_no_change_while_workload_rolls_or_rollout_runs():
    cfg = d.autotune_config(_res())
    out = _evaluate(cfg, {}, workload_blocker="pods are rolling (1/2 updated)")
    assert out.decision == d.DEFER and "rolling" in out.reason
    out = _evaluate(cfg, {"rollout": {"kind": "apply", "phase": "Rolling"}})
    assert out.decision == d.DEFER and "rollout is in progress" in out.reason


def test_load_and_tuner_errors_change_nothing():
    cfg = d.autotune_config(_res())
    out = _evaluate(cfg, {}, load_error=("PrometheusUnavailable", "connection refused"), tune=None)
    assert out.decision == d.NODATA and "override" not in out.autotune
    assert out.conditions["MetricsAvailable"] == ("False", "PrometheusUnavailable", "connection refused")
    assert out.conditions["Tuned"][0] == "False"
    out = _evaluate(cfg, {}, tune=None, tune_error="no valid redundancy")
    assert out.decision == d.ERROR and out.conditions["Tuned"][1] == "TunerError"


def test_due():
    cfg = d.autotune_config(_res(evaluationIntervalSeconds=300))
    assert d.due(cfg, {}, T0)
    state = {"lastEvaluation": {"time": d.iso(T0 - 100)}}
    assert not d.due(cfg, state, T0)
    assert d.due(cfg, state, T0 + 200)


def _rolling_state():
    cfg = d.autotune_config(_res(observeSeconds=600))
    return cfg, _evaluate(cfg, {}).autotune


def test_rollout_happy_path_keeps():
    cfg, st = _rolling_state()
    # controller has not re-rendered yet: same hash, nothing happens
    s = r.advance(cfg, st, r.WorkloadView(3, True, "h-old"), now=T0 + 5)
    assert not s.changed
    # rolling
    s = r.advance(cfg, st, r.WorkloadView(3, False, "h-new"), now=T0 + 30)
    assert not s.changed
    s = r.advance(cfg, st, r.WorkloadView(3, True, "h-new"), now=T0 + 200)
    assert s.changed and s.autotune["rollout"]["phase"] == r.OBSERVING
    st = s.autotune
    assert r.measurement_window(cfg, st, T0 + 500) is None
    assert r.measurement_window(cfg, st, T0 + 800) == (T0 + 200, T0 + 800)
    s = r.advance(cfg, st, r.WorkloadView(3, True, "h-new"), now=T0 + 800, measured={"balancedness": 0.9})
    assert s.changed and "rollout" not in s.autotune
    assert s.autotune["override"]["windowSize"] == 3000  # kept
    h = s.autotune["history"][-1]
    assert h["action"] == "Kept" and h["measured"] == {"balancedness": 0.9} and h["baseline"] == {"balancedness": 0.8}


def test_regression_rolls_back_to_previous_override():
    cfg, st = _rolling_state()
    prev = {**CUR, "specGeneration": 3}
    st["rollout"]["previousOverride"] = prev
    st = r.advance(cfg, st, r.WorkloadView(3, True, "h-new"), now=T0 + 100).autotune
    s = r.advance(cfg, st, r.WorkloadView(3, True, "h-new"), now=T0 + 800, measured={"balancedness": 0.7})
    assert s.rollback_reason == "regression"
    assert s.autotune["override"] == prev
    assert s.autotune["rollout"]["phase"] == r.ROLLING_BACK
    assert len(s.autotune["restarts"]) == 2
    st = s.autotune
    # still old pods -> wait; restored template rendered and settled -> done
    assert not r.advance(cfg, st, r.WorkloadView(3, False, "h-old"), now=T0 + 850).changed
    s = r.advance(cfg, st, r.WorkloadView(3, True, "h-old"), now=T0 + 900)
    assert "rollout" not in s.autotune and s.autotune["history"][-1]["action"] == "RolledBack"


def test_within_tolerance_is_kept():
    cfg, st = _rolling_state()
    st = r.advance(cfg, st, r.WorkloadView(3, True, "h-new"), now=T0 + 100).autotune
    s = r.advance(cfg, st, r.WorkloadView(3, True, "h-new"), now=T0 + 800, measured={"balancedness": 0.79})
    assert s.rollback_reason is None and s.autotune["history"][-1]["action"] == "Kept"


def test_crash_loop_rolls_back_and_degrades():
    cfg, st = _rolling_state()
    s = r.advance(cfg, st, r.WorkloadView(3, False, "h-new", ("p-1",)), now=T0 + 60)
    assert s.rollback_reason == "crashloop"
    assert "override" not in s.autotune  # previous override was none: spec.eplb runs again
    assert s.conditions["Degraded"][0] == "True"
    st = s.autotune
    s = r.advance(cfg, st, r.WorkloadView(3, True, "h-old"), now=T0 + 120)
    assert s.autotune["history"][-1]["action"] == "RolledBack"
    assert s.conditions["Degraded"][1] == "RolledBackAfterCrashLoop"
    assert s.autotune["degraded"]["reason"] == "RolledBackAfterCrashLoop"


def test_user_edit_supersedes():
    cfg, st = _rolling_state()
    s = r.advance(cfg, st, r.WorkloadView(4, False, "h-user"), now=T0 + 60)
    assert "override" not in s.autotune and "rollout" not in s.autotune
    assert s.autotune["history"][-1]["action"] == "Superseded"


SPEC = {"windowSize": 1000, "stepInterval": 3000, "numRedundantExperts": 0}


def _recorded_rolling_state():
    cfg = d.autotune_config(_res(observeSeconds=600))
    return cfg, _evaluate(cfg, {}, spec_eplb=dict(SPEC)).autotune


def test_replicas_edit_during_rollout_does_not_supersede():
    cfg, st = _recorded_rolling_state()
    # generation 4 (a /scale), spec.eplb unchanged: the rollout goes on to Observing
    s = r.advance(cfg, st, r.WorkloadView(4, True, "h-new", spec_eplb=dict(SPEC)), now=T0 + 60)
    assert s.autotune["rollout"]["phase"] == r.OBSERVING and s.autotune["override"]["windowSize"] == 3000


@pytest.mark.parametrize("view_kw,needle", [
    ({"spec_eplb": {**SPEC, "windowSize": 2000}}, "spec.eplb changed"),
    ({"spec_eplb": dict(SPEC), "eplb_enabled": False}, "enabled was set to false"),
    ({"spec_eplb": dict(SPEC), "target_invalid": "not divisible"}, "no longer valid"),
])
def test_spec_eplb_edit_during_rollout_supersedes(view_kw, needle):
    cfg, st = _recorded_rolling_state()
    s = r.advance(cfg, st, r.WorkloadView(3, False, "h-user", **view_kw), now=T0 + 60)
    assert "override" not in s.autotune and "rollout" not in s.autotune
    h = s.autotune["history"][-1]
    assert h["action"] == "Superseded" and needle in h["reason"]


def test_timeout_rolls_back():
    cfg, st = _rolling_state()
    s = r.advance(cfg, st, r.WorkloadView(3, False, "h-new"), now=T0 + cfg.rollout_timeout_s + 1)
    assert s.rollback_reason == "timeout"


def test_history_bounded():
    st = {"history": [{"i": i} for i in range(d.HISTORY_LIMIT)]}
    h = d.append_history(st, {"i": "new"})
    assert len(h) == d.HISTORY_LIMIT and h[-1] == {"i": "new"} and h[0] == {"i": 1}


def test_merge_patch_and_conditions():
    assert d.merge_patch({"a": 1, "b": {"c": 1, "d": 2}}, {"b": {"c": 1}, "e": 3}) == {"a": None, "b": {"d": None}, "e": 3}
    c = d.set_conditions([{"type": "Ready", "status": "True"}], {"Tuned": ("True", "Kept", "m")}, now=T0, generation=2)
    assert [x["type"] for x in c] == ["Ready", "Tuned"] and c[1]["observedGeneration"] == 2
    ltt = c[1]["lastTransitionTime"]
    c2 = d.set_conditions(c, {"Tuned": ("True", "Applying", "m2")}, now=T0 + 100, generation=2)
    assert c2[1]["lastTransitionTime"] == ltt and c2[1]["reason"] == "Applying"
