"""Replicas that do not see the same load (a cache-affine router): the divergence of their expert loads,
per-replica tuning against one shared setting, its status record and Event, and reading each replica's
own load the operator's way (moe_eplb.eplb.tuning.replicas, the reader's ``only_pods``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moe_eplb.api.autotune_status import Evaluation
from moe_eplb.api.knobs import VLLM_DEFAULTS, Knobs
from moe_eplb.controller import decisions as d
from moe_eplb.eplb.replay.costmodel import CostModel
from moe_eplb.eplb.tuning.options import TuneOptions
from moe_eplb.eplb.tuning.replicas import DIVERGENCE_THRESHOLD, js_divergence, replay_score, tune_per_replica
from moe_eplb.eplb.tuning.tuner import tune
from moe_eplb.eplb.workload import synth
from moe_eplb.eplb.workload.profiles import BUILTIN_PROFILES
from moe_eplb.eplb.workload.trace import LoadTrace
from moe_eplb.metrics.grid import grid_for
from moe_eplb.metrics.reader import read_load_trace
from moe_eplb.metrics.scrape import PodScraper
from moe_eplb_harness.demo.tuning import hot_experts
from tests.metrics.rounds import scrape_rounds

SHAPE = (8, 64, 4, 6)
TOPO = dict(ep_size=16, num_nodes=1, num_groups=4)


def test_js_divergence_in_bits():
    p = np.array([[4.0, 2.0, 1.0, 1.0]])
    same = np.stack([p, 3 * p])  # the same distribution at another volume
    assert js_divergence(same) == pytest.approx(0.0, abs=1e-12)
    disjoint = np.array([[[1.0, 0.0]], [[0.0, 5.0]]])
    assert js_divergence(disjoint) == pytest.approx(1.0)  # two replicas: at most log2(2) = 1 bit
    four = np.eye(4)[:, None, :]  # four replicas on four different experts: log2(4) bits
    assert js_divergence(four) == pytest.approx(2.0)
    # layers weighted by their load; a replica without load in a layer is left out of it
    two_layers = np.array([[[1.0, 0.0], [3.0, 3.0]], [[0.0, 1.0], [3.0, 3.0]]])
    assert js_divergence(two_layers) == pytest.approx(1.0 * 1 / 7)
    assert js_divergence(np.array([[[1.0, 2.0]]])) == 0.0  # one replica
    with pytest.raises(ValueError, match="replicas, layers, experts"):
        js_divergence(np.ones((2, 3)))


@pytest.fixture(scope="module")
def cache_affine():
    """Two replicas of one model behind a cache-affine router: one gets a chat tenant whose prompts draw
    6x on 4 experts of every layer, the other broad traffic that spreads nearly evenly over the experts."""
    chat = dataclasses.replace(BUILTIN_PROFILES["deepseek-v3-steady"], name="chat",
                               phases=({"chat": 0.9, "code": 0.05, "math": 0.05},))
    a = hot_experts(synth.generate(chat, model_shape=SHAPE, hours=1, seed=3), from_second=0.0, experts=4, factor=6.0)
    b = synth.generate("deepseek-v3-flat", model_shape=SHAPE, hours=1, seed=3)
    t = min(a.num_buckets, b.num_buckets)
    return a.slice(0, t), b.slice(0, t)


def test_per_replica_settings_beat_one_shared_setting_where_the_loads_diverge(cache_affine):
    a, b = cache_affine
    cost = CostModel(moe_time_share=0.3, bytes_per_expert=3 * 7168 * 2048 * 58 / 8, kv_throughput_elasticity=0.5)
    pooled = LoadTrace(load=(a.load + b.load) / 2, bucket_steps=(a.bucket_steps + b.bucket_steps) // 2,
                       bucket_seconds=a.bucket_seconds, top_k=a.top_k, model=a.model)
    shared = tune(pooled, TuneOptions(**TOPO), current=VLLM_DEFAULTS, cost=cost).recommendation
    per = tune_per_replica({"a": a, "b": b}, shared, lambda tr: tune(tr, TuneOptions(**TOPO), current=VLLM_DEFAULTS, cost=cost),
                           lambda tr, k: replay_score(tr, k, cost=cost, **TOPO))
    assert per.divergence > DIVERGENCE_THRESHOLD and per.tuned
    assert per.gain > 0.01  # each replica on its own load beats the shared pick
    assert all(p.gain_vs_shared >= 0.0 for p in per.picks)
    assert {p.replica: p.knobs.num_redundant_experts for p in per.picks}["b"] == 0  # no redundancy for even load
    # the shared pick replayed on each replica is what the per-replica gain is measured against
    for p in per.picks:
        trace = {"a": a, "b": b}[p.replica]
        assert p.shared_score == pytest.approx(replay_score(trace, shared, cost=cost, **TOPO))
    assert sorted(r for group in per.groups.values() for r in group) == ["a", "b"]
    out = per.to_dict()
    assert out["tuned"] is True and len(out["replicas"]) == 2
    # the status record and the Event, said once
    rec = d.replicas_record(per)
    assert rec["tuned"] and rec["divergenceBits"] == pytest.approx(per.divergence, rel=1e-5)
    assert {r["replica"] for r in rec["perReplica"]} == {"a", "b"}
    event = d.replicas_event(per, None, 0.001)
    assert event[1] == "PerReplicaSettings" and "a recommendation" in event[2]
    assert d.replicas_event(per, Evaluation(time=0.0, replicas=rec), 0.001) is None
    assert d.replicas_event(per, None, 0.5) is None  # below minGain: nothing to say


def test_replicas_with_the_same_traffic_are_tuned_together(cache_affine):
    a, _ = cache_affine
    twin = dataclasses.replace(a, load=a.load * 1.01)
    calls = []
    per = tune_per_replica({"a": a, "b": twin}, Knobs(1000, 3000, 0), lambda tr: calls.append(tr),
                           lambda tr, k: 1.0)
    assert per.divergence < 1e-6 and not per.tuned and calls == []
    assert d.replicas_record(per) == {"divergenceBits": pytest.approx(per.divergence, abs=1e-9),
                                      "thresholdBits": DIVERGENCE_THRESHOLD, "tuned": False}


def test_the_reader_reads_one_replicas_load_from_the_rounds_already_scraped():
    rng = np.random.default_rng(0)
    T, L, E = 12, 2, 8
    loads = {"p0": rng.poisson(50, (T, L, E)).astype(float), "p1": rng.poisson(5, (T, L, E)).astype(float)}
    scraper = PodScraper()
    scraper.rounds = scrape_rounds(loads, T)
    grid = grid_for(scraper.rounds[-1].time, T * 15.0, 15.0)
    assert grid[0] == scraper.rounds[0].time
    kw = dict(namespace="ns", name="m", window_seconds=T * 15.0, bucket_seconds=15.0, scraper=scraper,
              num_layers=L, num_experts=E)
    for pod, load in loads.items():
        own = read_load_trace(**kw, only_pods=frozenset({pod}))
        np.testing.assert_allclose(own.load, load)
        assert own.total_steps == 250 * T
        # a replica is tuned with the shared cost model: its read can leave the telemetry out
        bare = read_load_trace(**kw, only_pods=frozenset({pod}), telemetry=False)
        np.testing.assert_array_equal(bare.load, own.load)
        np.testing.assert_array_equal(bare.bucket_steps, own.bucket_steps)
        assert bare.telemetry is None
    assert len(scraper.rounds) == T + 1  # no new scrape for a replica's read
