"""Steps 2-3: the domain mix over time, the request rate and the bursts, and how concentrated the
requests are."""

from __future__ import annotations

import numpy as np

from moe_eplb.eplb.workload import profiles as _profiles
from moe_eplb.eplb.workload.profiles import (
    PopularityFit,
    Profile,
    TemporalFit,
)
from moe_eplb.eplb.workload.synth.catalog import SynthError, list_profiles


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
