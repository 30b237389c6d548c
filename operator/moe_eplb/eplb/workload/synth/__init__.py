"""Workload generator: realistic expert-load traces for a target MoE shape, built from the expert
popularity measured on real models (see :mod:`moe_eplb.eplb.workload.profiles` and docs/traces.md).

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
:data:`moe_eplb.eplb.workload.profiles.BUILTIN_PROFILES`.

In parts (each imports only the ones listed before it):

- ``catalog``: model shapes, profiles by name, ``SynthError``;
- ``sources``: the popularity's source: shipped fits or real files;
- ``layout``: step 1, the expert layout;
- ``schedule``: steps 2-3, mix, rate and bursts;
- ``generator``: ``generate`` and ``with_phases``.
"""

from moe_eplb.eplb.workload.synth.catalog import MODEL_SHAPES, SynthError, get_profile, list_profiles, resolve_shape
from moe_eplb.eplb.workload.synth.generator import generate, with_phases
from moe_eplb.eplb.workload.synth.layout import domain_popularity
from moe_eplb.eplb.workload.synth.schedule import request_concentration

__all__ = ["MODEL_SHAPES", "SynthError", "domain_popularity", "generate", "get_profile", "list_profiles",
           "request_concentration", "resolve_shape", "with_phases"]
