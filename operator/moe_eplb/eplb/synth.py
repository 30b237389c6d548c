"""Workload generator: realistic expert-load traces for a target MoE shape, built from the expert
popularity measured on real models (see :mod:`moe_eplb.eplb.profiles` and docs/traces.md).

Method, in order (everything is drawn from one ``numpy`` generator seeded by ``seed``):

1. **Expert layout** (depends only on the fit, the shape and the seed). For target MoE layer l at
   relative depth ``l / (L - 1)``, interpolate the fitted sorted-popularity curves and the domain
   correlation matrix between the two nearest sampled source layers. Draw a latent vector per expert
   from a Gaussian copula with that correlation (one coordinate per domain); in each domain, the
   expert with the r-th smallest coordinate gets the curve's value at ``r / (E - 1)``. So each
   domain keeps the real max/mean and the shape of its popularity curve, and two domains share
   their hot experts as much as they do in the real model (hence similar total-variation distances).
   With a source fitted with expert groups (DeepSeek-V3: 8 groups of 32) and a target with groups,
   an expert's latent is ``a * g[group] + sqrt(1 - a^2) * eps``: the hot experts cluster in a few
   groups as in the real model, which is what loads the GPUs of a static placement unevenly
   (:func:`profiles.static_imbalance`). A profile's workload domain is a source domain, a
   stand-in for one (:data:`profiles.DOMAIN_SOURCES`), or, for a source whose domains are serving
   regimes, a token-weighted mixture of regimes (:data:`profiles.REGIME_MIXES`).
2. **Domain mix over time**: the profile's phases with smooth (logistic) transitions, a slow
   log-normal AR(1) drift per domain, and Poisson bursts that add requests from one domain.
3. **Request rate and steps**: a day/night curve (trough 04:00, peak 16:00, ``night_ratio``) times
   the bursts and ~5 % bucket-to-bucket noise gives the relative rate ``r``. Throughput in tokens
   follows ``r``; the engine's step rate follows ``sqrt(r)`` up to its peak and the batch the rest:
   ``bucket_steps = peak_steps_per_second * min(sqrt(r), 1) * bucket_seconds`` and
   ``tokens_per_step = peak_tokens_per_step * r / min(sqrt(r), 1)``.
4. **Per-bucket shares**: the mix-weighted sum of the domains' popularity, times log-normal noise
   for the requests' own preferences: each request's shares scatter around the mix like a
   Dirichlet with concentration ``kappa'`` (:func:`request_concentration`: a request lies ~1.9x as
   far from the mean as two domains lie apart, as measured on Mixtral), and a bucket averages
   ``n = tokens / request_tokens`` requests, so ``Var = p (1 - p) / ((kappa' + 1) n)``; AR(1) over
   buckets with ``exp(-bucket_steps / mean_request_tokens)`` (requests finishing and starting).
5. **Counts**: ``load[t, l] ~ Multinomial(bucket_steps * tokens_per_step * top_k, shares)``, so
   every layer's load sums exactly to tokens x top_k.

Model shapes are :data:`MODEL_SHAPES`; profiles are
:data:`moe_eplb.eplb.profiles.BUILTIN_PROFILES`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from moe_eplb.eplb import profiles as _profiles
from moe_eplb.eplb.profiles import (
    DOMAIN_SOURCES,
    REGIME_MIXES,
    PopularityFit,
    Profile,
    TemporalFit,
)
from moe_eplb.eplb.trace import LoadTrace

# name -> (MoE layers, routed experts per layer, expert groups, top_k)
MODEL_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "deepseek-v3": (58, 256, 8, 8),
    "qwen3-vl-30b-a3b": (48, 128, 1, 8),
}


_CHUNK = 64  # buckets generated at a time


class SynthError(ValueError):
    """A generator request that cannot be met; the message names the argument and the fix."""


def list_profiles() -> list[str]:
    """Names of the built-in profiles, sorted."""
    return sorted(_profiles.BUILTIN_PROFILES)


def get_profile(name: str) -> Profile:
    """The built-in profile ``name``; unknown names list the valid ones."""
    try:
        return _profiles.BUILTIN_PROFILES[name]
    except KeyError:
        raise SynthError(f"profile: unknown profile {name!r}; choose one of: {', '.join(list_profiles())}") from None


def resolve_shape(model_shape: str | Sequence[int]) -> tuple[str, tuple[int, int, int, int]]:
    """``name`` or ``(layers, experts, groups, top_k)`` -> (label, shape)."""
    if isinstance(model_shape, str):
        if model_shape not in MODEL_SHAPES:
            raise SynthError(f"model_shape: unknown shape {model_shape!r}; choose one of: {', '.join(MODEL_SHAPES)}")
        return model_shape, MODEL_SHAPES[model_shape]
    shape = tuple(int(x) for x in model_shape)
    if len(shape) == 3:
        shape = (shape[0], shape[1], 1, shape[2])
    if len(shape) != 4 or min(shape) <= 0:
        raise SynthError(f"model_shape: expected (layers, experts, groups, top_k) > 0, got {model_shape!r}")
    layers, experts, groups, top_k = shape
    if experts % groups:
        raise SynthError(f"model_shape: {experts} experts do not split into {groups} groups")
    if top_k > experts:
        raise SynthError(f"model_shape: top_k {top_k} is more than {experts} experts")
    return f"{layers}x{experts}-top{top_k}", shape  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------
# Sources (shipped fits or the real files)
# --------------------------------------------------------------------------------------------------


def _load_sources(
    source: Any, num_experts: int = 0, num_groups: int = 1
) -> tuple[PopularityFit | None, TemporalFit | None]:
    """Turn ``source`` (path(s) to real routing files, DomainCounts / TokenRouting objects, or
    fits) into a popularity fit and/or a temporal fit.

    Expert counts with the target's ``num_experts`` are taken to be of the target model and, if it
    has ``num_groups > 1`` expert groups, fitted with that group structure (on the static placement
    over 32 GPUs if the experts split evenly over 32, else over one GPU per group).

    Token-routing files of one model give the temporal fit. Expert-counts files: with one, it is
    the popularity source; with two, the one with the routing model's expert count and top-k (e.g.
    Mixtral's, next to Mixtral's routing) measures that model's domain spread for the
    request/domain ratio (:func:`request_concentration`) and the other is the popularity source.
    """
    from moe_eplb.eplb import tracefile

    if source is None:
        return None, None
    items = list(source) if isinstance(source, (list, tuple)) else [source]
    pops: list[PopularityFit] = []
    routings = []
    temporal: TemporalFit | None = None
    for item in items:
        if isinstance(item, (str, os.PathLike)):
            item = tracefile.read_routing_file(item)
        if isinstance(item, tracefile.DomainCounts):
            same_shape = item.num_experts == num_experts and num_groups > 1 and num_experts % num_groups == 0
            ep = 32 if num_experts % 32 == 0 else num_groups
            item = (_profiles.fit_popularity(item, num_groups=num_groups, ep_size=ep) if same_shape
                    else _profiles.fit_popularity(item))
        if isinstance(item, PopularityFit):
            pops.append(item)
        elif isinstance(item, tracefile.TokenRouting):
            routings.append(item)
        elif isinstance(item, TemporalFit):
            temporal = item
        else:
            raise SynthError(f"source: cannot use {type(item).__name__} as a source")
    if len(pops) > 2 or (len(pops) == 2 and not routings):
        raise SynthError(
            "source: give one expert-counts file (the popularity), or two together with token-routing "
            "files (the popularity, and the counts of the routing's own model)"
        )
    pop, same_model = (pops[0] if pops else None), None
    if routings:
        shape = (routings[0].num_experts, routings[0].top_k)
        matching = [p for p in pops if (p.num_experts, p.top_k) == shape]
        if len(pops) == 2:
            if len(matching) != 1:
                raise SynthError(
                    f"source: of two expert-counts files exactly one must match the routing model "
                    f"({shape[0]} experts, top-{shape[1]}); {len(matching)} do"
                )
            same_model = matching[0]
            pop = pops[0] if pops[1] is same_model else pops[1]
        elif matching:
            same_model = matching[0]
        temporal = _profiles.fit_temporal(routings, same_model_popularity=same_model)
    return pop, temporal


def _resolve_domains(fit: PopularityFit, wanted: Sequence[str]) -> dict[str, dict[str, float]]:
    """Profile domain -> ``{source domain of fit: weight}`` (:func:`profiles.resolve_domain`)."""
    out = {}
    for d in wanted:
        got = _profiles.resolve_domain(d, fit.domains)
        if got is None:
            needs = " or ".join(DOMAIN_SOURCES.get(d, (d,)))
            if d in REGIME_MIXES:
                needs += f" (or the regimes {' + '.join(REGIME_MIXES[d])})"
            raise SynthError(
                f"profile: domain {d!r} needs source domain {needs}, which {fit.source} "
                f"does not have (it has: {', '.join(fit.domains)}); use another source or profile"
            )
        out[d] = got
    return out


# --------------------------------------------------------------------------------------------------
# Step 1: expert layout
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# Steps 2-3: mix, rate, steps
# --------------------------------------------------------------------------------------------------


def _ar1(
    rng: np.random.Generator, shape: tuple[int, ...], rho: np.ndarray | float, prev: np.ndarray | None = None
) -> np.ndarray:
    """Stationary unit-variance AR(1) along axis 0 (``rho`` per step, scalar or ``[T]``),
    continuing from ``prev`` (the value before the first step) if given."""
    t = shape[0]
    rho = np.broadcast_to(np.asarray(rho, dtype=np.float64), (t,))
    out = rng.standard_normal(shape)
    scale = np.sqrt(1.0 - rho**2)
    if prev is not None:
        out[0] = rho[0] * prev + scale[0] * out[0]
    for i in range(1, t):
        out[i] = rho[i] * out[i - 1] + scale[i] * out[i]
    return out


def _boundaries(profile: Profile, shift_at: float | None) -> np.ndarray:
    n = len(profile.phases)
    if shift_at is not None:
        if n < 2:
            raise SynthError(
                f"shift_at: profile {profile.name!r} has one phase (no mix shift); use a shifting profile "
                f"({', '.join(p for p in list_profiles() if len(_profiles.BUILTIN_PROFILES[p].phases) > 1)})"
            )
        if not 0.0 < shift_at < 1.0:
            raise SynthError(f"shift_at: must be a fraction of the trace in (0, 1), got {shift_at}")
        rest = np.linspace(shift_at, 1.0, n)[:-1]
        return rest
    if profile.boundaries is not None:
        b = np.asarray(profile.boundaries, dtype=np.float64)
        if b.shape != (n - 1,) or np.any(np.diff(b) <= 0) or (n > 1 and (b[0] <= 0 or b[-1] >= 1)):
            raise SynthError(f"profile.boundaries: need {n - 1} increasing fractions in (0, 1), got {profile.boundaries}")
        return b
    return np.arange(1, n) / n


def _mix_schedule(profile, domains, times, duration, shift_at, rng) -> np.ndarray:
    """``[T, D]`` share of each domain's requests (rows sum to 1), before bursts."""
    d_index = {d: i for i, d in enumerate(domains)}
    phases = np.zeros((len(profile.phases), len(domains)))
    for p, mix in enumerate(profile.phases):
        for d, wgt in mix.items():
            if wgt < 0:
                raise SynthError(f"profile.phases[{p}]: weight of {d!r} is negative")
            phases[p, d_index[d]] += wgt
        if phases[p].sum() <= 0:
            raise SynthError(f"profile.phases[{p}]: all weights are 0")
    phases /= phases.sum(axis=1, keepdims=True)
    bounds = _boundaries(profile, shift_at) * duration
    tau = max(profile.transition_seconds, 1e-6) / 4.4  # 10 % -> 90 % over transition_seconds
    cdf = 1.0 / (1.0 + np.exp(-np.clip((times[:, None] - bounds[None, :]) / tau, -60, 60)))  # [T, P-1]
    cum = np.concatenate([np.ones((times.size, 1)), cdf, np.zeros((times.size, 1))], axis=1)
    weights = cum[:, :-1] - cum[:, 1:]  # [T, P]
    mix = weights @ phases
    if profile.mix_jitter > 0:
        rho = np.exp(-(times[1] - times[0] if times.size > 1 else 1.0) / max(profile.mix_jitter_seconds, 1e-6))
        jit = _ar1(rng, mix.shape, rho) * profile.mix_jitter
        mix = mix * np.exp(jit - profile.mix_jitter**2 / 2)
    return mix / mix.sum(axis=1, keepdims=True)


