"""The trace file format: round trips through every format, and a clear error for every bad trace."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from moe_eplb.eplb.workload.trace import LoadTrace, TraceError
from moe_eplb.eplb.workload.tracefile import (
    load_trace,
    save_trace,
    trace_from_dict,
    trace_to_dict,
)


def _trace(seed: int = 0, t: int = 5, l: int = 3, e: int = 8, integer: bool = True, **kw) -> LoadTrace:
    rng = np.random.default_rng(seed)
    load = rng.integers(0, 1000, size=(t, l, e)).astype(float)
    if not integer:
        load = load + rng.random(load.shape)
    return LoadTrace(load=load, bucket_steps=rng.integers(1, 400, size=t), **kw)


def _good() -> dict:
    return trace_to_dict(_trace(bucket_seconds=15.0, top_k=2, model="m"))


def _same(a: LoadTrace, b: LoadTrace) -> None:
    np.testing.assert_array_equal(a.load, b.load)
    np.testing.assert_array_equal(a.bucket_steps, b.bucket_steps)
    assert (a.bucket_seconds, a.top_k, a.model) == (b.bucket_seconds, b.top_k, b.model)


@pytest.mark.parametrize("suffix", [".json", ".json.gz", ".npz"])
@pytest.mark.parametrize("integer", [True, False])
def test_round_trip_every_format(tmp_path, suffix, integer):
    trace = _trace(integer=integer, bucket_seconds=15.0, top_k=2, model="deepseek-v3")
    path = save_trace(trace, tmp_path / f"t{suffix}")
    _same(load_trace(path), trace)
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_round_trip_without_optional_keys(tmp_path, suffix):
    trace = _trace()
    back = load_trace(save_trace(trace, tmp_path / f"t{suffix}"))
    _same(back, trace)
    assert back.bucket_seconds is None and back.top_k is None and back.model is None


def test_dict_round_trip_and_integers_stay_integers():
    d = _good()
    assert all(isinstance(x, int) for x in d["load"][0][0])
    assert set(d) == {"num_layers", "num_experts", "bucket_steps", "load", "bucket_seconds", "top_k", "model"}
    _same(trace_from_dict(json.loads(json.dumps(d))), trace_from_dict(d))


def test_json_file_is_the_documented_dict(tmp_path):
    path = save_trace(_trace(top_k=2), tmp_path / "t.json")
    d = json.loads(path.read_text())
    assert d["num_layers"] == 3 and d["num_experts"] == 8 and len(d["bucket_steps"]) == 5
    assert np.asarray(d["load"]).shape == (5, 3, 8)
    with gzip.open(save_trace(_trace(top_k=2), tmp_path / "t.json.gz"), "rt") as fh:
        assert json.load(fh) == d


def _with(**changes):
    d = _good()
    for k, v in changes.items():
        if v is _DROP:
            d.pop(k)
        else:
            d[k] = v
    return d


_DROP = object()


@pytest.mark.parametrize(
    "changes, key, words",
    [
        ({"extra": 1}, "extra", "unknown key"),
        ({"load": _DROP}, "load", "missing"),
        ({"bucket_steps": _DROP}, "bucket_steps", "missing"),
        ({"num_layers": _DROP}, "num_layers", "missing"),
        ({"num_layers": 4}, "num_layers", "load has 3 layers"),
        ({"num_experts": 9}, "num_experts", "load has 8 experts"),
        ({"num_layers": 0}, "num_layers", "integer > 0"),
        ({"num_experts": 2.5}, "num_experts", "integer > 0"),
        ({"num_layers": True}, "num_layers", "integer > 0"),
        ({"load": []}, "load", "empty"),
        ({"load": [[[1, 2], [3]]]}, "load", "rectangular"),
        ({"load": [[1, 2]]}, "load", "T x L x E"),
        ({"load": [[["a"] * 8] * 3] * 5}, "load", "numbers"),
        ({"bucket_steps": [1, 2]}, "bucket_steps", "does not match the 5 buckets"),
        ({"bucket_steps": [[1]] * 5}, "bucket_steps", "list of T integers"),
        ({"bucket_steps": [1, 2, -3, 4, 5]}, "bucket_steps", ">= 0"),
        ({"bucket_steps": [1, 2, 3.5, 4, 5]}, "bucket_steps", "whole numbers"),
        ({"bucket_seconds": 0}, "bucket_seconds", "> 0"),
        ({"bucket_seconds": "15"}, "bucket_seconds", "> 0"),
        ({"top_k": 0}, "top_k", "integer > 0"),
        ({"top_k": 9}, "top_k", "more than num_experts"),
        ({"model": 3}, "model", "string"),
    ],
)
def test_bad_trace_names_key_and_problem(changes, key, words):
    with pytest.raises(TraceError) as err:
        trace_from_dict(_with(**changes))
    msg = str(err.value)
    assert msg.startswith(key), msg
    assert words in msg, msg


def test_negative_and_nan_loads_are_located():
    d = _good()
    d["load"][2][1][4] = -7
    with pytest.raises(TraceError, match=r"^load: negative value -7.0 at bucket 2, layer 1, expert 4"):
        trace_from_dict(d)
    d = _good()
    d["load"][0][0][0] = float("nan")
    with pytest.raises(TraceError, match=r"^load: NaN or infinite value nan at bucket 0, layer 0, expert 0"):
        trace_from_dict(d)
    d["load"][0][0][0] = float("inf")
    with pytest.raises(TraceError, match=r"^load: NaN or infinite value inf at bucket 0"):
        trace_from_dict(d)


def test_not_an_object():
    with pytest.raises(TraceError, match=r"^trace: expected a JSON object"):
        trace_from_dict([1, 2, 3])


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_with(extra=1)))
    with pytest.raises(TraceError, match=r"bad\.json: extra: unknown key"):
        load_trace(bad)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(TraceError, match=r"broken\.json: not valid JSON \(line 1, column 2"):
        load_trace(broken)
    with pytest.raises(TraceError, match=r"no such file"):
        load_trace(tmp_path / "absent.npz")
    with pytest.raises(TraceError, match=r"unknown trace file type; use one of \.json, \.json\.gz, \.npz"):
        load_trace(tmp_path / "t.csv")
    with pytest.raises(TraceError, match=r"unknown trace file type"):
        save_trace(_trace(), tmp_path / "t.txt")
    assert not (tmp_path / "t.txt").exists()


def test_npz_with_unknown_key_or_bad_shape(tmp_path):
    t = _trace()
    np.savez(tmp_path / "a.npz", num_layers=3, num_experts=8, bucket_steps=t.bucket_steps, load=t.load, junk=1)
    with pytest.raises(TraceError, match=r"junk: unknown key"):
        load_trace(tmp_path / "a.npz")
    np.savez(tmp_path / "b.npz", num_layers=3, num_experts=8, bucket_steps=t.bucket_steps, load=t.load[:, :2])
    with pytest.raises(TraceError, match=r"num_layers: is 3 but load has 2 layers"):
        load_trace(tmp_path / "b.npz")


def test_routing_file_is_not_taken_for_a_trace(tmp_path):
    p = tmp_path / "counts.json"
    p.write_text(json.dumps({"kind": "expert_counts_by_domain", "counts": {}}))
    with pytest.raises(TraceError, match=r"routing data file .* not a load trace"):
        load_trace(p)


def test_summary_values():
    load = np.zeros((2, 2, 4))
    load[0, 0] = [4, 0, 0, 0]  # max/mean 4
    load[0, 1] = [1, 1, 1, 1]  # 1
    load[1, 0] = [2, 2, 0, 0]  # 2
    trace = LoadTrace(load=load, bucket_steps=[2, 2], top_k=1, bucket_seconds=10.0)
    np.testing.assert_allclose(trace.imbalance(), [[4.0, 1.0], [2.0, np.nan]])
    np.testing.assert_allclose(trace.popularity(), [[0.75, 0.25, 0, 0], [0.25, 0.25, 0.25, 0.25]])
    s = trace.summary()
    assert s["imbalance_per_layer"] == {"min": 1.0, "median": 2.0, "max": 3.0, "argmax_layer": 0}
    assert s["imbalance_per_bucket"]["max"] == 4.0 and s["imbalance_per_bucket"]["median"] == 2.0
    assert s["duration_seconds"] == 20.0 and s["total_steps"] == 4
    assert s["routed_per_layer"] == 6.0 and s["tokens_per_step"] == 1.5  # mean over layers: (8 + 4) / 2
    json.dumps(s)
