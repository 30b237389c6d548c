"""The judge of an experiment: an interval and a stopping rule the field's noise cannot fool (pure, numpy).

What fooled the first judge (measured on the simulated engines with a real cluster's noise):
its interval was re-checked at every 15 s tick with no correction (181 looks in an hour), the ticks'
noise is correlated (lag-1 +0.33: a plain standard error is too small), the restarted arm's first
minutes (vLLM's initial placement, a cold prefix cache) were counted, and a fixed difference between
two pods' speeds was read as the settings' effect. This module holds the answer to each; the
experiment state machine (:mod:`moe_eplb.controller.experiment`) decides which values count:

* **robust errors** -- :func:`batch_means`: the per-bucket differences, outliers clipped
  (:func:`clip_outliers`), grouped into consecutive batches long enough to be nearly independent;
  the standard error of the batches' mean with ``batches - 1`` degrees of freedom;
* **repeated looks** -- :func:`boundaries`: a Lan-DeMets error-spending rule, an
  O'Brien-Fleming-type spending function of the information fraction (:func:`spent`); each look's
  boundary is computed for the looks actually taken (the density of the running sum carried from
  look to look on a grid), so the chance of ever crossing a boundary when nothing differs stays at
  the level however many looks there were; a boundary on the z scale becomes one on the t scale of
  the estimate's degrees of freedom at the same tail probability (:func:`t_boundary`). Where the
  estimate is the mean of a few independent pair contrasts (the interleaved design, 2-10 degrees of
  freedom), that conversion errs by a point or more, so the boundaries of the t statistics
  themselves are found by simulation instead (:func:`pair_boundaries`: the statistics' joint law
  under no effect does not depend on the noise's scale);
* **pod bias** -- :func:`did`: the trial pod's difference from the control measured on the same
  settings before the trial (the pre-period), subtracted (difference in differences), after
  :func:`adjust` took out what the two sides' different batch sizes explain (a cache-affine router
  sends one replica more requests than another, and a bigger batch takes longer steps: the
  per-bucket log batch ratio times the step time's elasticity to the batch, which the control pods'
  own step-time model gives, :func:`batch_elasticity`; a slope fitted over both periods where no
  served balancedness is scraped);
  :func:`crossover`: the interleaved design's block contrasts (each pair of consecutive blocks swaps
  which replicas run the trial, so a replica's own speed cancels in the pair);
* **the rule** -- :func:`decide`: at a look, promote when the estimate's lower boundary is above the
  promotion threshold, "loses" when its upper boundary is below 0, and at the last look (maxSeconds)
  an experiment that crossed neither is **undecided**: the running settings stay.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from moe_eplb.eplb.tuning.calibrate.step_time import fit_step_model
from moe_eplb.eplb.tuning.experiment import t_quantile

__all__ = ["Robust", "clip_outliers", "batch_means", "adjust", "batch_elasticity", "MIN_ELASTICITY_BUCKETS", "did",
           "crossover", "spent", "boundaries", "t_boundary", "Decision", "decide", "WINS", "LOSES", "UNDECIDED",
           "MIN_BATCH", "MAX_BATCHES", "MIN_PAIRS"]

#: fewest buckets in a batch of :func:`batch_means` at the operator's 15 s tick (:data:`BATCH_SECONDS`)
MIN_BATCH = 8
#: the least time a batch spans: several times the correlation time of the noise measured on
#: simulated and reported clusters (:func:`batch_size` turns it into buckets of a given length)
BATCH_SECONDS = 120.0
#: most batches: more buckets make longer batches (their correlation shrinks with their length)
MAX_BATCHES = 12
#: fewest block pairs the interleaved design needs for an interval (2 degrees of freedom)
MIN_PAIRS = 3
#: per-bucket differences farther than this many MADs from their median are clipped to it
CLIP_MADS = 4.0
#: a look happens only once the information fraction grew this much since the last one
MIN_LOOK_STEP = 0.05

WINS, LOSES, UNDECIDED = "wins", "loses", "undecided"

_N = NormalDist()


@dataclass(frozen=True)
class Robust:
    """An estimate of a mean difference (log scale) with its standard error and degrees of freedom;
    ``n``: the values (buckets or block pairs) behind it."""

    mean: float
    se: float
    dof: float
    n: int


def clip_outliers(values: Sequence[float], mads: float = CLIP_MADS) -> np.ndarray:
    """``values`` with those farther than ``mads`` median absolute deviations (scaled to a normal sd)
    from their median clipped to that distance: a garbage-collector pause or a burst of long prefills
    in one pod's bucket (20-60 % longer steps) would otherwise weigh as much as minutes of data.
    Symmetric, so it does not move the centre of a symmetric noise."""
    x = np.asarray(values, dtype=float)
    if len(x) < 4:
        return x
    med = float(np.median(x))
    mad = 1.4826 * float(np.median(np.abs(x - med)))
    if mad <= 0:
        return x
    return np.clip(x, med - mads * mad, med + mads * mad)


def batch_size(buckets: int, seconds: float) -> int:
    """Buckets per batch where ``buckets`` buckets span ``seconds``: enough for :data:`BATCH_SECONDS`
    (8 at 15 s ticks; 1 where a busy loop's ticks are 2 minutes apart)."""
    if buckets <= 0 or seconds <= 0:
        return MIN_BATCH
    return max(1, math.ceil(BATCH_SECONDS / (seconds / buckets) - 1e-9))


def batch_means(values: Sequence[float], *, min_batch: int = MIN_BATCH, max_batches: int = MAX_BATCHES) -> Robust | None:
    """The mean of ``values`` (per-bucket differences in time order) with an autocorrelation-robust
    standard error: outliers clipped, the buckets cut into ``k = min(max_batches, n // min_batch)``
    consecutive batches, the standard error of the batches' mean from their spread, ``k - 1``
    degrees of freedom. A batch spans several correlation times of the noise, so the batches are
    nearly independent where the buckets are not (``min_batch``: :func:`batch_size`). None with
    fewer than two batches."""
    x = clip_outliers(values)
    k = min(int(max_batches), len(x) // max(1, int(min_batch)))
    if k < 2:
        return None
    means = np.array([b.mean() for b in np.array_split(x, k)])
    return Robust(mean=float(means.mean()), se=float(means.std(ddof=1) / math.sqrt(k)), dof=float(k - 1), n=len(x))


#: a covariate whose values spread less than this (log ratio sd) explains nothing: left out
MIN_COVARIATE_SD = 0.005
#: the log-sd of a pod's own speed assumed where a pre-period measured none (a cluster's pods differ
#: by several percent): an experiment that could not measure its pods' differences stays undecided
#: unless its effect is far beyond them
UNMEASURED_POD_SD = 0.03


def adjust(periods: Sequence[tuple[Sequence[float], Sequence[float], Sequence[str]]], *,
           kinds: Sequence[str] = ("step_time",), elasticity: float | None = None) -> list[np.ndarray]:
    """The per-bucket differences of each period less what their batch sizes explain: each period
    is ``(differences, log batch ratios, objective kinds)``. Only the step time is adjusted by
    default: an engine's batch is the traffic's where it is not saturated, while a saturated
    engine's batch is what its KV cache holds -- which a change of redundancy changes, so there the
    batch is part of the effect, not noise. Outliers are clipped first.

    ``elasticity``: the step time's elasticity to the batch (d log step / d log tokens per step,
    from the step-time model fitted on the control pods' own buckets, :func:`batch_elasticity`):
    a step-time difference (log control / trial) is adjusted by ``elasticity`` times its log batch
    ratio. Without it, one slope per objective kind in ``kinds`` is fitted by least squares over
    every period at once with one mean per period -- from the few percent the router's split
    varies within an experiment, so within about +-0.25 (docs/tuner.md), an error the batch-means
    interval does not see where the split moved between the periods. A kind whose ratios hardly
    vary (an even router) keeps its differences as they are."""
    ds = [clip_outliers(d) for d, _, _ in periods]
    if not ds or not sum(len(d) for d in ds):
        return [np.asarray(d, dtype=float) for d in ds]
    if elasticity is not None:
        out = []
        for d, (_, x, kk) in zip(ds, periods):
            adjusted = np.asarray([k in kinds for k in kk], dtype=bool)
            out.append(d + np.where(adjusted, float(elasticity) * np.asarray(x, dtype=float), 0.0))
        return out
    xs = [np.asarray(x, dtype=float) for _, x, _ in periods]
    ks = [list(k) for _, _, k in periods]
    kinds = sorted({k for kk in ks for k in kk} & set(kinds))
    rows, ys = [], []
    cols = [(kind, np.concatenate([np.where(np.asarray(k) == kind, x, 0.0) for x, k in zip(xs, ks)]))
            for kind in kinds]
    cols = [(kind, c) for kind, c in cols if np.count_nonzero(c) > 2 and np.std(c[c != 0.0]) >= MIN_COVARIATE_SD]
    if not cols:
        return ds
    n = [len(d) for d in ds]
    for p, size in enumerate(n):
        rows.append(np.repeat(np.eye(len(n))[p][None, :], size, axis=0))
        ys.append(ds[p])
    a = np.hstack([np.vstack(rows)] + [c[:, None] for _, c in cols])
    coef, *_ = np.linalg.lstsq(a, np.concatenate(ys), rcond=None)
    slopes = coef[len(n):]
    out, at = [], 0
    for p, size in enumerate(n):
        explained = sum(slope * c[at:at + size] for slope, (_, c) in zip(slopes, cols))
        out.append(ds[p] - explained)
        at += size
    return out


def did(post: Robust, pre: Robust | None, *, unknown_sd: float = 0.0) -> Robust:
    """Difference in differences: the trial's difference from the control (``post``) less the same
    pods' difference on the same settings before the trial (``pre``); their errors add (independent
    periods), the degrees of freedom by Welch-Satterthwaite. Without a pre-period for the trial's
    pod (it runs where none was measured) its bias is unknown: 0 with the standard error
    ``unknown_sd`` (the spread of the measured pods' biases)."""
    if pre is None:
        se = math.hypot(post.se, unknown_sd)
        return Robust(mean=post.mean, se=se, dof=post.dof, n=post.n)
    a, b = post.se ** 2, pre.se ** 2
    dof = (a + b) ** 2 / (a * a / max(post.dof, 1.0) + b * b / max(pre.dof, 1.0)) if a + b > 0 else post.dof
    return Robust(mean=post.mean - pre.mean, se=math.sqrt(a + b), dof=float(dof), n=post.n)


#: fewest buckets of the control pods with a step time, a batch and a served balancedness for the
#: step-time model behind :func:`batch_elasticity`
MIN_ELASTICITY_BUCKETS = 40


def batch_elasticity(step_seconds: Sequence[float], tokens_per_step: Sequence[float],
                     balancedness: Sequence[float]) -> float | None:
    """The step time's elasticity to the batch from the control pods' own buckets (the pre-period's
    and the trial's control side: the same pods, the same settings throughout), by the calibration's
    step-time model (:func:`moe_eplb.eplb.tuning.calibrate.step_time.fit_step_model`: the balanced
    step time affine in the tokens per step, times the served imbalance's share): the load's ups and
    downs over the experiment span a far wider range of batches than the router's split between two
    pods does, and the imbalance, which moves with the load, is in the model rather than in the
    slope. None with fewer than :data:`MIN_ELASTICITY_BUCKETS` usable buckets (no balancedness: the
    exporter's tokens per rank are not scraped) or no fit."""
    rows = [(s, t, 1.0 / b) for s, t, b in zip(step_seconds, tokens_per_step, balancedness)
            if s and t and b and s > 0 and t > 0 and 0 < b <= 1]
    if len(rows) < MIN_ELASTICITY_BUCKETS:
        return None
    y, tok, imb = (np.asarray(c, dtype=float) for c in zip(*rows))
    e = fit_step_model(y, np.ones_like(y), tok, imb).batch_elasticity
    return None if e is None or not math.isfinite(e) else min(1.0, max(0.0, e))


def crossover(block_values: Sequence[float]) -> Robust | None:
    """The interleaved design's estimate from its blocks' values in time order (each the trial arm's
    difference from the control arm over a block's counted buckets; the replicas running the trial
    swap from one block to the next): the mean of the complete pairs' averages, the standard error
    from their spread, ``pairs - 1`` degrees of freedom. A replica's own speed enters the two blocks
    of a pair with opposite signs, and a drift over time nearly so, so both cancel in the pair;
    the pairs, minutes apart, are nearly independent. None with fewer than :data:`MIN_PAIRS` pairs."""
    v = np.asarray(block_values, dtype=float)
    pairs = len(v) // 2
    if pairs < MIN_PAIRS:
        return None
    w = (v[0:2 * pairs:2] + v[1:2 * pairs:2]) / 2.0
    return Robust(mean=float(w.mean()), se=float(w.std(ddof=1) / math.sqrt(pairs)), dof=float(pairs - 1), n=pairs)


# --- the spending rule ----------------------------------------------------------------------------


def spent(alpha: float, tau: float) -> float:
    """The one-sided error ``alpha`` spent by information fraction ``tau`` (0..1): the Lan-DeMets
    O'Brien-Fleming-type function ``2 - 2 Phi(z_(1 - alpha/2) / sqrt(tau))`` -- almost nothing
    early, when an estimate is noisiest, and ``alpha`` at ``tau = 1``."""
    if tau <= 0:
        return 0.0
    z = _N.inv_cdf(1.0 - alpha / 2.0)
    return float(min(alpha, 2.0 - 2.0 * _N.cdf(z / math.sqrt(min(1.0, tau)))))


#: the running sum's grid on the scale of the whole experiment (tau = 1): +-9 sd, 0.01 sd apart
_GRID = np.linspace(-9.0, 9.0, 1801)
_DS = float(_GRID[1] - _GRID[0])


@functools.lru_cache(maxsize=4096)
def _looks(alpha: float, taus: tuple[float, ...]) -> tuple[tuple[float, ...], np.ndarray]:
    """``(z boundaries, the running sum's sub-density after the last look)`` for looks at ``taus``;
    each call adds one look to its (cached) prefix's state: the density carried from the previous
    look by a normal step of variance ``tau - tau_prev`` (a convolution on the grid), the boundary
    where the mass above it equals the error this look spends, the density then cut there."""
    tau = taus[-1]
    inc = spent(alpha, tau) - spent(alpha, taus[-2] if len(taus) > 1 else 0.0)
    if len(taus) == 1:
        c = math.inf if inc <= 0 else _N.inv_cdf(1.0 - inc)
        sd = math.sqrt(tau)
        dens = np.exp(-0.5 * (_GRID / sd) ** 2) / (sd * math.sqrt(2 * math.pi))
        bounds: tuple[float, ...] = (c,)
    else:
        prev_bounds, prev = _looks(alpha, taus[:-1])
        step = math.sqrt(tau - taus[-2])
        half = int(math.ceil(8.0 * step / _DS))
        offsets = np.arange(-half, half + 1) * _DS
        kernel = np.exp(-0.5 * (offsets / step) ** 2) / (step * math.sqrt(2 * math.pi)) * _DS
        dens = np.convolve(prev, kernel, mode="same")
        if inc <= 0:
            c = math.inf
        else:
            # the mass above each grid point (trapezoid), then the point where it equals ``inc``
            cells = (dens[1:] + dens[:-1]) / 2.0 * _DS
            above = np.concatenate([np.cumsum(cells[::-1])[::-1], [0.0]])
            j = int(np.searchsorted(-above, -inc))  # first point whose mass above is <= inc
            if j <= 0:
                b = float(_GRID[0])
            elif j >= len(_GRID):
                b = float(_GRID[-1])
            else:
                a0, a1 = above[j - 1], above[j]
                frac = (a0 - inc) / (a0 - a1) if a0 > a1 else 0.0
                b = float(_GRID[j - 1] + frac * _DS)
            c = b / math.sqrt(tau)
        bounds = prev_bounds + (c,)
    cut = bounds[-1] * math.sqrt(tau)
    return bounds, np.where(_GRID < cut, dens, 0.0)


def boundaries(alpha: float, taus: Sequence[float]) -> tuple[float, ...]:
    """The z boundaries of looks at information fractions ``taus`` (increasing, in (0, 1]) that
    spend one-sided error ``alpha`` by :func:`spent`: under no effect the running z statistic
    crosses boundary k (and none before) with probability ``spent(tau_k) - spent(tau_(k-1))``,
    computed for the Brownian motion the running sum of independent increments follows."""
    clean: list[float] = []
    for t in taus:
        t = min(1.0, max(1e-6, float(t)))
        if not clean or t > clean[-1]:
            clean.append(round(t, 6))
    if not clean:
        return ()
    return _looks(float(alpha), tuple(clean))[0]


def t_boundary(z: float, dof: float) -> float:
    """A z boundary on the t scale of ``dof`` degrees of freedom, at the same upper tail probability
    (the estimate's standard error is itself estimated)."""
    if not math.isfinite(z):
        return math.inf
    p = _N.cdf(z)
    if p >= 1.0 - 1e-12:
        return math.inf
    if p <= 0.5:
        return z
    return t_quantile(p, max(1.0, dof))


#: paths of :func:`pair_boundaries`' simulation (its seed is fixed: the same looks, the same boundaries)
PAIR_PATHS = 100_000


@functools.lru_cache(maxsize=512)
def _pair_boundaries(alpha: float, looks: tuple[int, ...], planned: int) -> tuple[float, ...]:
    rng = np.random.default_rng(40_2026)
    top = looks[-1]
    w = rng.standard_normal((PAIR_PATHS, top))
    k = np.arange(1, top + 1)
    mean = np.cumsum(w, axis=1) / k
    var = (np.cumsum(w * w, axis=1) - k * mean * mean) / np.maximum(k - 1, 1)
    alive = np.ones(PAIR_PATHS, dtype=bool)
    out, before = [], 0.0
    for j, n in enumerate(looks):
        tau = 1.0 if j == len(looks) - 1 and n >= planned else min(1.0, n / planned)
        inc = spent(alpha, tau) - before
        before = spent(alpha, tau)
        t = mean[:, n - 1] / np.sqrt(var[:, n - 1] / n)
        want = int(round(inc * PAIR_PATHS))
        if want <= 0:
            out.append(math.inf)
            continue
        live = np.sort(t[alive])[::-1]
        c = float(live[min(want, len(live)) - 1]) if len(live) else math.inf
        out.append(c)
        alive &= t < c
    return tuple(out)


def pair_boundaries(alpha: float, looks: Sequence[int], planned: int) -> tuple[float, ...]:
    """The t boundaries of looks after ``looks`` complete pairs (increasing, each >= 2) when
    ``planned`` pairs make the whole experiment: under no effect, with the pairs' contrasts
    independent and normal, the t statistic of the first k pairs crosses look j's boundary (and none
    before) with probability ``spent(tau_j) - spent(tau_(j-1))``, ``tau = pairs / planned`` (1 at a
    look with all planned pairs). Found by simulating the statistics (their law does not depend on
    the noise's scale), with a fixed seed."""
    clean = tuple(sorted({int(n) for n in looks if int(n) >= 2}))
    if not clean:
        return ()
    return _pair_boundaries(float(alpha), clean, max(int(planned), clean[-1]))


@dataclass(frozen=True)
class Decision:
    """One look's result: ``outcome`` :data:`WINS`, :data:`LOSES`, :data:`UNDECIDED` (the last look
    crossed neither boundary) or None (measure on); the estimate and the repeated confidence
    interval of this look (``ci_low``: the boundary a promotion must clear; ``ci_high``: the one a
    loss must fall below), all on the relative scale (``+0.03``: 3 % better)."""

    outcome: str | None
    estimate: float
    ci_low: float
    ci_high: float
    tau: float
    dof: float


def decide(est: Robust, looks: Sequence[float], *, alpha: float, threshold: float, last: bool,
           pairs: tuple[Sequence[int], int] | None = None) -> Decision:
    """Apply the rule at the look whose information fraction is ``looks[-1]`` (``looks``: every look
    so far, this one included). Each side spends one-sided ``alpha``: promote when
    ``(mean - log(1 + threshold)) / se`` reaches the upper boundary, loses when ``-mean / se``
    reaches the lower one; at the ``last`` look
    (maxSeconds) the rest of the error is spent and an estimate that crossed neither is undecided.
    ``pairs``: ``(pairs at each look, planned pairs)`` where the estimate is a mean of pair
    contrasts (:func:`crossover`): the boundaries of :func:`pair_boundaries`."""
    taus = list(looks)
    if last:
        taus[-1] = 1.0
    def bound(a: float) -> float:
        if pairs is not None:
            at, planned = pairs
            return pair_boundaries(a, at, planned if not last else min(int(planned), int(at[-1])))[-1]
        return t_boundary(boundaries(a, taus)[-1] if taus else math.inf, est.dof)

    c_up = c_down = bound(alpha)
    floor = math.log1p(threshold)
    lo = est.mean - c_up * est.se if math.isfinite(c_up) else -math.inf
    hi = est.mean + c_down * est.se if math.isfinite(c_down) else math.inf
    outcome = None
    if lo > floor:
        outcome = WINS
    elif hi < 0:
        outcome = LOSES
    elif last:
        outcome = UNDECIDED
    return Decision(outcome=outcome, estimate=_relative(est.mean), ci_low=_relative(lo), ci_high=_relative(hi),
                    tau=taus[-1] if taus else 0.0, dof=est.dof)


def _relative(log_ratio: float) -> float:
    """A log ratio as a relative difference (``exp(x) - 1``): -1 and +inf at the ends, and for an
    early look's boundary so wide that ``exp`` would overflow a float."""
    if math.isnan(log_ratio):
        return log_ratio
    if log_ratio > 700.0:
        return math.inf
    return math.expm1(log_ratio) if log_ratio > -700.0 else -1.0
