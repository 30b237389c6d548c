"""Pure unit tests of the autotune decision and the rollout state machine (no I/O), on the typed
``status.autotune`` records, plus their round trip through the CRD's camelCase form."""

from __future__ import annotations

import dataclasses

import pytest

from moe_eplb.api.autotune_status import (
    HISTORY_LIMIT,
    AutotuneStatus,
    DataWindow,
    HistoryEntry,
    Measurement,
    Override,
    autotune_status_patch,
    autotune_status_to_crd,
    iso,
    json_merge_patch,
    parse_autotune_status,
)
from moe_eplb.api.knobs import Knobs
from moe_eplb.api.spec import AutotuneSpec
from moe_eplb.controller import decisions as d
from moe_eplb.controller import rollout as r

T0 = 1_800_000_000.0
CUR = Knobs(1000, 3000, 0)
NEW = Knobs(3000, 1000, 8)
SPEC = Knobs(1000, 3000, 0)


def _cfg(**kw) -> AutotuneSpec:
    return AutotuneSpec(**{"mode": "Apply", **kw})


def _answer(target=NEW, gain=0.05, change=True) -> d.TunerAnswer:
    return d.TunerAnswer(recommendation=target, wants_change=change, reason="test", gain=gain,
                         breakdown={"balance": gain + 0.01, "restart": -0.01})


def _evaluate(cfg, state=AutotuneStatus(), now=T0, **kw) -> d.Evaluated:
    args = dict(now=now, generation=3, current=CUR, spec_eplb=SPEC,
                data_window=DataWindow(buckets=20, steps=4000, source="prometheus"), answer=_answer(),
                baseline=Measurement(balancedness=0.8), from_hash="h-old")
    args.update(kw)
    return d.evaluate(cfg, state, **args)


def test_apply_starts_rollout_with_override_and_budget_entry():
    out = _evaluate(_cfg())
    assert out.decision == d.APPLY and out.started_rollout
    st = out.status
    assert st.override == Override.of(NEW, spec_generation=3, spec_eplb=SPEC)
    assert st.rollout.phase == r.ROLLING and st.rollout.from_knobs == CUR and st.rollout.to_knobs == NEW
    assert st.rollout.from_hash == "h-old" and st.rollout.spec_eplb == SPEC
    assert st.restarts == (T0,) and st.last_change_time == T0
    ev = st.last_evaluation
    assert ev.decision == "Apply" and ev.recommended == NEW and ev.predicted_gain == 0.05
    assert ev.gain_breakdown == pytest.approx({"balance": 0.06, "restart": -0.01})
    assert out.conditions["Tuned"][1] == "Applying"
    # what is stored: the CRD's names and RFC 3339 times
    crd = autotune_status_to_crd(st)
    assert crd["override"] == {"windowSize": 3000, "stepInterval": 1000, "numRedundantExperts": 8, "specGeneration": 3,
                               "specEplb": {"windowSize": 1000, "stepInterval": 3000, "numRedundantExperts": 0}}
    assert crd["rollout"]["from"] == {"windowSize": 1000, "stepInterval": 3000, "numRedundantExperts": 0}
    assert crd["lastChangeTime"] == iso(T0) and crd["restarts"] == [iso(T0)]
    assert crd["lastEvaluation"]["gainBreakdown"] == pytest.approx({"balance": 0.06, "restart": -0.01})


def test_status_round_trips_through_the_crd_form():
    st = _evaluate(_cfg()).status
    again = parse_autotune_status(autotune_status_to_crd(st))
    assert again == st and not again.notes
    # a malformed record is dropped and named; the others survive
    crd = autotune_status_to_crd(st)
    crd["override"]["windowSize"] = "big"
    crd["degraded"] = 5
    bad = parse_autotune_status(crd)
    assert bad.override is None and bad.degraded is None and bad.rollout == st.rollout
    assert any("status.autotune.override.windowSize" in n for n in bad.notes)
    assert any("status.autotune.degraded" in n for n in bad.notes)


def test_patch_deletes_what_the_new_status_drops_and_keeps_the_rest():
    stored = parse_autotune_status({"override": {"windowSize": 1}, "recommendation": {
        "windowSize": 1, "stepInterval": 2, "numRedundantExperts": 0}, "legacyKey": 1})
    new = stored.replace(override=None)
    patch = autotune_status_patch(stored, new)
    assert patch == {"override": None, "legacyKey": None}
    assert json_merge_patch({"a": 1, "b": {"c": 1, "d": 2}}, {"b": {"c": 1}, "e": 3}) == \
        {"a": None, "b": {"d": None}, "e": 3}


