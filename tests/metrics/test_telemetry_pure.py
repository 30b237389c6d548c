"""The reader's telemetry (moe_eplb.metrics.telemetry_keys): raw samples -> trace keys, on the bucket grid;
missing or incomplete sources leave keys absent, never filled in."""

from __future__ import annotations

import numpy as np
import pytest

from moe_eplb.api.knobs import Knobs
from moe_eplb.eplb.workload import synth
from moe_eplb.eplb.workload.trace import LoadTrace
from moe_eplb.metrics.reader import trace_from_scraped_rounds, with_telemetry
from moe_eplb.metrics.scrape import Round, parse_exposition
from moe_eplb.metrics.series import Series
from moe_eplb.metrics.telemetry_keys import TelemetrySeries, gauge_mean, telemetry_from_series
from moe_eplb_harness.engines.engine import EngineRun, EngineSettings, SimClock, SimulatedEngine
from moe_eplb_harness.engines.physics import TrueCost

GRID = np.array([0.0, 15.0, 30.0, 45.0])  # 3 buckets
TS = np.array([0.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 35.0, 40.0, 45.0])


def _s(values, **labels) -> Series:
    return Series({"model_name": "m", "pod": "p0", **labels}, TS, np.asarray(values, float))


def _counter(per_sample):
    return np.concatenate([[0.0], np.cumsum(per_sample)])


def _src(**over) -> TelemetrySeries:
    # 3 steps per 5 s sample; step time 0.05 s in bucket 0, 0.06 in 1 and 2
    steps = np.array([3.0] * 9)
    secs = steps * np.array([0.05] * 3 + [0.06] * 6)
    src = TelemetrySeries(
        step_sum=[_s(_counter(secs), rank="0")], step_count=[_s(_counter(steps), rank="0")],
        rank_tokens=[_s(_counter(np.full(9, v)), layer=str(l), rank=str(r))
                     for l in range(2) for r, v in ((0, 3.0), (1, 1.0))],
        rearrangement_sum=[_s(_counter([0, 0, 0, 0.9, 0, 0, 0, 0, 0]))],
        rearrangement_count=[_s(_counter([0, 0, 0, 1, 0, 0, 0, 0, 0]))],
        config_info=[Series({"model_name": "m", "window_size": "1000", "step_interval": "3000",
                             "num_redundant_experts": "0", "ep_size": "2", "use_async": "false"}, TS, np.ones(10))],
        kv_bytes=[_s(np.full(10, 4e10), rank="0"), _s(np.full(10, 4.2e10), rank="1"), _s(np.full(10, 4.4e10), rank="2")],
        kv_usage=[_s([0.5] * 4 + [0.9] * 6, engine="0")],
        preemptions=[_s(_counter([0, 0, 0, 0, 0, 0, 1, 1, 0]), engine="0")],
        waiting=[_s([0] * 7 + [2] * 3, engine="0"), _s([0] * 7 + [1] * 3, engine="1")],
        # 100 queried tokens per sample; 60 hits per sample in bucket 0, then 30; nothing queried in bucket 2
        prefix_queries=[_s(_counter([100] * 6 + [0] * 3), engine="0")],
        prefix_hits=[_s(_counter([60] * 3 + [30] * 3 + [0] * 3), engine="0")],
        cache_config=[Series({"engine": "0", "num_gpu_blocks": "22000", "block_size": "16", "gpu_memory_utilization":
                              "0.9"}, TS, np.ones(10))],  # vLLM's info gauge has no model_name label
    )
    for k, v in over.items():
        setattr(src, k, v)
    return src


def test_every_key_from_its_series():
    got = telemetry_from_series(_src(), GRID, np.array([9, 9, 9]), num_layers=2, model="m")
    tel = got.telemetry
    assert got.skipped == {}
    np.testing.assert_allclose(tel.step_seconds, [0.05, 0.06, 0.06])
    assert tel.rank_load.shape == (3, 2, 2) and tel.rank_load[0, 0].tolist() == [9.0, 3.0]
    assert [(e.bucket, e.seconds) for e in tel.rearrangements] == [(1, pytest.approx(0.9))]
    assert tel.config.knobs == Knobs(1000, 3000, 0) and tel.config.ep_size == 2 and tel.config.use_async is False
    assert tel.kv_cache_bytes_per_gpu == 4.2e10  # median over ranks
    np.testing.assert_allclose(tel.kv_cache_usage, [0.5, 0.9, 0.9])
    assert tel.preemptions.tolist() == [0.0, 0.0, 2.0]
    np.testing.assert_allclose(tel.requests_waiting, [0, 0, 3])  # summed over engines
    assert tel.prefix_cache_queries.tolist() == [300.0, 300.0, 0.0]
    np.testing.assert_allclose(tel.prefix_cache_hit_rate, [0.6, 0.3, np.nan])  # nothing queried: no rate
    assert (tel.kv_cache_blocks, tel.kv_block_size, tel.kv_cache_tokens) == (22000, 16, 352000)


def test_prefix_cache_counters_of_older_engines_are_read_by_their_gpu_names():
    new = _src()
    src = _src(prefix_queries=[], prefix_hits=[], prefix_queries_old=new.prefix_queries,
               prefix_hits_old=new.prefix_hits)
    tel = telemetry_from_series(src, GRID, np.array([9, 9, 9]), num_layers=2, model="m").telemetry
    np.testing.assert_allclose(tel.prefix_cache_hit_rate, [0.6, 0.3, np.nan])
    got = telemetry_from_series(_src(prefix_hits=[], cache_config=[Series({"engine": "0", "block_size": "16"}, TS,
                                                                            np.ones(10))]),
                                GRID, np.array([9, 9, 9]), num_layers=2, model="m")
    assert got.telemetry.prefix_cache_hit_rate is None and "vllm:prefix_cache_hits_total" in got.skipped[
        "prefix_cache_hit_rate"]
    assert got.telemetry.kv_cache_blocks is None and "num_gpu_blocks" in got.skipped["kv_cache_blocks"]


