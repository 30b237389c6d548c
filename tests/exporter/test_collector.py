"""Pod aggregation, balancedness, cardinality modes, the text exposition and the HTTP server."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moe_eplb.contracts import k8s_names, metric_names
from moe_eplb.exporter import snapshot as snap
from moe_eplb.exporter.collector import (
    BalancednessWindow,
    PodCollector,
    aggregate,
    balancedness,
    families,
)
from moe_eplb.exporter.server import make_registry, serve
from moe_eplb.exporter.settings import ExporterSettingsError, Settings


def _worker(pid, rank, ep, L=2, E=4, scale=1.0, steps=10, name="m", use_async=False):
    et = np.arange(L * E, dtype=float).reshape(L, E) * scale
    rt = np.zeros((L, ep))
    rt[:, rank] = 1.0 * scale
    rt[:, (rank + 1) % ep] += 2.0 * scale
    reps = np.ones((L, E), np.int64)
    reps[0, 1] = 2
    return snap.WorkerSnapshot(pid=pid, time=0.0, models=[snap.ModelSnapshot(
        name=name, ep_rank=rank, ep_size=ep, expert_tokens=et, rank_tokens=rt, replicas=reps, steps=steps + rank,
        rearrangements=3 + rank, duration_sum=1.5, window_size=1000, step_interval=3000, num_redundant_experts=4,
        use_async=use_async, start_time=100.0 + rank)])


def test_snapshot_roundtrip(tmp_path):
    w = _worker(7, 1, 2)
    snap.write(str(tmp_path), w)
    (back,) = snap.read_all(str(tmp_path))
    m0, m1 = w.models[0], back.models[0]
    assert (back.pid, m1.name, m1.ep_rank, m1.steps, m1.window_size, m1.use_async) == (7, "m", 1, 11, 1000, False)
    np.testing.assert_array_equal(m0.expert_tokens, m1.expert_tokens)
    np.testing.assert_array_equal(m0.replicas, m1.replicas)


def test_aggregate_sums_load_and_takes_engine_values_from_the_most_advanced_rank():
    pm = aggregate([_worker(1, 0, 2), _worker(2, 1, 2, scale=2.0)])["m"]
    np.testing.assert_array_equal(pm.expert_tokens, np.arange(8.0).reshape(2, 4) * 3)
    np.testing.assert_array_equal(pm.rank_tokens, [[1 + 4, 2 + 2]] * 2)
    # lockstep values are never summed over ranks; rank 1's snapshot is one step further (11, 4)
    assert pm.steps == 11 and pm.rearrangements == 4, "lockstep values must not be summed over ranks"
    assert pm.complete and pm.ranks == {0, 1}
    assert pm.start_time == 100.0


def test_balancedness_is_per_layer_not_vllms_layer_summed_ratio():
    # rank 0 is overloaded in layer 0, rank 1 in layer 1: summed over layers they look equal
    rt = np.array([[30.0, 10.0], [10.0, 30.0]])
    b = balancedness(rt)
    assert b == {0: pytest.approx(20 / 30), 1: pytest.approx(20 / 30)}
    per_rank = rt.sum(axis=0)  # vLLM <= 0.2x logged mean/max of per-rank totals over layers
    assert per_rank.mean() / per_rank.max() == 1.0
    assert balancedness(np.zeros((2, 2))) == {}


def test_balancedness_window_forgets_old_load():
    w = BalancednessWindow(seconds=10)
    pm = aggregate([_worker(1, 0, 2), _worker(2, 1, 2)])["m"]
    pm.rank_tokens = np.array([[100.0, 0.0]])
    assert w.update(0.0, pm) == {0: 0.5}
    pm.rank_tokens = np.array([[100.0, 50.0]])
    w.update(5.0, pm)
    pm.rank_tokens = np.array([[150.0, 150.0]])
    # baseline: the newest sample at or before t-10 = t=5 -> delta [50, 100]
    assert w.update(15.0, pm) == {0: pytest.approx(75 / 100)}


def _series(fams):
    return sum(len(f.samples) for f in fams)


def test_modes_and_cardinality_deepseek_v3_shape():
    L, E, EP, R = 58, 256, 32, 32
    rng = np.random.default_rng(0)
    reps = np.ones((L, E), np.int64)
    for l in range(L):
        reps[l, rng.choice(E, R, replace=False)] = 2
    m = snap.ModelSnapshot(name="deepseek-ai/DeepSeek-V3", ep_rank=0, ep_size=EP, expert_tokens=np.ones((L, E)),
                           rank_tokens=np.ones((L, EP)), replicas=reps)
    pm = aggregate([snap.WorkerSnapshot(pid=1, time=0, models=[m])])["deepseek-ai/DeepSeek-V3"]
    pm.balancedness = balancedness(pm.rank_tokens)
    full = _series(families({"x": pm}, "full"))
    reduced = _series(families({"x": pm}, "reduced"))
    # per rank (one worker here): the step-duration and step-token histograms (buckets + +Inf +
    # _sum + _count each); the KV-cache gauge only when the worker saw its cache (not here)
    per_rank = (len(metric_names.STEP_SECONDS_BUCKETS) + 3) + (len(metric_names.STEP_TOKENS_BUCKETS) + 3)
    assert full == L * E * 2 + L * EP + L + 1 + 1 + 1 + 1 + 1 + (len(snap.DURATION_BUCKETS) + 1 + 2) + per_rank
    assert reduced == L * E + L * EP + L * R + L + 5 + len(snap.DURATION_BUCKETS) + 3 + per_rank
    assert full > 20_000 > reduced
    # a pod holding all 32 ranks (one worker each, KV gauge on) stays under 20 000 in reduced mode
    assert reduced + (EP - 1) * per_rank + EP < 20_000


@pytest.mark.integration
def test_exposition_keeps_exact_names_and_labels(tmp_path):
    snap.write(str(tmp_path), _worker(1, 0, 2))
    snap.write(str(tmp_path), _worker(2, 1, 2))
    coll = PodCollector(str(tmp_path), "full", 60, clock=lambda: 0.0)
    httpd = serve(make_registry(coll), "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}{k8s_names.EXPORTER_PATH}"
        req = urllib.request.Request(url, headers={
            "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            ctype, text = resp.headers["Content-Type"], resp.read().decode()
    finally:
        httpd.shutdown()
    assert ctype.startswith("text/plain; version=0.0.4")
    assert "# EOF" not in text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    for name in (metric_names.EXPERT_TOKENS, metric_names.RANK_TOKENS, metric_names.EXPERT_REPLICAS, metric_names.REARRANGEMENTS,
                 metric_names.ENGINE_STEPS, metric_names.BALANCEDNESS, metric_names.CONFIG_INFO, metric_names.REARRANGEMENT_SECONDS + "_bucket",
                 metric_names.REARRANGEMENT_SECONDS + "_count", metric_names.EXPORTER_START_TIME):
        assert name in samples, name
    tokens = {(s.labels["layer"], s.labels["expert"]): s.value for f in text_string_to_metric_families(text)
              for s in f.samples if s.name == metric_names.EXPERT_TOKENS}
    assert tokens[("1", "3")] == 14.0 and len(tokens) == 8  # layer 1 expert 3 = 7 on each of the two ranks
    info = samples[metric_names.CONFIG_INFO].labels
    assert info == {"model_name": "m", "window_size": "1000", "step_interval": "3000", "num_redundant_experts": "4",
                    "ep_size": "2", "use_async": "false"}  # the calibration reads the rearrangement mode from it


def test_balancedness_is_not_exported_by_a_pod_missing_ranks(tmp_path):
    snap.write(str(tmp_path), _worker(1, 0, 4))  # ranks 1..3 live in other pods
    fams = {f.name: f for f in PodCollector(str(tmp_path)).collect()}
    assert fams[metric_names.BALANCEDNESS].samples == []
    assert fams[metric_names.EXPORTER_RANKS].samples[0].value == 1


@pytest.mark.parametrize("env,key", [
    ({"MOE_EPLB_EXPORTER_MODE": "verbose"}, "MOE_EPLB_EXPORTER_MODE"),
    ({"MOE_EPLB_EXPORTER_PORT": "99999"}, "MOE_EPLB_EXPORTER_PORT"),
    ({"MOE_EPLB_EXPORTER_FLUSH_SECONDS": "soon"}, "MOE_EPLB_EXPORTER_FLUSH_SECONDS"),
    ({"MOE_EPLB_TRACE_BUCKET_SECONDS": "0"}, "MOE_EPLB_TRACE_BUCKET_SECONDS"),
])
def test_bad_settings_name_the_variable(env, key):
    with pytest.raises(ExporterSettingsError, match=key):
        Settings.from_env(env)
    s = Settings.from_env({})
    assert (s.mode, s.port, s.trace_dir) == ("full", k8s_names.EXPORTER_PORT, None)
