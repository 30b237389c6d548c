"""Calibration of the cost model from telemetry: the fits recover known parameters, refuse what
cannot be told, and the calibrated tuner picks well where the constant model keeps the defaults."""

from __future__ import annotations

import numpy as np
import pytest

from moe_eplb.api.knobs import VLLM_DEFAULTS
from moe_eplb.eplb.replay.costmodel import CostModel
from moe_eplb.eplb.replay.simulator import Replay, Topology
from moe_eplb.eplb.tuning.calibrate import (
    DEFAULT,
    MEASURED,
    PARAMETERS,
    CalibrationError,
    calibrate,
    fit_step_model,
    fit_sync_stall,
    kv_pressure,
)
from moe_eplb.eplb.tuning.tuner import TuneOptions, tune
from moe_eplb.eplb.workload import synth
from moe_eplb.eplb.workload.trace import LoadTrace
from moe_eplb_harness.engines.physics import TrueCost
from moe_eplb_harness.engines.recording import record


def _synthetic(f: float, n_buckets: int = 240, noise: float = 0.01, seed: int = 0, spread: float = 0.3,
               outliers: int = 0, d: float | None = None):
    rng = np.random.default_rng(seed)
    steps = rng.integers(250, 320, n_buckets).astype(float)
    tok = rng.uniform(3000, 5000, n_buckets)
    x = 1.0 + rng.uniform(0.0, spread, n_buckets)
    k = (rng.random(n_buckets) < 0.1).astype(float)
    y = (0.01 + 8e-6 * tok) * (1 + f * (x - 1)) + (d or 0.0) * k / steps
    y *= np.exp(rng.normal(0, noise, n_buckets))
    if outliers:
        y[rng.choice(n_buckets, outliers, replace=False)] *= 1.5
    return y, steps, tok, x, k


@pytest.mark.parametrize("f", [0.05, 0.3, 0.7])
def test_step_fit_recovers_the_share(f):
    y, n, tok, x, _ = _synthetic(f)
    fit = fit_step_model(y, n, tok, x)
    assert fit.share == pytest.approx(f, abs=0.03)
    assert 0 < fit.share_se < 0.03
    assert abs(fit.share - f) < 4 * fit.share_se + 0.005
    s0 = 0.01 + 8e-6 * np.average(tok, weights=n)
    assert fit.seconds_per_step == pytest.approx(s0, rel=0.01)


def test_step_fit_is_robust_to_outlier_buckets():
    y, n, tok, x, _ = _synthetic(0.4, outliers=12)
    fit = fit_step_model(y, n, tok, x)
    assert fit.share == pytest.approx(0.4, abs=0.04)
    assert fit.outliers >= 10
    plain = np.polyfit(x, y / (0.01 + 8e-6 * tok), 1)  # a non-robust line is pulled by the outliers
    assert abs(plain[0] / plain[1] - 0.4) > abs(fit.share - 0.4)


def test_step_fit_measures_the_seconds_a_rearrangement_costs():
    y, n, tok, x, k = _synthetic(0.3, d=2.0)
    fit = fit_step_model(y, n, tok, x, k)
    assert fit.rearrangement_s == pytest.approx(2.0, rel=0.15)
    assert fit.share == pytest.approx(0.3, abs=0.03)


def test_narrow_imbalance_range_is_refused_with_the_reason():
    y, n, tok, x, _ = _synthetic(0.5, spread=0.01)
    fit = fit_step_model(y, n, tok, x, default_share=0.35)
    assert fit.share is None and fit.share_se is None
    assert "spans only" in fit.reason and "< 0.02" in fit.reason
    assert fit.seconds_per_step is not None  # the balanced step time is still measured


def test_noisy_fit_is_refused_as_too_uncertain():
    y, n, tok, x, _ = _synthetic(0.5, spread=0.04, noise=0.08, n_buckets=60)
    fit = fit_step_model(y, n, tok, x)
    assert fit.share is None and "too uncertain" in fit.reason


def test_too_few_buckets():
    y, n, tok, x, _ = _synthetic(0.5, n_buckets=10)
    fit = fit_step_model(y, n, tok, x)
    assert fit.share is None and fit.seconds_per_step is None and "need 20" in fit.reason


def test_sync_stall_is_the_median_with_its_standard_error():
    med, se = fit_sync_stall([0.9, 1.0, 1.1, 1.0, 30.0])  # one stuck rearrangement does not move it
    assert med == 1.0 and se == pytest.approx(1.2533 * 1.4826 * 0.1 / np.sqrt(5))
    assert fit_sync_stall([1.0, 1.0]) is None


def test_kv_pressure_needs_a_full_cache_and_a_queue():
    usage = np.array([0.95, 0.95, 0.5, 0.99])
    e, se, share = kv_pressure(usage, np.array([1, 0, 0, 0]), np.array([0, 0, 3, 2]))
    assert share == 0.5 and e == 0.5  # bucket 0 (preempted) and 3 (queue); 2 has a queue but room
    assert se > 0
    assert kv_pressure(np.full(10, 0.6), np.zeros(10), np.zeros(10))[0] == 0.0
    assert kv_pressure(np.full(10, 0.95), None, None)[0] == 1.0  # no queue series: a full cache counts


@pytest.fixture(scope="module")
def small_workload():
    """Two hours of a chat -> code -> math mix on 8 MoE layers x 64 experts (top-4), EP 16."""
    return synth.generate("deepseek-v3-chat-code-math", model_shape=(8, 64, 1, 4), hours=2, seed=0)


