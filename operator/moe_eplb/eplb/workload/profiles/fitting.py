"""Fitting (pure): :func:`fit_popularity`, :func:`fit_temporal`, :func:`fit_group_loading` and the
statistics they and the generator's tests use (sorted curves, normal scores, total variation,
the Dirichlet concentration, the static placement's imbalance)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from moe_eplb.eplb.workload.profiles.fits import _LOG_FLOOR, QUANTILE_RANKS, PopularityFit, TemporalFit
from moe_eplb.eplb.workload.trace import TraceError


def sorted_curve(share: np.ndarray) -> np.ndarray:
    """``[..., E]`` shares -> ``[..., Q]`` ``log(E * share)`` of the sorted shares at
    :data:`QUANTILE_RANKS` (linear interpolation between ranks)."""
    share = np.asarray(share, dtype=np.float64)
    e = share.shape[-1]
    s = np.sort(share / share.sum(axis=-1, keepdims=True) * e, axis=-1)
    pos = np.asarray(QUANTILE_RANKS) * (e - 1)
    lo = np.floor(pos).astype(int)
    hi = np.minimum(lo + 1, e - 1)
    frac = pos - lo
    vals = s[..., lo] * (1 - frac) + s[..., hi] * frac
    return np.log(np.maximum(vals, _LOG_FLOOR))


def normal_scores(x: np.ndarray) -> np.ndarray:
    """van der Waerden normal scores ``Phi^-1((rank + 0.5) / n)`` of ``x`` along the last axis
    (tied values share their mean rank)."""
    from statistics import NormalDist

    x = np.asarray(x, dtype=np.float64)
    n = x.shape[-1]
    flat = x.reshape(-1, n)
    inv = np.vectorize(NormalDist().inv_cdf)
    out = np.empty_like(flat)
    for i, row in enumerate(flat):
        ranks = np.empty(n)
        ranks[np.argsort(row, kind="stable")] = np.arange(n, dtype=np.float64)
        _, inverse, counts = np.unique(row, return_inverse=True, return_counts=True)
        ranks = (np.bincount(inverse, weights=ranks) / counts)[inverse]
        out[i] = inv((ranks + 0.5) / n)
    return out.reshape(x.shape)


def total_variation(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """TV distance ``0.5 * sum |p - q|`` between share vectors along the last axis."""
    p = p / p.sum(axis=-1, keepdims=True)
    q = q / q.sum(axis=-1, keepdims=True)
    return 0.5 * np.abs(p - q).sum(axis=-1)


def dirichlet_tv(share: np.ndarray, kappa: float) -> np.ndarray:
    """Mean TV distance between ``q ~ Dirichlet(kappa * share)`` and ``share`` (normal
    approximation ``E|q_e - p_e| = sqrt(2 / pi) * sd_e``), along the last axis."""
    p = np.asarray(share, dtype=np.float64)
    return 0.5 * np.sqrt(2 / np.pi) * np.sqrt(p * (1 - p) / (kappa + 1.0)).sum(axis=-1)


def kappa_for_tv(share: np.ndarray, tv: float) -> float:
    """The concentration whose Dirichlet draws lie ``tv`` (mean TV) from ``share`` (rows ``[..., E]``
    averaged): the inverse of :func:`dirichlet_tv`."""
    p = np.asarray(share, dtype=np.float64)
    spread = float(np.mean(0.5 * np.sqrt(2 / np.pi) * np.sqrt(p * (1 - p)).sum(axis=-1)))
    return max((spread / tv) ** 2 - 1.0, 0.0)


def mean_domain_tv(fit: PopularityFit) -> float | None:
    """Mean TV distance between two domains, over all pairs and sampled layers (None if < 2)."""
    d = len(fit.domains)
    if d < 2:
        return None
    upper = np.triu_indices(d, 1)
    return float(np.mean([fit.tv[k][upper] for k in range(len(fit.depth))]))


def curve_values(log_quantiles: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The sorted-popularity curve read at rank fractions ``u``.

    Args:
        log_quantiles: ``[..., Q]`` ``log(E * share)`` at :data:`QUANTILE_RANKS`.
        u: ``[..., E]`` rank fractions in [0, 1] (0 = least popular), same leading shape.

    Returns:
        ``[..., E]`` ``E * share`` (not renormalised), linear in the log between the kept ranks.
    """
    xp = np.asarray(QUANTILE_RANKS)
    j = np.clip(np.searchsorted(xp, u, side="right") - 1, 0, len(xp) - 2)
    frac = (u - xp[j]) / (xp[j + 1] - xp[j])
    lq = log_quantiles
    return np.exp(np.take_along_axis(lq, j, -1) * (1 - frac) + np.take_along_axis(lq, j + 1, -1) * frac)


