"""Live apply in the operator, pure parts: which resources can take it, the decision (live or
restart), the status records, what the pods are rendered with, the agreed step, the shift watch."""

from __future__ import annotations

import copy
import json

import pytest

from moe_eplb.api.autotune_status import (
    AutotuneStatus,
    DataWindow,
    LiveSettings,
    Measurement,
    Rollout,
    autotune_status_to_crd,
    parse_autotune_status,
)
from moe_eplb.api.knobs import Knobs
from moe_eplb.api.spec import AutotuneSpec, parse
from moe_eplb.contracts import k8s_names
from moe_eplb.contracts import live_protocol as lp
from moe_eplb.controller import decisions as d
from moe_eplb.controller.live import LivePod, engine_problem, live_capable, plan_step
from moe_eplb.controller.shift import ShiftSettings, ShiftWatch
from moe_eplb.render.objects import render_children
from tests.autotune.conftest import RESOURCE

T0 = 1_800_000_000.0
CUR = Knobs(1000, 3000, 0)
LIVE = Knobs(500, 1000, 0)


def _resource(image="vllm/vllm-openai:v0.32.0", **engine) -> dict:
    res = copy.deepcopy(RESOURCE)
    res["spec"]["engine"] = {"image": image, **engine}
    return res


@pytest.mark.parametrize("engine,needle", [
    ({}, None),
    ({"image": "vllm/vllm-openai:v0.34.1"}, None),
    ({"image": "vllm/vllm-openai:v0.12.0"}, "vLLM 0.12.0: live apply of window and interval is checked on vLLM "
                                           "0.32.x - 0.34.x only"),
    ({"image": "vllm/vllm-openai:latest"}, "the vLLM version is not known (set spec.engine.version"),
    ({"image": "vllm/vllm-openai:v0.33.0", "exporter": {"inject": False}}, "run no moe-eplb exporter"),
    ({"env": [{"name": "MOE_EPLB_LIVE_APPLY", "value": "off"}]}, "turns the exporter's live apply off"),
])
def test_which_resources_can_change_live(engine, needle):
    inf = parse(_resource(**engine))
    why = live_capable(inf)
    assert why is None if needle is None else needle in why, why


def _evaluate(target, *, state=AutotuneStatus(), live_problem=None, **kw) -> d.Evaluated:
    args = dict(now=T0, generation=3, current=CUR, spec_eplb=CUR,
                data_window=DataWindow(buckets=20, steps=4000, source="prometheus"),
                answer=d.TunerAnswer(recommendation=target, wants_change=True, reason="test", gain=0.05, breakdown={}),
                baseline=Measurement(balancedness=0.8), from_hash="h", live_problem=live_problem)
    args.update(kw)
    return d.evaluate(AutotuneSpec(mode="Apply", cooldown_s=3600.0), state, **args)


def test_a_window_and_interval_change_is_applied_live_past_the_restart_cooldown():
    state = AutotuneStatus(last_change_time=T0 - 60, restarts=(T0 - 60,))  # a restart a minute ago
    out = _evaluate(LIVE, state=state)
    assert out.decision == d.APPLY and out.live == LIVE and "applying live" in out.reason
    assert out.status.rollout is None and out.status.override is None  # no rollout, no new template
    assert out.status.restarts == state.restarts and out.status.last_change_time == T0 - 60
    assert out.status.last_evaluation.apply_mode == d.LIVE
    assert out.conditions["Tuned"][1] == "ApplyingLive"


def test_restart_where_live_is_not_possible_or_the_redundancy_changes():
    out = _evaluate(LIVE, live_problem="vLLM 0.12.0: live apply ... only")
    assert out.decision == d.APPLY and out.live is None and out.status.rollout is not None
    assert "(restart: vLLM 0.12.0" in out.reason and out.status.last_evaluation.apply_mode == d.RESTART
    out = _evaluate(Knobs(500, 1000, 8))  # redundancy: the weights' layout changes
    assert out.live is None and out.status.rollout is not None and out.status.last_evaluation.apply_mode == d.RESTART
    out = _evaluate(Knobs(500, 1000, 8), state=AutotuneStatus(last_change_time=T0 - 60))
    assert out.decision == d.DEFER and "cooldown" in out.reason


def test_a_live_change_waits_for_a_rollout_or_the_last_live_changes_rearrangement():
    rolling = AutotuneStatus(rollout=Rollout(kind="apply", phase="Rolling", started_at=T0 - 10))
    out = _evaluate(LIVE, state=rolling)
    assert out.decision == d.DEFER and "rollout is in progress" in out.reason and out.live is None
    out = _evaluate(LIVE, live_wait="the live change 30s ago has not rearranged on its interval 1000 yet")
    assert out.decision == d.DEFER and "has not rearranged" in out.reason


