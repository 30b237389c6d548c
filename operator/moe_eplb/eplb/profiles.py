"""Statistics fitted to real MoE routing data, and the workload profiles built on them.

Two kinds of fitted parameters (pure functions fit them; ``bench/fit_profiles.py`` runs the fit on
``../shared/traces`` and writes :data:`FIT_FILE`, which ships inside the package):

- :class:`PopularityFit` (from ``expert_counts_by_domain`` files, e.g. OLMoE's 64 experts x 6 text
  domains x layers 0/7/15): for each domain and sampled layer, the *sorted-popularity curve* --
  the quantile function of ``E * share`` (mean 1) over the experts, kept as a monotone curve on
  :data:`QUANTILE_RANKS` (exact for the 4 most and the 1 least popular expert, compressed in
  between) -- and, per layer, the correlation between domains of the experts' normal scores
  (a Gaussian copula: how much the hot experts of one domain are the hot experts of another). Plus
  the summary statistics the generator is tested against: max/mean per (domain, layer) and the
  total-variation distance between every two domains per layer.
- :class:`TemporalFit` (from ``token_routing_sequence`` files, e.g. Mixtral-8x7B's generated
  tokens): the per-request concentration ``kappa`` of a Dirichlet model of how one request's
  expert shares scatter around its domain's (from how the variance of expert counts in windows of
  n tokens grows with n), the lag-1 autocorrelation of token-level choices, and the mean request
  length in generated tokens (how fast the set of running requests turns over).

A :class:`Profile` is a workload: which domains arrive in what mix over time (a schedule of
phases), bursts, a day/night request rate and the engine's step rate and batch size at peak. The
schedule, bursts and rates are workload assumptions, stated in each profile's description; the
popularity and its time structure come from the fits.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from moe_eplb.eplb.trace import TraceError

FIT_FILE = "profiles.json"  # packaged next to this module
FIT_FORMAT_VERSION = 1

# Points of the sorted-popularity curve kept, as ranks of a 64-expert source (rank 0 = least
# popular, 63 = most popular), stored as fractions rank / 63 of the way from least to most popular.
_RANKS_OF_64 = (0, 1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 60, 61, 62, 63)
QUANTILE_RANKS = tuple(r / 63 for r in _RANKS_OF_64)

_LOG_FLOOR = 1e-4  # share * E below this (an expert that is practically never chosen) is clipped

# Workload domains -> source domains in the expert-count files, first present one wins. Math uses
# arXiv text (scientific writing, dense in formulas): the nearest domain with 64-expert counts.
DOMAIN_SOURCES: dict[str, tuple[str, ...]] = {
    "chat": ("tulu", "c4"),
    "code": ("github",),
    "math": ("arxiv",),
    "web": ("c4",),
    "wiki": ("wikipedia",),
    "books": ("book",),
}


# --------------------------------------------------------------------------------------------------
# Fitted parameters
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PopularityFit:
    """Per-domain, per-layer popularity shape of a source model.

    Attributes:
        source: model the counts came from (e.g. ``OLMoE-1B-7B (allenai)``).
        num_experts, top_k: the source model's.
        depth: ``[K]`` relative depth (0 = first MoE layer, 1 = last) of each sampled layer.
        log_quantiles: ``{domain: [K, Q]}`` ``log(E * share)`` of the expert at each of
            :data:`QUANTILE_RANKS` in each sampled layer (non-decreasing along Q).
        corr: ``[K, D, D]`` correlation between domains (order of ``domains``) of the experts'
            normal scores, per sampled layer.
        max_over_mean: ``{domain: [K]}`` max share / mean share per sampled layer (real data).
        tv: ``[K, D, D]`` total-variation distance between the domains' share vectors (real data).
    """

    source: str
    num_experts: int
    top_k: int
    depth: tuple[float, ...]
    log_quantiles: dict[str, np.ndarray]
    corr: np.ndarray
    max_over_mean: dict[str, np.ndarray]
    tv: np.ndarray

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(self.log_quantiles)

    def subset(self, domains: Sequence[str]) -> "PopularityFit":
        """The same fit restricted to ``domains`` (in that order)."""
        idx = [self.domains.index(d) for d in domains]
        return PopularityFit(
            source=self.source,
            num_experts=self.num_experts,
            top_k=self.top_k,
            depth=self.depth,
            log_quantiles={d: self.log_quantiles[d] for d in domains},
            corr=self.corr[:, idx][:, :, idx],
            max_over_mean={d: self.max_over_mean[d] for d in domains},
            tv=self.tv[:, idx][:, :, idx],
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "depth": list(self.depth),
            "quantile_ranks": list(QUANTILE_RANKS),
            "domains": list(self.domains),
            "log_quantiles": {d: np.round(q, 5).tolist() for d, q in self.log_quantiles.items()},
            "corr": np.round(self.corr, 5).tolist(),
            "max_over_mean": {d: np.round(v, 4).tolist() for d, v in self.max_over_mean.items()},
            "tv": np.round(self.tv, 4).tolist(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PopularityFit":
        if not np.allclose(d["quantile_ranks"], QUANTILE_RANKS):
            raise TraceError("popularity fit: quantile_ranks differ from this version's; re-run bench/fit_profiles.py")
        return cls(
            source=d["source"],
            num_experts=int(d["num_experts"]),
            top_k=int(d["top_k"]),
            depth=tuple(float(x) for x in d["depth"]),
            log_quantiles={k: np.asarray(d["log_quantiles"][k], dtype=np.float64) for k in d["domains"]},
            corr=np.asarray(d["corr"], dtype=np.float64),
            max_over_mean={k: np.asarray(d["max_over_mean"][k], dtype=np.float64) for k in d["domains"]},
            tv=np.asarray(d["tv"], dtype=np.float64),
        )


@dataclass(frozen=True)
class TemporalFit:
    """Time structure of token routing.

    Attributes:
        source: model the routing came from.
        num_experts, top_k: the source model's.
        kappa: Dirichlet concentration of one request's expert shares around the mean
            (``Var(q_e) = p_e (1 - p_e) / (kappa + 1)``), fitted on the source's E experts.
        lag1: lag-1 autocorrelation of a token's expert choices with the previous token's.
        mean_request_tokens: mean generated tokens per request.
        dispersion: ``{window_tokens: observed / multinomial variance}`` the fit used.
        request_tv: mean total-variation distance between one request's expert shares and the
            mean shares (Dirichlet with ``kappa`` around the source's mean shares).
        domain_tv: mean TV distance between two text domains of the same source model (from its
            expert counts, if known): ``request_tv / domain_tv`` says how much more requests differ
            from each other than domains do, which the generator carries over to other models.
    """

    source: str
    num_experts: int
    top_k: int
    kappa: float
    lag1: float
    mean_request_tokens: float
    dispersion: dict[int, float] = field(default_factory=dict)
    request_tv: float | None = None
    domain_tv: float | None = None

    @property
    def request_to_domain_tv(self) -> float | None:
        """``request_tv / domain_tv``, if both are known."""
        if self.request_tv is None or not self.domain_tv:
            return None
        return self.request_tv / self.domain_tv

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kappa"] = round(self.kappa, 3)
        d["request_tv"] = None if self.request_tv is None else round(self.request_tv, 4)
        d["domain_tv"] = None if self.domain_tv is None else round(self.domain_tv, 4)
        d["lag1"] = round(self.lag1, 4)
        d["mean_request_tokens"] = round(self.mean_request_tokens, 2)
        d["dispersion"] = {str(k): round(v, 4) for k, v in self.dispersion.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TemporalFit":
        return cls(
            source=d["source"],
            num_experts=int(d["num_experts"]),
            top_k=int(d["top_k"]),
            kappa=float(d["kappa"]),
            lag1=float(d["lag1"]),
            mean_request_tokens=float(d["mean_request_tokens"]),
            dispersion={int(k): float(v) for k, v in d.get("dispersion", {}).items()},
            request_tv=None if d.get("request_tv") is None else float(d["request_tv"]),
            domain_tv=None if d.get("domain_tv") is None else float(d["domain_tv"]),
        )


# --------------------------------------------------------------------------------------------------
# Fitting (pure)
# --------------------------------------------------------------------------------------------------


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


def mean_domain_tv(fit: "PopularityFit") -> float | None:
    """Mean TV distance between two domains, over all pairs and sampled layers (None if < 2)."""
    d = len(fit.domains)
    if d < 2:
        return None
    upper = np.triu_indices(d, 1)
    return float(np.mean([fit.tv[k][upper] for k in range(len(fit.depth))]))


def fit_popularity(counts) -> PopularityFit:
    """Fit a :class:`PopularityFit` from a :class:`~moe_eplb.eplb.tracefile.DomainCounts`."""
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
    return PopularityFit(
        source=counts.model,
        num_experts=counts.num_experts,
        top_k=counts.top_k,
        depth=tuple(float(x) for x in counts.depth()),
        log_quantiles={d: sorted_curve(shares[d]) for d in domains},
        corr=corr,
        max_over_mean={d: shares[d].max(axis=1) * counts.num_experts for d in domains},
        tv=tv,
    )


def fit_temporal(
    routings: Sequence[Any],
    windows: Sequence[int] = (4, 8, 16, 32, 64),
    same_model_popularity: "PopularityFit | None" = None,
) -> TemporalFit:
    """Fit a :class:`TemporalFit` from :class:`~moe_eplb.eplb.tracefile.TokenRouting` objects of
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


# --------------------------------------------------------------------------------------------------
# Built-in fits (packaged JSON written by bench/fit_profiles.py)
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _builtin_raw() -> dict[str, Any]:
    text = importlib.resources.files("moe_eplb.eplb").joinpath(FIT_FILE).read_text(encoding="utf-8")
    d = json.loads(text)
    if d.get("format_version") != FIT_FORMAT_VERSION:
        raise TraceError(f"{FIT_FILE}: format_version {d.get('format_version')} is not {FIT_FORMAT_VERSION}")
    return d


def builtin_popularity(name: str = "olmoe") -> PopularityFit:
    """A shipped :class:`PopularityFit` (``olmoe``: OLMoE-1B-7B, 64 experts; ``mixtral``:
    Mixtral-8x7B, 8 experts; ``olmoe-sft``: OLMoE SFT, chat only)."""
    fits = _builtin_raw()["popularity"]
    if name not in fits:
        raise TraceError(f"popularity fit {name!r} is not shipped; choose one of {', '.join(fits)}")
    return PopularityFit.from_dict(fits[name])


def builtin_temporal() -> TemporalFit:
    """The shipped :class:`TemporalFit` (Mixtral-8x7B-Instruct, GSM8K + HumanEval generations)."""
    return TemporalFit.from_dict(_builtin_raw()["temporal"])


# --------------------------------------------------------------------------------------------------
# Workload profiles
# --------------------------------------------------------------------------------------------------


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
            domains are keys of :data:`DOMAIN_SOURCES` or the source's own domain names.
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


_DSV3 = dict(model_shape="deepseek-v3", peak_tokens_per_step=4096.0)
_QWEN = dict(model_shape="qwen3-vl-30b-a3b", peak_tokens_per_step=256.0, request_tokens=1024.0)
_STEADY_MIX = {"chat": 0.6, "code": 0.25, "math": 0.15}
_CCM = ({"chat": 0.8, "code": 0.1, "math": 0.1}, {"chat": 0.2, "code": 0.7, "math": 0.1}, {"chat": 0.2, "code": 0.1, "math": 0.7})

BUILTIN_PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="deepseek-v3-chat-code-math",
            description="DeepSeek-V3 shape; the mix moves chat -> code -> math in thirds, with bursts",
            phases=_CCM,
            **_DSV3,
        ),
        Profile(
            name="deepseek-v3-steady",
            description="DeepSeek-V3 shape; a steady chat/code/math mix (60/25/15) with bursts",
            phases=(_STEADY_MIX,),
            **_DSV3,
        ),
        Profile(
            name="deepseek-v3-chat-to-code",
            description="DeepSeek-V3 shape; chat-heavy, then one shift to code-heavy at the middle",
            phases=({"chat": 0.85, "code": 0.1, "math": 0.05}, {"chat": 0.2, "code": 0.75, "math": 0.05}),
            **_DSV3,
        ),
        Profile(
            name="deepseek-v3-diurnal",
            description="DeepSeek-V3 shape for a day: chat overnight, code in office hours, math in the evening",
            phases=(
                {"chat": 0.8, "web": 0.1, "code": 0.1},
                {"chat": 0.3, "code": 0.6, "math": 0.1},
                {"chat": 0.4, "math": 0.5, "code": 0.1},
                {"chat": 0.8, "web": 0.1, "code": 0.1},
            ),
            boundaries=(9 / 24, 18 / 24, 22 / 24),
            transition_seconds=1800.0,
            start_hour=0.0,
            **_DSV3,
        ),
        Profile(
            name="deepseek-v3-flat",
            description="DeepSeek-V3 shape with Mixtral-8x7B's nearly even popularity (a control where EPLB gains little)",
            phases=(_STEADY_MIX,),
            popularity="mixtral",
            **_DSV3,
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
