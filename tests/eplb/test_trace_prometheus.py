"""The Prometheus range-query reader: bodies shaped as /api/v1/query_range returns them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_eplb.eplb.trace import TraceError
from moe_eplb.eplb.tracefile import trace_from_prometheus
from moe_eplb.exporter import names

T0 = 1_760_000_000.0
STEP = 15.0


def _body(series: list[dict]) -> dict:
    # round-trip through JSON text, as the HTTP side will hand it over
    return json.loads(json.dumps({"status": "success", "data": {"resultType": "matrix", "result": series}}))


def _series(labels: dict, values, times=None) -> dict:
    times = times if times is not None else [T0 + i * STEP for i in range(len(values))]
    return {"metric": labels, "values": [[t, repr(float(v))] for t, v in zip(times, values)]}


def _expert_body(load: np.ndarray, model: str = "ds", drop=(), **extra_labels) -> dict:
    t, l, e = load.shape
    series = []
    for layer in range(l):
        for expert in range(e):
            if (layer, expert) in drop:
                continue
            labels = {"layer": str(layer), "expert": str(expert), "model": model, **extra_labels}
            series.append(_series(labels, load[:, layer, expert]))
    return _body(series)


def _steps_body(steps, model: str = "ds") -> dict:
    return _body([_series({"model": model}, steps)])


LOAD = np.arange(4 * 2 * 3, dtype=float).reshape(4, 2, 3) * 10.5
STEPS = [300.2, 299.8, 0.0, 301.0]


def test_reads_matrix_steps_and_spacing():
    trace = trace_from_prometheus(_expert_body(LOAD), _steps_body(STEPS), top_k=8)
    np.testing.assert_array_equal(trace.load, LOAD)
    np.testing.assert_array_equal(trace.bucket_steps, [300, 300, 0, 301])
    assert trace.bucket_seconds == STEP and trace.model == "ds" and trace.top_k == 8
    assert trace.meta["start_time"] == T0


def test_accepts_the_data_member_and_explicit_shape():
    body = _expert_body(LOAD)
    trace = trace_from_prometheus(body["data"], _steps_body(STEPS)["data"], num_layers=2, num_experts=5)
    assert trace.load.shape == (4, 2, 5)
    np.testing.assert_array_equal(trace.load[:, :, 3:], 0)  # experts never routed to: zero


def test_missing_expert_series_and_points_are_zero():
    body = _expert_body(LOAD, drop={(1, 2)})
    series = body["data"]["result"]
    series[0]["values"] = series[0]["values"][2:]  # (0, 0)'s counter appeared at the third bucket
    trace = trace_from_prometheus(body, _steps_body(STEPS))
    expected = LOAD.copy()
    expected[:, 1, 2] = 0
    expected[:2, 0, 0] = 0
    np.testing.assert_array_equal(trace.load, expected)


def test_series_per_pod_are_added_and_steps_take_the_lockstep_max():
    a = _expert_body(LOAD, pod="a")["data"]["result"]
    b = _expert_body(LOAD * 2, pod="b")["data"]["result"]
    steps = _body([_series({"model": "ds", "pod": "a"}, STEPS), _series({"model": "ds", "pod": "b"}, [300, 310, 0, 0])])
    trace = trace_from_prometheus(_body(a + b), steps)
    np.testing.assert_array_equal(trace.load, LOAD * 3)
    np.testing.assert_array_equal(trace.bucket_steps, [300, 310, 0, 301])


def test_layer_without_any_series_is_an_error():
    drop = {(0, e) for e in range(3)}
    with pytest.raises(TraceError, match=r"^layer: no series at all for layer\(s\) \[0\] of 2"):
        trace_from_prometheus(_expert_body(LOAD, drop=drop), _steps_body(STEPS))
    with pytest.raises(TraceError, match=r"layer\(s\) \[2\] of 3"):
        trace_from_prometheus(_expert_body(LOAD), _steps_body(STEPS), num_layers=3)


def test_incomplete_scrape_of_one_layer_is_an_error():
    body = _expert_body(LOAD)
    for s in body["data"]["result"]:
        if s["metric"]["layer"] == "1":
            del s["values"][1]
    with pytest.raises(TraceError, match=rf"^layer: at time {T0 + STEP} layer\(s\) \[1\] have no points"):
        trace_from_prometheus(body, _steps_body(STEPS))


def test_load_without_steps_point_is_an_error():
    steps = _body([_series({"model": "ds"}, STEPS[:3])])
    with pytest.raises(TraceError, match=rf"no engine-steps point at time {T0 + 3 * STEP}"):
        trace_from_prometheus(_expert_body(LOAD), steps)


@pytest.mark.parametrize(
    "expert_body, steps_body, pattern",
    [
        (_expert_body(LOAD), _body([]), rf"^{names.ENGINE_STEPS} result: no series"),
        (_body([]), _steps_body(STEPS), rf"^{names.EXPERT_TOKENS} result: no series"),
        (_expert_body(LOAD), {"status": "error", "errorType": "bad_data", "error": "parse error"}, r"query failed \(bad_data: parse error\)"),
        (_expert_body(LOAD), {"status": "success", "data": {"resultType": "vector", "result": []}}, r"resultType is 'vector'"),
        (_expert_body(LOAD, model="other"), _steps_body(STEPS), r"^model: the results mix 2 models"),
        (_expert_body(LOAD), _body([_series({}, STEPS, [T0, T0 + 15, T0 + 45, T0 + 60])]), r"not evenly spaced"),
        (_expert_body(LOAD), _body([_series({}, [1, 2, float("nan"), 3])]), r"NaN or infinite"),
        (_expert_body(-LOAD - 1), _steps_body(STEPS), r"negative values"),
        (_body([_series({"layer": "x", "expert": "0"}, [1, 2, 3, 4])]), _steps_body(STEPS), r"label layer='x' is not an integer"),
        (_body([_series({"layer": "0"}, [1, 2, 3, 4])]), _steps_body(STEPS), r"label expert=None is not an integer"),
    ],
)
def test_bad_results(expert_body, steps_body, pattern):
    with pytest.raises(TraceError, match=pattern):
        trace_from_prometheus(expert_body, steps_body)


def test_shape_smaller_than_labels_is_an_error():
    with pytest.raises(TraceError, match=r"^num_experts: is 2 but the result has a series for expert 2"):
        trace_from_prometheus(_expert_body(LOAD), _steps_body(STEPS), num_experts=2)


def test_single_bucket_needs_bucket_seconds():
    load = LOAD[:1]
    with pytest.raises(TraceError, match=r"^bucket_seconds: only one bucket"):
        trace_from_prometheus(_expert_body(load), _steps_body(STEPS[:1]))
    trace = trace_from_prometheus(_expert_body(load), _steps_body(STEPS[:1]), bucket_seconds=30)
    assert trace.bucket_seconds == 30 and trace.num_buckets == 1
