"""What a candidate's redundancy costs in replicas: the redundancy-KV-cache trade a user pays in GPUs.

Each redundant expert slot takes GPU memory the KV cache would otherwise get: with ``R`` redundant
experts every GPU of an EP group holds ``R / EP`` more expert copies per MoE layer, so
``R * layers * bytes_per_expert / EP`` bytes less KV cache per GPU (vLLM sizes the cache from what
the weights leave). :func:`replicas_needed` turns that into replicas: at today's traffic (the KV
cache in use now, over ``replicas_now`` replicas) and the autoscaler's target usage, how many
replicas a candidate needs to hold the same requests -- fewer when its predicted throughput is
higher (requests finish sooner and hold their cache for less time). Pure arithmetic, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class KvCapacity:
    """Today's KV-cache state of a deployment, as measured.

    Attributes:
        replicas: replicas (replica groups) serving now.
        usage: mean KV-cache usage now, 0..1 (``vllm:kv_cache_usage_perc``).
        kv_bytes_per_gpu: KV-cache bytes of one GPU under the running redundancy.
        redundant: redundant experts running now.
        target: the usage the autoscaler holds (its KVCacheUsage target; 1.0 -- a full cache --
            when it scales on another metric).
    """

    replicas: int
    usage: float
    kv_bytes_per_gpu: float
    redundant: int
    target: float = 1.0


def kv_bytes_per_gpu(cap: KvCapacity, redundant: int, *, num_moe_layers: int, bytes_per_expert: float,
                     ep_size: int) -> float:
    """KV-cache bytes per GPU with ``redundant`` redundant experts instead of ``cap.redundant``."""
    return cap.kv_bytes_per_gpu + (cap.redundant - redundant) * num_moe_layers * bytes_per_expert / ep_size


def replicas_needed(cap: KvCapacity, redundant: int, *, num_moe_layers: int, bytes_per_expert: float, ep_size: int,
                    throughput_ratio: float = 1.0) -> int | None:
    """Replicas a candidate with ``redundant`` redundant experts needs so that today's KV-cache
    demand stays at the target usage; ``throughput_ratio``: the candidate's predicted throughput
    over the running one's. None when the candidate leaves no KV cache at all."""
    kv = kv_bytes_per_gpu(cap, redundant, num_moe_layers=num_moe_layers, bytes_per_expert=bytes_per_expert,
                          ep_size=ep_size)
    if kv <= 0 or cap.target <= 0:
        return None
    demand = cap.replicas * cap.usage * cap.kv_bytes_per_gpu / max(throughput_ratio, 1e-9)
    return max(1, math.ceil(demand / (kv * cap.target) - 1e-9))


@dataclass(frozen=True)
class CandidateCost:
    """One candidate's redundancy priced in replicas (see :func:`candidate_costs`)."""

    window_size: int
    step_interval: int
    num_redundant_experts: int
    kv_cache_gib_per_gpu: float
    replicas: int | None  # None: the candidate leaves no KV cache

    def to_dict(self) -> dict[str, Any]:
        return {"window_size": self.window_size, "step_interval": self.step_interval,
                "num_redundant_experts": self.num_redundant_experts,
                "kv_cache_gib_per_gpu": self.kv_cache_gib_per_gpu, "replicas": self.replicas}


def candidate_costs(result: Any, cap: KvCapacity, *, num_moe_layers: int, bytes_per_expert: float, ep_size: int,
                    limit: int = 6) -> list[CandidateCost]:
    """The best ``limit`` candidates of a :class:`~moe_eplb.eplb.tuning.tuner.TuneResult` with the KV cache
    per GPU their redundancy leaves and the replicas they need (:func:`replicas_needed`, scaled by
    their predicted throughput over the running settings', when the result has them)."""
    ref = result.current.mean if result.current is not None and result.current.mean > 0 else None
    shape = dict(num_moe_layers=num_moe_layers, bytes_per_expert=bytes_per_expert, ep_size=ep_size)
    out = []
    for c in result.candidates[:limit]:
        r = c.knobs.num_redundant_experts
        kv = kv_bytes_per_gpu(cap, r, **shape)
        n = replicas_needed(cap, r, throughput_ratio=c.mean / ref if ref else 1.0, **shape)
        out.append(CandidateCost(c.knobs.window_size, c.knobs.step_interval, r, round(kv / 2**30, 3), n))
    return out


def capacity_from_trace(trace: Any, *, replicas: int, redundant: int, target: float = 1.0,
                        recent_buckets: int = 4) -> KvCapacity | None:
    """Today's KV cache from a trace's telemetry (mean usage over the last ``recent_buckets``
    buckets, KV-cache bytes per GPU); None when the telemetry lacks either."""
    tel = trace.telemetry
    if tel is None or tel.kv_cache_usage is None or not tel.kv_cache_bytes_per_gpu:
        return None
    recent = np.asarray(tel.kv_cache_usage[-recent_buckets:], dtype=np.float64)
    if not np.isfinite(recent).any():
        return None
    return KvCapacity(replicas=max(1, replicas), usage=float(np.nanmean(recent)),
                      kv_bytes_per_gpu=float(tel.kv_cache_bytes_per_gpu), redundant=redundant, target=target)
