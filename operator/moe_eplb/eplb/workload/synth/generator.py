"""The public entry point: :func:`generate` (a :class:`~moe_eplb.eplb.workload.trace.LoadTrace` from
a profile) and :func:`with_phases`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from moe_eplb.eplb.workload import profiles as _profiles
from moe_eplb.eplb.workload.profiles import (
    PopularityFit,
    Profile,
    TemporalFit,
)
from moe_eplb.eplb.workload.synth.catalog import _CHUNK, SynthError, get_profile, resolve_shape
from moe_eplb.eplb.workload.synth.layout import domain_popularity
from moe_eplb.eplb.workload.synth.schedule import _ar1, _bursts, _mix_schedule, request_concentration
from moe_eplb.eplb.workload.synth.sources import _load_sources, _resolve_domains
from moe_eplb.eplb.workload.trace import LoadTrace


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
