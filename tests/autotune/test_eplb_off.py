"""EPLB off as the tuner's pick, in the operator: ``spec.autotune.allowDisable`` (CRD, parse), the override
that turns EPLB off and the precedence that runs it, the decision (Apply only when allowed, otherwise a
recommendation in status and an Event), the rollout that turns it off and its history, and the
evaluation while it runs off. Pure: typed records in, typed records out."""

from __future__ import annotations

import copy

import pytest
import yaml

from moe_eplb.api.autotune_status import (
    AutotuneStatus,
    DataWindow,
    Measurement,
    Override,
    autotune_status_to_crd,
    parse_autotune_status,
)
from moe_eplb.api.knobs import VLLM_DEFAULTS, Knobs
from moe_eplb.api.spec import AutotuneSpec, parse
from moe_eplb.controller import decisions as d
from moe_eplb.controller import rollout as r
from moe_eplb.eplb.replay.costmodel import CostModel
from moe_eplb.eplb.tuning.options import TuneOptions
from moe_eplb.eplb.tuning.overlap import OverlapContext
from moe_eplb.eplb.tuning.tuner import tune
from moe_eplb.eplb.workload import synth
from moe_eplb.render.objects import render_children
from tests.example_manifests import EXAMPLES

T0 = 1_800_000_000.0
CUR = SPEC = Knobs(1000, 3000, 0)


def _off_answer(on_change: bool = False) -> d.TunerAnswer:
    return d.TunerAnswer(recommendation=Knobs(1000, 10000, 0) if on_change else CUR, wants_change=on_change,
                         reason="the best EPLB-on setting's verdict", gain=0.03 if on_change else 0.0, breakdown={},
                         disable=True, disable_reason="EPLB off: beats the best EPLB-on setting", disable_gain=0.045,
                         advice={"enabled": False, "mode": "off", "offVsOn": 0.04, "whatWouldChange": ["x"]})


def _evaluate(cfg: AutotuneSpec, state: AutotuneStatus = AutotuneStatus(), **kw) -> d.Evaluated:
    args = dict(now=T0, generation=3, current=CUR, spec_eplb=SPEC, answer=_off_answer(),
                data_window=DataWindow(buckets=20, steps=4000, source="prometheus"),
                baseline=Measurement(balancedness=0.9), from_hash="h-on")
    args.update(kw)
    return d.evaluate(cfg, state, **args)


def test_apply_turns_eplb_off_only_where_allowed():
    out = _evaluate(AutotuneSpec(mode="Apply", allow_disable=True))
    assert out.decision == d.APPLY and out.started_rollout and out.predicted_gain == 0.045
    st = out.status
    assert st.override == Override.disabled(spec_generation=3, spec_eplb=SPEC) and st.override.enabled is False
    assert st.rollout.to_enabled is False and st.rollout.from_knobs == CUR and st.restarts == (T0,)
    assert st.recommendation.enabled is False
    assert out.events == [("Normal", "ApplyingTunedSettings", out.reason)] and out.reason.startswith("turning EPLB off")
    ev = st.last_evaluation
    assert ev.tuner_decision == "disable" and ev.eplb_advice["mode"] == "off"
    crd = autotune_status_to_crd(st)
    assert crd["override"]["enabled"] is False and "windowSize" not in crd["override"]
    assert crd["rollout"]["toEnabled"] is False and crd["recommendation"]["enabled"] is False
    assert crd["lastEvaluation"]["eplbAdvice"]["offVsOn"] == 0.04
    assert parse_autotune_status(crd) == st  # round trip
    # the same blockers as any change: a cooldown defers it
    later = _evaluate(AutotuneSpec(mode="Apply", allow_disable=True), st.replace(rollout=None), now=T0 + 60)
    assert later.decision == d.DEFER and "cooldown" in later.reason and later.status.override == st.override