def test_recommend_mode_writes_recommendation_only():
    out = _evaluate(_cfg(mode="Recommend"))
    assert out.decision == d.RECOMMEND
    assert out.status.override is None and out.status.rollout is None
    assert out.status.recommendation.knobs == NEW


def test_keep_when_gain_below_min_gain_or_tuner_says_keep():
    assert _evaluate(_cfg(min_gain=0.1)).decision == d.KEEP
    assert _evaluate(_cfg(), answer=_answer(change=False)).decision == d.KEEP
    assert _evaluate(_cfg(), answer=_answer(target=CUR, gain=0.0)).decision == d.KEEP


def test_cooldown_and_restart_budget_defer():
    cfg = _cfg(cooldown_s=3600, max_restarts_per_day=2)
    out = _evaluate(cfg, AutotuneStatus(last_change_time=T0 - 600, restarts=(T0 - 600,)))
    assert out.decision == d.DEFER and "cooldown" in out.reason and out.status.override is None
    # cooldown over, but two restarts in the last 24 h spend the budget
    out = _evaluate(cfg, AutotuneStatus(last_change_time=T0 - 7200, restarts=(T0 - 7200, T0 - 9000)))
    assert out.decision == d.DEFER and "restart budget" in out.reason
    # restarts older than a day do not count
    out = _evaluate(cfg, AutotuneStatus(last_change_time=T0 - 7200, restarts=(T0 - 7200, T0 - 90000)))
    assert out.decision == d.APPLY and out.status.restarts == (T0 - 7200, T0)


def test_no_change_while_workload_rolls_or_rollout_runs():
    cfg = _cfg()
    out = _evaluate(cfg, workload_blocker="pods are rolling (1/2 updated)")
    assert out.decision == d.DEFER and "rolling" in out.reason
    busy = _evaluate(cfg).status
    out = _evaluate(cfg, busy, now=T0 + 7200)
    assert out.decision == d.DEFER and "rollout is in progress" in out.reason


def test_load_and_tuner_errors_change_nothing():
    out = _evaluate(_cfg(), load_error=("PrometheusUnavailable", "connection refused"), answer=None)
    assert out.decision == d.NODATA and out.status.override is None
    assert out.conditions["MetricsAvailable"] == ("False", "PrometheusUnavailable", "connection refused")
    assert out.conditions["Tuned"][0] == "False"
    out = _evaluate(_cfg(), answer=None, tune_error="no valid redundancy")
    assert out.decision == d.ERROR and out.conditions["Tuned"][1] == "TunerError"


def test_due():
    cfg = _cfg(evaluation_interval_s=300)
    assert d.due(cfg, AutotuneStatus(), T0)
    state = _evaluate(cfg, now=T0 - 100).status
    assert not d.due(cfg, state, T0)
    assert d.due(cfg, state, T0 + 200)
    # the interval runs from when the evaluation began (its load was read up to dataWindow.end), not
    # from when its tuner finished: a 120 s read-and-tune does not push every later evaluation back
    slow = dataclasses.replace(state, last_evaluation=dataclasses.replace(
        state.last_evaluation, data_window=DataWindow(start=T0 - 1920, end=T0 - 220, buckets=20, steps=4000)))
    assert d.due(cfg, slow, T0 + 80) and not d.due(cfg, slow, T0 + 79)
    assert not d.due(cfg, state, T0 + 80)


def _rolling_state(spec_eplb=SPEC):
    cfg = _cfg(observe_s=600)
    return cfg, _evaluate(cfg, spec_eplb=spec_eplb).status


def _view(generation=3, settled=True, template="h-new", crash=(), **kw) -> r.WorkloadView:
    return r.WorkloadView(generation, settled, template, crash, **{"spec_eplb": SPEC, **kw})


