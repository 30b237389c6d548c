"""The fitted parameters: :class:`PopularityFit` and :class:`TemporalFit` (their meaning: the
package's docstring), the quantile ranks their curves are kept on, and the workload domains they
stand for (:func:`resolve_domain`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moe_eplb.eplb.workload.trace import TraceError

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