BPE = 58 * 3 * 7168 * 2048 / 8  # a DeepSeek-V3 rank's redundant-expert memory, spread over 8 layers
MOE_BOUND = TrueCost(moe_time_share=0.6, kv_demand=0.5, kv_throughput_elasticity=0.0)
KV_BOUND = TrueCost(moe_time_share=0.05, kv_demand=1.5, kv_throughput_elasticity=1.0, use_async=False,
                    sync_stall_s=1.5)


@pytest.mark.parametrize("true", [MOE_BOUND, KV_BOUND], ids=["moe-bound", "kv-bound"])
def test_calibration_recovers_the_true_parameters(small_workload, true):
    hist = record(small_workload.slice(0, 240), VLLM_DEFAULTS, 16, true, bytes_per_expert=BPE, seed=0)
    cal = calibrate(hist, cost=CostModel(bytes_per_expert=BPE))
    p = cal.parameters
    assert set(p) == set(PARAMETERS)
    assert p["moe_time_share"].source == MEASURED
    assert p["moe_time_share"].value == pytest.approx(true.moe_time_share, abs=0.05)
    assert p["kv_throughput_elasticity"].value == pytest.approx(true.kv_throughput_elasticity, abs=0.05)
    assert p["seconds_per_step"].value == pytest.approx(true.cost_model(hist).seconds_per_step, rel=0.03)
    assert cal.use_async is true.use_async
    if true.use_async:
        assert p["sync_stall_s"].source == DEFAULT and "async mode" in p["sync_stall_s"].note
        fitted = p["async_s_per_moved_byte"]
        assert abs(fitted.value - true.async_s_per_moved_byte) < 3 * fitted.uncertainty  # within its own error
        assert fitted.uncertainty < 0.5 * true.async_s_per_moved_byte
    else:
        assert p["sync_stall_s"].value == pytest.approx(true.sync_stall_s, rel=0.05)
        assert p["async_s_per_moved_byte"].source == DEFAULT
    cost = cal.apply(CostModel())
    assert cost.moe_time_share == p["moe_time_share"].value and cost.use_async is true.use_async
    assert cost.kv_cache_bytes_per_gpu == pytest.approx(true.kv_cache_bytes_per_gpu)
    d = cal.to_dict()
    assert set(d) == {"parameters", "measured", "use_async", "fit", "ranges", "memory"}
    assert set(d["parameters"]["moe_time_share"]) == {"value", "uncertainty", "source", "note"}


def test_without_telemetry_calibration_says_so():
    tr = LoadTrace(load=np.ones((3, 2, 4)), bucket_steps=[1, 1, 1])
    with pytest.raises(CalibrationError, match="^trace: has none of the telemetry keys"):
        calibrate(tr)


def test_defaults_are_kept_and_named_when_a_source_is_missing(small_workload):
    hist = record(small_workload.slice(0, 240), VLLM_DEFAULTS, 16, MOE_BOUND, bytes_per_expert=BPE)
    tel = hist.telemetry
    from dataclasses import replace

    bare = LoadTrace(load=hist.load, bucket_steps=hist.bucket_steps, bucket_seconds=15.0,
                     telemetry=replace(tel, rank_load=None, kv_cache_usage=None, rearrangements=None))
    p = calibrate(bare).parameters
    assert p["moe_time_share"].source == DEFAULT and "no rank_load" in p["moe_time_share"].note
    assert p["kv_throughput_elasticity"].source == DEFAULT and p["kv_throughput_elasticity"].value == 0.5
    assert p["sync_stall_s"].note == "the trace has no rearrangements"
    assert p["seconds_per_step"].value == pytest.approx(15.0 / hist.bucket_steps.mean())


@pytest.mark.parametrize("true", [MOE_BOUND, KV_BOUND], ids=["moe-bound", "kv-bound"])
def test_calibrated_pick_is_within_97_percent_of_hindsight_where_constants_misjudge(small_workload, true):
    """Tune on the first hour (telemetry from the true parameters, vLLM's defaults running), score
    on the second hour with the TRUE parameters against the best of the whole grid. The constant
    model cannot tell a MoE-bound deployment from a KV-bound one; calibration can."""
    hist = record(small_workload.slice(0, 240), VLLM_DEFAULTS, 16, true, bytes_per_expert=BPE, seed=0)
    future = small_workload.slice(240, 480)
    options = TuneOptions(ep_size=16, bytes_per_expert=BPE)
    constant = tune(hist, options, current=VLLM_DEFAULTS)
    calibrated = tune(hist, options, current=VLLM_DEFAULTS,
                      cost=calibrate(hist, cost=CostModel(bytes_per_expert=BPE)).apply(CostModel()))
    replay = Replay(future, Topology(16), true.cost_model(future, BPE))
    score = {k: replay.run(k).throughput.relative for k in {c.knobs for c in calibrated.candidates}}
    best = max(score.values())
    pick = replay.run(calibrated.recommendation).throughput.relative
    defaults = replay.run(VLLM_DEFAULTS).throughput.relative
    constant_pick = replay.run(constant.recommendation).throughput.relative
    assert pick >= 0.97 * best and pick >= defaults and pick >= constant_pick
    if true is MOE_BOUND:  # the defaults are far from the best: redundancy pays, memory is free
        assert defaults < 0.9 * best
        assert calibrated.recommendation.num_redundant_experts > 0
    else:  # memory is what limits: the constant model's redundant experts cost throughput
        assert calibrated.recommendation.num_redundant_experts == 0
        assert constant.recommendation.num_redundant_experts > 0 and constant_pick < 0.97 * best
