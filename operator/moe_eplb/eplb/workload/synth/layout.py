"""Step 1, the expert layout: each domain's expert popularity per layer (:func:`domain_popularity`),
drawn from the fitted curves with the fitted correlations between domains and expert groups."""

from __future__ import annotations

import numpy as np

from moe_eplb.eplb.workload import profiles as _profiles
from moe_eplb.eplb.workload.profiles import (
    PopularityFit,
)


def _valid_corr(c: np.ndarray, floor: float = 1e-4) -> np.ndarray:
    """``[..., D, D]`` symmetric matrices with unit diagonal -> the nearest-by-eigenvalue-clipping
    positive-definite correlation matrices (rounded correlations of near-identical domains, e.g.
    0.999 between two prefill regimes, can be slightly indefinite)."""
    w, v = np.linalg.eigh(c)
    out = np.einsum("...ij,...j,...kj->...ik", v, np.maximum(w, floor), v)
    sd = np.sqrt(np.diagonal(out, axis1=-2, axis2=-1))
    return out / (sd[..., :, None] * sd[..., None, :])


def _cholesky_corr(c: np.ndarray) -> np.ndarray:
    """Cholesky factors of ``[..., D, D]`` correlation matrices, made valid first if they are not."""
    eye = 1e-9 * np.eye(c.shape[-1])
    try:
        return np.linalg.cholesky(c + eye)
    except np.linalg.LinAlgError:
        return np.linalg.cholesky(_valid_corr(c) + eye)


def _residual_corr(corr: np.ndarray, a: np.ndarray, group_corr: np.ndarray) -> np.ndarray:
    """Correlation between domains of the experts' own latents ``eps`` such that the whole latent
    ``a * g + sqrt(1 - a^2) * eps`` keeps the fitted correlation ``corr`` ``[L, D, D]`` (``a``
    ``[L, D]``, ``group_corr`` ``[D, D]`` of ``g``), made a valid correlation matrix."""
    b = np.sqrt(np.maximum(1.0 - a**2, 1e-6))
    ce = (corr - a[:, :, None] * a[:, None, :] * group_corr) / (b[:, :, None] * b[:, None, :])
    ce = np.clip(ce, -1.0, 1.0)
    idx = np.arange(ce.shape[-1])
    ce[:, idx, idx] = 1.0
    return _valid_corr(ce)


def domain_popularity(
    fit: PopularityFit, num_layers: int, num_experts: int, seed: int = 0, num_groups: int = 1
) -> np.ndarray:
    """Expert shares of every source domain mapped onto a target shape.

    With a group structure in ``fit`` and ``num_groups > 1`` the target's experts come in
    ``num_groups`` contiguous groups: expert e's latent is ``a * g[group(e)] + sqrt(1 - a^2) *
    eps[e]`` with the fitted loading ``a^2`` per domain, group latents correlated between domains
    by ``fit.group_corr`` and ``eps`` by what keeps the fitted total correlation per layer.

    Returns:
        float64 ``[D, L, E]`` (D = ``fit.domains``); each ``[d, l]`` row sums to 1.
    """
    rng = np.random.default_rng([seed, 1])
    d_count = len(fit.domains)
    depth = np.asarray(fit.depth)
    target = np.linspace(0.0, 1.0, num_layers) if num_layers > 1 else np.zeros(1)
    hi = np.clip(np.searchsorted(depth, target, side="right"), 1, len(depth) - 1) if len(depth) > 1 else np.zeros(num_layers, int)
    lo = np.maximum(hi - 1, 0)
    span = np.where(depth[hi] > depth[lo], depth[hi] - depth[lo], 1.0)
    w = np.clip((target - depth[lo]) / span, 0.0, 1.0)[:, None]  # [L, 1]
    logq = np.stack([fit.log_quantiles[d] for d in fit.domains])  # [D, K, Q]
    logq_l = logq[:, lo] * (1 - w) + logq[:, hi] * w  # [D, L, Q]
    corr = fit.corr[lo] * (1 - w[:, :, None]) + fit.corr[hi] * w[:, :, None]  # [L, D, D]
    grouped = (
        fit.group_loading is not None and fit.group_corr is not None and num_groups > 1 and num_experts % num_groups == 0
    )
    if grouped:
        a = np.broadcast_to(np.sqrt(np.clip(fit.group_loading, 0.0, 0.999)), (num_layers, d_count))  # [L, D]
        group_corr = _valid_corr(fit.group_corr)
        corr = _residual_corr(corr, a, group_corr)
    chol = _cholesky_corr(corr)
    z = np.einsum("lij,lej->lie", chol, rng.standard_normal((num_layers, num_experts, d_count)))  # [L, D, E]
    if grouped:
        chol_g = _cholesky_corr(group_corr)
        g = np.einsum("ij,lgj->lig", chol_g, rng.standard_normal((num_layers, num_groups, d_count)))  # [L, D, G]
        g = np.repeat(g, num_experts // num_groups, axis=-1)  # [L, D, E]
        z = a[:, :, None] * g + np.sqrt(1.0 - a**2)[:, :, None] * z
    ranks = np.argsort(np.argsort(z, axis=-1, kind="stable"), axis=-1, kind="stable")
    u = ranks / max(num_experts - 1, 1)  # [L, D, E]
    vals = _profiles.curve_values(np.moveaxis(logq_l, 0, 1), u)  # [L, D, E]
    shares = vals / vals.sum(axis=-1, keepdims=True)
    return np.moveaxis(shares, 1, 0)  # [D, L, E]
