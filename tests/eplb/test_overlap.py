"""Is EPLB worth it: the shared-expert overlap EPLB costs (catalog, vLLM's rule, the cost model, the
simulator, the robust scenarios), EPLB off and rearrange-only as outcomes of the search, what would
change the answer, and learning the overlap from EPLB-on against EPLB-off step times
(moe_eplb.eplb.tuning.overlap, the tuner's ``allow_off`` / ``current_enabled``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_eplb.api import catalog, wide_ep
from moe_eplb.api.knobs import VLLM_DEFAULTS, Knobs
from moe_eplb.eplb.replay.costmodel import CostModel
from moe_eplb.eplb.replay.simulator import Replay, Topology
from moe_eplb.eplb.tuning.calibrate import calibrate
from moe_eplb.eplb.tuning.exploration import ArmObservation
from moe_eplb.eplb.tuning.learn import learn
from moe_eplb.eplb.tuning.options import TuneOptions
from moe_eplb.eplb.tuning.overlap import EPLB_OFF, OverlapContext, context_for, hidden_range, hidden_range_from_ratio
from moe_eplb.eplb.tuning.robust import Range, scenario_segments, terms_of
from moe_eplb.eplb.tuning.tuner import segment_edges, tune
from moe_eplb.eplb.workload import synth
from moe_eplb_harness.engines.physics import TrueCost
from moe_eplb_harness.engines.recording import record

SHAPE = (8, 64, 4, 6)  # 8 MoE layers x 64 experts, 4 groups, top-6 (a small DeepSeek-like model)
V034 = (0, 34, 0)
DROPS = OverlapContext("deepep_low_latency", True, 1 / 3, (("deepep_v2", ""), ("allgather_reducescatter", "")))
KEPT = OverlapContext("deepep_v2", False, 1 / 3, DROPS.alternatives)


@pytest.fixture(scope="module")
def flat():
    """Nearly even expert popularity (Mixtral's fit on a DeepSeek-like shape): balancing gains little."""
    return synth.generate("deepseek-v3-flat", model_shape=SHAPE, hours=0.5, seed=0)


@pytest.fixture(scope="module")
def skewed():
    """DeepSeek-V3's skewed popularity moving chat -> code -> math: balancing gains a lot."""
    return synth.generate("deepseek-v3-chat-code-math", model_shape=SHAPE, hours=0.5, seed=0)


# --- the facts ------------------------------------------------------------------------------------


def test_catalog_shared_expert_ratios():
    assert catalog.lookup("deepseek-ai/DeepSeek-V3").shared_expert_ratio == pytest.approx(1 / 8)
    assert catalog.lookup("deepseek-ai/DeepSeek-V2-Lite").shared_expert_ratio == pytest.approx(2 / 6)
    assert catalog.lookup("meta-llama/Llama-4-Scout-17B-16E").shared_expert_ratio == pytest.approx(1.0)
    assert catalog.lookup("zai-org/GLM-4.5-Air").shared_expert_ratio == pytest.approx(1 / 8)
    for name in ("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-VL-30B-A3B-Instruct", "mistralai/Mixtral-8x7B-v0.1"):
        assert catalog.lookup(name).shared_experts == 0 and catalog.lookup(name).shared_expert_ratio == 0.0


def test_overlap_rule_and_safe_backends_by_vendor():
    assert wide_ep.eplb_drops_shared_overlap("deepep_low_latency", V034)
    assert wide_ep.eplb_drops_shared_overlap("mori", V034)
    for b in ("allgather_reducescatter", "deepep_v2", "flashinfer_nvlink_one_sided", None):
        assert not wide_ep.eplb_drops_shared_overlap(b, V034)
    # the FlashInfer two-sided kernels drop it with data parallel whatever EPLB does: EPLB costs nothing there
    assert not wide_ep.eplb_drops_shared_overlap("flashinfer_nvlink_two_sided", V034, data_parallel=8)
    assert wide_ep.eplb_drops_shared_overlap("flashinfer_nvlink_two_sided", V034, data_parallel=1)
    assert [b for b, _ in wide_ep.overlap_safe_backends(V034, "amd")] == ["allgather_reducescatter"]
    nvidia = dict(wide_ep.overlap_safe_backends(V034, "nvidia", nodes=4))
    assert set(nvidia) == {"allgather_reducescatter", "deepep_v2", "flashinfer_nvlink_one_sided"}
    assert "NVLink domain" in nvidia["flashinfer_nvlink_one_sided"] and nvidia["deepep_v2"] == ""
    assert dict(wide_ep.overlap_safe_backends(V034, "nvidia"))["flashinfer_nvlink_one_sided"] == ""
    assert wide_ep.gpu_vendor("amd.com/gpu") == "amd" and wide_ep.gpu_vendor("example.com/gpu") is None
    ctx = context_for("deepseek-ai/DeepSeek-V3", "deepep_low_latency", V034, gpu_resource_name="amd.com/gpu")
    assert ctx.priced and ctx.shared_expert_ratio == pytest.approx(1 / 8)
    assert ctx.alternatives == (("allgather_reducescatter", ""),)
    assert not context_for("Qwen/Qwen3-30B-A3B", "deepep_low_latency", V034).priced  # no shared experts


# --- the cost model and the replay -----------------------------------------------------------------


def test_overlap_loss_is_priced_on_eplb_on_replays_only(skewed):
    base = CostModel(moe_time_share=0.4, seconds_per_step=0.05)
    priced = DROPS.apply(base).with_(overlap_hidden=0.75)
    assert priced.overlap_loss == pytest.approx(0.4 * (1 / 3) * 0.75)
    assert KEPT.apply(base).overlap_loss == 0.0 and base.overlap_loss == 0.0
    topo = Topology(8, 1, 4)
    knobs = Knobs(1000, 3000, 0)
    a, b = Replay(skewed, topo, base), Replay(skewed, topo, priced)
    on_a, on_b = a.run(knobs), b.run(knobs)
    # every bucket takes ideal x loss longer, nothing else moves
    np.testing.assert_allclose(on_b.bucket_time_s - on_a.bucket_time_s, on_a.bucket_ideal_s * priced.overlap_loss)
    assert on_b.throughput.overlap_seconds == pytest.approx(on_a.bucket_ideal_s.sum() * priced.overlap_loss)
    assert on_b.throughput.relative == pytest.approx(on_b.bucket_ideal_s.sum() / on_b.bucket_time_s.sum())
    assert on_b.throughput.overlap_factor < 1.0 == on_a.throughput.overlap_factor
    # without EPLB nothing is lost
    np.testing.assert_allclose(b.run_static().bucket_time_s, a.run_static().bucket_time_s)
    # re-pricing a replay (the robust scenarios) reproduces the simulator, on and off
    edges = segment_edges(skewed.num_buckets, 4)
    for res in (on_b, b.run_static()):
        seg = scenario_segments(terms_of(res, skewed.bucket_steps, edges), priced, 8, SHAPE[0], SHAPE[1])
        np.testing.assert_allclose(seg, res.segment_throughput(edges), rtol=1e-9)


# --- on, off, rearrange-only -------------------------------------------------------------------------


def test_off_wins_where_balancing_gains_less_than_the_overlap_costs(flat):
    cost = CostModel(moe_time_share=0.35)
    dropped = tune(flat, TuneOptions(ep_size=8, num_groups=4, overlap=DROPS), current=VLLM_DEFAULTS, cost=cost)
    assert not dropped.enabled and dropped.mode == "off" and dropped.decision == "change"
    assert dropped.pick is dropped.off and dropped.off.knobs is EPLB_OFF
    assert dropped.reason.startswith("EPLB off") and "best EPLB-on setting" in dropped.reason
    assert dropped.off.score > dropped.chosen.score
    # where EPLB must stay on, the best EPLB-on setting and its own verdict
    assert isinstance(dropped.recommendation, Knobs) and dropped.on_decision in ("keep", "change")
    advice = dropped.advice
    assert advice["mode"] == "off" and advice["off_vs_on"] > 0.01 and advice["overlap_loss"] == pytest.approx(
        0.35 / 3 * 0.5)
    assert 0.0 < advice["break_even_hidden"] < 0.5  # on would win only if the overlap had hidden far less
    words = " ".join(advice["what_would_change"])
    assert "spec.parallelism.all2allBackend" in words and "deepep_v2" in words
    out = dropped.to_dict()["recommendation"]
    assert out["enabled"] is False and out["mode"] == "off" and out["eplb_on"]["decision"] == dropped.on_decision
    json.dumps(dropped.to_dict())  # the --json output stays serialisable
    # the same deployment on a backend that keeps the overlap: EPLB stays on, rearranging only
    kept = tune(flat, TuneOptions(ep_size=8, num_groups=4, overlap=KEPT), current=VLLM_DEFAULTS, cost=cost)
    assert kept.enabled and kept.mode == "rearrange_only" and kept.recommendation.num_redundant_experts == 0
    # never off where the caller does not allow it
    never = tune(flat, TuneOptions(ep_size=8, num_groups=4, overlap=DROPS, allow_off=False), current=VLLM_DEFAULTS, cost=cost)
    assert never.enabled and never.off is None and never.recommendation == dropped.recommendation


def test_eplb_stays_on_where_balancing_pays_for_the_overlap(skewed):
    res = tune(skewed, TuneOptions(ep_size=8, num_groups=4, overlap=DROPS), current=VLLM_DEFAULTS, cost=CostModel(moe_time_share=0.35))
    assert res.enabled and res.mode == "balance" and res.recommendation.num_redundant_experts > 0
    assert res.advice["off_vs_on"] < -0.1
    kept = res.advice["overlap_kept"]
    assert kept["gain_vs_pick"] > 0.03  # the overlap kept is worth about its price (1/3 x 0.35 x 0.5 = 5.8 %)


def test_eplb_running_off_is_turned_on_only_when_it_pays_a_restart(flat, skewed):
    cost = CostModel(moe_time_share=0.35)
    on = tune(skewed, TuneOptions(ep_size=8, num_groups=4, overlap=DROPS), current=VLLM_DEFAULTS, current_enabled=False, cost=cost)
    assert on.enabled and on.decision == "change" and on.current is on.off
    stay = tune(flat, TuneOptions(ep_size=8, num_groups=4, overlap=KEPT), current=VLLM_DEFAULTS, current_enabled=False, cost=cost)
    assert not stay.enabled and stay.decision == "keep"  # +0.9 % on would not pay the restart (threshold 1.9 %)


def test_robust_decision_holds_over_the_overlap_range(flat):
    """With telemetry the decision is minimax regret: the overlap's share hidden is a prior range 0-1 the
    calibration adds where the backend drops it, and EPLB off is one of the options."""
    true = TrueCost(moe_time_share=0.35, kv_demand=0.3, bytes_per_expert=3 * 2048 * 1408 * 2)
    history = record(flat, VLLM_DEFAULTS, 8, true, num_groups=4, seed=0)
    cost = DROPS.apply(CostModel(bytes_per_expert=true.bytes_per_expert))
    cal = calibrate(history, cost=cost, num_groups=4)
    assert cal.ranges["overlap_hidden"].source == "prior"
    assert (cal.ranges["overlap_hidden"].low, cal.ranges["overlap_hidden"].high) == (0.0, 1.0)
    assert "overlap_hidden" not in calibrate(history, cost=KEPT.apply(cost), num_groups=4).ranges
    res = tune(history, TuneOptions(ep_size=8, num_groups=4, overlap=DROPS), current=VLLM_DEFAULTS, cost=cal.apply(cost),
               robust=cal.robustness())
    labels = [f["enabled"] if "enabled" in f else True for f in res.robust["finalists"]]
    assert False in labels  # EPLB off was scored in every scenario
    assert not res.enabled and res.mode == "off"
    assert res.advice["overlap_loss_low"] == 0.0 < res.advice["overlap_loss_high"]


# --- learning the overlap from EPLB-on against EPLB-off step times ---------------------------------------


def _step(f: float, x: float, loss: float = 0.0, s0: float = 0.04) -> float:
    return s0 * ((1 - f) + f * x + loss)


def test_hidden_range_recovers_the_truth():
    f, rho, h, x_on, x_off = 0.3, 1 / 8, 0.6, 1.05, 1.4
    r = _step(f, x_on, f * rho * h) / _step(f, x_off)
    lo, hi = hidden_range_from_ratio(r, r * (1 + 1e-9), (f, f), rho, x_on, x_off)
    assert lo == pytest.approx(h, abs=1e-6) and hi == pytest.approx(h, abs=1e-6)
    lo, hi = hidden_range_from_ratio(r * 0.995, r * 1.005, (0.25, 0.35), rho, x_on, x_off)
    assert lo < h < hi and hi - lo < 1.0
    assert hidden_range_from_ratio(r, r, (0.3, 0.3), 0.0, x_on, x_off) is None  # no shared experts
    # from two arms: the off arm's balancedness is a replay's (the exporter counts nothing with EPLB off)
    on = ArmObservation(Knobs(1000, 3000, 0), 3, 1800.0, step_seconds=_step(f, x_on, f * rho * h),
                        tokens_per_step=100.0, balancedness=1 / x_on)
    off = ArmObservation(Knobs(1000, 3000, 0), 1, 1800.0, step_seconds=_step(f, x_off), tokens_per_step=101.0,
                         eplb=False)
    got = hidden_range(on, off, (0.28, 0.32), rho, off_balancedness=1 / x_off)
    assert got is not None and got[0] < h < got[1]
    assert hidden_range(on, off, (0.28, 0.32), rho) is None  # no imbalance for the off side: cannot tell
    far = ArmObservation(off.knobs, 1, 1800.0, step_seconds=off.step_seconds, tokens_per_step=150.0, eplb=False)
    assert hidden_range(on, far, (0.28, 0.32), rho, off_balancedness=1 / x_off) is None  # batches differ


def test_learn_narrows_the_overlap_from_an_off_arm(flat):
    true = TrueCost(moe_time_share=0.35, kv_demand=0.3, bytes_per_expert=3 * 2048 * 1408 * 2)
    history = record(flat, VLLM_DEFAULTS, 8, true, num_groups=4, seed=0)
    cost = DROPS.apply(CostModel(bytes_per_expert=true.bytes_per_expert))
    cal = calibrate(history, cost=cost, num_groups=4)
    share = cal.ranges["moe_time_share"]
    f, rho, h = true.moe_time_share, 1 / 3, 0.7
    x_on, x_off = 1.02, 1.08
    on = ArmObservation(VLLM_DEFAULTS, 3, 3600.0, step_seconds=_step(f, x_on, f * rho * h), tokens_per_step=100.0,
                        balancedness=1 / x_on)
    off = ArmObservation(VLLM_DEFAULTS, 1, 3600.0, step_seconds=_step(f, x_off), tokens_per_step=100.0, eplb=False)
    got = learn(cal, cost, off, on, source="trial EPLB off", off_balancedness=1 / x_off)
    assert [g.parameter for g in got] == ["overlap_hidden"], (share, got)
    assert got[0].low < h < got[0].high and got[0].high - got[0].low <= 0.8
    # the calibration keeps it: the range's source is the experiment
    again = calibrate(history, cost=cost, num_groups=4, learned=got)
    assert again.ranges["overlap_hidden"].source == "experiment"
    assert isinstance(again.ranges["overlap_hidden"], Range)