def _bursts(profile, domains, active, times, bucket_seconds, duration, rng) -> np.ndarray:
    """``[T, D]`` extra request rate (relative to the base rate) from bursts."""
    extra = np.zeros((times.size, len(domains)))
    b = profile.bursts
    if b is None or b.per_hour <= 0:
        return extra
    count = rng.poisson(b.per_hour * duration / 3600.0)
    starts = rng.uniform(0.0, duration, count)
    lengths = rng.exponential(b.mean_seconds, count)
    choice = rng.integers(0, len(active), count)
    lo = times - bucket_seconds / 2
    for s, ln, c in zip(starts, lengths, choice):
        d = b.domain if b.domain is not None else active[c]
        overlap = np.clip(np.minimum(lo + bucket_seconds, s + ln) - np.maximum(lo, s), 0, None) / bucket_seconds
        extra[:, domains.index(d)] += (b.rate_multiplier - 1.0) * overlap
    return extra


def request_concentration(pop_fit: PopularityFit, temporal: TemporalFit, dom_pop: np.ndarray) -> float:
    """Dirichlet concentration of one request's expert shares around its mix's, on the target.

    One request differs from the mean ``request_to_domain_tv`` times as much (in TV distance) as
    two domains differ from each other -- measured on the temporal source (Mixtral: 0.095 vs 0.051)
    -- and the popularity source's domains are ``mean_domain_tv`` apart (OLMoE: 0.37), so a request
    lies ``ratio * mean_domain_tv`` (at most 0.95) from the mean; :func:`profiles.kappa_for_tv`
    turns that into a concentration for the target's ``dom_pop`` ``[D, L, E]``. Without the ratio
    (no domains in one of the sources) the fitted ``kappa`` is scaled by ``E / E_source``, which
    keeps an average expert's relative spread.
    """
    ratio = temporal.request_to_domain_tv
    domain_tv = _profiles.mean_domain_tv(pop_fit)
    if ratio is None or domain_tv is None:
        return temporal.kappa * dom_pop.shape[-1] / temporal.num_experts
    return _profiles.kappa_for_tv(dom_pop, min(ratio * domain_tv, 0.95))