def test_without_allow_disable_off_is_a_recommendation_and_an_event_once():
    cfg = AutotuneSpec(mode="Apply")
    out = _evaluate(cfg)
    assert out.decision == d.KEEP and out.status.override is None and out.status.rollout is None
    assert out.status.recommendation.enabled is False and out.status.recommendation.predicted_gain == 0.045
    (event,) = [e for e in out.events if e[1] == "RecommendEplbOff"]
    assert "spec.autotune.allowDisable is false" in event[2] and "+4.5%" in event[2]
    assert "EPLB off predicted" in out.reason and "EPLB off predicted" in out.conditions["Tuned"][2]
    again = _evaluate(cfg, out.status, now=T0 + 300)
    assert not [e for e in again.events if e[1] == "RecommendEplbOff"]  # already said
    # the best EPLB-on setting is still applied where it pays
    on = _evaluate(cfg, answer=_off_answer(on_change=True))
    assert on.decision == d.APPLY and on.status.override == Override.of(Knobs(1000, 10000, 0), spec_generation=3,
                                                                         spec_eplb=SPEC)
    assert on.status.rollout.to_enabled is None and "EPLB off predicted" in on.reason
    # Recommend mode: the recommendation is the decision
    rec = _evaluate(AutotuneSpec(mode="Recommend", allow_disable=True))
    assert rec.decision == d.RECOMMEND and rec.reason.startswith("EPLB off predicted") and "mode Recommend" in rec.reason


def test_the_rollout_that_turns_eplb_off_says_so():
    cfg = AutotuneSpec(mode="Apply", allow_disable=True, observe_s=600)
    st = _evaluate(cfg).status
    view = r.WorkloadView(3, True, "h-off", (), spec_eplb=SPEC)
    st = r.advance(cfg, st, view, now=T0 + 100).status
    s = r.advance(cfg, st, view, now=T0 + 100 + 2 * 600 + 61, measured=None)
    assert s.status.history[-1].action == "Kept" and s.status.history[-1].to_enabled is False
    assert "kept EPLB off without a measurement" in s.conditions["Tuned"][2]
    assert s.status.override.enabled is False


def _resource(allow: bool, off: bool) -> dict:
    doc = yaml.safe_load((EXAMPLES / "qwen3-30b-a3b-autotune.yaml").read_text())
    doc = copy.deepcopy(doc)
    doc["spec"]["autotune"]["mode"] = "Apply"
    doc["spec"]["autotune"]["allowDisable"] = allow
    eplb = doc["spec"]["eplb"]
    spec_knobs = Knobs(eplb.get("windowSize", 1000), eplb.get("stepInterval", 3000), eplb.get("numRedundantExperts", 0))
    if off:
        override = Override.disabled(spec_generation=1, spec_eplb=spec_knobs)
        doc["status"] = {"autotune": autotune_status_to_crd(AutotuneStatus(override=override))}
    return doc


def test_the_override_runs_eplb_off_while_allow_disable_stays_true():
    inf = parse(_resource(True, True))
    assert inf.autotune.allow_disable is True
    assert not inf.effective.enabled and inf.effective.source == "autotune" and inf.override_problem is None
    args = next(c for c in render_children(inf) if c["kind"] == "Deployment")["spec"]["template"]
    on = parse(_resource(True, False))
    assert on.effective.enabled and on.effective.config_hash() != inf.effective.config_hash()
    argv = " ".join(args["spec"]["containers"][0]["args"])
    assert "--enable-eplb" not in argv and "--eplb-config" not in argv
    # allowDisable set back to false: spec.eplb runs again, and the loop drops the stale override
    back = parse(_resource(False, True))
    assert back.effective.enabled and back.effective.source == "spec"
    assert back.override_problem == "spec.autotune.allowDisable is false: the tuner's EPLB off no longer applies"
    # the CRD default: off
    assert parse(yaml.safe_load((EXAMPLES / "qwen3-30b-a3b-autotune.yaml").read_text())).autotune.allow_disable is False


def test_tuner_answer_of_an_off_result():
    trace = synth.generate("deepseek-v3-flat", model_shape=(8, 64, 4, 6), hours=0.5, seed=0)
    ctx = OverlapContext("deepep_low_latency", True, 1 / 3)
    res = tune(trace, TuneOptions(ep_size=8, num_groups=4, overlap=ctx), current=VLLM_DEFAULTS, cost=CostModel(moe_time_share=0.35))
    assert not res.enabled
    answer = d.TunerAnswer.of(res)
    assert answer.disable and answer.disable_gain == pytest.approx(res.headline_gain()[0])
    assert answer.recommendation == res.recommendation and answer.wants_change == (res.on_decision == "change")
    assert answer.advice["mode"] == "off" and answer.advice["enabled"] is False
    assert answer.advice["overlapDropped"] is True and answer.advice["whatWouldChange"]
