"""The experiment judge (``moe_eplb.eplb.tuning.judge``), pure: the spending rule's boundaries and the
error they keep over many looks, the autocorrelation-robust interval on a known AR(1) series, the
difference in differences removing a fixed pod bias, the batch-size covariate, the crossover's
cancellation of a replica's own speed, and the decision at the last look."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moe_eplb.eplb.tuning import judge
from moe_eplb.eplb.tuning.experiment import t_quantile


def test_spending_spends_alpha_by_the_end_and_little_early() -> None:
    assert judge.spent(0.05, 1.0) == pytest.approx(0.05)
    assert judge.spent(0.05, 0.0) == 0.0
    values = [judge.spent(0.05, t) for t in np.linspace(0.05, 1.0, 20)]
    assert all(b >= a for a, b in zip(values, values[1:]))
    assert judge.spent(0.05, 0.25) < 0.001  # O'Brien-Fleming-type: a quarter of the way, almost nothing


def test_boundaries_match_the_published_obrien_fleming_ones() -> None:
    """Lan-DeMets O'Brien-Fleming-type spending, 5 equally spaced looks, one-sided 0.025: the
    boundaries tabulated in the group-sequential literature (4.877, 3.357, 2.680, 2.290, 2.031)."""
    got = judge.boundaries(0.025, [0.2, 0.4, 0.6, 0.8, 1.0])
    assert got == pytest.approx((4.877, 3.357, 2.680, 2.290, 2.031), abs=0.005)


def _crossing_rate(bounds, taus, rng, paths=40_000) -> float:
    inc = np.diff(np.concatenate([[0.0], taus]))
    s = np.cumsum(rng.standard_normal((paths, len(taus))) * np.sqrt(inc), axis=1)
    return float((s / np.sqrt(taus) >= np.asarray(bounds)).any(axis=1).mean())


def test_many_looks_keep_the_error_at_the_level() -> None:
    """60 looks (every minute of an hour): the spending boundaries cross under no effect about as
    often as the level (0.05); the same looks at a fixed one-sided 5 % boundary (1.645), what the
    judge before issue 40 did at every tick, cross several times as often."""
    rng = np.random.default_rng(3)
    taus = np.arange(1, 61) / 60.0
    spent_rate = _crossing_rate(judge.boundaries(0.05, taus), taus, rng)
    naive_rate = _crossing_rate([1.645] * len(taus), taus, rng)
    assert 0.04 <= spent_rate <= 0.056
    assert naive_rate > 0.15


def test_looks_taken_at_uneven_times_still_spend_the_level() -> None:
    rng = np.random.default_rng(4)
    taus = np.array([0.31, 0.33, 0.5, 0.52, 0.8, 0.97, 1.0])
    assert 0.04 <= _crossing_rate(judge.boundaries(0.05, taus), taus, rng) <= 0.056


def _ar1(rng, n, rho, sd=0.03, mean=0.0):
    e = rng.standard_normal(n) * sd
    x = np.empty(n)
    x[0] = e[0]
    for i in range(1, n):
        x[i] = rho * x[i - 1] + math.sqrt(1 - rho * rho) * e[i]
    return x + mean


def test_the_robust_interval_covers_an_ar1_mean() -> None:
    """240 ticks of AR(1) noise with lag-1 correlation 0.5: the batch-means interval at 90 % covers
    the true mean about 90 % of the time; the plain Student-t interval on the ticks, as if they
    were independent, covers it far less often."""
    rng = np.random.default_rng(7)
    robust = plain = 0
    reps = 400
    for _ in range(reps):
        x = _ar1(rng, 240, 0.5, mean=0.01)
        est = judge.batch_means(x)
        assert est is not None and est.dof == judge.MAX_BATCHES - 1
        half = t_quantile(0.95, est.dof) * est.se
        robust += abs(est.mean - 0.01) <= half
        se = x.std(ddof=1) / math.sqrt(len(x))
        plain += abs(x.mean() - 0.01) <= t_quantile(0.95, len(x) - 1) * se
    assert 0.85 <= robust / reps <= 0.95
    assert plain / reps < 0.80


def test_batch_means_needs_two_batches_and_clips_outliers() -> None:
    assert judge.batch_means([0.01] * (2 * judge.MIN_BATCH - 1)) is None
    rng = np.random.default_rng(1)
    x = rng.normal(0.0, 0.02, 200)
    spoiled = x.copy()
    spoiled[::25] += 0.5  # garbage-collector pauses in one arm's buckets
    clean, hit = judge.batch_means(x), judge.batch_means(spoiled)
    assert abs(hit.mean - clean.mean) < 0.01  # unclipped the shift would be 8 x 0.5 / 200 = 0.02
    assert float(np.max(judge.clip_outliers(spoiled))) < 0.2


def test_did_removes_a_fixed_pod_bias() -> None:
    """The trial's replica is 3 % faster by itself (its GPUs): measured on the same settings before
    the trial, that difference is subtracted; without the pre-period it would pass for the
    settings' effect."""
    rng = np.random.default_rng(11)
    bias, effect = 0.03, 0.0
    pre = judge.batch_means(rng.normal(bias, 0.02, 120))
    post = judge.batch_means(rng.normal(bias + effect, 0.02, 240))
    d = judge.did(post, pre)
    assert abs(d.mean - effect) < 3 * d.se and d.se > post.se
    assert post.mean > 0.02  # what the judge before issue 40 read as a 3 % gain
    unknown = judge.did(post, None, unknown_sd=0.02)
    assert unknown.mean == post.mean and unknown.se == pytest.approx(math.hypot(post.se, 0.02))


