"""Pure unit tests of experiments: the decision ``Experiment`` (a change, or the tuner's exploration,
on one of two or more replicas), the experiment state machine (``controller.experiment``), the
record's round trip through ``status.autotune``, and the arms' workloads (``render.experiment``)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from moe_eplb.api.autotune_status import (
    BASELINE,
    CROSS_POD,
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
from moe_eplb.eplb.tuning.experiment import DISCARDED, PROMOTED, ArmBucket
from moe_eplb.eplb.tuning.exploration import Exploration
from moe_eplb.render.objects import render_children
from tests.example_manifests import seed as seed_fixture

seed = seed_fixture  # the seed resource (a pytest fixture)

T0 = 1_800_000_000.0
CUR = Knobs(1000, 3000, 0)
NEW = Knobs(3000, 1000, 8)


def _cfg(**kw) -> AutotuneSpec:
    return AutotuneSpec(mode="Apply", experiments=ExperimentsSpec(**{"min_s": 300, "max_s": 1200, **kw}))


def _answer(**kw) -> d.TunerAnswer:
    args = dict(recommendation=NEW, wants_change=True, reason="test", gain=0.05, breakdown={}, restart_charge=0.01)
    args.update(kw)
    return d.TunerAnswer(**args)


def _evaluate(cfg, replicas=2, answer=None, state=AutotuneStatus()):
    return d.evaluate(cfg, state, now=T0, generation=3, current=CUR, spec_eplb=CUR,
                      data_window=DataWindow(buckets=20, steps=4000, source="pods"), answer=answer or _answer(),
                      from_hash="h-old", replicas=replicas)


def test_a_change_with_two_replicas_starts_an_experiment():
    """A change of redundancy (or any change where the engines cannot take it live) is a cross-pod
    experiment, starting with its pre-period on the running settings (no pod restarts yet)."""
    out = _evaluate(_cfg())
    assert out.decision == d.EXPERIMENT and out.started_rollout
    exp = out.status.experiment
    assert exp.phase == BASELINE and exp.design == CROSS_POD and exp.trial.knobs == NEW and exp.control.knobs == CUR
    assert "cross-pod: the engines do not take settings live" in out.reason and "1800s pre-period" in out.reason
    assert _evaluate(_cfg(baseline_s=0)).status.experiment.phase == STARTING
    assert (exp.trial.replicas, exp.control.replicas) == (1, 1) and exp.restart_charge == 0.01
    assert out.status.override is None and out.status.rollout is None  # the control keeps running
    assert out.status.restarts == (T0,)
    assert ("Normal", "ExperimentStarted") == out.events[0][:2]


def test_one_replica_or_disabled_applies_to_all():
    assert _evaluate(_cfg(), replicas=1).decision == d.APPLY
    assert _evaluate(_cfg(enabled=False), replicas=3).decision == d.APPLY


def test_explore_starts_an_experiment_where_the_point_estimate_would_keep():
    """The call site of TuneResult.explore: the tuner keeps, but makes a case for a trial."""
    ex = Exploration(candidate=Knobs(1000, 3000, 16), parameter="moe_time_share", regret_at_stake=0.08,
                     trial_cost=0.01, reason="moe_time_share decides; its range is a prior")
    answer = _answer(recommendation=CUR, wants_change=False, gain=0.0, explore=ex.candidate,
                     explore_reason=ex.reason)
    out = _evaluate(_cfg(), answer=answer)
    assert out.decision == d.EXPERIMENT and out.status.experiment.trial.knobs == ex.candidate
    assert out.status.experiment.explore == ex.reason
    assert _evaluate(_cfg(), answer=answer, replicas=1).decision == d.KEEP  # no trial on a lone replica


def test_tuner_answer_carries_explore_and_the_restart_charge(monkeypatch):
    from moe_eplb.eplb.tuning.tuner import TuneResult

    ex = Exploration(candidate=NEW, parameter="moe_time_share", regret_at_stake=0.05, trial_cost=0.01, reason="r")
    cost = type("C", (), {"restart_s": 36.0, "horizon_s": 3600.0})()
    chosen = type("Cand", (), {"result": type("R", (), {"throughput": type("T", (), {"to_dict": lambda s: {}})()})()})()
    result = TuneResult.__new__(TuneResult)
    for k, v in dict(recommendation=CUR, decision="keep", reason="k", chosen=chosen, cost=cost, explore=ex,
                     current=None, defaults=None, no_eplb_segments=np.zeros(1)).items():
        object.__setattr__(result, k, v)
    monkeypatch.setattr(TuneResult, "headline_gain", lambda self: (0.0, "current"))
    ans = d.TunerAnswer.of(result)
    assert ans.explore == NEW and ans.explore_reason == "r" and ans.restart_charge == pytest.approx(0.01)


def _running(state=None, **exp_changes):
    st = state or _evaluate(_cfg()).status
    exp = dataclasses.replace(st.experiment, phase=RUNNING, ready_at=T0 + 60, **exp_changes)
    return st.replace(experiment=exp)


def _pair(gain, rng):
    c = 0.02 * math.exp(rng.normal(0, 0.01))
    return (ArmBucket(step_seconds=c / (1 + gain), tokens_per_step=64),
            ArmBucket(step_seconds=c * math.exp(rng.normal(0, 0.01)), tokens_per_step=64))


def _run(cfg, st, gain, *, seconds=30.0, until=2000.0):
    rng = np.random.default_rng(1)
    view = x.ArmsView(replicas=2, trial_ready=1, control_ready=1)
    t = T0 + 60
    while t < T0 + until:
        t += seconds
        step = x.advance(cfg, st, view, now=t, bucket=_pair(gain, rng), observations={"trial": {}, "control": {}})
        st = step.status
        if step.verdict is not None:
            return step, t
    raise AssertionError("no verdict")


def test_starting_becomes_running_when_the_trial_is_ready():
    cfg = _cfg(baseline_s=0)
    st = _evaluate(cfg).status
    assert not x.advance(cfg, st, x.ArmsView(2, 0, 1, settled=False), now=T0 + 30).changed
    step = x.advance(cfg, st, x.ArmsView(2, 1, 1), now=T0 + 60)
    assert step.status.experiment.phase == RUNNING and step.status.experiment.ready_at == T0 + 60


def test_a_winning_trial_is_promoted_after_min_seconds():
    cfg = _cfg()
    step, t = _run(cfg, _running(), 0.05)
    assert step.verdict == PROMOTED and t - (T0 + 60) >= 300
    st = step.status
    assert st.experiment.phase == PROMOTING and st.override.resolve(CUR) == NEW
    assert st.experiment.ci_low > 0.01 and st.experiment.estimate == pytest.approx(0.05, abs=0.01)
    assert st.experiment.observations == {"trial": {}, "control": {}}
    assert len(st.restarts) == 2  # the trial's start and the promotion
    # promoting ends when every replica runs the trial's settings
    assert not x.advance(cfg, st, x.ArmsView(2, 1, 1), now=t + 10).changed
    done = x.advance(cfg, st, x.ArmsView(2, 2, 0), now=t + 60).status
    assert done.experiment is None and done.experiments[-1].verdict == PROMOTED
    assert done.experiments[-1].samples == ()  # the per-bucket samples are not kept in the history


def test_a_losing_trial_is_discarded_and_restored():
    cfg = _cfg()
    step, _ = _run(cfg, _running(), -0.05)
    assert step.verdict == DISCARDED and step.status.experiment.phase == RESTORING
    assert step.status.experiment.ci_high < 0 and step.status.override is None
    done = x.advance(cfg, step.status, x.ArmsView(2, 0, 2), now=T0 + 5000).status
    assert done.experiments[-1].verdict == DISCARDED and done.experiment is None


def test_no_difference_decides_at_max_seconds_on_the_estimate():
    step, t = _run(_cfg(), _running(), 0.0)
    assert step.verdict == DISCARDED and t >= T0 + 60 + 1200
    assert "maxSeconds" in step.status.experiment.reason


@pytest.mark.parametrize(("view", "words"), [
    (x.ArmsView(replicas=1, trial_ready=1, control_ready=1), "scale-in"),
    (x.ArmsView(replicas=2, trial_ready=0, control_ready=1, trial_crashlooping=("tiny-trial-x",)), "crash-loops"),
])
def test_early_ends_discard_with_the_reason(view, words):
    for st in (_evaluate(_cfg()).status, _running()):
        step = x.advance(_cfg(), st, view, now=T0 + 100)
        assert step.verdict == DISCARDED and words in step.status.experiment.reason
        assert step.status.experiment.phase == RESTORING and step.status.override is None


def test_a_user_edit_ends_the_experiment_at_once():
    step = x.advance(_cfg(), _running(), x.ArmsView(2, 1, 1, superseded="spec.eplb changed"), now=T0 + 100)
    assert step.status.experiment is None and "spec.eplb changed" in step.status.experiments[-1].reason


def test_the_record_round_trips_through_the_status():
    step, _ = _run(_cfg(), _running(), 0.05)
    crd = autotune_status_to_crd(step.status)
    assert crd["experiment"]["trial"]["knobs"] == {"windowSize": 3000, "stepInterval": 1000, "numRedundantExperts": 8}
    assert crd["experiment"]["verdict"] == "promoted" and "ciLow" in crd["experiment"]
    back = parse_autotune_status(crd)
    assert back.experiment == step.status.experiment and not back.notes


def test_learned_ranges_narrow_the_calibration_the_experiment_started_from():
    """An ended experiment's arms narrow the MoE share (eplb.tuning.learn.learn), and the status keeps it; no
    calibration (an operator restarted since) or a missing arm teaches nothing."""
    from moe_eplb.api.autotune_status import AutotuneStatus
    from moe_eplb.controller.autotune import learned_entries
    from moe_eplb.eplb.replay.costmodel import CostModel
    from moe_eplb.eplb.tuning.calibrate import Calibration
    from moe_eplb.eplb.tuning.exploration import ArmObservation
    from moe_eplb.eplb.tuning.robust import Range

    cal = Calibration(parameters={}, ranges={"moe_time_share": Range("moe_time_share", 0.35, 0.03, 0.6, "prior")})

    def arm(knobs, pods, bal, f=0.4, s0=0.05):  # step time of a MoE share f at served balancedness bal
        return ArmObservation(knobs, pods, 1800.0, step_seconds=s0 * ((1 - f) + f / bal), tokens_per_step=4096.0,
                              balancedness=bal)

    trial, control = arm(Knobs(100, 1000, 32), 1, 0.95), arm(Knobs(1000, 3000, 0), 1, 0.75)
    got = x.learned_ranges(cal, CostModel(), trial, control, source="experiment of 100/1000/32")
    assert [r.parameter for r in got] == ["moe_time_share"]
    assert got[0].low < 0.4 < got[0].high and got[0].high - got[0].low < 0.8 * (0.6 - 0.03)
    kept = AutotuneStatus().with_learned(learned_entries(got))
    assert [(e.parameter, e.low, e.high, e.source) for e in kept.learned] == [
        ("moe_time_share", got[0].low, got[0].high, "experiment of 100/1000/32")]
    assert x.learned_ranges(None, CostModel(), trial, control, source="x") == []
    assert x.learned_ranges(cal, CostModel(), trial, None, source="x") == []


# --- the arms' workloads ----------------------------------------------------------------------------


def _inf(seed_resource, phase, *, nodes=1, replicas=3, surge=0):
    res = dict(seed_resource)
    spec = res["spec"] = dict(res["spec"])
    spec["replicas"] = replicas
    spec["rollout"] = {"maxSurge": surge, "maxUnavailable": 1 - surge if surge else 1}
    if nodes > 1:
        spec["parallelism"] = {**spec["parallelism"], "nodes": nodes, "data": spec["parallelism"].get("data", 1) * nodes}
    inf = parse(res)
    cur = inf.effective.knobs
    st = x.start(inf.status, now=T0, current=cur, target=Knobs(cur.window_size, cur.step_interval,
                                                                cur.num_redundant_experts + 4),
                 replicas=replicas, generation=1, spec_eplb=cur, from_hash="h", restart_charge=0.01,
                 predicted_gain=0.05)
    st = st.replace(experiment=dataclasses.replace(st.experiment, phase=phase))
    return dataclasses.replace(inf, status=st)


def _workloads(children, kind):
    return {c["metadata"]["name"]: c for c in children if c["kind"] == kind}


@pytest.mark.parametrize(("phase", "surge", "main", "trial"), [
    (STARTING, 0, 2, 1), (STARTING, 1, 3, 1), (RUNNING, 0, 2, 1), (PROMOTING, 0, 2, 1),
    (RESTORING, 0, 3, None), (RESTORING, 1, 3, 1),
])
def test_deployment_arms(seed, phase, surge, main, trial):
    inf = _inf(seed, phase, surge=surge)
    deps = _workloads(render_children(inf), "Deployment")
    name = inf.name
    assert deps[name]["spec"]["replicas"] == main
    h = lambda dep: dep["spec"]["template"]["metadata"]["annotations"]["eplb.ai/eplb-config-hash"]  # noqa: E731
    if trial is None:
        assert set(deps) == {name}
        return
    t = deps[f"{name}-trial"]
    assert t["spec"]["replicas"] == trial
    assert t["spec"]["selector"]["matchLabels"]["eplb.ai/arm"] == "trial"
    assert t["spec"]["template"]["metadata"]["labels"]["eplb.ai/arm"] == "trial"
    assert "eplb.ai/arm" not in deps[name]["spec"]["template"]["metadata"]["labels"]  # the control is not rolled
    assert h(t) != h(deps[name]) or phase == PROMOTING
    # the Service selects both arms: same traffic
    svc = next(c for c in render_children(inf) if c["kind"] == "Service")
    assert set(svc["spec"]["selector"].items()) <= set(t["spec"]["template"]["metadata"]["labels"].items())


@pytest.mark.parametrize(("phase", "partition"), [(STARTING, 2), (RUNNING, 2), (PROMOTING, 0), (RESTORING, 0)])
def test_lws_arms_use_the_partition(seed, phase, partition):
    inf = _inf(seed, phase, nodes=2)
    (lws,) = _workloads(render_children(inf), "LeaderWorkerSet").values()
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]["partition"] == partition
    assert lws["spec"]["replicas"] == 3
    h = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["annotations"]["eplb.ai/eplb-config-hash"]
    no_exp = dataclasses.replace(inf, status=inf.status.replace(experiment=None))
    (plain,) = _workloads(render_children(no_exp), "LeaderWorkerSet").values()
    base = plain["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["annotations"]["eplb.ai/eplb-config-hash"]
    assert (h == base) == (phase == RESTORING)
    assert plain["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]["partition"] == 0


# --- one replica: the objective across time judges a change applied to all ------------------------


def _observing(before_buckets):
    from moe_eplb.api.autotune_status import OBSERVING, Measurement, Rollout
    from moe_eplb.eplb.tuning.experiment import buckets_record

    ro = Rollout(kind="apply", phase=OBSERVING, started_at=T0, ready_at=T0 + 60, from_knobs=CUR, to_knobs=NEW,
                 from_hash="h-old", to_hash="h-new", baseline=Measurement(balancedness=0.8),
                 objective_before=buckets_record(before_buckets))
    return AutotuneStatus(rollout=ro)


@pytest.mark.parametrize(("est", "low", "high", "action"), [
    (0.03, 0.01, 0.05, "Kept"), (-0.01, -0.015, 0.01, "Kept"), (-0.08, -0.12, -0.04, "RolledBack")])
def test_the_rollout_is_judged_on_the_objective_not_balancedness(est, low, high, action):
    from moe_eplb.api.autotune_status import ROLLING_BACK, Measurement
    from moe_eplb.controller import rollout as r

    cfg = AutotuneSpec(mode="Apply", observe_s=300, rollback_tolerance=0.02)
    view = r.WorkloadView(generation=1, settled=True, template_hash="h-new", spec_eplb=CUR)
    # balancedness rose, but the objective decides (and the reverse)
    m = Measurement(balancedness=0.9, objective="step_time", estimate=est, ci_low=low, ci_high=high)
    step = r.advance(cfg, _observing([ArmBucket(0.02, 64)] * 3), view, now=T0 + 400, measured=m)
    if action == "Kept":
        assert step.status.rollout is None and step.status.history[-1].action == "Kept"
        assert "on step_time" in step.status.history[-1].reason and "balancedness 0.900" in step.status.history[-1].reason
    else:
        assert step.status.rollout.phase == ROLLING_BACK and step.rollback_reason == "regression"


def test_buckets_of_a_trace_and_their_record():
    from moe_eplb.eplb.tuning import experiment as ex
    from moe_eplb.eplb.workload.trace import LoadTrace, Telemetry

    load = np.ones((4, 2, 8)) * 100.0  # 800 token-slots per layer per bucket, top-2: 400 tokens
    tel = Telemetry(step_seconds=np.array([0.02, np.nan, 0.025, 0.02]), requests_waiting=np.array([0, 0, 3, 0.0]),
                    kv_cache_usage=np.array([0.5, 0.5, 0.5, 0.97]))
    trace = LoadTrace(load=load, bucket_steps=np.array([10, 0, 10, 10]), bucket_seconds=60.0, top_k=2, telemetry=tel)
    got = ex.buckets_of_trace(trace, gpus_per_engine=4)
    assert len(got) == 3  # the bucket without steps is left out
    assert got[0].tokens_per_step == pytest.approx(40.0) and got[0].step_seconds == pytest.approx(0.02)
    assert got[0].tokens_per_second_per_gpu == pytest.approx(40 / 0.02 / 4)
    assert [b.saturated for b in got] == [False, True, True]
    assert ex.buckets_from_record(ex.buckets_record(got)) == got
    assert ex.buckets_from_record({"stepSeconds": [1]}) == []


@pytest.mark.parametrize(("est", "action"), [(-0.12, "RolledBack"), (-0.01, "Kept")])
def test_an_inconclusive_interval_observes_on_then_the_estimate_decides(est, action):
    """An interval across -rollbackTolerance (here [-30%, +10%]) decides nothing while the window can
    still grow; at 2 x observeSeconds + 60 s the estimate decides, the interval stated."""
    from moe_eplb.api.autotune_status import OBSERVING, ROLLING_BACK, Measurement
    from moe_eplb.controller import rollout as r

    cfg = AutotuneSpec(mode="Apply", observe_s=300, rollback_tolerance=0.02)
    assert r.judge_limit_s(cfg) == 660
    view = r.WorkloadView(generation=1, settled=True, template_hash="h-new", spec_eplb=CUR)
    m = Measurement(balancedness=0.4, objective="step_time", estimate=est, ci_low=-0.30, ci_high=0.10)
    state = _observing([ArmBucket(0.02, 64)] * 3)
    ready = state.rollout.ready_at
    early = r.advance(cfg, state, view, now=ready + 400, measured=m)
    assert early.status.rollout.phase == OBSERVING and not early.status.history
    assert early.needs_measurement == (ready, ready + 400)  # the next tick measures a longer window
    late = r.advance(cfg, state, view, now=ready + 660, measured=m)
    if action == "Kept":
        entry = late.status.history[-1]
        assert late.status.rollout is None and entry.action == "Kept"
        assert "inconclusive after 660s: decided on the estimate" in entry.reason and "-1.00%" in entry.reason
    else:
        assert late.status.rollout.phase == ROLLING_BACK and late.rollback_reason == "regression"
        assert "inconclusive after 660s" in late.status.rollout.reason and "-12.00%" in late.status.rollout.reason
    # a conclusive interval decides at once, before the limit
    sure = Measurement(balancedness=0.4, objective="step_time", estimate=est, ci_low=est - 0.005, ci_high=est + 0.005)
    now = r.advance(cfg, state, view, now=ready + 400, measured=sure)
    assert (now.status.rollout is None) == (action == "Kept")
    # ... from enough degrees of freedom: the same narrow interval from a fit with 2 left waits
    assert r.advance(cfg, state, view, now=ready + 400,
                     measured=dataclasses.replace(sure, dof=r.JUDGE_MIN_DOF)).status.rollout != state.rollout
    few = r.advance(cfg, state, view, now=ready + 400, measured=dataclasses.replace(sure, dof=2))
    assert few.status.rollout.phase == OBSERVING and not few.status.history
    late = r.advance(cfg, state, view, now=ready + 660, measured=dataclasses.replace(sure, dof=2))
    reason = late.status.history[-1].reason if action == "Kept" else late.status.rollout.reason
    assert "inconclusive after 660s (2 degrees of freedom): decided on the estimate" in reason


def test_the_control_sides_own_buckets_give_the_batch_elasticity():
    """A cross-pod experiment keeps the control side's step time, batch and served balancedness --
    the trial node's pre-period "others" and the control arm since: the same pods on the same
    settings -- and the judge's batch adjustment takes its elasticity from their step-time model
    (the truth here: 8e-6 * 1800 / (0.012 + 8e-6 * 1800) = 0.545); none without balancedness, and
    an interleaved experiment keeps none (its arms swap replicas)."""
    rng = np.random.default_rng(3)
    tok = 1800.0 + 800.0 * np.sin(np.linspace(0.0, 6.0, 200))
    imbalance = 1.35 - 0.12 * (tok - 1000.0) / 1600.0
    step = (0.012 + 8e-6 * tok) * (0.65 + 0.35 * imbalance) * np.exp(rng.normal(0.0, 0.02, 200))
    buckets = [ArmBucket(step_seconds=float(s), tokens_per_step=float(t), balancedness=float(1 / i))
               for s, t, i in zip(step, tok, imbalance)]
    exp = _running().experiment
    pre = {"d": [0.0] * 80, "x": [0.0] * 80, "k": "s" * 80}
    for b in buckets[:80]:
        pre = {**pre, **x._with_levels({k: pre.get(k, []) for k in "stb"}, b, x.BASELINE_LIMIT)}
    exp = dataclasses.replace(exp, design="cross-pod", baseline={"node-a": pre}, trial_node="node-a")
    for b in buckets[80:]:
        exp = x.with_bucket(exp, (ArmBucket(step_seconds=0.02, tokens_per_step=64), b), counted=True)
    assert len(exp.control_levels["s"]) == 120 and exp.control_levels["t"][0] == pytest.approx(tok[80], abs=1e-3)
    assert x.control_elasticity(exp) == pytest.approx(8e-6 * 1800 / (0.012 + 8e-6 * 1800), abs=0.03)
    blind = dataclasses.replace(exp, control_levels={"s": exp.control_levels["s"], "t": exp.control_levels["t"],
                                                     "b": [0.0] * 120}, baseline=None)
    assert x.control_elasticity(blind) is None
    inter = x.with_bucket(dataclasses.replace(exp, design="interleaved", control_levels=None),
                          (buckets[0], buckets[1]), counted=True)
    assert inter.control_levels is None
