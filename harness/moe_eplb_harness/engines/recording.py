"""A trace served by one SIMULATED engine, with the telemetry a real deployment would record.

:func:`record` replays a load trace through the simulated EPLB of :mod:`moe_eplb_harness.engines.engine` and
turns the deployment's true cost parameters (:class:`moe_eplb_harness.engines.physics.TrueCost`) into every
telemetry key of docs/traces.md -- the input the calibration (:mod:`moe_eplb.eplb.tuning.calibrate`) must
recover the parameters from. Tests, the benchmarks and ``moe-eplb`` tooling use it; the operator never.
"""

from __future__ import annotations

import numpy as np

from moe_eplb.api.knobs import Knobs
from moe_eplb.eplb.workload.trace import LoadTrace, Rearrangement, RecordedConfig, Telemetry, served_imbalance
from moe_eplb_harness.engines.engine import EngineSettings, SimulatedEplb
from moe_eplb_harness.engines.physics import TrueCost, tokens_per_step

__all__ = ["record"]


def record(trace: LoadTrace, knobs: Knobs, ep_size: int, true: TrueCost, *, num_nodes: int = 1,
           num_groups: int = 1, bytes_per_expert: float | None = None, seed: int = 0) -> LoadTrace:
    """``trace`` served by one simulated engine running ``knobs`` on ``ep_size`` GPUs, with the
    telemetry a real deployment with cost ``true`` would record (every key of docs/traces.md).

    The engine starts cold at bucket 0 (vLLM's start-up placement). ``bytes_per_expert``: the
    expert size (None: the cost model's known shapes; unknown shapes move no bytes)."""
    rng = np.random.default_rng(seed)
    L, E, T = trace.num_layers, trace.num_experts, trace.num_buckets
    per_expert = true.expert_bytes(L, E) if bytes_per_expert is None else float(bytes_per_expert)
    eplb = SimulatedEplb(L, E, EngineSettings(model=trace.model or "model", ep_size=ep_size, knobs=knobs,
                                              num_nodes=num_nodes, num_groups=num_groups))
    tok = tokens_per_step(trace)
    base = np.asarray(true.balanced_step_s(tok), np.float64)
    rank_load = np.zeros((T, L, ep_size))
    overhead = np.zeros(T)
    events: list[Rearrangement] = []
    for t in range(T):
        before = len(eplb.moved)
        rank_load[t] = eplb.run(trace.load[t], int(trace.bucket_steps[t]))
        for moved in eplb.moved[before:]:
            lost, duration = true.rearrangement(moved, ep_size, L, per_expert, float(base[t]), rng)
            overhead[t] += lost
            events.append(Rearrangement(t, duration))
    step = true.step_seconds(tok, served_imbalance(rank_load), overhead, trace.bucket_steps, rng)
    red_bytes = L * per_expert * knobs.num_redundant_experts / ep_size
    ref = float(np.median(tok[trace.bucket_steps > 0])) if np.any(trace.bucket_steps > 0) else 1.0
    usage, preempt, waiting = true.kv_state(tok, ref, red_bytes, trace.bucket_steps, rng)
    queried, hit = true.prefix_state(tok, ref, red_bytes, trace.bucket_steps, rng)
    tel = Telemetry(step_seconds=step, rank_load=rank_load, kv_cache_usage=usage, preemptions=preempt,
                    requests_waiting=waiting, rearrangements=tuple(events),
                    config=RecordedConfig(knobs, ep_size, true.use_async),
                    kv_cache_bytes_per_gpu=true.kv_cache_bytes_per_gpu - red_bytes,
                    prefix_cache_queries=queried, prefix_cache_hit_rate=hit,
                    kv_cache_blocks=true.kv_cache_blocks(red_bytes), kv_block_size=true.kv_block_size)
    return LoadTrace(load=trace.load, bucket_steps=trace.bucket_steps, bucket_seconds=trace.bucket_seconds,
                     top_k=trace.top_k, model=trace.model, meta=dict(trace.meta), telemetry=tel)
