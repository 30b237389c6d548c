"""Pure tests of issue 40's experiment designs (``controller.experiment``, ``controller.interleaved``):
the cross-pod design's pre-period (difference in differences by node) and warm-up, the
undecided-at-maxSeconds rule, the interleaved schedule (block lengths against the slower arm's
interval, alternation, the discarded start of each block) and its state machine driven with an
injected live apply, and what the reconciler renders for each."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from moe_eplb.api.autotune_status import (
    BASELINE,
    INTERLEAVED,
    PROMOTING,
    RESTORING,
    RUNNING,
    STARTING,
    AutotuneStatus,
    DataWindow,
    autotune_status_to_crd,
    parse_autotune_status,
)
from moe_eplb.api.knobs import Knobs
from moe_eplb.api.spec import AutotuneSpec, ExperimentsSpec, parse
from moe_eplb.controller import decisions as d
from moe_eplb.controller import experiment as x
from moe_eplb.controller import interleaved as il
from moe_eplb.eplb.tuning.experiment import DISCARDED, PROMOTED, ArmBucket
from moe_eplb.render.objects import render_children
from tests.example_manifests import seed as seed_fixture

seed = seed_fixture

T0 = 1_800_000_000.0
CUR = Knobs(1000, 3000, 0)
LIVE = Knobs(2000, 1000, 0)  # window and interval only: may run interleaved
TICK = 15.0


def _cfg(**kw) -> AutotuneSpec:
    return AutotuneSpec(mode="Apply", experiments=ExperimentsSpec(**{"min_s": 600, "max_s": 1800, "baseline_s": 600,
                                                                     "warmup_s": 300, **kw}))


def _bucket(step: float, rng, noise=0.01, batch=64.0) -> ArmBucket:
    return ArmBucket(step_seconds=step * math.exp(rng.normal(0, noise)), tokens_per_step=batch)


# --- cross-pod: pre-period, warm-up, difference in differences --------------------------------------


def _cross_pod(cfg, *, trial_speed: float, effect: float, trial_node: str = "node-a", cold: float = 0.0,
               seed_: int = 1, until: float = 6 * 3600):
    """Drive a cross-pod experiment: two replicas on nodes node-a and node-b; node-a's GPUs are
    ``trial_speed`` times as fast (a fixed pod bias); the trial restarts on ``trial_node`` and its
    settings are ``effect`` better; a restarted pod is ``cold`` slower for its first 300 s."""
    rng = np.random.default_rng(seed_)
    st = x.start(AutotuneStatus(), now=T0, current=CUR, target=Knobs(1000, 3000, 8), replicas=2, generation=1,
                 spec_eplb=CUR, from_hash="h", restart_charge=0.0139, predicted_gain=0.05,
                 baseline_s=cfg.experiments.baseline_s)
    speed = {"node-a": trial_speed, "node-b": 1.0}
    t, ready_at = T0, None
    while t < T0 + until:
        t += TICK
        exp = st.experiment
        if exp.phase == BASELINE:
            a, b = _bucket(0.02 / speed["node-a"], rng), _bucket(0.02, rng)
            base = {"node-a": (a, b), "node-b": (b, a)}
            st = x.advance(cfg, st, x.ArmsView(2, 0, 2), now=t, baseline=base).status
            continue
        if exp.phase == STARTING:
            ready = t - (exp.trial_started_at or exp.started_at) >= 120
            st = x.advance(cfg, st, x.ArmsView(2, int(ready), 1, trial_node=trial_node), now=t).status
            ready_at = t if ready else None
            continue
        age = t - ready_at
        slow = 1.0 + (cold if age < 300 else 0.0)
        pair = (_bucket(0.02 * slow / speed.get(trial_node, 1.0) / (1 + effect), rng), _bucket(0.02, rng))
        step = x.advance(cfg, st, x.ArmsView(2, 1, 1, trial_node=trial_node), now=t, bucket=pair)
        st = step.status
        if step.verdict is not None:
            return step, t
    raise AssertionError("no verdict")


def test_the_pre_period_measures_each_node_and_then_the_trial_starts():
    cfg = _cfg()
    rng = np.random.default_rng(0)
    st = x.start(AutotuneStatus(), now=T0, current=CUR, target=Knobs(1000, 3000, 8), replicas=2, generation=1,
                 spec_eplb=CUR, from_hash="h", restart_charge=0.01, predicted_gain=0.05, baseline_s=600)
    assert st.experiment.phase == BASELINE and st.restarts == (T0,)
    t = T0
    while st.experiment.phase == BASELINE:
        t += TICK
        a, b = _bucket(0.02 / 1.03, rng), _bucket(0.02, rng)
        st = x.advance(cfg, st, x.ArmsView(2, 0, 2), now=t, baseline={"node-a": (a, b), "node-b": (b, a)}).status
    assert t == T0 + 600 and st.experiment.phase == STARTING and st.experiment.trial_started_at == t
    base = st.experiment.baseline
    assert len(base["node-a"]["d"]) == 40 and base["node-a"]["k"] == "s" * 40
    assert np.mean(base["node-a"]["d"]) == pytest.approx(math.log(1.03), abs=0.005)
    # the record round-trips through the status
    back = parse_autotune_status(autotune_status_to_crd(st))
    assert back.experiment == st.experiment and not back.notes


def test_did_keeps_a_fast_trial_node_from_passing_for_a_gain():
    """The trial restarts on GPUs 3 % faster than the control's, its settings no better (A/A): with
    the pre-period the node's own speed is subtracted and the trial is not promoted; without it (the
    judge's input before issue 40) the node's speed is read as a 3 % gain and promoted."""
    step, _ = _cross_pod(_cfg(), trial_speed=1.03, effect=0.0)
    assert step.verdict == DISCARDED and step.status.experiment.outcome == "undecided"
    assert abs(step.status.experiment.estimate) < 0.01
    blind, _ = _cross_pod(_cfg(baseline_s=0), trial_speed=1.03, effect=0.0)
    assert blind.verdict == PROMOTED and blind.status.experiment.estimate > 0.02


def test_did_finds_a_gain_on_a_slow_trial_node():
    """A +4 % gain on GPUs 3 % slower: read raw, about +1 % (below the restart charge); with the
    pre-period subtracted, promoted."""
    step, _ = _cross_pod(_cfg(), trial_speed=0.97, effect=0.04)
    assert step.verdict == PROMOTED and step.status.experiment.estimate == pytest.approx(0.04, abs=0.01)
    assert "wins" in step.status.experiment.reason and step.status.experiment.outcome == "wins"


def test_a_trial_on_a_node_the_pre_period_did_not_measure_widens_the_interval():
    known, _ = _cross_pod(_cfg(), trial_speed=1.0, effect=0.04, seed_=3)
    unknown, _ = _cross_pod(_cfg(), trial_speed=1.0, effect=0.04, trial_node="node-z", seed_=3)
    assert known.verdict == PROMOTED
    assert unknown.status.experiment.trial_node == "node-z"
    # no pre-period for node-z: its bias is unknown, the spread of the measured nodes' widens the interval
    est_known, est_unknown = x.judged(known.status.experiment), x.judged(unknown.status.experiment)
    assert est_unknown is not None and est_known is not None


def test_the_warm_up_is_not_counted():
    """A restarted trial 10 % slower for its first 300 s (a cold prefix cache, vLLM's initial
    placement), no better after: with the 300 s warm-up the cold buckets are not among those judged
    and the trial is not called a loss; with no warm-up they are (20 buckets at -10 %)."""
    warm, t = _cross_pod(_cfg(), trial_speed=1.0, effect=0.0, cold=0.10, seed_=5)
    exp = warm.status.experiment
    assert warm.verdict == DISCARDED and exp.outcome == "undecided"
    assert exp.warmup_seconds == 300
    # the judged time starts after the warm-up: ready + 300 s, one bucket a tick from then
    assert exp.elapsed_seconds == pytest.approx(t - exp.ready_at - 300)
    assert len(exp.samples) == round((t - exp.ready_at - 300) / TICK) + 1
    assert abs(np.mean(exp.samples)) < 0.005
    cold, _ = _cross_pod(_cfg(warmup_s=0), trial_speed=1.0, effect=0.0, cold=0.10, seed_=5)
    first = cold.status.experiment.samples[:20]
    assert np.mean(first) == pytest.approx(math.log(1 / 1.1), abs=0.01)


def test_undecided_at_max_seconds_keeps_the_running_settings():
    step, t = _cross_pod(_cfg(), trial_speed=1.0, effect=0.012, seed_=8)
    exp = step.status.experiment
    assert step.verdict == DISCARDED and exp.outcome == "undecided" and "undecided at maxSeconds" in exp.reason
    assert exp.phase == RESTORING and step.status.override is None
    assert exp.elapsed_seconds >= 1800 and exp.looks[-1] == 1.0


# --- interleaved: the schedule ----------------------------------------------------------------------


def test_plan_blocks_follow_the_slower_arm():
    """At 20 steps/s an interval of 3000 steps is 150 s: each block discards the new arm's first
    rearrangement (150 s + a tick, and the longer window's refill where the windows differ: +100 s)
    and counts at least one interval of the slower arm; the replicas split by name into two groups."""
    pods = ["r-3", "r-1", "r-2", "r-0"]
    sched = il.plan(Knobs(1000, 1000, 0), Knobs(1000, 3000, 0), pods=pods, steps_per_second=20.0, tick_s=TICK,
                    max_s=3600)
    assert sched["discardSeconds"] == 165 and sched["blockSeconds"] == 165 + 150
    assert sched["discardSeconds"] >= 3000 / 20 and sched["blockSeconds"] - sched["discardSeconds"] >= 3000 / 20
    assert sched["pairs"] == 3600 // (2 * 315)
    assert sched["groups"] == [["r-0", "r-2"], ["r-1", "r-3"]]
    refill = il.plan(Knobs(3000, 1000, 0), Knobs(1000, 3000, 0), pods=pods, steps_per_second=20.0, tick_s=TICK,
                     max_s=3600)
    assert refill["discardSeconds"] == 165 + 150  # + the 3000-step window's refill
    fast = il.plan(Knobs(1000, 200, 0), Knobs(1000, 100, 0), pods=pods, steps_per_second=20.0, tick_s=TICK, max_s=3600)
    assert fast["blockSeconds"] - fast["discardSeconds"] == il.MIN_MEASURE_TICKS * TICK  # at least 4 ticks counted


@pytest.mark.parametrize(("trial", "pods", "rate", "max_s", "words"), [
    (Knobs(1000, 3000, 8), ["a", "b"], 20.0, 3600, "redundant experts"),
    (LIVE, ["a"], 20.0, 3600, "1 serving replica"),
    (LIVE, ["a", "b"], 0.0, 3600, "step rate is unknown"),
    (Knobs(1000, 20000, 0), ["a", "b"], 20.0, 3600, "block pairs"),
])
def test_plan_says_why_the_design_does_not_fit(trial, pods, rate, max_s, words):
    got = il.plan(trial, CUR, pods=pods, steps_per_second=rate, tick_s=TICK, max_s=max_s)
    assert isinstance(got, str) and words in got


def _interleaved_state(cfg, schedule=None, trial=LIVE):
    sched = schedule or il.plan(trial, CUR, pods=["p0", "p1", "p2", "p3"], steps_per_second=50.0, tick_s=TICK,
                                max_s=cfg.experiments.max_s)
    return x.start(AutotuneStatus(), now=T0, current=CUR, target=trial, replicas=4, generation=1, spec_eplb=CUR,
                   from_hash="h", restart_charge=0.0139, predicted_gain=0.05, schedule=sched)


def test_the_blocks_alternate_and_discard_their_start():
    cfg = _cfg()
    st = _interleaved_state(cfg)
    exp = st.experiment
    assert exp.design == INTERLEAVED and exp.phase == RUNNING and exp.block == -1
    assert exp.restart_charge == 0.0 and st.restarts == ()  # no restart: nothing to charge
    a, b = il.groups(exp)
    view = x.ArmsView(4, 0, 4, engine_pods=a + b)
    first = x.advance(cfg, st, view, now=T0 + TICK)
    assert [(r.pods, r.knobs, r.block) for r in first.live] == [(a, LIVE, 0), (b, CUR, 0)]
    assert not first.changed  # nothing recorded before the apply is confirmed
    started = x.applied(first, [(r, True, "ok") for r in first.live], now=T0 + TICK)
    exp = started.status.experiment
    assert exp.block == 0 and exp.block_started_at == T0 + TICK and exp.ready_at == T0 + TICK
    assert il.arms_now(exp) == (a, b) and il.arms_now(exp, 1) == (b, a)
    assert ("Normal", "ExperimentRunning") == started.events[0][:2]
    discard = exp.schedule["discardSeconds"]
    assert not il.counted(exp, T0 + TICK + discard)  # that bucket began inside the discarded part
    assert il.counted(exp, T0 + 2 * TICK + discard)
    rng = np.random.default_rng(0)
    st, t = started.status, T0 + TICK
    blocks = []
    while t < T0 + TICK + 3 * exp.schedule["blockSeconds"]:
        t += TICK
        step = x.advance(cfg, st, view, now=t, bucket=(_bucket(0.02, rng), _bucket(0.02, rng)))
        if step.live:
            blocks.append((t, step.live[0].block, step.live[0].pods))
            step = x.applied(step, [(r, True, "ok") for r in step.live], now=t)
        st = step.status
    assert [k for _, k, _ in blocks] == [1, 2, 3]
    assert [p for _, _, p in blocks] == [b, a, b]  # the trial's group alternates
    assert blocks[0][0] == T0 + TICK + exp.schedule["blockSeconds"]
    # each finished block kept one value, from its counted buckets only
    assert len(st.experiment.block_values) == 3


def _drive_interleaved(cfg, *, group_a_speed: float, effect: float, seed_: int = 2, fail_at: int | None = None):
    """Four replicas in two groups; group A's GPUs ``group_a_speed`` times as fast; the trial's
    settings ``effect`` better; the live apply of block ``fail_at`` fails."""
    rng = np.random.default_rng(seed_)
    st = _interleaved_state(cfg)
    a, b = il.groups(st.experiment)
    view = x.ArmsView(4, 0, 4, engine_pods=a + b)
    t, applied = T0, []
    while t < T0 + 6 * 3600:
        t += TICK
        exp = st.experiment
        trial, _ = il.arms_now(exp)
        pair = None
        if trial:
            fast = trial == a
            ts = 0.02 / (group_a_speed if fast else 1.0) / (1 + effect)
            cs = 0.02 / (1.0 if fast else group_a_speed)
            pair = (_bucket(ts, rng), _bucket(cs, rng))
        step = x.advance(cfg, st, view, now=t, bucket=pair)
        if step.live:
            results = [(r, not (fail_at is not None and r.block == fail_at), "rank 3 did not answer") for r in step.live]
            applied.append(step.live)
            step = x.applied(step, results, now=t)
        st = step.status
        if step.verdict is not None or (st.experiment is None and st.experiments):
            return step, applied
    raise AssertionError("no verdict")


def test_a_fast_group_does_not_pass_for_a_gain():
    """Group A is 5 % faster by itself, the settings the same (A/A): every block reads +-5 %, the
    pairs cancel it, nothing is promoted."""
    step, _ = _drive_interleaved(_cfg(), group_a_speed=1.05, effect=0.0)
    exp = step.status.experiment
    assert step.verdict == DISCARDED and exp.outcome == "undecided"
    assert max(abs(v) for v in exp.block_values) > 0.04 and abs(exp.estimate) < 0.01
    # every look was kept (the rule spends its error over all of them), the last at all the information
    assert len(exp.looks) >= 2 and list(exp.looks) == sorted(exp.looks) and exp.looks[-1] == 1.0


def test_a_gain_is_promoted_live_to_every_replica():
    cfg = _cfg()
    step, applied = _drive_interleaved(cfg, group_a_speed=1.05, effect=0.03)
    st = step.status
    assert step.verdict == PROMOTED and st.experiment.phase == PROMOTING
    assert st.override.resolve(CUR) == LIVE and st.restarts == ()  # no restart counted
    assert st.experiment.estimate == pytest.approx(0.03, abs=0.01)
    # the promotion is applied live to every replica; confirmed, the experiment ends
    everyone = il.groups(st.experiment)[0] + il.groups(st.experiment)[1]
    promote = x.advance(cfg, st, x.ArmsView(4, 0, 4, engine_pods=everyone), now=T0 + 9000)
    assert [(set(r.pods), r.knobs) for r in promote.live] == [(set(everyone), LIVE)]
    retry = x.applied(promote, [(promote.live[0], False, "timeout")], now=T0 + 9000)
    assert retry.status.experiment.phase == PROMOTING and "retrying" in retry.conditions["Tuned"][2]
    done = x.applied(promote, [(promote.live[0], True, "ok")], now=T0 + 9000)
    assert done.status.experiment is None and done.status.experiments[-1].verdict == PROMOTED
    assert done.status.history[-1].action == "Kept"


def test_a_failed_live_apply_ends_it_with_the_running_settings():
    step, _ = _drive_interleaved(_cfg(), group_a_speed=1.0, effect=0.03, fail_at=2)
    exp = step.status.experiment
    assert step.verdict == DISCARDED and exp.phase == RESTORING and "rank 3 did not answer" in exp.reason
    assert ("Warning", "LiveApplyFailed") == step.events[-1][:2]
    back = x.advance(_cfg(), step.status, x.ArmsView(4, 0, 4, engine_pods=il.groups(exp)[0] + il.groups(exp)[1]),
                     now=T0 + 9000)
    assert [r.knobs for r in back.live] == [CUR]


def test_a_replaced_replica_ends_an_interleaved_experiment():
    cfg = _cfg()
    st = _interleaved_state(cfg)
    a, b = il.groups(st.experiment)
    step = x.advance(cfg, st, x.ArmsView(4, 0, 4, engine_pods=a + b[:1] + ("p9",)), now=T0 + TICK)
    assert step.verdict == DISCARDED and "replicas changed" in step.status.experiment.reason
    assert "p9" in step.status.experiment.reason


# --- the decision and the rendering -------------------------------------------------------------------


def _answer(target):
    return d.TunerAnswer(recommendation=target, wants_change=True, reason="t", gain=0.05, breakdown={},
                         restart_charge=0.0139)


def test_the_decision_runs_live_settings_interleaved():
    cfg = _cfg()
    plans = []

    def planner(target, current):
        plans.append((target, current))
        return il.plan(target, current, pods=["p0", "p1"], steps_per_second=20.0, tick_s=TICK, max_s=3600)

    out = d.evaluate(cfg, AutotuneStatus(), now=T0, generation=1, current=CUR, spec_eplb=CUR,
                     data_window=DataWindow(buckets=20, steps=4000, source="pods"), answer=_answer(LIVE),
                     from_hash="h", replicas=2, interleave=planner)
    assert plans == [(LIVE, CUR)]
    assert out.decision == d.EXPERIMENT and out.status.experiment.design == INTERLEAVED
    assert "in turns on the same 2 replicas" in out.reason and out.status.restarts == ()
    redundancy = d.evaluate(cfg, AutotuneStatus(), now=T0, generation=1, current=CUR, spec_eplb=CUR,
                            data_window=DataWindow(buckets=20, steps=4000, source="pods"),
                            answer=_answer(Knobs(1000, 3000, 8)), from_hash="h", replicas=2, interleave=planner)
    assert redundancy.status.experiment.design == "cross-pod" and "redundant experts" in redundancy.reason


@pytest.mark.parametrize("kind", ["baseline", "interleaved"])
def test_a_pre_period_or_an_interleaved_experiment_renders_the_workload_as_it_is(seed, kind):
    res = dict(seed)
    res["spec"] = {**res["spec"], "replicas": 3}
    inf = parse(res)
    plain = render_children(inf)
    cur = inf.effective.knobs
    if kind == "baseline":
        st = x.start(inf.status, now=T0, current=cur, target=dataclasses.replace(cur, num_redundant_experts=cur.num_redundant_experts + 4),
                     replicas=3, generation=1, spec_eplb=cur, from_hash="h", restart_charge=0.01, predicted_gain=0.05,
                     baseline_s=600)
    else:
        target = dataclasses.replace(cur, step_interval=cur.step_interval * 2)
        sched = il.plan(target, cur, pods=["a", "b", "c"], steps_per_second=50.0, tick_s=TICK, max_s=3600)
        st = x.start(inf.status, now=T0, current=cur, target=target, replicas=3, generation=1, spec_eplb=cur,
                     from_hash="h", restart_charge=0.0, predicted_gain=0.05, schedule=sched)
    got = render_children(dataclasses.replace(inf, status=st))
    assert got == plain


# --- the loop's seams ----------------------------------------------------------------------------------


def _pod(name, *, group=None, worker="0", node=None, ready=True):
    labels = {}
    if group is not None:
        labels = {"leaderworkerset.sigs.k8s.io/group-key": group, "leaderworkerset.sigs.k8s.io/worker-index": worker}
    return {"metadata": {"name": name, "labels": labels}, "spec": {"nodeName": node} if node else {},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_a_groups_settings_go_to_all_of_its_pods_and_nodes_are_read():
    from moe_eplb.controller.autotune import _group_pods, _node_of

    pods = [_pod("g-0", group="k0", node="n1"), _pod("g-0-1", group="k0", worker="1"), _pod("g-1", group="k1"),
            _pod("g-1-1", group="k1", worker="1"), _pod("d-a", node="n7")]
    assert [p["metadata"]["name"] for p in _group_pods(pods, ("g-0", "d-a"))] == ["g-0", "g-0-1", "d-a"]
    assert _node_of(pods, "g-0") == "n1" and _node_of(pods, "g-1") is None and _node_of(pods, "nope") is None


def test_without_live_apply_every_experiment_is_cross_pod(monkeypatch):
    """Where ``live_capable`` refuses the resource the planner says why (and the decision runs the
    experiment cross-pod); where it accepts it, it plans interleaved blocks on the ready engine pods
    at the step rate the evaluation read."""
    from types import SimpleNamespace

    from moe_eplb.controller import autotune as at
    from moe_eplb.controller.autotune_settings import AutotuneSettings

    inf = SimpleNamespace(autotune=_cfg(max_s=3600))
    got = SimpleNamespace(data_window=DataWindow(start=T0, end=T0 + 1800, buckets=30, steps=36_000),
                          pods=(_pod("a"), _pod("b"), _pod("c", ready=False)))
    loop = SimpleNamespace(settings=AutotuneSettings())
    monkeypatch.setattr(at.live, "live_capable", lambda _inf: None)
    sched = at.AutotuneLoop._interleave_planner(loop, inf, got)(LIVE, CUR)
    assert sched["groups"] == [["a"], ["b"]] and sched["stepsPerSecond"] == 20.0
    monkeypatch.setattr(at.live, "live_capable", lambda _inf: "vLLM 0.10 cannot")
    assert at.AutotuneLoop._interleave_planner(loop, inf, got)(LIVE, CUR) == "vLLM 0.10 cannot"