def test_record_live_keeps_the_restart_budget_and_round_trips():
    state = AutotuneStatus(last_change_time=T0 - 900, restarts=(T0 - 900,))
    rec = d.record_live(state, now=T0, current=CUR, target=LIVE, config_hash="abc", step=1234,
                        steps={"pod-0": 1234}, reason="why")
    assert rec.live == LiveSettings(500, 1000, "abc", 1234, {"pod-0": 1234}, T0)
    assert [(c.from_knobs, c.to_knobs, c.step) for c in rec.live_changes] == [(CUR, LIVE, 1234)]
    assert rec.restarts == state.restarts and rec.last_change_time == state.last_change_time
    crd = autotune_status_to_crd(rec)
    assert crd["live"]["configHash"] == "abc" and crd["liveChanges"][0]["to"]["stepInterval"] == 1000
    assert parse_autotune_status(crd).live == rec.live


def test_the_live_values_run_over_their_template_only_and_the_pods_mount_them():
    res = _resource()
    template_hash = parse(res).effective.config_hash()
    res["status"] = {"autotune": {"live": {"windowSize": 500, "stepInterval": 1000, "configHash": template_hash,
                                           "step": 77}}}
    inf = parse(res)
    assert inf.running_knobs == Knobs(500, 1000, inf.effective.knobs.num_redundant_experts)
    children = render_children(inf)
    cm = next(c for c in children if c["kind"] == "ConfigMap")
    assert cm["metadata"]["name"] == k8s_names.live_configmap_name(inf.name)
    assert json.loads(cm["data"][k8s_names.LIVE_FILE_KEY]) == {
        lp.FILE_WINDOW: 500, lp.FILE_INTERVAL: 1000, lp.FILE_HASH: template_hash, lp.FILE_STEP: 77}
    pod = next(c for c in children if c["kind"] == "Deployment")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env[k8s_names.CONFIG_HASH_ENV] == template_hash and env[k8s_names.LIVE_FILE_ENV] == k8s_names.LIVE_FILE
    assert {"name": k8s_names.LIVE_VOLUME, "configMap": {"name": cm["metadata"]["name"], "optional": True}} in \
        pod["volumes"]
    # the pod template does not change with the live values (no rollout)
    plain = next(c for c in render_children(parse(_resource())) if c["kind"] == "Deployment")
    assert plain["spec"]["template"] == next(c for c in children if c["kind"] == "Deployment")["spec"]["template"]
    # another template (a change that restarted the pods): the template's values run
    res["status"]["autotune"]["live"]["configHash"] = "another"
    assert parse(res).running_knobs == parse(res).effective.knobs and parse(res).live is None


def _rank(r, *, step=500, counter=40, window=1000, interval=3000, supported=True, last=(460,), rate=50.0, t=T0):
    return lp.RankStatus(ep_rank=r, ep_size=2, pid=100 + r, step=step, counter=counter, window_size=window,
                         step_interval=interval, supported=supported, why="" if supported else "vLLM 0.31",
                         rearranged_at=last, rate=rate, time=t)


def test_an_engine_must_report_every_rank_aligned_on_the_expected_values():
    pods = [LivePod("p", "http://x", "p", 2)]
    assert engine_problem("p", pods, [_rank(0), _rank(1)], CUR) is None
    assert "EP ranks [1] do not report" in engine_problem("p", pods, [_rank(0)], CUR)
    assert "cannot change live: vLLM 0.31" in engine_problem("p", pods, [_rank(0), _rank(1, supported=False)], CUR)
    assert "runs window 900" in engine_problem("p", pods, [_rank(0), _rank(1, window=900)], CUR)
    # a rank already on the target takes the change as a no-op (undoing a partial change)
    assert engine_problem("p", pods, [_rank(0), _rank(1, window=500, interval=1000)], CUR, LIVE) is None
    assert "not aligned" in engine_problem("p", pods, [_rank(0), _rank(1, last=(3,))], CUR)


def test_the_agreed_step_is_ahead_by_the_lead_and_clear_of_rearrangements():
    ranks = [_rank(0), _rank(1)]
    at, grace = plan_step(ranks, LIVE, now=T0 + 1.0, lead_seconds=3.0, grace_seconds=2.0)
    assert grace == 100 and at >= 500 + 150 + 50  # 3 s of lead and the 1 s since the report, at 50 steps/s
    counter_at = 40 + (at - 500)
    assert lp.guard_problem(counter_at, grace, 3000, 1000) is None


def test_shift_watch_fires_on_a_sustained_move_beyond_the_recent_spread():
    w = ShiftWatch(ShiftSettings(sample_seconds=60))
    values = [0.80, 0.81, 0.79, 0.80, 0.82, 0.80, 0.81, 0.79, 0.66, 0.80, 0.80]  # one bad window: no shift
    for i, v in enumerate(values):
        assert w.add(i * 60.0, (i + 1) * 60.0, v) is None
    assert w.add(660.0, 720.0, 0.62) is None  # one window moved
    shift = w.add(720.0, 780.0, 0.60)  # two: a shift, dated from the first moved window
    assert shift is not None and shift.at == 660.0 and shift.before == pytest.approx(0.80, abs=0.01)
    assert w.pending is shift and w.add(780.0, 840.0, 0.60) is None  # pending until the loop evaluates
    w.reset(900.0)
    assert w.pending is None and not w.samples and w.due(950.0) is None and w.due(960.0) == 900.0


