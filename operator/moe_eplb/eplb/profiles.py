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
  total-variation distance between every two domains per layer. For a source whose experts come
  in groups (DeepSeek-V3: 8 groups of 32, with group-limited routing) also the *group structure*:
  per domain, how strongly the experts of one group share a common latent (fitted so that the
  static placement's busiest GPU carries what it carries in the real data, see
  :func:`fit_group_loading`), and the correlation between domains of the group latents.
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
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

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

# Workload domains -> DeepSeek-V3 regimes (SGLang's runs in deepseek_v3_expert_counts.json), for a
# source whose domains are regimes rather than text: a request of that shape sends its prompt
# through a prefill regime and its answer through a decode regime, so the domain is the mixture of
# the two weighted by their tokens. The request shapes are assumptions (docs/traces.md):
# chat ~1000 tokens in, ~1000 out; code: long context (~1800-2048 in), short answer (~100 out);
# math: short problem (~512 in), long worked answer (~1000 out).
REGIME_MIXES: dict[str, dict[str, float]] = {
    "chat": {"prefill_in1000out1000": 0.5, "decode_in1000out1000": 0.5},
    "code": {"prefill_in2048": 0.95, "decode_in1800out100": 0.05},
    "math": {"prefill_in512": 0.35, "decode_in1000out1000": 0.65},
}


def resolve_domain(domain: str, available: Sequence[str]) -> dict[str, float] | None:
    """Source domains (with weights summing to 1) that stand for workload ``domain`` in a source
    with domains ``available``: the domain itself, else the first of its :data:`DOMAIN_SOURCES`
    present, else its :data:`REGIME_MIXES` mixture if every regime in it is present; None if none."""
    if domain in available:
        return {domain: 1.0}
    for cand in DOMAIN_SOURCES.get(domain, ()):
        if cand in available:
            return {cand: 1.0}
    mix = REGIME_MIXES.get(domain)
    if mix and all(r in available for r in mix):
        total = sum(mix.values())
        return {r: w / total for r, w in mix.items()}
    return None


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
        num_groups: expert groups of the source (1: none, or not modelled).
        group_loading: ``[D]`` (only with ``num_groups > 1``) the weight ``a^2`` in ``[0, 1)`` of
            the group's latent in an expert's latent ``a * g_group + sqrt(1 - a^2) * eps_expert``,
            per domain (:func:`fit_group_loading`); None: no group structure.
        group_corr: ``[D, D]`` correlation between domains of the group latents ``g``.
        group_ep_size: the EP size whose static placement ``group_loading`` was fitted on.
        busiest_gpu: ``[D]`` real busiest-GPU/mean of each domain on that placement
            (:func:`static_imbalance`; with the group structure only).
    """

    source: str
    num_experts: int
    top_k: int
    depth: tuple[float, ...]
    log_quantiles: dict[str, np.ndarray]
    corr: np.ndarray
    max_over_mean: dict[str, np.ndarray]
    tv: np.ndarray
    num_groups: int = 1
    group_loading: np.ndarray | None = None
    group_corr: np.ndarray | None = None
    group_ep_size: int | None = None
    busiest_gpu: np.ndarray | None = None

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(self.log_quantiles)

    def subset(self, domains: Sequence[str]) -> PopularityFit:
        """The same fit restricted to ``domains`` (in that order)."""
        idx = [self.domains.index(d) for d in domains]
        grouped = self.group_loading is not None and self.group_corr is not None
        return PopularityFit(
            source=self.source,
            num_experts=self.num_experts,
            top_k=self.top_k,
            depth=self.depth,
            log_quantiles={d: self.log_quantiles[d] for d in domains},
            corr=self.corr[:, idx][:, :, idx],
            max_over_mean={d: self.max_over_mean[d] for d in domains},
            tv=self.tv[:, idx][:, :, idx],
            num_groups=self.num_groups,
            group_loading=self.group_loading[idx] if grouped else None,
            group_corr=self.group_corr[idx][:, idx] if grouped else None,
            group_ep_size=self.group_ep_size,
            busiest_gpu=self.busiest_gpu[idx] if grouped and self.busiest_gpu is not None else None,
        )

    def to_dict(self, digits: int | None = None) -> dict[str, Any]:
        """JSON-ready numbers, rounded: curves and correlations to 5 decimals and the real-data
        statistics to 4, or everything to ``digits`` decimals if given."""
        fine, coarse = (5, 4) if digits is None else (digits, digits)
        out = {
            "source": self.source,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "depth": [round(x, 6) for x in self.depth] if digits is not None else list(self.depth),
            "quantile_ranks": list(QUANTILE_RANKS),
            "domains": list(self.domains),
            "log_quantiles": {d: np.round(q, fine).tolist() for d, q in self.log_quantiles.items()},
            "corr": np.round(self.corr, fine).tolist(),
            "max_over_mean": {d: np.round(v, coarse).tolist() for d, v in self.max_over_mean.items()},
            "tv": np.round(self.tv, coarse).tolist(),
        }
        if self.group_loading is not None and self.group_corr is not None:
            out["groups"] = {
                "num_groups": self.num_groups,
                "ep_size": self.group_ep_size,
                "loading": np.round(self.group_loading, fine).tolist(),
                "corr": np.round(self.group_corr, fine).tolist(),
                "busiest_gpu": None if self.busiest_gpu is None else np.round(self.busiest_gpu, coarse).tolist(),
            }
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PopularityFit:
        if not np.allclose(d["quantile_ranks"], QUANTILE_RANKS):
            raise TraceError("popularity fit: quantile_ranks differ from this version's; re-run bench/fit_profiles.py")
        groups = d.get("groups")
        return cls(
            source=d["source"],
            num_experts=int(d["num_experts"]),
            top_k=int(d["top_k"]),
            depth=tuple(float(x) for x in d["depth"]),
            log_quantiles={k: np.asarray(d["log_quantiles"][k], dtype=np.float64) for k in d["domains"]},
            corr=np.asarray(d["corr"], dtype=np.float64),
            max_over_mean={k: np.asarray(d["max_over_mean"][k], dtype=np.float64) for k in d["domains"]},
            tv=np.asarray(d["tv"], dtype=np.float64),
            num_groups=int(groups["num_groups"]) if groups else 1,
            group_loading=np.asarray(groups["loading"], dtype=np.float64) if groups else None,
            group_corr=np.asarray(groups["corr"], dtype=np.float64) if groups else None,
            group_ep_size=int(groups["ep_size"]) if groups else None,
            busiest_gpu=np.asarray(groups["busiest_gpu"], dtype=np.float64) if groups and groups.get("busiest_gpu") else None,
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
    def from_dict(cls, d: Mapping[str, Any]) -> TemporalFit:
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
    """Fit a :class:`PopularityFit` from a :class:`~moe_eplb.eplb.tracefile.DomainCounts`.

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
    Mixtral-8x7B, 8 experts; ``olmoe-sft``: OLMoE SFT, chat only; ``deepseek-v3``: DeepSeek-V3,
    256 experts in 8 groups, every MoE layer, the six SGLang regimes as domains)."""
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
