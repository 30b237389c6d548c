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