def test_adjust_takes_out_what_the_batch_sizes_explain() -> None:
    """A cache-affine router gives the trial's replica more traffic after the pre-period than
    during it (its share drifted): bigger batches, longer steps. The covariate (log batch ratio)
    explains it; the adjusted difference in differences finds the true 0."""
    rng = np.random.default_rng(5)
    n_pre, n_post = 120, 240
    x_pre, x_post = rng.normal(0.0, 0.03, n_pre), rng.normal(0.08, 0.03, n_post)
    beta = -0.5  # step-time difference (trial faster: +) falls as the trial's batch grows
    d_pre = beta * x_pre + rng.normal(0.0, 0.01, n_pre)
    d_post = beta * x_post + rng.normal(0.0, 0.01, n_post)
    kinds = ["step_time"]
    raw = judge.did(judge.batch_means(d_post), judge.batch_means(d_pre))
    a_post, a_pre = judge.adjust([(d_post, x_post, kinds * n_post), (d_pre, x_pre, kinds * n_pre)])
    adj = judge.did(judge.batch_means(a_post), judge.batch_means(a_pre))
    assert raw.mean < -0.03  # a 4 % "loss" that is the router's
    assert abs(adj.mean) < 3 * adj.se + 0.002
    # an even router: nothing to explain, the differences are kept (clipped only)
    even = judge.adjust([(d_pre, np.zeros(n_pre), kinds * n_pre)])
    assert np.allclose(even[0], judge.clip_outliers(d_pre))


def _engine_buckets(rng, n: int = 240, *, c0: float = 0.012, per_token: float = 8e-6, share: float = 0.35):
    """Buckets of one engine over a day's load: tokens per step from 1000 to 2600, the served
    imbalance falling as the load grows (bigger batches spread more evenly over the experts), the
    step time ``(c0 + per_token tok) ((1 - share) + share imbalance)`` with 2 % noise."""
    tok = 1800.0 + 800.0 * np.sin(np.linspace(0.0, 6.0, n)) + rng.normal(0.0, 40.0, n)
    imbalance = 1.35 - 0.12 * (tok - 1000.0) / 1600.0 + rng.normal(0.0, 0.03, n)
    step = (c0 + per_token * tok) * (1.0 - share + share * imbalance) * np.exp(rng.normal(0.0, 0.02, n))
    return step, tok, 1.0 / imbalance


def test_batch_elasticity_is_the_step_models_not_a_log_log_slope() -> None:
    """The step time's elasticity to the batch at the mean batch (per-token part of the balanced
    step: 8e-6 * 1800 / (0.012 + 8e-6 * 1800) = 0.545), from the step-time model with the served
    imbalance in it; a log-log slope of step time on batch over the same buckets reads the imbalance
    that moves with the load (and the model's curvature) and misses it by more than the 0.05 the
    judge can afford (docs/tuner.md)."""
    step, tok, bal = _engine_buckets(np.random.default_rng(11))
    want = 8e-6 * tok.mean() / (0.012 + 8e-6 * tok.mean())
    got = judge.batch_elasticity(step, tok, bal)
    assert got == pytest.approx(want, abs=0.03)
    plain = float(np.polyfit(np.log(tok), np.log(step), 1)[0])
    assert abs(plain - want) > 0.05
    # no served balancedness (the exporter's tokens per rank not scraped), or too few buckets: none
    assert judge.batch_elasticity(step, tok, np.zeros_like(bal)) is None
    assert judge.batch_elasticity(step[:judge.MIN_ELASTICITY_BUCKETS - 1], tok[:39], bal[:39]) is None


