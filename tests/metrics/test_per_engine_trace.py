"""The tuner's load trace is per engine (replica group), so its answer does not depend on how many
replicas the autoscaler runs: the sources sum every pod, and ``assemble.per_engine`` divides each
bucket by the engines that ran in it (``meta["engines"]``). The pods' load is read the operator's
way: scrape rounds through :func:`moe_eplb.metrics.reader.trace_from_scraped_rounds` on its grid."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from moe_eplb.controller.autotune_settings import OPERATOR_SEARCH
from moe_eplb.eplb.tuning.tuner import tune
from moe_eplb.metrics.assemble import per_engine
from moe_eplb.metrics.grid import grid_for
from moe_eplb.metrics.reader import trace_from_scraped_rounds
from moe_eplb.metrics.scrape import PodSample, Round

L, E, T, STEPS = 2, 16, 48, 250  # layers, experts, buckets, engine steps per bucket and engine
B, T0 = 15.0, 990.0  # bucket seconds; the first round's time (on the grid, as the operator's reads are)


def _load() -> np.ndarray:
    """[T, L, E] tokens of one engine: a popularity that drifts half-way (so the window matters)."""
    rng = np.random.default_rng(7)
    a, b = rng.dirichlet(np.full(E, 0.3), size=L), rng.dirichlet(np.full(E, 0.3), size=L)
    pop = np.array([a if t < T // 2 else b for t in range(T)])
    return np.round(pop * 8 * 64 * STEPS)


def _rounds(replicas: int, joins_at: int | None = None) -> list[Round]:
    """Scrape rounds of ``replicas`` pods serving the same workload (one more joins half-way
    through bucket ``joins_at``, as after a scale-out)."""
    load = _load()
    cum = np.concatenate([np.zeros((1, L, E)), np.cumsum(load, axis=0)])
    rounds = []
    for t in range(T + 1):
        pods = {}
        for i in range(replicas + (1 if joins_at is not None else 0)):
            start, done, steps = 0.0, cum[t], float(STEPS * t)
            if i == replicas:  # the late replica: starts half-way through bucket joins_at
                if t < joins_at:
                    continue
                start = T0 + B * joins_at - 1
                half = 0.5 * load[joins_at] if t > joins_at else 0.0
                done = cum[t] - cum[min(t, joins_at + 1)] + half
                steps = STEPS * (max(0, t - joins_at - 1) + (0.5 if t > joins_at else 0.0))
            tokens = {(layer, e): float(done[layer, e]) for layer in range(L) for e in range(E)}
            pods[f"p{i}"] = PodSample(start_time={"m": start}, steps={"m": float(steps)}, tokens={"m": tokens})
        rounds.append(Round(time=T0 + B * t, pods=pods))
    return rounds


def read(rounds: list[Round]):
    """The trace the operator reads from these rounds (window: T buckets ending at the last round)."""
    grid = grid_for(rounds[-1].time, T * B, B)
    assert grid[0] == rounds[0].time
    return trace_from_scraped_rounds(rounds, grid, num_layers=L, num_experts=E)


def test_summed_traces_scale_with_the_replicas_per_engine_traces_do_not():
    one = read(_rounds(1))
    three = read(_rounds(3))
    assert three.meta["engines"] == [3.0] * T
    np.testing.assert_array_equal(three.bucket_steps, 3 * one.bucket_steps)  # summed: 3x the steps
    per = per_engine(three)
    np.testing.assert_allclose(per.load, one.load)
    np.testing.assert_array_equal(per.bucket_steps, one.bucket_steps)
    assert per_engine(one) is one  # one engine: nothing to divide


def test_a_replica_joining_mid_window_counts_half_in_its_first_bucket():
    grown = read(_rounds(2, joins_at=20))
    assert grown.meta["engines"] == [2.0] * 20 + [2.5] + [3.0] * (T - 21)
    per = per_engine(grown)
    one = read(_rounds(1))
    np.testing.assert_allclose(per.load, one.load)
    np.testing.assert_array_equal(per.bucket_steps, one.bucket_steps)


def _candidates(trace) -> dict:
    result = tune(trace, replace(OPERATOR_SEARCH, ep_size=4, min_steps=1000, workers=1))
    return {c.knobs: (round(c.score, 6), c.result.rearrangements) for c in result.candidates}


def test_the_tuners_answer_is_invariant_to_the_replica_count():
    one = _candidates(read(_rounds(1)))
    four = read(_rounds(4))
    assert _candidates(per_engine(four)) == one  # every candidate's score and rearrangements
    # summed over the replicas, each engine would seem to rearrange 4x as often and score otherwise
    summed = _candidates(four)
    some = next(iter(one))
    assert summed[some][1] == 4 * one[some][1] and summed != one


def test_summed_telemetry_is_divided_and_means_are_kept():
    from moe_eplb.eplb.workload.trace import LoadTrace, Telemetry

    T2 = 3
    tel = Telemetry(step_seconds=np.full(T2, 0.02), rank_load=np.full((T2, L, 4), 100.0),
                    kv_cache_usage=np.full(T2, 0.5), preemptions=np.array([4.0, 2.0, 0.0]),
                    requests_waiting=np.array([6.0, 3.0, 0.0]))
    trace = LoadTrace(load=np.full((T2, L, E), 8.0), bucket_steps=np.array([200, 100, 0]), bucket_seconds=15.0,
                      meta={"engines": [2.0, 1.0, 0.0]}, telemetry=tel)
    per = per_engine(trace)
    np.testing.assert_array_equal(per.bucket_steps, [100, 100, 0])
    np.testing.assert_allclose(per.load[:, 0, 0], [4.0, 8.0, 8.0])  # an empty bucket is left as it is
    np.testing.assert_allclose(per.telemetry.rank_load[:, 0, 0], [50.0, 100.0, 100.0])
    np.testing.assert_allclose(per.telemetry.preemptions, [2.0, 2.0, 0.0])
    np.testing.assert_allclose(per.telemetry.requests_waiting, [3.0, 3.0, 0.0])
    np.testing.assert_allclose(per.telemetry.step_seconds, trace.telemetry.step_seconds)  # means: unchanged
    np.testing.assert_allclose(per.telemetry.kv_cache_usage, trace.telemetry.kv_cache_usage)
    assert per.meta["engines_summed"] == [2.0, 1.0, 0.0]


def test_concurrency_of_pods_that_replace_each_other_or_run_side_by_side():
    from moe_eplb.metrics.assemble import concurrent_engines

    T5 = 5
    def run(a, b):
        flags = np.zeros(T5, dtype=bool)
        flags[a:b] = True
        return flags

    # one pod replaced by another within bucket 2 (a rollout with maxSurge 0): one engine throughout
    np.testing.assert_array_equal(concurrent_engines([run(0, 3), run(2, 5)], T5), [1, 1, 1, 1, 1])
    # one engine starting mid-window: one engine from its first bucket, none before
    np.testing.assert_array_equal(concurrent_engines([run(2, 5)], T5), [0, 0, 1, 1, 1])
    # a second replica joins in bucket 2: 1.5 there, then 2
    np.testing.assert_array_equal(concurrent_engines([run(0, 5), run(2, 5)], T5), [1, 1, 1.5, 2, 2])
    # replica groups of 2 pods: counted in groups
    np.testing.assert_array_equal(concurrent_engines([run(0, 5)] * 4, T5, pods_per_engine=2), [2] * 5)