# --------------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------------


def generate(
    profile: str | Profile,
    *,
    model_shape: str | Sequence[int] | None = None,
    hours: float = 1.0,
    bucket_seconds: float = 15.0,
    seed: int = 0,
    shift_at: float | None = None,
    source: Any = None,
    peak_steps_per_second: float | None = None,
    peak_tokens_per_step: float | None = None,
) -> LoadTrace:
    """Generate a synthetic load trace.

    Args:
        profile: a built-in profile name (:func:`list_profiles`) or a :class:`Profile`.
        model_shape: a :data:`MODEL_SHAPES` name or ``(layers, experts, groups, top_k)``; default the
            profile's.
        hours: trace length; ``T = round(hours * 3600 / bucket_seconds)`` buckets.
        bucket_seconds: seconds per bucket.
        seed: everything random follows from it (same arguments + seed = identical trace). The
            expert layout depends only on (source, shape, seed), so profiles generated with the
            same seed put the same experts in the same places.
        shift_at: for profiles with several phases, the fraction of the trace (0..1) where the first
            mix shift happens (later phases evenly spaced after it).
        source: real data instead of the shipped fits: a path (or list of paths) to
            ``expert_counts_by_domain`` and/or ``token_routing_sequence`` JSON files, or the parsed
            objects, or fitted :class:`PopularityFit` / :class:`TemporalFit`.
        peak_steps_per_second, peak_tokens_per_step: override the profile's.

    Returns:
        :class:`LoadTrace` ``[T, L, E]`` with ``bucket_seconds``, ``top_k`` and ``model`` (the shape
        name) set; ``meta`` holds ``profile``, ``seed``, ``domains``, ``mix`` ``[T, D]`` and
        ``rate`` ``[T]`` (relative request rate).
    """
    prof = get_profile(profile) if isinstance(profile, str) else profile
    if not isinstance(prof, Profile):
        raise SynthError(f"profile: expected a name or a Profile, got {type(prof).__name__}")
    shape_name, (num_layers, num_experts, num_groups, top_k) = resolve_shape(model_shape or prof.model_shape)
    num_buckets = _num_buckets(hours, bucket_seconds, seed)
    peak_steps = float(prof.peak_steps_per_second if peak_steps_per_second is None else peak_steps_per_second)
    peak_tokens = float(prof.peak_tokens_per_step if peak_tokens_per_step is None else peak_tokens_per_step)
    if not peak_steps > 0:
        raise SynthError(f"peak_steps_per_second: must be > 0, got {peak_steps}")
    if not peak_tokens > 0:
        raise SynthError(f"peak_tokens_per_step: must be > 0, got {peak_tokens}")

    pop_fit, temporal = _load_sources(source, num_experts, num_groups)
    pop_fit = pop_fit or _profiles.builtin_popularity(prof.popularity)
    temporal = temporal or _profiles.builtin_temporal()
    wanted, dom_pop = _domains(prof, pop_fit, num_layers, num_experts, num_groups, seed)

    rng_mix, rng_burst, rng_rate, rng_noise, rng_count = (
        np.random.default_rng([seed, 2, i]) for i in range(5)
    )
    duration = num_buckets * bucket_seconds
    times = (np.arange(num_buckets) + 0.5) * bucket_seconds
    mix = _mix_schedule(prof, wanted, times, duration, shift_at, rng_mix)  # [T, D]
    mix, rate = _request_rate(prof, wanted, mix, times, bucket_seconds, duration, rng_rate, rng_burst)

    step_scale = np.minimum(np.sqrt(rate), 1.0)
    bucket_steps = np.round(peak_steps * step_scale * bucket_seconds).astype(np.int64)
    tokens_per_step = peak_tokens * rate / step_scale
    load = _expert_load(prof, pop_fit, temporal, dom_pop, mix, bucket_steps, tokens_per_step, top_k,
                        rng_noise, rng_count)
    return LoadTrace(
        load=load,
        bucket_steps=bucket_steps,
        bucket_seconds=float(bucket_seconds),
        top_k=top_k,
        model=shape_name,
        meta={
            "profile": prof.name,
            "seed": seed,
            "source": pop_fit.source,
            "domains": tuple(wanted),
            "mix": mix,
            "rate": rate,
        },
    )