def test_shift_watch_reads_each_window_over_two_scrapes_and_never_across_a_change():
    """A 90 s window on a clock sped up 80 times is a wall second, under two 2 s scrapes: each read
    spans at least ``min_read_seconds`` (overlapping the windows before it), but none reaches back
    past the last change, and the first window waits until a whole read fits after it."""
    w = ShiftWatch(ShiftSettings(sample_seconds=90, min_read_seconds=320))
    assert w.due(1000.0) == 910.0 and w.read_window(910.0, 1000.0) == (680.0, 1000.0)  # no change seen yet
    w.reset(1000.0)
    assert w.due(1090.0) is None and w.due(1319.0) is None  # a window's due, but a read would cross the change
    assert w.due(1320.0) == 1000.0 and w.read_window(1000.0, 1320.0) == (1000.0, 1320.0)
    w.add(1000.0, 1320.0, 0.80)
    assert w.due(1409.0) is None and w.due(1410.0) == 1320.0
    assert w.read_window(1320.0, 1410.0) == (1090.0, 1410.0)  # overlaps the window before
    # windows stay 90 s apart; overlapping reads share their load, so the newest windows judged
    # reach from one read to the next disjoint one: 1 + ceil(320 / 90) = 5 (2 without a floor)
    assert w.recent == 5 and ShiftWatch(ShiftSettings(sample_seconds=90)).recent == 2
    t, bal = 1410.0, [0.80, 0.81, 0.80, 0.79, 0.80, 0.81, 0.80]
    for v in bal:
        assert w.add(t - 90.0, t, v) is None
        t += 90.0
    at = t - 90.0
    # a burst moves the reads that hold it (here 3), then passes: not a shift
    for v in (0.70, 0.68, 0.72, 0.80, 0.80):
        assert w.add(t - 90.0, t, v) is None
        t += 90.0
    w.reset(t)
    t += 320.0
    for v in [0.80, 0.81, 0.80, 0.79, 0.80, 0.81, 0.70, 0.64, 0.62, 0.62]:
        assert w.add(t - 90.0, t, v) is None
        t += 90.0
    shift = w.add(t - 90.0, t, 0.62)
    t += 90.0
    # a step: five windows beyond the spread, dated from the first read that reached past it
    assert shift is not None and shift.at == t - 6 * 90.0 and shift.after == pytest.approx(0.64)
    assert at < shift.at
    assert ShiftWatch(ShiftSettings(sample_seconds=90)).read_window(0.0, 90.0) == (0.0, 90.0)  # no floor


def test_shift_watch_measures_the_windows_missed_while_the_loop_was_busy():
    """An evaluation that took 8 minutes of the clock: the windows it held up are measured after it,
    still 90 s apart (the last one up to now), none read across the last change."""
    w = ShiftWatch(ShiftSettings(sample_seconds=90, min_read_seconds=200, max_history=4))
    w.reset(1000.0)
    assert w.due(1250.0) == 1000.0
    assert w.window_ends(1000.0, 1250.0) == [1250.0]  # 1090 and 1180: a read would cross the change
    assert w.window_ends(1250.0, 1300.0) == [1300.0]  # less than a window late: one window
    assert w.window_ends(1250.0, 1730.0) == [1340.0, 1430.0, 1520.0, 1610.0, 1730.0]
    # never more than the history keeps (max_history 4 + the 4 newest judged with 200 s reads)
    assert w.recent == 4 and len(w.window_ends(1250.0, 5000.0)) == 8 and w.window_ends(1250.0, 5000.0)[-1] == 5000.0


def test_an_exploration_of_window_and_interval_is_not_a_restart_trial_where_they_change_live():
    """A trial replica restarted with window and interval only would run the template of the pods it
    is compared with (the live values aside): on engines that change them live, no such trial."""
    explore = d.TunerAnswer(recommendation=CUR, wants_change=False, reason="keep", gain=0.0, breakdown={},
                            explore=Knobs(100, 250, 0), explore_reason="a prior range decides")
    cfg = AutotuneSpec(mode="Apply")
    args = dict(now=T0, generation=3, current=CUR, spec_eplb=CUR, data_window=None, answer=explore, replicas=2)
    assert d.evaluate(cfg, AutotuneStatus(), live_problem=None, **args).decision == d.KEEP
    restart = d.evaluate(cfg, AutotuneStatus(), live_problem="vLLM 0.12.0: ...", **args)
    assert restart.decision == d.EXPERIMENT and restart.status.experiment.trial.knobs == Knobs(100, 250, 0)
    # an exploration of the redundancy is still a trial on one replica
    redundancy = d.TunerAnswer(recommendation=CUR, wants_change=False, reason="keep", gain=0.0, breakdown={},
                               explore=Knobs(1000, 3000, 16), explore_reason="a prior range decides")
    assert d.evaluate(cfg, AutotuneStatus(), live_problem=None, **{**args, "answer": redundancy}).decision == \
        d.EXPERIMENT
