"""Where the popularity comes from: the shipped fits or the real routing data files."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from moe_eplb.eplb.workload import profiles as _profiles
from moe_eplb.eplb.workload.profiles import (
    DOMAIN_SOURCES,
    REGIME_MIXES,
    PopularityFit,
    TemporalFit,
)
from moe_eplb.eplb.workload.synth.catalog import SynthError


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
    from moe_eplb.eplb.workload import tracefile

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
