"""Scrape rounds the operator's direct reader would have taken of pods with known expert loads."""

from __future__ import annotations

import numpy as np

from moe_eplb.metrics.scrape import PodSample, Round


def scrape_rounds(loads: dict[str, np.ndarray], buckets: int, *, steps: int = 250, t0: float = 990.0,
                  bucket_seconds: float = 15.0) -> list[Round]:
    """``buckets + 1`` rounds, ``bucket_seconds`` apart from ``t0``: each pod's cumulative expert
    tokens (``loads[pod]``: buckets x layers x experts) and ``steps`` engine steps a bucket."""
    rounds = []
    for t in range(buckets + 1):
        pods = {}
        for name, load in loads.items():
            done = load[:t].sum(axis=0)
            tokens = {(layer, e): float(done[layer, e]) for layer in range(load.shape[1]) for e in range(load.shape[2])}
            pods[name] = PodSample(start_time={"m": 0.0}, steps={"m": float(steps * t)}, tokens={"m": tokens})
        rounds.append(Round(time=t0 + bucket_seconds * t, pods=pods))
    return rounds