def test_rollout_happy_path_keeps():
    cfg, st = _rolling_state()
    # controller has not re-rendered yet: same hash, nothing happens
    assert not r.advance(cfg, st, _view(template="h-old"), now=T0 + 5).changed
    assert not r.advance(cfg, st, _view(settled=False), now=T0 + 30).changed  # rolling
    s = r.advance(cfg, st, _view(), now=T0 + 200)
    assert s.changed and s.status.rollout.phase == r.OBSERVING and s.conditions["Tuned"][1] == "Observing"
    st = s.status
    assert r.measurement_window(cfg, st, T0 + 500) is None
    assert r.measurement_window(cfg, st, T0 + 800) == (T0 + 200, T0 + 800)
    s = r.advance(cfg, st, _view(), now=T0 + 800, measured=Measurement(balancedness=0.9))
    assert s.changed and s.status.rollout is None
    assert s.status.override.window_size == 3000  # kept
    h = s.status.history[-1]
    assert h.action == "Kept" and h.measured == Measurement(balancedness=0.9) and h.baseline.balancedness == 0.8
    assert s.conditions["Tuned"][1] == "Kept"


def test_kept_without_measurement_sets_the_tuned_condition():
    cfg, st = _rolling_state()
    st = r.advance(cfg, st, _view(), now=T0 + 100).status
    s = r.advance(cfg, st, _view(), now=T0 + 100 + 2 * 600 + 61, measured=None)
    assert s.status.rollout is None and s.status.history[-1].action == "Kept"
    assert s.conditions["Tuned"][:2] == ("True", "KeptUnmeasured")


def test_regression_rolls_back_to_previous_override():
    cfg, st = _rolling_state()
    prev = Override.of(CUR, spec_generation=3, spec_eplb=SPEC)
    st = st.replace(rollout=dataclasses.replace(st.rollout, previous_override=prev))
    st = r.advance(cfg, st, _view(), now=T0 + 100).status
    s = r.advance(cfg, st, _view(), now=T0 + 800, measured=Measurement(balancedness=0.7))
    assert s.rollback_reason == "regression"
    assert s.status.override == prev
    assert s.status.rollout.phase == r.ROLLING_BACK
    assert len(s.status.restarts) == 2
    st = s.status
    # still old pods -> wait; restored template rendered and settled -> done
    assert not r.advance(cfg, st, _view(settled=False, template="h-old"), now=T0 + 850).changed
    s = r.advance(cfg, st, _view(template="h-old"), now=T0 + 900)
    assert s.status.rollout is None and s.status.history[-1].action == "RolledBack"
    assert s.conditions["Tuned"][1] == "RolledBack"


def test_within_tolerance_is_kept():
    cfg, st = _rolling_state()
    st = r.advance(cfg, st, _view(), now=T0 + 100).status
    s = r.advance(cfg, st, _view(), now=T0 + 800, measured=Measurement(balancedness=0.79))
    assert s.rollback_reason is None and s.status.history[-1].action == "Kept"


@pytest.mark.parametrize("observing", [False, True])
def test_crash_loop_rolls_back_and_degrades_in_either_phase(observing):
    cfg, st = _rolling_state()
    if observing:
        st = r.advance(cfg, st, _view(), now=T0 + 30).status
        assert st.rollout.phase == r.OBSERVING
    s = r.advance(cfg, st, _view(settled=False, crash=("p-1",)), now=T0 + 60)
    assert s.rollback_reason == "crashloop"
    assert s.status.override is None  # previous override was none: spec.eplb runs again
    assert s.conditions["Degraded"][0] == "True" and s.status.degraded.reason == "CrashLoopAfterTuning"
    s = r.advance(cfg, s.status, _view(template="h-old"), now=T0 + 120)
    assert s.status.history[-1].action == "RolledBack"
    assert s.conditions["Degraded"][1] == "RolledBackAfterCrashLoop"
    assert s.status.degraded.reason == "RolledBackAfterCrashLoop"


def test_user_edit_supersedes_by_generation_for_old_records():
    cfg, st = _rolling_state()
    st = st.replace(rollout=dataclasses.replace(st.rollout, spec_eplb=None))  # written by an older operator
    s = r.advance(cfg, st, _view(generation=4, settled=False, template="h-user"), now=T0 + 60)
    assert s.status.override is None and s.status.rollout is None
    assert s.status.history[-1].action == "Superseded"


def test_replicas_edit_during_rollout_does_not_supersede():
    cfg, st = _rolling_state()
    # generation 4 (a /scale), spec.eplb unchanged: the rollout goes on to Observing
    s = r.advance(cfg, st, _view(generation=4), now=T0 + 60)
    assert s.status.rollout.phase == r.OBSERVING and s.status.override.window_size == 3000