class StaticImbalance(NamedTuple):
    """Whole-trace load concentration under vLLM's static placement (:func:`static_imbalance`)."""

    busiest_gpu: float  # median over layers of (busiest GPU's load / mean GPU load)
    hottest_expert: float  # median over layers of (hottest expert's load / mean expert load)


def static_imbalance_per_layer(load: np.ndarray, ep_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Busiest-GPU/mean and hottest-expert/mean of each row of ``load``.

    Args:
        load: ``[..., E]`` load (or shares) per logical expert of one layer, e.g. ``[L, E]`` a
            trace's load summed over its buckets.
        ep_size: GPUs of the expert-parallel group. vLLM's static placement (no EPLB) puts the
            contiguous range ``g * E / ep_size .. (g + 1) * E / ep_size - 1`` on GPU g.

    Returns:
        ``([...], [...])``: the busiest GPU's load over the mean GPU load, and the hottest expert's
        load over the mean expert load (1.0 for a row with no load).
    """
    load = np.asarray(load, dtype=np.float64)
    e = load.shape[-1]
    if ep_size < 1 or e % ep_size:
        raise TraceError(f"ep_size: {e} experts do not split evenly over {ep_size} GPUs")
    per_gpu = load.reshape(*load.shape[:-1], ep_size, e // ep_size).sum(-1)
    mean = load.mean(-1)
    safe = np.where(mean > 0, mean, 1.0)
    gpu = np.where(mean > 0, per_gpu.max(-1) / (safe * (e // ep_size)), 1.0)
    expert = np.where(mean > 0, load.max(-1) / safe, 1.0)
    return gpu, expert


def static_imbalance(load: np.ndarray, ep_size: int = 32) -> StaticImbalance:
    """How unevenly a workload loads the GPUs and experts without EPLB -- the figures the
    DeepSeek-V3 profiles are fitted and tested against.

    Definition: sum the load over the whole trace per layer (``[T, L, E]`` -> ``[L, E]``; a
    ``[L, E]`` array is taken as already summed). For each layer, place the experts as vLLM does
    without EPLB (contiguous ranges of ``E / ep_size`` experts per GPU, see
    :func:`static_imbalance_per_layer`) and take the busiest GPU's load over the mean GPU load, and
    the hottest expert's load over the mean expert load. Report the median of each over the layers.

    Real DeepSeek-V3 (SGLang's expert counts, EP 32): busiest GPU 2.04-2.52, hottest expert
    5.20-7.06 over the six regimes (docs/traces.md).
    """
    load = np.asarray(load, dtype=np.float64)
    if load.ndim == 3:
        load = load.sum(axis=0)
    if load.ndim != 2:
        raise TraceError(f"load: expected [L, E] or [T, L, E], got shape {load.shape}")
    gpu, expert = static_imbalance_per_layer(load, ep_size)
    return StaticImbalance(busiest_gpu=float(np.median(gpu)), hottest_expert=float(np.median(expert)))


def moe_depth(counts) -> np.ndarray:
    """``[K]`` relative depth of each sampled layer among the MoE layers. A file that lists every
    layer from its first one to the model's last (DeepSeek-V3: layers 3..60, the first three are
    dense) spans the MoE layers evenly from 0 to 1; otherwise ``counts.depth()``."""
    layers = np.asarray(counts.layers)
    every = len(layers) > 1 and np.array_equal(layers, np.arange(layers[0], counts.num_layers))
    if every and layers[0] > 0:
        return np.arange(len(layers), dtype=np.float64) / (len(layers) - 1)
    return np.asarray(counts.depth(), dtype=np.float64)


# a^2 grid searched by fit_group_loading, and its draws per grid point
_GROUP_GRID = np.linspace(0.0, 0.98, 50)
_GROUP_DRAWS = 64


def fit_group_loading(
    shares: np.ndarray,
    log_quantiles: np.ndarray,
    num_groups: int,
    ep_size: int = 32,
    seed: int = 0,
) -> np.ndarray:
    """Group loading ``a^2`` per domain that reproduces the real busiest-GPU/mean of
    :func:`static_imbalance` (median over layers, static placement over ``ep_size`` GPUs).

    The generator gives expert e of group g(e) the latent ``a * g + sqrt(1 - a^2) * eps_e``
    (``g``, ``eps`` standard normal) and the curve's value at the latent's rank. For each domain
    this searches ``a^2`` on a grid (0 .. 0.98) for the value at which the median over random
    layouts (the same draws for every grid point) of the median over layers of the busiest
    GPU/mean equals the real one (linear interpolation; 0 or 0.98 at the ends). One value per domain
    rather than per layer: a layer's busiest GPU is a single draw of its group layout, and per-layer
    values that noisy would make the domains' loadings inconsistent with their correlation.

    A moment fit on the experts' normal scores falls short: the real hot experts cluster in their
    groups more than a Gaussian copula with the same rank correlation puts them (DeepSeek-V3
    decode: 5.8 of the 8 hottest experts of a layer in its hottest group, vs 3.8).

    Args:
        shares: ``[D, K, E]`` real expert shares (K: every layer of the model).
        log_quantiles: ``[D, K, Q]`` their curves as the generator reads them (rounded as shipped).
        num_groups: the source's expert groups (contiguous ``E / num_groups`` experts each).
        ep_size: GPUs of the static placement the busiest GPU is measured on.
        seed: seed of the layouts drawn.

    Returns:
        ``[D]`` ``a^2``.
    """
    d, k, e = shares.shape
    if e % num_groups or e % ep_size:
        raise TraceError(f"fit_group_loading: {e} experts do not split into {num_groups} groups and {ep_size} GPUs")
    target = np.array([static_imbalance(shares[i], ep_size).busiest_gpu for i in range(d)])
    u = np.broadcast_to(np.arange(e) / (e - 1), (d * k, e))
    v_sorted = curve_values(np.asarray(log_quantiles, dtype=np.float64).reshape(d * k, -1), u)  # [DK, E]
    rng = np.random.default_rng([seed, 7])
    g = np.repeat(rng.standard_normal((_GROUP_DRAWS, num_groups)), e // num_groups, axis=1)  # [N, E]
    eps = rng.standard_normal((_GROUP_DRAWS, e))
    table = np.empty((len(_GROUP_GRID), d))
    for i, a2 in enumerate(_GROUP_GRID):
        z = np.sqrt(a2) * g + np.sqrt(1.0 - a2) * eps
        rank = np.argsort(np.argsort(z, axis=1, kind="stable"), axis=1, kind="stable")  # [N, E]
        busiest, _ = static_imbalance_per_layer(v_sorted[:, rank], ep_size)  # [DK, N]
        table[i] = np.median(np.median(busiest.reshape(d, k, -1), axis=1), axis=1)
    table = np.maximum.accumulate(table, axis=0)  # monotone in a^2 (removes draw noise)
    return np.array([np.interp(target[j], table[:, j], _GROUP_GRID) for j in range(d)])


def fit_popularity(counts, num_groups: int = 1, ep_size: int = 32, digits: int | None = None) -> PopularityFit:
    """Fit a :class:`PopularityFit` from a :class:`~moe_eplb.eplb.workload.tracefile.DomainCounts`.

    With ``num_groups > 1`` (the source's experts come in that many contiguous groups, as
    DeepSeek-V3's 8 groups of 32) the group structure is fitted too: :func:`fit_group_loading` on the
    static placement over ``ep_size`` GPUs, on the curves rounded to ``digits`` decimals as
    :meth:`PopularityFit.to_dict` will ship them (5 if None), and the correlation between domains of
    the groups' mean normal scores, pooled over the layers.
    """
    domains = counts.domains
    shares = {d: counts.popularity(d) for d in domains}  # [K, E]
    k = len(counts.layers)
    scores = np.stack([normal_scores(shares[d]) for d in domains], axis=1)  # [K, D, E]
    corr = np.stack([np.corrcoef(scores[i]) if len(domains) > 1 else np.ones((1, 1)) for i in range(k)])
    corr = np.clip(corr, -1.0, 1.0)
    tv = np.zeros((k, len(domains), len(domains)))
    for a, da in enumerate(domains):
        for b, db in enumerate(domains):
            tv[:, a, b] = total_variation(shares[da], shares[db])
    log_quantiles = {d: sorted_curve(shares[d]) for d in domains}
    loading = group_corr = busiest = None
    if num_groups > 1:
        e = counts.num_experts
        stacked = np.stack([shares[d] for d in domains])  # [D, K, E]
        shipped = np.round(np.stack([log_quantiles[d] for d in domains]), 5 if digits is None else digits)
        loading = fit_group_loading(stacked, shipped, num_groups, ep_size)
        busiest = np.array([static_imbalance(s, ep_size).busiest_gpu for s in stacked])
        group_means = scores.reshape(k, len(domains), num_groups, e // num_groups).mean(-1)  # [K, D, G]
        flat = np.moveaxis(group_means, 1, 0).reshape(len(domains), -1)
        group_corr = np.clip(np.corrcoef(flat), -1.0, 1.0) if len(domains) > 1 else np.ones((1, 1))
    return PopularityFit(
        source=counts.model,
        num_experts=counts.num_experts,
        top_k=counts.top_k,
        depth=tuple(float(x) for x in moe_depth(counts)),
        log_quantiles=log_quantiles,
        corr=corr,
        max_over_mean={d: shares[d].max(axis=1) * counts.num_experts for d in domains},
        tv=tv,
        num_groups=max(1, num_groups),
        group_loading=loading,
        group_corr=group_corr,
        group_ep_size=ep_size if num_groups > 1 else None,
        busiest_gpu=busiest,
    )


def fit_temporal(
    routings: Sequence[Any],
    windows: Sequence[int] = (4, 8, 16, 32, 64),
    same_model_popularity: PopularityFit | None = None,
) -> TemporalFit:
    """Fit a :class:`TemporalFit` from :class:`~moe_eplb.eplb.workload.tracefile.TokenRouting` objects of
    one source model (and, for ``domain_tv``, that model's :class:`PopularityFit`).

    ``kappa``: inside each request, count each expert's choices in consecutive windows of n tokens;
    with per-request shares ``q ~ Dirichlet(kappa * p)`` the variance of a window count is the
    multinomial one times ``1 + c + (n - 1) / (kappa + 1)`` (``c``: short-range correlation
    between neighbouring tokens), so a least-squares line through the observed/multinomial
    variance ratios over n gives ``1 / (kappa + 1)`` as its slope.
    """
    if not routings:
        raise TraceError("fit_temporal: no token-routing data given")
    e, k = routings[0].num_experts, routings[0].top_k
    ratios: dict[int, float] = {}
    lag_num = lag_den = 0.0
    lengths: list[int] = []
    mean_shares = []
    for n in windows:
        obs = mult = 0.0
        for r in routings:
            hot = r.onehot()  # [N, L, E]
            valid = (r.choices >= 0).all(axis=2)  # [N, L]
            p = hot.sum(0) / np.maximum(valid.sum(0), 1)[:, None]  # [L, E] share of choices
            for sid in np.unique(r.sequence_id):
                seq = hot[r.sequence_id == sid]
                w = seq.shape[0] // n
                if w < 2:
                    continue
                cnt = seq[: w * n].reshape(w, n, *seq.shape[1:]).sum(1)  # [w, L, E]
                obs += float(((cnt - n * p) ** 2).sum())
                mult += float((n * p * (1 - p / k)).sum() * w)
        if mult > 0:
            ratios[n] = obs / mult
    for r in routings:
        hot = r.onehot()
        p = hot.mean(0)
        mean_shares.append(p / np.maximum(p.sum(axis=1, keepdims=True), 1e-12))
        for sid in np.unique(r.sequence_id):
            z = hot[r.sequence_id == sid] - p
            lengths.append(int(z.shape[0]))
            if z.shape[0] > 1:
                lag_num += float((z[1:] * z[:-1]).sum())
                lag_den += float((z * z).sum() * (z.shape[0] - 1) / z.shape[0])
    if len(ratios) < 2:
        raise TraceError("fit_temporal: requests are too short to measure dispersion over windows")
    ns = np.array(sorted(ratios), dtype=np.float64)
    ys = np.array([ratios[int(n)] for n in ns])
    slope, _intercept = np.polyfit(ns - 1, ys - 1, 1)
    slope = float(np.clip(slope, 1e-4, 1.0))  # kappa in [0, 1e4]
    kappa = 1.0 / slope - 1.0
    return TemporalFit(
        source=routings[0].model,
        num_experts=e,
        top_k=k,
        kappa=kappa,
        lag1=lag_num / lag_den if lag_den > 0 else 0.0,
        mean_request_tokens=float(np.mean(lengths)),
        dispersion={int(n): float(v) for n, v in ratios.items()},
        request_tv=float(np.mean(dirichlet_tv(np.concatenate(mean_shares), kappa))),
        domain_tv=mean_domain_tv(same_model_popularity) if same_model_popularity is not None else None,
    )
