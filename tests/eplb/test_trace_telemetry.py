"""Telemetry keys of the trace format: round trips, strict validation naming the key, slicing."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from moe_eplb.contracts.trace_format import TELEMETRY_KEYS
from moe_eplb.eplb.workload.trace import LoadTrace, TraceError, served_imbalance
from moe_eplb.eplb.workload.tracefile import load_trace, save_trace, trace_from_dict, trace_to_dict

T, L, E, EP = 4, 2, 8, 2


def _good() -> dict:
    rng = np.random.default_rng(3)
    load = rng.integers(0, 50, size=(T, L, E))
    steps = [30, 0, 25, 31]
    load[1] = 0
    rank = load.reshape(T, L, EP, E // EP).sum(axis=3)
    return {"num_layers": L, "num_experts": E, "bucket_steps": steps, "load": load.tolist(), "bucket_seconds": 15,
            "top_k": 2, "step_seconds": [0.05, None, 0.06, 0.055], "rank_load": rank.tolist(),
            "kv_cache_usage": [0.5, 0.4, 0.97, 0.99], "preemptions": [0, 0, 2, 5], "requests_waiting": [0, 0, 3.5, 7],
            "rearrangements": [{"bucket": 3, "seconds": 1.2}, {"bucket": 0, "seconds": 0.8}],
            "config": {"window_size": 1000, "step_interval": 3000, "num_redundant_experts": 0, "ep_size": EP,
                       "use_async": False},
            "kv_cache_bytes_per_gpu": 2.5e10, "prefix_cache_queries": [900, 0, 700, 800],
            "prefix_cache_hit_rate": [0.6, None, 0.4, 0.45], "kv_cache_blocks": 22_000, "kv_block_size": 16}


def test_every_key_is_read_into_typed_fields():
    tr = trace_from_dict(_good())
    tel = tr.telemetry
    assert tel.keys() == TELEMETRY_KEYS
    assert np.isnan(tel.step_seconds[1]) and tel.step_seconds[2] == 0.06
    assert tel.rank_load.shape == (T, L, EP) and tel.ep_size == EP
    assert [(e.bucket, e.seconds) for e in tel.rearrangements] == [(0, 0.8), (3, 1.2)]  # sorted by bucket
    assert tel.config.knobs.label == "1000/3000/0" and tel.config.use_async is False
    assert tel.kv_cache_bytes_per_gpu == 2.5e10
    count, secs = tel.rearrangements_per_bucket(T)
    assert count.tolist() == [1, 0, 0, 1] and secs.tolist() == [0.8, 0, 0, 1.2]


def test_served_imbalance_is_sum_of_max_over_sum_of_mean():
    rl = np.array([[[3.0, 1.0], [2.0, 2.0]], [[0.0, 0.0], [0.0, 0.0]]])
    out = served_imbalance(rl)
    assert out[0] == pytest.approx((3 + 2) / (2 + 2)) and np.isnan(out[1])


@pytest.mark.parametrize("suffix", [".json", ".json.gz", ".npz"])
def test_round_trip_every_format(tmp_path, suffix):
    tr = trace_from_dict(_good())
    path = save_trace(tr, tmp_path / f"t{suffix}")
    if suffix == ".json":
        text = path.read_text()
        assert "NaN" not in text and json.loads(text)["step_seconds"][1] is None  # strict JSON: null
    back = load_trace(path).telemetry
    for key in ("step_seconds", "rank_load", "kv_cache_usage", "preemptions", "requests_waiting",
                "prefix_cache_queries", "prefix_cache_hit_rate"):
        np.testing.assert_array_equal(getattr(back, key), getattr(tr.telemetry, key))
    assert (back.kv_cache_blocks, back.kv_block_size) == (22_000, 16) and back.kv_cache_tokens == 352_000
    assert back.rearrangements == tr.telemetry.rearrangements
    assert back.config == tr.telemetry.config
    assert back.kv_cache_bytes_per_gpu == tr.telemetry.kv_cache_bytes_per_gpu
    assert trace_to_dict(load_trace(path)) == trace_to_dict(tr)


def test_a_trace_without_telemetry_writes_no_telemetry_key():
    d = _good()
    for k in TELEMETRY_KEYS:
        d.pop(k)
    tr = trace_from_dict(d)
    assert tr.telemetry is None
    assert not set(trace_to_dict(tr)) & set(TELEMETRY_KEYS)
    assert "telemetry" not in tr.summary()


def _with(**changes) -> dict:
    d = copy.deepcopy(_good())
    for k, v in changes.items():
        if v is ...:
            d.pop(k)
        else:
            d[k] = v
    return d


@pytest.mark.parametrize("changes,prefix,words", [
    (dict(step_seconds=[0.05, None, 0.06]), "step_seconds:", "4 numbers"),
    (dict(step_seconds=[0.05, None, None, 0.05]), "step_seconds:", "bucket 2"),
    (dict(step_seconds=[0.05, None, 0.0, 0.05]), "step_seconds:", "> 0"),
    (dict(step_seconds=[0.05, None, "x", 0.05]), "step_seconds:", "numbers"),
    (dict(rank_load=[[[1, 2]] * L] * (T - 1)), "rank_load:", "T x L x ep"),
    (dict(rank_load=[[[1, -2]] * L] * T), "rank_load:", "negative value at bucket 0, layer 0, rank 1"),
    (dict(kv_cache_usage=[50, 40, 97, 99]), "kv_cache_usage:", "a fraction, not a percentage"),
    (dict(kv_cache_usage=[0.5, 0.4, float("nan"), 0.5]), "kv_cache_usage:", "no value at bucket 2"),
    (dict(preemptions=[0, -1, 0, 0]), "preemptions:", ">= 0"),
    (dict(requests_waiting=[0, 0, 0]), "requests_waiting:", "4 numbers"),
    (dict(rearrangements=[{"bucket": 4, "seconds": 1}]), "rearrangements[0].bucket:", "0..3"),
    (dict(rearrangements=[{"bucket": 1, "seconds": -1}]), "rearrangements[0].seconds:", ">= 0"),
    (dict(rearrangements=[{"bucket": 1}]), "rearrangements[0].seconds:", "missing"),
    (dict(rearrangements=[{"bucket": 1, "seconds": 1, "moved": 3}]), "rearrangements[0].moved:", "unknown key"),
    (dict(rearrangements={"bucket": 1}), "rearrangements:", "list"),
    (dict(config={"window_size": 1000, "step_interval": 3000}), "config.num_redundant_experts:", "missing"),
    (dict(config={"window_size": 0, "step_interval": 3000, "num_redundant_experts": 0}), "config.window_size:", "> 0 and <= 100000"),
    (dict(config={"window_size": 10, "step_interval": 30, "num_redundant_experts": 1, "ep_size": 2}), "config:",
     "divisible"),
    (dict(config={"window_size": 10, "step_interval": 30, "num_redundant_experts": 0, "ep_size": 4}),
     "config.ep_size:", "rank_load has 2 ranks"),
    (dict(config={"window_size": 10, "step_interval": 30, "num_redundant_experts": 0, "use_async": "yes"}),
     "config.use_async:", "true, false or null"),
    (dict(config={"window_size": 10, "step_interval": 30, "num_redundant_experts": 0, "policy": "x"}),
     "config.policy:", "unknown key"),
    (dict(kv_cache_bytes_per_gpu=0), "kv_cache_bytes_per_gpu:", "> 0"),
    (dict(kv_cache_bytes_per_gpu=True), "kv_cache_bytes_per_gpu:", "> 0"),
    (dict(prefix_cache_hit_rate=[60, None, 40, 45]), "prefix_cache_hit_rate:", "a fraction, not a percentage"),
    (dict(prefix_cache_hit_rate=[0.6, None, None, 0.4]), "prefix_cache_hit_rate:", "no value at bucket 2"),
    (dict(prefix_cache_hit_rate=[0.6, 0.5, 0.4]), "prefix_cache_hit_rate:", "4 numbers"),
    (dict(prefix_cache_queries=[900, -1, 700, 800]), "prefix_cache_queries:", ">= 0"),
    (dict(kv_cache_blocks=0), "kv_cache_blocks:", "an integer > 0"),
    (dict(kv_block_size=16.5), "kv_block_size:", "integer"),
])
def test_strict_errors_name_the_key(changes, prefix, words):
    with pytest.raises(TraceError) as err:
        trace_from_dict(_with(**changes))
    assert str(err.value).startswith(prefix), str(err.value)
    assert words in str(err.value)


def test_file_errors_name_the_file_and_key(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_with(kv_cache_usage=[0.5, 2, 0.5, 0.5])))
    with pytest.raises(TraceError, match=r"bad\.json: kv_cache_usage: must be in \[0, 1\], got 2\.0 at bucket 1"):
        load_trace(path)


def test_slice_cuts_every_series_and_renumbers_rearrangements():
    tr = trace_from_dict(_good())
    part = tr.slice(2, 4)
    assert part.telemetry.step_seconds.tolist() == [0.06, 0.055]
    assert part.telemetry.rank_load.shape == (2, L, EP)
    assert [(e.bucket, e.seconds) for e in part.telemetry.rearrangements] == [(1, 1.2)]
    assert part.telemetry.config == tr.telemetry.config
    assert part.telemetry.prefix_cache_hit_rate.tolist() == [0.4, 0.45]
    assert part.telemetry.prefix_cache_queries.tolist() == [700, 800] and part.telemetry.kv_cache_blocks == 22_000


def test_summary_reports_the_telemetry():
    s = trace_from_dict(_good()).summary()
    assert s["telemetry"] == list(TELEMETRY_KEYS)
    assert s["step_seconds"] == {"min": 0.05, "median": 0.055, "max": 0.06}
    assert s["preemptions_total"] == 7.0 and s["rearrangements"] == {"count": 2, "median_seconds": 1.0}
    assert s["config"]["use_async"] is False and s["ep_size"] == EP
    assert s["prefix_cache_hit_rate"] == {"min": 0.4, "median": 0.45, "max": 0.6}
    assert s["prefix_cache_queries_total"] == 2400.0 and s["kv_cache_tokens"] == 352_000


def test_load_trace_object_checks_telemetry_too():
    from moe_eplb.eplb.workload.trace import Telemetry

    with pytest.raises(TraceError, match="^kv_cache_usage: expected 2 numbers"):
        LoadTrace(load=np.ones((2, 1, 2)), bucket_steps=[1, 1], telemetry=Telemetry(kv_cache_usage=np.zeros(3)))


# --- physical consistency (issue 24; docs/traces.md "Consistency checks") ---------------------------


def _scaled_rank(d: dict, factor: float, bucket: int | None = None) -> dict:
    rank = np.asarray(d["rank_load"], float)
    if bucket is None:
        rank *= factor
    else:
        rank[bucket] *= factor
    d["rank_load"] = rank.tolist()
    return d


def test_a_consistent_trace_has_no_warnings():
    assert "warnings" not in trace_from_dict(_good()).meta


@pytest.mark.parametrize("changes,message", [
    (lambda d: _scaled_rank(d, 1e6), r"^rank_load: sums to 1\.022e\+09 tokens but load to 1022; both count the same"),
    (lambda d: _scaled_rank(d, 0.3), r"^rank_load: sums to 306\.6 tokens but load to 1022; .*\(within a factor 2\)"),
    (lambda d: {**d, "rearrangements": [{"bucket": 1, "seconds": 1e6}]},
     r"^rearrangements: 1e\+06 s at bucket 1, longer than the whole trace \(4 buckets of 15 s = 60 s\)"),
    (lambda d: {**d, "step_seconds": [0.05, None, 61.0, 0.05]},
     r"^step_seconds: 61 s at bucket 2, longer than the whole trace .* ONE engine step"),
    (lambda d: {**d, "preemptions": [0, 0, 1e300, 0]}, r"^preemptions: value 1e\+300 above 2\*\*53 at bucket 2"),
])
def test_physically_impossible_telemetry_is_refused(changes, message):
    with pytest.raises(TraceError, match=message):
        trace_from_dict(changes(_good()))


def test_small_disagreements_are_warnings_not_refusals():
    d = _scaled_rank(_good(), 1.5, bucket=2)
    d["rearrangements"] = [{"bucket": 3, "seconds": 20.0}]
    tr = trace_from_dict(d)
    assert tr.meta["warnings"] == [
        "rank_load: 2 of 8 (bucket, layer) sums differ from load's by more than 5% (first: bucket 2, layer 0: "
        f"{1.5 * np.asarray(d['load'])[2, 0].sum():.6g} vs {np.asarray(d['load'])[2, 0].sum():.6g})",
        "rearrangements: 1 longer than one bucket (15 s; first: bucket 3, 20 s)"]


def test_cli_shows_the_warnings(tmp_path):
    from click.testing import CliRunner

    from moe_eplb.cli import main

    d = _scaled_rank(_good(), 1.5, bucket=2)
    path = tmp_path / "w.json"
    path.write_text(json.dumps(d))
    out = CliRunner().invoke(main, ["trace", "info", str(path), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["warnings"][0].startswith("rank_load: 2 of 8 (bucket, layer) sums differ")
    out = CliRunner().invoke(main, ["simulate", "--trace", str(path), "--ep-size", 2, "--window", 10, "--interval", 10,
                                    "--redundant", 0, "--json"])
    assert out.exit_code == 0, out.output
    assert f"Warning: {path}: rank_load: 2 of 8" in out.stderr


def test_config_ranges_are_the_crds_bounds():
    import pathlib

    import yaml

    from moe_eplb.contracts.trace_format import CONFIG_RANGES

    crd = yaml.safe_load((pathlib.Path(__file__).resolve().parents[2] / "operator" / "moe_eplb" / "api" / "crd.yaml")
                         .read_text())
    eplb = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["eplb"]["properties"]
    for key, crd_key in (("window_size", "windowSize"), ("step_interval", "stepInterval"),
                         ("num_redundant_experts", "numRedundantExperts")):
        assert CONFIG_RANGES[key] == (eplb[crd_key]["minimum"], eplb[crd_key]["maximum"]), key
