"""Workload profiles: :class:`Profile` (domains, their mix over time, bursts, rates) and
:data:`BUILTIN_PROFILES`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Burst:
    """Bursts of requests from one domain: arrivals per hour (Poisson), mean duration, and the
    request-rate multiplier during a burst. ``domain=None`` picks a random domain of the profile."""

    per_hour: float = 2.0
    mean_seconds: float = 120.0
    rate_multiplier: float = 1.8
    domain: str | None = None


@dataclass(frozen=True)
class Profile:
    """A workload to generate.

    Attributes:
        name: profile name.
        description: what it models, in one sentence.
        model_shape: default target shape (a key of ``synth.MODEL_SHAPES``).
        phases: domain mixes ``{domain: weight}`` one after the other (weights need not sum to 1);
            domains are the source's own domain names, keys of :data:`DOMAIN_SOURCES` (text
            sources) or of :data:`REGIME_MIXES` (the DeepSeek-V3 regimes), see
            :func:`resolve_domain`.
        boundaries: fractions of the trace where phase i ends (``len(phases) - 1`` values,
            increasing, in (0, 1)); ``None`` spreads the phases evenly.
        transition_seconds: width of the smooth change between two phases.
        mix_jitter: strength of slow random drift of the mix around the schedule (0 = none).
        mix_jitter_seconds: correlation time of that drift.
        bursts: :class:`Burst` or ``None``.
        diurnal: whether the request rate follows the day (trough 04:00, peak 16:00).
        start_hour: time of day at the first bucket (for the day/night rate).
        night_ratio: request rate at the trough relative to the peak.
        peak_steps_per_second: engine steps per second at peak request rate.
        peak_tokens_per_step: tokens per engine step over the whole EP group at peak (the load
            EPLB sums over its window).
        request_tokens: mean tokens (prompt + output) of one request; a bucket's tokens come
            from about ``tokens / request_tokens`` requests, whose own preferences add noise.
        popularity: name of the shipped popularity fit to use.
    """

    name: str
    description: str
    model_shape: str
    phases: tuple[Mapping[str, float], ...]
    boundaries: tuple[float, ...] | None = None
    transition_seconds: float = 300.0
    mix_jitter: float = 0.15
    mix_jitter_seconds: float = 600.0
    bursts: Burst | None = Burst()
    diurnal: bool = True
    start_hour: float = 13.0
    night_ratio: float = 0.3
    peak_steps_per_second: float = 20.0
    peak_tokens_per_step: float = 4096.0
    request_tokens: float = 2048.0
    popularity: str = "olmoe"


_DSV3 = dict(model_shape="deepseek-v3", peak_tokens_per_step=4096.0, popularity="deepseek-v3")
_QWEN = dict(model_shape="qwen3-vl-30b-a3b", peak_tokens_per_step=256.0, request_tokens=1024.0)
_STEADY_MIX = {"chat": 0.6, "code": 0.25, "math": 0.15}
_CCM = ({"chat": 0.8, "code": 0.1, "math": 0.1}, {"chat": 0.2, "code": 0.7, "math": 0.1}, {"chat": 0.2, "code": 0.1, "math": 0.7})
_ON_REGIMES = " (chat/code/math: request shapes over the SGLang prefill/decode regimes)"

BUILTIN_PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="deepseek-v3-chat-code-math",
            description="DeepSeek-V3; the mix moves chat -> code -> math in thirds, with bursts" + _ON_REGIMES,
            phases=_CCM,
            **_DSV3,
        ),
        Profile(
            name="deepseek-v3-steady",
            description="DeepSeek-V3; a steady chat/code/math mix (60/25/15) with bursts" + _ON_REGIMES,
            phases=(_STEADY_MIX,),
            **_DSV3,
        ),
        Profile(
            name="deepseek-v3-chat-to-code",
            description="DeepSeek-V3; chat-heavy, then one shift to code-heavy at the middle" + _ON_REGIMES,
            phases=({"chat": 0.85, "code": 0.1, "math": 0.05}, {"chat": 0.2, "code": 0.75, "math": 0.05}),
            **_DSV3,
        ),
        Profile(
            name="deepseek-v3-diurnal",
            description="DeepSeek-V3 for a day: chat overnight, code in office hours, math in the evening" + _ON_REGIMES,
            phases=(
                {"chat": 0.9, "code": 0.1},
                {"chat": 0.3, "code": 0.6, "math": 0.1},
                {"chat": 0.4, "math": 0.5, "code": 0.1},
                {"chat": 0.9, "code": 0.1},
            ),
            boundaries=(9 / 24, 18 / 24, 22 / 24),
            transition_seconds=1800.0,
            start_hour=0.0,
            **_DSV3,
        ),
        Profile(
            name="deepseek-v3-flat",
            description="DeepSeek-V3 shape with Mixtral-8x7B's nearly even popularity (the flat control: EPLB gains little)",
            phases=(_STEADY_MIX,),
            **{**_DSV3, "popularity": "mixtral"},
        ),
        Profile(
            name="qwen3-vl-30b-a3b-steady",
            description="Qwen3-VL-30B-A3B shape; a steady chat-heavy mix (80/10/10) with bursts",
            phases=({"chat": 0.8, "code": 0.1, "math": 0.1},),
            **_QWEN,
        ),
        Profile(
            name="qwen3-vl-30b-a3b-chat-code-math",
            description="Qwen3-VL-30B-A3B shape; the mix moves chat -> code -> math in thirds, with bursts",
            phases=_CCM,
            **_QWEN,
        ),
        Profile(
            name="qwen3-vl-30b-a3b-chat-to-math",
            description="Qwen3-VL-30B-A3B shape; chat-heavy, then one shift to math-heavy at the middle",
            phases=({"chat": 0.85, "code": 0.05, "math": 0.1}, {"chat": 0.2, "code": 0.05, "math": 0.75}),
            **_QWEN,
        ),
    )
}