def _num_buckets(hours: float, bucket_seconds: float, seed: Any) -> int:
    """The trace's bucket count, after checking the length, the bucket and the seed."""
    if not hours > 0:
        raise SynthError(f"hours: must be > 0, got {hours}")
    if not bucket_seconds > 0:
        raise SynthError(f"bucket_seconds: must be > 0, got {bucket_seconds}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise SynthError(f"seed: must be an integer >= 0, got {seed!r}")
    num_buckets = int(round(hours * 3600.0 / bucket_seconds))
    if num_buckets < 1:
        raise SynthError(f"hours: {hours} h is shorter than one {bucket_seconds} s bucket")
    return num_buckets


def _domains(prof: Profile, pop_fit: PopularityFit, num_layers: int, num_experts: int, num_groups: int,
             seed: int) -> tuple[list[str], np.ndarray]:
    """The profile's domains (its phases', then its burst domain) and each one's expert popularity
    ``[D, L, E]`` on the target shape (the source's domains mapped onto them, laid out by ``seed``)."""
    wanted = list(dict.fromkeys(d for mix in prof.phases for d in mix))
    if prof.bursts is not None and prof.bursts.domain is not None and prof.bursts.domain not in wanted:
        wanted.append(prof.bursts.domain)
    mapping = _resolve_domains(pop_fit, wanted)
    layout = domain_popularity(pop_fit, num_layers, num_experts, seed, num_groups)  # [D_src, L, E]
    src_index = {d: i for i, d in enumerate(pop_fit.domains)}
    dom_pop = np.stack([
        sum(wgt * layout[src_index[src]] for src, wgt in mapping[d].items()) for d in wanted
    ])  # [D, L, E]
    return wanted, dom_pop


def _request_rate(prof: Profile, wanted: list[str], mix: np.ndarray, times: np.ndarray, bucket_seconds: float,
                  duration: float, rng_rate: np.random.Generator,
                  rng_burst: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Request rate: day/night x noise, plus bursts. Returns the domain mix with the bursts
    ``[T, D]`` and the relative rate ``[T]``."""
    num_buckets = times.shape[0]
    if prof.diurnal:
        hour = (prof.start_hour + times / 3600.0) % 24.0
        base = prof.night_ratio + (1 - prof.night_ratio) * 0.5 * (1 - np.cos(2 * np.pi * (hour - 4.0) / 24.0))
    else:
        base = np.ones(num_buckets)
    base = base * np.exp(0.05 * rng_rate.standard_normal(num_buckets) - 0.05**2 / 2)
    active = [d for d in wanted if any(ph.get(d, 0) > 0 for ph in prof.phases)]
    extra = _bursts(prof, wanted, active, times, bucket_seconds, duration, rng_burst)  # [T, D] relative
    per_domain = mix * base[:, None] + extra * base[:, None]
    rate = per_domain.sum(axis=1)
    return per_domain / rate[:, None], rate


def _expert_load(prof: Profile, pop_fit: PopularityFit, temporal: TemporalFit, dom_pop: np.ndarray, mix: np.ndarray,
                 bucket_steps: np.ndarray, tokens_per_step: np.ndarray, top_k: int, rng_noise: np.random.Generator,
                 rng_count: np.random.Generator) -> np.ndarray:
    """Per-bucket expert load ``[T, L, E]``: the mixture of the domains' shares x noise from the
    running requests' own preferences, drawn as counts of the bucket's expert assignments."""
    num_buckets = bucket_steps.shape[0]
    num_layers, num_experts = dom_pop.shape[1], dom_pop.shape[2]
    kappa = request_concentration(pop_fit, temporal, dom_pop)
    requests = np.maximum(bucket_steps * tokens_per_step / max(prof.request_tokens, 1.0), 1.0)  # [T]
    rho = np.exp(-bucket_steps / max(temporal.mean_request_tokens, 1.0))  # [T]
    assignments = np.round(bucket_steps * tokens_per_step).astype(np.int64) * top_k  # [T]
    # Buckets in chunks (same draws whatever T), so a long trace needs memory for its load only.
    load = np.empty((num_buckets, num_layers, num_experts), dtype=np.float64)
    z_prev = None
    for start in range(0, num_buckets, _CHUNK):
        sl = slice(start, min(start + _CHUNK, num_buckets))
        shares = np.einsum("td,dle->tle", mix[sl], dom_pop)
        rel_var = (1.0 - shares) / (shares * (kappa + 1.0) * requests[sl, None, None])
        sigma = np.sqrt(np.minimum(rel_var, 1.0))  # log-normal tails: cap so a cold expert cannot turn hot
        z = _ar1(rng_noise, shares.shape, rho[sl], z_prev)
        z_prev = z[-1]
        shares *= np.exp(sigma * z - sigma**2 / 2)
        shares /= shares.sum(axis=-1, keepdims=True)
        n = np.broadcast_to(assignments[sl, None], shares.shape[:2])
        load[sl] = rng_count.multinomial(n, shares)
    return load


def with_phases(profile: str | Profile, phases: Sequence[Mapping[str, float]], **changes: Any) -> Profile:
    """A copy of ``profile`` with other phases (and any other :class:`Profile` fields changed)."""
    prof = get_profile(profile) if isinstance(profile, str) else profile
    return dataclasses.replace(prof, phases=tuple(dict(p) for p in phases), boundaries=None, **changes)
