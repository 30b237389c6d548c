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

In parts (each imports only the ones listed before it):

- ``fits``: the fitted parameter types (``PopularityFit``, ``TemporalFit``), the quantile ranks, the workload domains;
- ``fitting``: the fits themselves (pure) and the statistics they use;
- ``builtin``: the packaged fits (:data:`FIT_FILE`, ``profiles.json`` in this package);
- ``workloads``: ``Profile``, ``Burst`` and ``BUILTIN_PROFILES``.
"""

from moe_eplb.eplb.workload.profiles.builtin import FIT_FILE, FIT_FORMAT_VERSION, builtin_popularity, builtin_temporal
from moe_eplb.eplb.workload.profiles.fits import (
    DOMAIN_SOURCES,
    QUANTILE_RANKS,
    REGIME_MIXES,
    PopularityFit,
    TemporalFit,
    resolve_domain,
)
from moe_eplb.eplb.workload.profiles.fitting import (
    StaticImbalance,
    curve_values,
    dirichlet_tv,
    fit_group_loading,
    fit_popularity,
    fit_temporal,
    kappa_for_tv,
    mean_domain_tv,
    moe_depth,
    normal_scores,
    sorted_curve,
    static_imbalance,
    static_imbalance_per_layer,
    total_variation,
)
from moe_eplb.eplb.workload.profiles.workloads import BUILTIN_PROFILES, Burst, Profile

__all__ = ["BUILTIN_PROFILES", "Burst", "DOMAIN_SOURCES", "FIT_FILE", "FIT_FORMAT_VERSION", "PopularityFit", "Profile",
           "QUANTILE_RANKS", "REGIME_MIXES", "StaticImbalance", "TemporalFit", "builtin_popularity", "builtin_temporal",
           "curve_values", "dirichlet_tv", "fit_group_loading", "fit_popularity", "fit_temporal", "kappa_for_tv",
           "mean_domain_tv", "moe_depth", "normal_scores", "resolve_domain", "sorted_curve", "static_imbalance",
           "static_imbalance_per_layer", "total_variation"]
