"""The tuner: search space, constraints and their errors, ranking, keep/change decision, the
screening stage, and the done-when property on a workload derived from real routing data."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from moe_eplb.cli.tune_args import parse_bounds, parse_bytes, parse_knobs
from moe_eplb.eplb.replay.costmodel import CostModel
from moe_eplb.eplb.replay.simulator import Knobs, Replay, Topology
from moe_eplb.eplb.tuning.tuner import (
    SEED_CONFIG,
    VLLM_DEFAULTS,
    Bounds,
    Candidate,
    TuneError,
    TuneOptions,
    _gain_lower_bound,
    tune,
)
from moe_eplb.eplb.workload.trace import LoadTrace

# every test runs on the compiled kernels and on the NumPy path (tests/eplb/conftest.py)
pytestmark = pytest.mark.usefixtures("kernel_path")


def _drifting_trace(T=40, L=4, E=16, seed=0) -> LoadTrace:
    """Hot experts that move halfway through, Poisson noise; 200 steps per 10 s bucket."""
    rng = np.random.default_rng(seed)
    base = rng.gamma(0.6, 1.0, size=(2, L, E))
    t = np.arange(T)[:, None, None]
    mix = np.clip((t - T / 2) / 4 + 0.5, 0, 1)
    rate = (1 - mix) * base[0] + mix * base[1]
    load = rng.poisson(rate / rate.sum(-1, keepdims=True) * 4000).astype(float)
    return LoadTrace(load=load, bucket_steps=np.full(T, 200), bucket_seconds=10.0)


SMALL = dict(windows=(200, 800, 2000), intervals=(400, 1000, 3000), segments=4)


def test_every_candidate_is_valid_ranked_and_reported():
    trace = _drifting_trace()
    res = tune(trace, TuneOptions(ep_size=4, bounds=Bounds(redundant=(0, 8)), **SMALL))
    d = res.to_dict()
    json.dumps(d)
    rs = {c["num_redundant_experts"] for c in d["candidates"]}
    assert rs == {0, 4, 8}  # (16 + R) % 4 == 0 within 0:8
    assert len(d["candidates"]) == 3 * 3 * 3 + 2  # grid + vLLM defaults + seed (both valid here)
    assert {(c["window_size"], c["step_interval"], c["num_redundant_experts"])
            for c in d["candidates"]} >= {(1000, 3000, 0), (3000, 1000, 8)}
    scores = [c["score"] for c in d["candidates"]]
    assert all(a >= b - 1e-3 for a, b in zip(scores, scores[1:]))  # ranked (ties within 1e-3)
    for c in res.candidates:  # the score is the mean of the worst half of the segments
        seg = np.sort(c.segment_throughput)
        assert c.score == pytest.approx(seg[: (len(seg) + 1) // 2].mean())
    rec = d["recommendation"]
    assert set(rec) >= {"window_size", "step_interval", "num_redundant_experts", "decision",
                        "reason", "predicted_throughput", "breakdown", "gain_vs_no_eplb"}
    assert rec["decision"] == "change"  # no current given
    assert rec["predicted_gain_vs"] == "vllm_defaults"
    assert rec["predicted_gain"] == pytest.approx(res.chosen.score / res.defaults.score - 1)
    assert d["baselines"]["no_eplb"]["balancedness"] < rec["balancedness"]
    assert d["baselines"]["vllm_defaults"]["window_size"] == 1000
    # The recommendation is replayable and gives the reported numbers.
    again = Replay(trace, Topology(4)).run(res.recommendation)
    assert again.throughput.relative == pytest.approx(rec["predicted_throughput"])


def test_prior_keeps_a_known_configuration_unless_clearly_beaten():
    trace = _drifting_trace(seed=3)
    res = tune(trace, TuneOptions(ep_size=4, bounds=Bounds(redundant=(0, 8)), prior_margin=0.5, **SMALL))
    # With a 50 % margin no searched configuration can beat the best known one.
    known = {VLLM_DEFAULTS, SEED_CONFIG}
    assert res.recommendation in known
    best_known = max((c for c in res.candidates if c.knobs in known), key=lambda c: c.score)
    assert res.recommendation == best_known.knobs
    res0 = tune(trace, TuneOptions(ep_size=4, bounds=Bounds(redundant=(0, 8)), prior_margin=0.0, **SMALL))
    anchor = max((c for c in res0.candidates if c.knobs in known), key=lambda c: c.score)
    if res0.recommendation != anchor.knobs:  # a searched config won: it beat the anchor consistently
        pick = next(c for c in res0.candidates if c.knobs == res0.recommendation)
        assert pick.score > anchor.score and _gain_lower_bound(pick, anchor) > 0.0


def test_one_lucky_segment_does_not_beat_a_known_configuration():
    def cand(seg):
        seg = np.asarray(seg, dtype=float)
        return Candidate(Knobs(1, 1, 0), None, seg, float(np.sort(seg)[:3].mean()), float(seg.mean()))

    anchor = cand([0.95] * 6)
    lucky = cand([0.95 * 1.10, 0.949, 0.949, 0.949, 0.949, 0.95])  # +10 % once, worse 4 times
    steady = cand([0.95 * 1.01] * 5 + [0.95 * 1.008])  # ~+1 % everywhere
    assert _gain_lower_bound(lucky, anchor) < 0.002 < _gain_lower_bound(steady, anchor)


def test_keep_or_change_accounts_for_the_restart():
    trace = _drifting_trace(seed=1)
    bad = Knobs(200, 400, 8)  # rearranges often and pays KV memory for 8 redundant experts
    cost = CostModel(bytes_per_expert=2e8)
    common = TuneOptions(ep_size=4, bounds=Bounds(redundant=(0, 8)), prior_margin=0.0, **SMALL)
    cheap = tune(trace, replace(common, min_gain=0.0), current=bad, cost=cost.with_(restart_s=0.0))
    assert cheap.decision == "change" and cheap.recommendation != bad
    gain = cheap.best.score / cheap.current.score - 1
    assert gain > 0
    dear = tune(trace, replace(common, min_gain=0.0), current=bad, cost=cost.with_(restart_s=cost.horizon_s * (gain + 0.01)))
    assert dear.decision == "keep" and dear.recommendation == bad
    assert "restart" in dear.reason
    assert dear.to_dict()["baselines"]["current"]["window_size"] == 200
    assert dear.to_dict()["recommendation"]["predicted_gain"] == 0.0  # keep: current vs current
    assert cheap.to_dict()["recommendation"]["predicted_gain"] == pytest.approx(gain)
    best = tune(trace, common, current=cheap.best.knobs, cost=cost)
    assert best.decision == "keep"


def test_memory_budget_limits_redundancy():
    trace = _drifting_trace()
    per_r = 4 * 1e6 / 4  # bytes per GPU per redundant expert: L x bytes_per_expert / ep
    res = tune(trace, TuneOptions(ep_size=4, memory_budget_bytes=4.5 * per_r, bytes_per_expert=1e6,
                                  bounds=Bounds(redundant=(0, 16)), **SMALL))
    assert {c.knobs.num_redundant_experts for c in res.candidates} == {0, 4}


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(bounds=Bounds(redundant=(1, 3))), r"bounds\.redundant: no R in 1:3"),
        (dict(memory_budget_bytes=10.0, bytes_per_expert=1e6, bounds=Bounds(redundant=(4, 8))),
         "memory_budget: .* less than"),
        (dict(memory_budget_bytes=1e9), "bytes_per_expert"),
        (dict(ep_size=3, bounds=Bounds(redundant=(0, 1))),
         r"bounds\.redundant: no R in 0:1 .* ep_size 3; valid values are 2, 5"),
        (dict(num_groups=3), "topology: num_groups"),
        (dict(bounds=Bounds(window=(3000, 3000)), windows=(1,)), None),  # bounds ends are tried
    ],
)
def test_impossible_constraints_say_which(kwargs, needle):
    trace = _drifting_trace(T=12, L=2)  # 2400 engine steps: enough data to tune on
    args = {**dict(ep_size=4, bounds=Bounds(redundant=(0, 8)), **SMALL), **kwargs}
    if needle is None:
        res = tune(trace, TuneOptions(**args))
        assert {c.knobs.window_size for c in res.candidates if c.knobs not in
                (VLLM_DEFAULTS, SEED_CONFIG)} == {3000}
        return
    with pytest.raises(TuneError, match=needle):
        tune(trace, TuneOptions(**args))


@pytest.mark.parametrize("T", [1, 8])
def test_too_little_data_is_refused_not_called_consistent(T):
    """One bucket (or fewer engine steps than the operator's InsufficientData threshold) has no time
    structure to judge a gain "consistent" by: the tuner says so instead of recommending."""
    trace = _drifting_trace(T=T, L=2)
    with pytest.raises(TuneError, match=rf"trace: {T} bucket\(s\) and {200 * T} engine steps are too little "
                                        r"to tune on: at least 2 buckets and 2000 engine steps"):
        tune(trace, TuneOptions(ep_size=4, **SMALL))
    assert tune(trace, TuneOptions(ep_size=4, min_steps=1, **SMALL)) if T > 1 else True


def test_parsers():
    assert parse_bounds("window=500:5000,interval=500:10000,redundant=0:32") == Bounds(
        (500, 5000), (500, 10000), (0, 32))
    assert parse_bounds("window=:4000") == Bounds(window=(None, 4000))
    assert parse_bounds("redundant=8") == Bounds(redundant=(8, 8))
    for bad, needle in [("speed=1:2", "NAME=LO:HI"), ("window=a:b", "bounds.window"),
                        ("window=10:5", "lower end")]:
        with pytest.raises(TuneError, match=needle):
            parse_bounds(bad)
    assert parse_knobs("1000, 3000, 0") == VLLM_DEFAULTS
    with pytest.raises(TuneError, match="current"):
        parse_knobs("1000,3000")
    with pytest.raises(TuneError, match="window_size"):
        parse_knobs("0,3000,0")
    assert parse_bytes("8Gi") == 8 * 2**30
    assert parse_bytes("8589934592") == 8 * 2**30
    assert parse_bytes("500M") == 500_000_000
    with pytest.raises(TuneError, match="memory_budget"):
        parse_bytes("8 apples")


def test_screening_finds_the_all_layers_pick():
    trace = _drifting_trace(T=30, L=12, E=16, seed=5)
    kw = dict(ep_size=4, bounds=Bounds(redundant=(0, 8)), prior_margin=0.0, **SMALL)
    screened = tune(trace, TuneOptions(screen_layers=4, finalists=6, **kw))
    full = tune(trace, TuneOptions(screen_layers=None, **kw))
    assert screened.stats["screen_layer_stride"] == 3
    assert full.stats["screen_layer_stride"] == 1
    assert screened.best.knobs == full.best.knobs
    assert screened.best.score == pytest.approx(full.best.score)  # finalists are exact
    assert len(screened.candidates) == len(full.candidates)


def test_progress_reaches_the_total():
    seen = []
    tune(_drifting_trace(T=10, L=2), TuneOptions(ep_size=4, bounds=Bounds(redundant=(0, 4)), **SMALL),
         progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1]
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))


SHARED = Path(os.environ.get("MOE_EPLB_SHARED_TRACES",
                             Path(__file__).resolve().parents[3] / "shared" / "traces"))
REAL_FILES = ("olmoe_expert_counts.json", "mixtral_humaneval_token_routing.json",
              "mixtral_gsm8k_token_routing.json")


def _real_source():
    files = [SHARED / f for f in REAL_FILES]
    if not all(f.is_file() for f in files):
        pytest.skip(f"real routing data not found at {SHARED} (set MOE_EPLB_SHARED_TRACES)")
    return [str(f) for f in files]


@pytest.mark.parametrize("source", ["shipped-fits", pytest.param("real-files", marks=pytest.mark.traces)])
def test_holdout_property_on_real_data_derived_workload(source):
    """Done-when on one small workload built from real routing data (the generator's shipped
    fits, or fitted now on the files in ../shared/traces): Qwen3-VL shape, a chat -> math shift,
    tuned on the first half only, scored on the second."""
    from bench.holdout import evaluate_holdout
    from moe_eplb.eplb.workload import synth

    src = _real_source() if source == "real-files" else None
    trace = synth.generate("qwen3-vl-30b-a3b-chat-to-math", hours=1.0, seed=7, source=src)
    ho = evaluate_holdout(trace, ep_size=4)
    rows = ho.rows
    assert rows["seed"].result is not None and rows["vllm_defaults"].result is not None
    assert ho.ratio_to_hindsight() >= 0.97
    assert rows["tuner"].throughput >= rows["vllm_defaults"].throughput
    assert rows["tuner"].throughput >= rows["seed"].throughput
    assert rows["hindsight"].throughput >= rows["tuner"].throughput
    assert rows["no_eplb"].balancedness < rows["tuner"].balancedness
    assert rows["clairvoyant"].balancedness >= rows["hindsight"].balancedness