def test_adjust_with_a_known_elasticity_fits_no_slope() -> None:
    """With the elasticity known, each step-time difference is raised by elasticity x log batch
    ratio (the trial's bigger batch explains its longer steps); throughput buckets are kept as they
    are; the periods' own means are not touched (no fit across them)."""
    x = np.array([0.1, -0.05, 0.2, 0.0])
    d = np.array([-0.05, 0.025, -0.1, 0.01])
    kinds = ["step_time", "step_time", "throughput_per_gpu", "step_time"]
    (out,) = judge.adjust([(d, x, kinds)], elasticity=0.5)
    assert out == pytest.approx([0.0, 0.0, -0.1, 0.01])


def test_crossover_cancels_a_replicas_own_speed() -> None:
    """Group A is 5 % faster by itself; the trial alternates between the groups, so the blocks read
    effect +- 5 %, and the pairs' averages the effect."""
    rng = np.random.default_rng(2)
    effect, bias = 0.03, 0.05
    blocks = [effect + (bias if k % 2 == 0 else -bias) + rng.normal(0, 0.004) for k in range(10)]
    est = judge.crossover(blocks)
    assert est.n == 5 and est.dof == 4
    assert abs(est.mean - effect) < 0.005
    assert judge.crossover(blocks[: 2 * judge.MIN_PAIRS - 1]) is None


def test_pair_boundaries_are_exact_for_one_look_and_spend_the_level() -> None:
    """One look with every pair is the plain one-sided t test; several looks keep the error at the
    level for independent normal pairs (checked on fresh simulations), where converting the z
    boundaries to the t scale errs above it."""
    (c,) = judge.pair_boundaries(0.05, [5], 5)
    assert c == pytest.approx(t_quantile(0.95, 4), rel=0.01)
    looks, planned = [3, 4, 5, 6], 6
    bounds = judge.pair_boundaries(0.05, looks, planned)
    rng = np.random.default_rng(99)
    w = rng.standard_normal((60_000, planned))
    k = np.arange(1, planned + 1)
    mean = np.cumsum(w, axis=1) / k
    sd = np.sqrt((np.cumsum(w * w, axis=1) - k * mean ** 2) / np.maximum(k - 1, 1))
    t = np.stack([mean[:, n - 1] / (sd[:, n - 1] / math.sqrt(n)) for n in looks], axis=1)
    exact = float((t >= np.asarray(bounds)).any(axis=1).mean())
    assert 0.045 <= exact <= 0.055
    taus = [n / planned for n in looks]
    converted = [judge.t_boundary(z, n - 1) for z, n in zip(judge.boundaries(0.05, taus), looks)]
    assert float((t >= np.asarray(converted)).any(axis=1).mean()) > exact + 0.003


@pytest.mark.parametrize(("mean", "outcome"), [(0.05, judge.WINS), (-0.05, judge.LOSES), (0.005, None)])
def test_decide_before_the_last_look(mean, outcome) -> None:
    est = judge.Robust(mean=mean, se=0.005, dof=11, n=120)
    dec = judge.decide(est, [0.5], alpha=0.05, threshold=0.01, last=False)
    assert dec.outcome == outcome
    assert dec.ci_low < math.expm1(mean) < dec.ci_high


def test_undecided_at_the_last_look_keeps_the_running_settings() -> None:
    """An estimate whose interval still spans the threshold at maxSeconds is undecided -- even where
    the point estimate beats the charge (the judge before issue 40 promoted it then)."""
    est = judge.Robust(mean=math.log1p(0.02), se=0.01, dof=11, n=240)
    dec = judge.decide(est, [0.5, 0.9], alpha=0.05, threshold=0.0139, last=True)
    assert dec.outcome == judge.UNDECIDED and dec.estimate > 0.0139
    assert dec.ci_low < 0.0139 < dec.ci_high
    # the last look spends what is left: a narrower interval decides
    sure = judge.decide(judge.Robust(mean=math.log1p(0.04), se=0.006, dof=11, n=240), [0.5, 0.9], alpha=0.05,
                        threshold=0.0139, last=True)
    assert sure.outcome == judge.WINS


def test_an_early_look_with_a_huge_boundary_reports_an_open_interval_not_an_overflow() -> None:
    """The first look of a long experiment, with few degrees of freedom: the spending rule's
    boundary is so wide that ``exp`` of the interval's end would overflow a float (the operator's
    timer once failed on it every tick). The interval is open at the top, nothing is decided."""
    est = judge.Robust(mean=0.02, se=200.0, dof=11, n=120)
    dec = judge.decide(est, [0.2], alpha=0.05, threshold=0.0139, last=False)
    assert dec.outcome is None and dec.ci_high == math.inf and dec.ci_low == -1.0
    assert dec.estimate == pytest.approx(math.expm1(0.02))
