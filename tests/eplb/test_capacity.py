"""A candidate's redundancy priced in replicas (eplb/replay/capacity.py) and the evaluation record of it
(decisions.replica_costs on a real tuner result)."""

from __future__ import annotations

import pytest

from moe_eplb.controller import decisions as d
from moe_eplb.eplb.replay.capacity import KvCapacity, kv_bytes_per_gpu, replicas_needed
from moe_eplb.eplb.tuning.tuner import TuneOptions, tune
from tests.metrics.test_per_engine_trace import L, _rounds, read

GIB, MIB = 2**30, 2**20
# Qwen3-30B-A3B-like: 48 MoE layers, ~9 MiB per expert, EP 4; 4 replicas at 60 % of 20 GiB per GPU
CAP = KvCapacity(replicas=4, usage=0.6, kv_bytes_per_gpu=20 * GIB, redundant=0, target=0.8)
SHAPE = dict(num_moe_layers=48, bytes_per_expert=9 * MIB, ep_size=4)


def test_redundancy_takes_kv_cache_and_costs_replicas():
    assert kv_bytes_per_gpu(CAP, 32, **SHAPE) == 20 * GIB - 32 * 48 * 9 * MIB / 4  # 3.375 GiB less
    assert replicas_needed(CAP, 0, **SHAPE) == 3  # 48 GiB in use / (20 GiB x 0.8)
    assert replicas_needed(CAP, 32, **SHAPE) == 4  # 48 / (16.625 x 0.8) = 3.6
    assert replicas_needed(CAP, 32, throughput_ratio=1.25, **SHAPE) == 3  # faster: 38.4 / 13.3 = 2.9
    assert replicas_needed(KvCapacity(4, 0.6, 1 * GIB, 0), 64, **SHAPE) is None  # no cache left at all


def test_the_autoscalers_target_sets_the_count():
    assert replicas_needed(KvCapacity(2, 0.9, 10 * GIB, 0, target=1.0), 0, **SHAPE) == 2
    assert replicas_needed(KvCapacity(2, 0.9, 10 * GIB, 0, target=0.5), 0, **SHAPE) == 4


def test_replica_costs_of_the_tuners_candidates():
    trace = read(_rounds(1))
    result = tune(trace, TuneOptions(ep_size=4, windows=(250, 1000), intervals=(500, 2000), max_redundancy_levels=3,
                                     min_steps=1000, workers=1))
    cap = KvCapacity(replicas=3, usage=0.7, kv_bytes_per_gpu=4 * GIB, redundant=0, target=0.8)
    costs = d.replica_costs(result, cap, num_moe_layers=L, bytes_per_expert=512 * MIB, ep_size=4)
    assert 1 <= len(costs) <= 6
    assert [(c.window_size, c.step_interval, c.num_redundant_experts) for c in costs] == \
        [(c.knobs.window_size, c.knobs.step_interval, c.knobs.num_redundant_experts) for c in result.candidates[:6]]
    for c in costs:
        assert c.kv_cache_gib_per_gpu == pytest.approx(4 - c.num_redundant_experts * L * 0.5 / 4, abs=1e-3)
        ratio = next(x.mean for x in result.candidates if x.knobs.num_redundant_experts == c.num_redundant_experts
                     and (x.knobs.window_size, x.knobs.step_interval) == (c.window_size, c.step_interval))
        ref = result.current.mean if result.current is not None else ratio
        assert c.replicas == replicas_needed(cap, c.num_redundant_experts, num_moe_layers=L,
                                             bytes_per_expert=512 * MIB, ep_size=4, throughput_ratio=ratio / ref)
    assert d.replica_costs(result, None, num_moe_layers=L, bytes_per_expert=1, ep_size=4) == ()
