"""The workload generator: its statistics match the real data it was fitted on, it is
deterministic by seed, and bad requests get clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from moe_eplb.eplb.workload import profiles, synth
from moe_eplb.eplb.workload.profiles import total_variation
from moe_eplb.eplb.workload.trace import LoadTrace

FIT = profiles.builtin_popularity("olmoe")
REAL_MM = np.concatenate(list(FIT.max_over_mean.values()))  # 2.50 .. 7.81 (OLMoE)


def _single(domain: str, shape="qwen3-vl-30b-a3b", hours=0.25, seed=3) -> LoadTrace:
    prof = synth.with_phases("qwen3-vl-30b-a3b-steady", [{domain: 1.0}], bursts=None, mix_jitter=0.0)
    return synth.generate(prof, model_shape=shape, hours=hours, seed=seed)


def _real_at_depth(values_per_sampled_layer: np.ndarray, num_layers: int) -> np.ndarray:
    return np.interp(np.linspace(0, 1, num_layers), FIT.depth, values_per_sampled_layer)


def test_builtin_profiles_and_shapes():
    names = synth.list_profiles()
    for required in ("deepseek-v3-chat-code-math", "qwen3-vl-30b-a3b-steady"):
        assert required in names
    assert any("shift" in n or "-to-" in n for n in names)
    assert synth.MODEL_SHAPES["deepseek-v3"] == (58, 256, 8, 8)
    assert synth.MODEL_SHAPES["qwen3-vl-30b-a3b"] == (48, 128, 1, 8)
    for name in names:
        prof = synth.get_profile(name)
        assert prof.model_shape in synth.MODEL_SHAPES and prof.description


@pytest.mark.parametrize("shape", ["deepseek-v3", "qwen3-vl-30b-a3b"])
def test_mapped_popularity_keeps_each_domains_max_over_mean(shape):
    layers, experts, _, _ = synth.MODEL_SHAPES[shape]
    pop = synth.domain_popularity(FIT, layers, experts, seed=0)  # [D, L, E]
    assert pop.shape == (len(FIT.domains), layers, experts)
    np.testing.assert_allclose(pop.sum(-1), 1.0)
    for d, name in enumerate(FIT.domains):
        got = pop[d].max(axis=1) * experts
        want = _real_at_depth(FIT.max_over_mean[name], layers)
        # within 12 % of the real value at that depth (interpolation + renormalisation)
        assert np.all(np.abs(got / want - 1) < 0.12), (name, np.round(got / want, 3))
    mm = pop.max(axis=2) * experts
    assert mm.min() > 0.95 * REAL_MM.min() and mm.max() < 1.1 * REAL_MM.max()


@pytest.mark.parametrize("shape", ["deepseek-v3", "qwen3-vl-30b-a3b"])
def test_mapped_popularity_keeps_the_shift_between_domains(shape):
    layers, experts, _, _ = synth.MODEL_SHAPES[shape]
    pop = synth.domain_popularity(FIT, layers, experts, seed=1)
    d = len(FIT.domains)
    errors = []
    for a in range(d):
        for b in range(a + 1, d):
            got = total_variation(pop[a], pop[b])  # [L]
            want = _real_at_depth(FIT.tv[:, a, b], layers)
            errors.append(got - want)
            assert np.all((got > 0.10) & (got < 0.80))
    errors = np.array(errors)
    assert abs(errors.mean()) < 0.05 and np.abs(errors).mean() < 0.08, np.abs(errors).mean()


def test_generated_single_domain_traces_match_the_real_statistics():
    code, math = _single("code"), _single("math")
    layers = code.num_layers
    for trace, src in ((code, "github"), (math, "arxiv")):
        mm = trace.popularity().max(axis=1) * trace.num_experts
        want = _real_at_depth(FIT.max_over_mean[src], layers)
        assert np.all(np.abs(mm / want - 1) < 0.15)
        assert 2.5 * 0.95 < mm.min() and mm.max() < 7.8 * 1.1
        # per bucket, the requests' own preferences add noise around the domain's curve, not a new shape
        per_bucket = np.median(trace.imbalance(), axis=0)  # [L]
        assert np.all((per_bucket / mm > 0.95) & (per_bucket / mm < 1.25)), np.round(per_bucket / mm, 2)
        assert np.nanmax(trace.imbalance()) < 1.5 * mm.max()
    tv = total_variation(code.popularity(), math.popularity())
    a, b = FIT.domains.index("github"), FIT.domains.index("arxiv")
    want = _real_at_depth(FIT.tv[:, a, b], layers)
    assert np.abs(tv - want).mean() < 0.08, (tv.mean(), want.mean())
    assert 0.15 < tv.min() and tv.max() < 0.75


def test_loads_add_up_to_tokens_times_top_k_and_rates_are_realistic():
    trace = synth.generate("deepseek-v3-chat-code-math", hours=1.0, seed=0)
    assert trace.load.shape == (240, 58, 256)
    assert trace.top_k == 8 and trace.bucket_seconds == 15.0 and trace.model == "deepseek-v3"
    per_layer = trace.load.sum(axis=2)  # [T, L]
    assert np.all(per_layer == per_layer[:, :1])  # every layer sees the same tokens
    assert np.all(per_layer[:, 0] % 8 == 0)
    tokens_per_step = per_layer[:, 0] / 8 / trace.bucket_steps
    assert 2000 < tokens_per_step.min() and tokens_per_step.max() < 4096 * 2.5
    steps_per_second = trace.bucket_steps / trace.bucket_seconds
    assert 15 < steps_per_second.mean() <= 20.0 and steps_per_second.max() <= 20.0
    assert np.all(trace.load == np.round(trace.load))


def test_mix_shift_moves_the_hot_experts_and_steady_does_not():
    def drift(name, **kw):
        t = synth.generate(name, hours=1.5, seed=5, **kw)
        third = t.num_buckets // 3
        first, last = t.slice(0, third).popularity(), t.slice(2 * third, t.num_buckets).popularity()
        return total_variation(first, last).mean(), t

    shifting, t = drift("qwen3-vl-30b-a3b-chat-code-math")
    steady, _ = drift("qwen3-vl-30b-a3b-steady")
    # first third ~ 0.8 chat + 0.1 code + 0.1 math, last ~ 0.2 chat + 0.1 code + 0.7 math:
    # their difference is 0.6 (chat - math), so TV ~ 0.6 x the real TV(tulu, arxiv)
    a, b = FIT.domains.index("tulu"), FIT.domains.index("arxiv")
    expected = 0.6 * _real_at_depth(FIT.tv[:, a, b], t.num_layers).mean()
    assert abs(shifting / expected - 1) < 0.3, (shifting, expected)
    assert steady < 0.05 and shifting > 5 * steady
    mix = t.meta["mix"]
    dom = list(t.meta["domains"])
    assert mix[:20, dom.index("chat")].mean() > 0.6 and mix[-20:, dom.index("math")].mean() > 0.5


def test_shift_at_moves_the_shift():
    early = synth.generate("qwen3-vl-30b-a3b-chat-to-math", hours=1.0, seed=2, shift_at=0.25)
    late = synth.generate("qwen3-vl-30b-a3b-chat-to-math", hours=1.0, seed=2, shift_at=0.75)
    math = list(early.meta["domains"]).index("math")
    t = early.num_buckets
    assert early.meta["mix"][int(0.5 * t), math] > 0.5 > late.meta["mix"][int(0.5 * t), math]
    assert late.meta["mix"][int(0.9 * t), math] > 0.5


def test_bursts_and_day_night():
    day = synth.generate("deepseek-v3-diurnal", model_shape="qwen3-vl-30b-a3b", hours=24, bucket_seconds=300, seed=0)
    rate = day.meta["rate"]
    prof = synth.get_profile("deepseek-v3-diurnal")
    hours = (np.arange(day.num_buckets) + 0.5) * 300 / 3600
    night = rate[(hours > 3) & (hours < 5)]
    afternoon = rate[(hours > 15) & (hours < 17)]
    assert night.mean() < 1.3 * prof.night_ratio and afternoon.mean() > 0.85
    assert day.bucket_steps[(hours > 3) & (hours < 5)].mean() < 0.7 * day.bucket_steps.max()
    bursty = synth.with_phases("qwen3-vl-30b-a3b-steady", [{"chat": 1}],
                               bursts=profiles.Burst(per_hour=20, mean_seconds=120, rate_multiplier=3.0, domain="code"),
                               diurnal=False)
    t = synth.generate(bursty, hours=1.0, seed=4)
    code = list(t.meta["domains"]).index("code")
    in_burst = t.meta["mix"][:, code] > 0.3
    assert in_burst.any() and t.meta["rate"].max() > 2.0
    assert np.all(t.meta["rate"][in_burst] > 1.3)


def test_deterministic_by_seed():
    a = synth.generate("qwen3-vl-30b-a3b-chat-code-math", hours=0.5, seed=11)
    b = synth.generate("qwen3-vl-30b-a3b-chat-code-math", hours=0.5, seed=11)
    c = synth.generate("qwen3-vl-30b-a3b-chat-code-math", hours=0.5, seed=12)
    np.testing.assert_array_equal(a.load, b.load)
    np.testing.assert_array_equal(a.bucket_steps, b.bucket_steps)
    assert not np.array_equal(a.load, c.load)
    # the expert layout depends on the seed only, not on the profile
    np.testing.assert_array_equal(
        synth.domain_popularity(FIT, 48, 128, seed=11), synth.domain_popularity(FIT, 48, 128, seed=11)
    )
    s = synth.generate("qwen3-vl-30b-a3b-steady", hours=0.5, seed=11)
    hot_a = np.argsort(a.slice(0, 20).popularity(), axis=1)[:, -3:]
    hot_s = np.argsort(s.popularity(), axis=1)[:, -3:]
    overlap = np.mean([len(set(x) & set(y)) for x, y in zip(hot_a, hot_s)])
    assert overlap >= 2  # both start chat-heavy on the same layout


def test_flat_control_profile():
    t = synth.generate("deepseek-v3-flat", hours=0.25, seed=0)
    mm = t.popularity().max(axis=1) * t.num_experts
    real = np.concatenate(list(profiles.builtin_popularity("mixtral").max_over_mean.values()))  # 1.08-1.33
    assert mm.max() < 1.15 * real.max() and mm.min() > 0.95 * real.min()


def test_custom_shape_and_real_files_as_source(tmp_path):
    t = synth.generate("deepseek-v3-steady", model_shape=(4, 32, 4, 2), hours=0.1, seed=0)
    assert t.load.shape == (24, 4, 32) and t.top_k == 2 and t.model == "4x32-top2"
    flat = profiles.builtin_popularity("mixtral")  # Mixtral's 8 experts are nearly even
    m = synth.generate("deepseek-v3-chat-code-math", hours=0.25, seed=0, source=flat)
    mm = m.popularity().max(axis=1) * m.num_experts
    assert mm.max() < 1.6


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(profile="nope"), r"^profile: unknown profile 'nope'; choose one of: deepseek-v3-chat-code-math, "),
        (dict(profile="deepseek-v3-steady", model_shape="gpt"), r"^model_shape: unknown shape 'gpt'; choose one of: deepseek-v3, qwen3-vl-30b-a3b"),
        (dict(profile="deepseek-v3-steady", model_shape=(4, 30, 4, 2)), r"30 experts do not split into 4 groups"),
        (dict(profile="deepseek-v3-steady", shift_at=0.5), r"^shift_at: profile 'deepseek-v3-steady' has one phase"),
        (dict(profile="deepseek-v3-chat-to-code", shift_at=1.5), r"^shift_at: must be a fraction"),
        (dict(profile="deepseek-v3-steady", hours=0), r"^hours: must be > 0"),
        (dict(profile="deepseek-v3-steady", seed=-1), r"^seed: must be an integer >= 0"),
        (dict(profile="deepseek-v3-steady", peak_steps_per_second=0), r"^peak_steps_per_second: must be > 0"),
        (dict(profile="deepseek-v3-steady", source=[FIT, FIT, FIT]), r"^source: give one expert-counts file"),
        (dict(profile="deepseek-v3-steady", source=[object()]), r"^source: cannot use object as a source"),
        (dict(profile="deepseek-v3-steady", bucket_seconds=-5), r"^bucket_seconds: must be > 0"),
        (dict(profile="deepseek-v3-steady", hours=0.001), r"^hours: .* shorter than one 15.0 s bucket"),
        (dict(profile="deepseek-v3-steady", source=profiles.builtin_popularity("olmoe-sft")),
         (r"^profile: domain 'code' needs source domain github \(or the regimes prefill_in2048 \+ decode_in1800out100\), "
          r"which OLMoE-1B-7B SFT \(allenai\) does not have \(it has: tulu\)")),
    ],
)
def test_bad_requests(kwargs, pattern):
    profile = kwargs.pop("profile")
    with pytest.raises(synth.SynthError, match=pattern):
        synth.generate(profile, **kwargs)


@pytest.mark.parametrize("steps_per_second", [1.0, 4.0, 20.0])
def test_bucket_noise_decorrelates_as_requests_turn_over(steps_per_second):
    """The requests' own preferences persist while they run: the noise's lag-1 autocorrelation is
    exp(-steps per bucket / mean request length), with the fitted 146-token requests."""
    prof = synth.with_phases("qwen3-vl-30b-a3b-steady", [{"chat": 1.0}], bursts=None, mix_jitter=0.0, diurnal=False)
    t = synth.generate(prof, hours=2, seed=0, peak_steps_per_second=steps_per_second, peak_tokens_per_step=64)
    expected = np.exp(-t.bucket_steps.mean() / profiles.builtin_temporal().mean_request_tokens)
    x = np.log(t.load + 1)
    r = (x - x.mean(axis=0))[:, t.popularity() > 2 / t.num_experts]  # [T, hot experts]
    a, b = r[1:], r[:-1]
    lag1 = (a * b).sum(0) / np.sqrt((a * a).sum(0) * (b * b).sum(0))
    assert abs(np.median(lag1) - expected) < 0.06, (np.median(lag1), expected)