def test_missing_or_incomplete_sources_leave_keys_absent():
    src = _src(step_sum=[], kv_bytes=[], rank_tokens=[s for s in _src().rank_tokens if s.labels["layer"] == "0"])
    got = telemetry_from_series(src, GRID, np.array([9, 9, 9]), num_layers=2, model="m")
    assert got.telemetry.step_seconds is None and "no moe_eplb_step_duration_seconds" in got.skipped["step_seconds"]
    assert got.telemetry.rank_load is None and "do not cover the 2 layers" in got.skipped["rank_load"]
    assert got.telemetry.kv_cache_bytes_per_gpu is None
    # a bucket that ran steps without a step-duration observation: no step_seconds at all
    got = telemetry_from_series(_src(), GRID, np.array([9, 9, 9]) + np.array([0, 0, 0]), num_layers=2, model="other")
    assert got.telemetry is None  # nothing of model "other"


def test_gauges_carry_the_newest_sample_within_the_lookback_only_where_none_fell_in_the_bucket():
    s = Series({"model_name": "m"}, np.array([1.0, 2.0]), np.array([0.4, 0.6]))
    np.testing.assert_allclose(gauge_mean([s], np.array([0.0, 15.0, 30.0, 400.0])), [0.5, 0.6, np.nan])


def test_a_gauge_without_samples_where_engines_ran_is_left_out():
    usage = [Series({"model_name": "m"}, TS[:4], np.full(4, 0.5))]
    got = telemetry_from_series(_src(kv_usage=usage), GRID, np.array([9, 9, 9]), num_layers=2, model="m")
    assert got.telemetry.kv_cache_usage is not None  # carried within the lookback
    got = telemetry_from_series(_src(kv_usage=usage), np.array([0.0, 15.0, 30.0, 500.0]), np.array([9, 9, 9]),
                                num_layers=2, model="m")
    assert got.telemetry.kv_cache_usage is None and "bucket 2" in got.skipped["kv_cache_usage"]


def test_direct_scraping_of_a_simulated_engine_fills_every_key():
    wl = synth.generate("qwen3-vl-30b-a3b-steady", model_shape=(2, 8, 1, 2), hours=0.1, seed=0)
    true = TrueCost(moe_time_share=0.5, use_async=False, bytes_per_expert=1e6, prefix_reuse=0.6)
    eng = SimulatedEngine(wl, EngineSettings(model="m", ep_size=2, knobs=Knobs(100, 300, 0)), SimClock(),
                          EngineRun(true_cost=true))
    eng.ready = True
    eng.advance_to(0.0)
    rounds = []
    for t in range(15, 301, 15):
        eng.advance_to(float(t))
        rounds.append(Round(time=float(t), pods={"p": parse_exposition(eng.exposition().decode())}))
    trace = trace_from_scraped_rounds(rounds, np.array([r.time for r in rounds]), num_layers=2, num_experts=8)
    tel = trace.telemetry
    assert trace.meta["telemetry_skipped"] == {}
    assert set(tel.keys()) == {"step_seconds", "rank_load", "kv_cache_usage", "preemptions", "requests_waiting",
                               "rearrangements", "config", "kv_cache_bytes_per_gpu", "prefix_cache_queries",
                               "prefix_cache_hit_rate", "kv_cache_blocks", "kv_block_size"}
    assert tel.config.use_async is False and tel.config.knobs == Knobs(100, 300, 0)
    np.testing.assert_allclose(tel.rank_load.sum(axis=2), trace.load.sum(axis=2))  # same tokens, by rank
    assert np.all(tel.step_seconds > true.step_base_s)
    assert len(tel.rearrangements) > 3 and all(0.5 < e.seconds < 3 for e in tel.rearrangements)
    assert tel.kv_cache_bytes_per_gpu == true.kv_cache_bytes_per_gpu
    assert tel.kv_cache_blocks == true.kv_cache_blocks(0.0) and tel.kv_block_size == true.kv_block_size
    assert np.all(tel.prefix_cache_queries[trace.bucket_steps > 0] > 0)
    ran = np.isfinite(tel.prefix_cache_hit_rate)
    assert ran.sum() >= 15 and np.all((tel.prefix_cache_hit_rate[ran] > 0.3) & (tel.prefix_cache_hit_rate[ran] <= 0.6))


def test_the_trace_keeps_its_load_when_telemetry_is_inconsistent():
    trace = LoadTrace(load=np.ones((3, 2, 4)), bucket_steps=[9, 9, 9], model="m")
    src = _src(config_info=[Series({"model_name": "m", "window_size": "1000", "step_interval": "3000",
                                    "num_redundant_experts": "1", "ep_size": "2"}, TS, np.ones(10))])
    out = with_telemetry(trace, src, GRID, 1, [])
    assert out.telemetry.config is None and out.telemetry.step_seconds is not None  # only the bad key is left out
    assert out.meta["telemetry_skipped"]["config"].startswith("config: experts (4) + redundant (1)")
    np.testing.assert_array_equal(out.load, trace.load)