@pytest.mark.parametrize("view_kw,needle", [
    ({"spec_eplb": Knobs(2000, 3000, 0)}, "spec.eplb changed"),
    ({"eplb_enabled": False}, "enabled was set to false"),
    ({"target_invalid": "not divisible"}, "no longer valid"),
])
def test_spec_eplb_edit_during_rollout_supersedes(view_kw, needle):
    cfg, st = _rolling_state()
    s = r.advance(cfg, st, _view(settled=False, template="h-user", **view_kw), now=T0 + 60)
    assert s.status.override is None and s.status.rollout is None
    h = s.status.history[-1]
    assert h.action == "Superseded" and needle in h.reason


def test_timeout_rolls_back():
    cfg, st = _rolling_state()
    s = r.advance(cfg, st, _view(settled=False), now=T0 + cfg.rollout_timeout_s + 1)
    assert s.rollback_reason == "timeout"


def test_the_timeout_counts_the_old_pods_drain():
    """A rollout waits for every batch's old pods to drain (terminationGracePeriodSeconds): a long
    drainSeconds must not turn a healthy rollout into a timeout rollback."""
    cfg, st = _rolling_state()
    grace = 600 + 30 + 30
    timeout = r.rollout_timeout_s(cfg, stop_seconds=grace, replicas=4, max_surge=1, max_unavailable=1)
    assert timeout == cfg.rollout_timeout_s + 2 * grace  # 4 groups, 2 at a time
    assert r.rollout_timeout_s(cfg, stop_seconds=grace, replicas=3, max_surge=0, max_unavailable=0) == \
        cfg.rollout_timeout_s + 3 * grace
    assert r.rollout_timeout_s(cfg) == cfg.rollout_timeout_s
    waiting = r.advance(cfg, st, _view(settled=False), now=T0 + cfg.rollout_timeout_s + 1, timeout_s=timeout)
    assert not waiting.changed and waiting.rollback_reason is None
    late = r.advance(cfg, st, _view(settled=False), now=T0 + timeout + 1, timeout_s=timeout)
    assert late.rollback_reason == "timeout"


def test_unknown_phase_is_abandoned_with_a_condition():
    cfg, st = _rolling_state()
    st = st.replace(rollout=dataclasses.replace(st.rollout, phase="Teleporting"))
    s = r.advance(cfg, st, _view(), now=T0 + 60)
    assert s.status.rollout is None and s.status.history[-1].action == "Abandoned"
    assert s.conditions["Tuned"][1] == "Abandoned"


def test_history_bounded():
    st = AutotuneStatus(history=tuple(HistoryEntry(time=T0 + i, action=str(i)) for i in range(HISTORY_LIMIT)))
    h = st.with_history(HistoryEntry(time=T0 + 99, action="new")).history
    assert len(h) == HISTORY_LIMIT and h[-1].action == "new" and h[0].action == "1"


def test_conditions():
    c = d.set_conditions([{"type": "Ready", "status": "True"}], {"Tuned": ("True", "Kept", "m")}, now=T0, generation=2)
    assert [x["type"] for x in c] == ["Ready", "Tuned"] and c[1]["observedGeneration"] == 2
    ltt = c[1]["lastTransitionTime"]
    c2 = d.set_conditions(c, {"Tuned": ("True", "Applying", "m2")}, now=T0 + 100, generation=2)
    assert c2[1]["lastTransitionTime"] == ltt and c2[1]["reason"] == "Applying"


def test_a_change_time_in_the_future_is_clamped_and_warned_about():
    """A lastChangeTime (and restarts) a day in the future -- clock skew or a restored backup -- used
    to block tuning for that day ("last change -86063s ago"). It is clamped to now (and written back
    with the evaluation), so the cooldown runs from here and then tuning resumes."""
    future = T0 + 86063
    state = AutotuneStatus(last_change_time=future, restarts=(future,))
    cfg = _cfg(cooldown_s=3600, max_restarts_per_day=4)
    out = _evaluate(cfg, state)
    assert out.decision == d.DEFER
    assert "cooldown: last change 0s ago, 3600s of cooldownSeconds=3600 left" in out.reason
    assert out.status.last_change_time == T0 and out.status.restarts == (T0,)
    assert [e[:2] for e in out.events] == [("Warning", "ClockSkew")]
    assert "86063s in the future" in out.events[0][2]
    later = _evaluate(cfg, out.status, now=T0 + 3601)  # one cooldown later (not a day): a change
    assert later.decision == d.APPLY and not later.events[:-1]
    skewed = AutotuneStatus(last_change_time=T0 + 30, restarts=(T0 + 30,))
    assert d.clamp_future(skewed, T0) == (skewed, None)  # a small skew between replicas is tolerated
