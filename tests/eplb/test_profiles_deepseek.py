"""DeepSeek-V3 workloads: the profiles fitted on the real DeepSeek-V3 expert counts load a static
EP-32 placement as unevenly as the real regimes do, the flat control does not, and the figures are
computed by one definition (profiles.static_imbalance)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from moe_eplb.eplb.workload import profiles, synth, tracefile
from moe_eplb.eplb.workload.profiles import static_imbalance, static_imbalance_per_layer
from moe_eplb.eplb.workload.trace import TraceError

ROOT = Path(__file__).resolve().parents[2]
TRACES = Path(os.environ.get("MOE_EPLB_SHARED_TRACES", ROOT.parent / "shared" / "traces"))
needs_traces = pytest.mark.skipif(
    not TRACES.is_dir(), reason=f"real routing data not found at {TRACES} (set MOE_EPLB_SHARED_TRACES)"
)

FLAT = "deepseek-v3-flat"
DSV3_PROFILES = [n for n in synth.list_profiles() if synth.get_profile(n).model_shape == "deepseek-v3" and n != FLAT]
FIT = profiles.builtin_popularity("deepseek-v3")
EP = 32

# The bands every DeepSeek-V3 profile but the flat control must land in (EP 32, static placement).
GPU_BAND = (2.0, 3.2)
EXPERT_BAND = (4.5, 9.0)

# static_imbalance of the real counts, per regime: (busiest GPU / mean, hottest expert / mean)
REAL = {
    "decode_in1000out1000": (2.52, 5.20),
    "decode_in1800out100": (2.28, 5.77),
    "prefill_in512": (2.04, 5.49),
    "prefill_in1024": (2.15, 5.89),
    "prefill_in2048": (2.27, 7.06),
    "prefill_in1000out1000": (2.13, 5.81),
}


def test_static_imbalance_definition():
    # 2 buckets x 2 layers x 8 experts on 4 GPUs (2 experts each)
    load = np.zeros((2, 2, 8))
    load[0, 0] = [4, 4, 1, 1, 1, 1, 1, 1]  # layer 0 summed: [8, 8, 2, 2, 2, 2, 2, 2] -> GPUs 16, 4, 4, 4
    load[1, 0] = [4, 4, 1, 1, 1, 1, 1, 1]
    load[:, 1] = 1.0  # layer 1: even
    gpu, expert = static_imbalance_per_layer(load.sum(0), ep_size=4)
    np.testing.assert_allclose(gpu, [16 / 7, 1.0])  # mean GPU load 28 / 4 = 7
    np.testing.assert_allclose(expert, [8 / 3.5, 1.0])  # mean expert load 28 / 8 = 3.5
    got = static_imbalance(load, ep_size=4)  # [T, L, E]: summed over T, median over the 2 layers
    assert got.busiest_gpu == pytest.approx((16 / 7 + 1) / 2)
    assert got.hottest_expert == pytest.approx((8 / 3.5 + 1) / 2)
    assert static_imbalance(load.sum(0), ep_size=4) == got  # [L, E] is taken as already summed
    # contiguous ranges, not round robin: the same loads on experts 0 and 4 spread over 2 GPUs
    moved = load.sum(0).copy()
    moved[0] = [8, 2, 2, 2, 8, 2, 2, 2]
    assert static_imbalance_per_layer(moved, ep_size=4)[0][0] == pytest.approx(10 / 7)
    assert static_imbalance_per_layer(np.zeros((1, 8)), ep_size=4)[0][0] == 1.0  # no load: balanced
    with pytest.raises(TraceError, match="ep_size: 8 experts do not split evenly over 3 GPUs"):
        static_imbalance(load, ep_size=3)
    with pytest.raises(TraceError, match=r"expected \[L, E\] or \[T, L, E\]"):
        static_imbalance(np.ones(8))


def test_the_deepseek_profiles_run_on_the_deepseek_fit():
    assert sorted(DSV3_PROFILES) == [
        "deepseek-v3-chat-code-math", "deepseek-v3-chat-to-code", "deepseek-v3-diurnal", "deepseek-v3-steady",
    ]
    for name in DSV3_PROFILES:
        assert synth.get_profile(name).popularity == "deepseek-v3"
    assert synth.get_profile(FLAT).popularity == "mixtral"
    assert FIT.domains == tuple(REAL)
    assert FIT.num_experts == 256 and FIT.top_k == 8 and FIT.num_groups == 8 and FIT.group_ep_size == EP
    assert len(FIT.depth) == 58 and FIT.depth[0] == 0.0 and FIT.depth[-1] == 1.0  # every MoE layer
    # the chat/code/math request shapes resolve to token-weighted mixtures of regimes
    chat = profiles.resolve_domain("chat", FIT.domains)
    assert chat == {"prefill_in1000out1000": 0.5, "decode_in1000out1000": 0.5}
    assert profiles.resolve_domain("web", FIT.domains) is None
    # text sources keep their text domains
    assert profiles.resolve_domain("chat", profiles.builtin_popularity("olmoe").domains) == {"tulu": 1.0}


def test_the_fit_ships_parameters_not_counts():
    raw = json.loads((ROOT / "operator" / "moe_eplb" / "eplb" / "workload" / "profiles" / profiles.FIT_FILE).read_text())["popularity"]["deepseek-v3"]

    def longest(x) -> int:
        return max([len(x)] + [longest(v) for v in x]) if isinstance(x, list) else (
            max(longest(v) for v in x.values()) if isinstance(x, dict) else 0)

    assert longest(raw) == 58  # per-layer parameters; no list of 256 per-expert values
    assert len(raw["log_quantiles"]["prefill_in512"][0]) == len(profiles.QUANTILE_RANKS)
    loading = np.asarray(raw["groups"]["loading"])
    assert loading.shape == (6,) and np.all((loading > 0.1) & (loading < 0.95))
    # decode spreads over the groups least evenly in the real data: its loading is the largest
    assert np.argmax(loading) == FIT.domains.index("decode_in1000out1000")
    np.testing.assert_allclose(FIT.busiest_gpu, [v[0] for v in REAL.values()], atol=0.006)
    np.testing.assert_allclose(
        [np.median(FIT.max_over_mean[d]) for d in FIT.domains], [v[1] for v in REAL.values()], atol=0.006)


@pytest.mark.parametrize("name", DSV3_PROFILES)
def test_every_deepseek_profile_is_as_uneven_as_real_traffic(name):
    for seed in (0, 1):
        trace = synth.generate(name, hours=0.25, seed=seed)
        got = static_imbalance(trace.load, EP)
        assert GPU_BAND[0] <= got.busiest_gpu <= GPU_BAND[1], (name, seed, got)
        assert EXPERT_BAND[0] <= got.hottest_expert <= EXPERT_BAND[1], (name, seed, got)
        # and close to the real regimes it mixes, not just inside the band
        assert 2.05 < got.busiest_gpu < 2.55 and 5.0 < got.hottest_expert < 6.5, (name, seed, got)


def test_flat_control_stays_flat():
    got = static_imbalance(synth.generate(FLAT, hours=0.25, seed=0).load, EP)
    assert got.busiest_gpu < GPU_BAND[0] and got.busiest_gpu < 1.2
    assert got.hottest_expert < 1.4


def test_each_regime_layout_matches_its_real_figures():
    """Layout only (no request noise): each regime's generated expert layout, median over seeds,
    is within 0.12 of the real busiest GPU and 2 % of the real hottest expert; without the group
    structure the same curves give the mild figures of a random placement of hot experts."""
    layouts = np.stack([synth.domain_popularity(FIT, 58, 256, seed=s, num_groups=8) for s in range(5)])
    for d, (gpu, expert) in enumerate(REAL.values()):
        got = np.median([static_imbalance(layouts[s, d], EP) for s in range(5)], axis=0)
        assert abs(got[0] - gpu) < 0.12, (FIT.domains[d], got, gpu)
        assert abs(got[1] / expert - 1) < 0.02, (FIT.domains[d], got, expert)
    ungrouped = synth.domain_popularity(FIT, 58, 256, seed=0, num_groups=1)
    for d, (gpu, _) in enumerate(REAL.values()):
        assert static_imbalance(ungrouped[d], EP).busiest_gpu < gpu - 0.25


def test_regimes_share_their_hot_experts_as_in_the_real_model():
    pop = synth.domain_popularity(FIT, 58, 256, seed=2, num_groups=8)
    upper = np.triu_indices(len(FIT.domains), 1)
    got = np.array([[profiles.total_variation(pop[a], pop[b]).mean() for b in range(6)] for a in range(6)])[upper]
    want = FIT.tv.mean(axis=0)[upper]  # 0.01 (prefill at 1024 vs 1000 tokens) .. 0.20 (decode vs prefill)
    assert np.abs(got - want).max() < 0.06 and abs((got - want).mean()) < 0.03, np.round(got - want, 3)
    scores = np.stack([profiles.normal_scores(pop[d]) for d in range(6)])  # [D, L, E]
    corr = np.mean([np.corrcoef(scores[:, layer]) for layer in range(58)], axis=0)[upper]
    assert np.abs(corr - FIT.corr.mean(axis=0)[upper]).max() < 0.05


def test_other_shapes_still_work_with_the_deepseek_fit():
    t = synth.generate("deepseek-v3-steady", model_shape=(4, 32, 4, 2), hours=0.1, seed=0)
    assert t.load.shape == (24, 4, 32) and np.isfinite(t.load).all()
    q = synth.generate("deepseek-v3-steady", model_shape="qwen3-vl-30b-a3b", hours=0.1, seed=0)  # 1 group
    assert q.load.shape == (24, 48, 128) and 4.0 < static_imbalance(q.load, 4).hottest_expert < 9.0


@pytest.mark.traces
@needs_traces
@pytest.mark.parametrize("regime", list(REAL))
def test_real_figures_per_regime(regime):
    counts = tracefile.read_routing_file(TRACES / "deepseek_v3_expert_counts.json")
    got = static_imbalance(counts.counts[regime], EP)
    assert (round(got.busiest_gpu, 2), round(got.hottest_expert, 2)) == REAL[regime]
    # The shared README quotes 2.1-3.0 (this brief 2.05-3.04) and 5.2-8.2 for these regimes; the
    # median over layers gives 2.04-2.52 and 5.20-7.06 (the mean over layers: 2.08-2.88 and
    # 5.56-7.31). Both are inside the bands the generated profiles are held to.
    assert GPU_BAND[0] <= got.busiest_gpu <= GPU_BAND[1] and EXPERT_BAND[0] <= got.hottest_expert <= EXPERT_BAND[1]


@pytest.mark.traces
@needs_traces
def test_real_counts_facts_and_a_fresh_fit():
    counts = tracefile.read_routing_file(TRACES / "deepseek_v3_expert_counts.json")
    figures = np.array([static_imbalance(counts.counts[r], EP) for r in counts.domains])
    assert 2.03 < figures[:, 0].min() < 2.05 and 2.51 < figures[:, 0].max() < 2.53
    assert 5.19 < figures[:, 1].min() < 5.21 and 7.05 < figures[:, 1].max() < 7.07
    # contiguous placement is what makes it uneven: the hot experts share groups
    shuffled = counts.counts["decode_in1000out1000"][:, np.random.default_rng(0).permutation(256)]
    assert static_imbalance(shuffled, EP).busiest_gpu < 1.9
    # --from the real file for the DeepSeek-V3 shape gives the shipped traces up to rounding
    from_file = synth.generate("deepseek-v3-steady", hours=0.1, seed=0, source=TRACES / "deepseek_v3_expert_counts.json")
    shipped = synth.generate("deepseek-v3-steady", hours=0.1, seed=0)
    assert profiles.total_variation(from_file.popularity(), shipped.popularity()).max() < 0.01
    assert np.isclose(from_file.load, shipped.load, rtol=0.03, atol=50).mean() > 0.98
