"""The calibration in status.autotune.lastEvaluation (typed record, CRD round trip) and the operator's
calibration metrics."""

from __future__ import annotations

from prometheus_client import REGISTRY

from moe_eplb.api.autotune_status import (
    AutotuneStatus,
    CalibratedParameter,
    CalibrationRecord,
    autotune_status_to_crd,
    parse_autotune_status,
)
from moe_eplb.api.knobs import VLLM_DEFAULTS
from moe_eplb.api.spec import AutotuneSpec
from moe_eplb.controller import decisions as dec
from moe_eplb.controller import opmetrics
from moe_eplb.eplb.tuning.calibrate import Calibration, Parameter


def _cal(share_source: str = "measured") -> Calibration:
    return Calibration({"moe_time_share": Parameter(0.5812345678, 0.0312345, share_source, "fit")
                        if share_source == "measured" else Parameter(0.35, None, "default", "too narrow"),
                        "sync_stall_s": Parameter(1.21, 0.05, "measured", "median"),
                        "async_s_per_moved_byte": Parameter(3.9e-11, None, "default", "sync mode")}, False, {})


def test_record_is_written_camel_case_and_read_back():
    rec = dec.calibration_record(_cal())
    assert rec.parameters["moe_time_share"] == CalibratedParameter(0.581235, 0.0312345, "measured")
    assert rec.measured == ("moe_time_share", "sync_stall_s") and rec.use_async is False
    out = dec.evaluate(AutotuneSpec(), AutotuneStatus(), now=1.8e9, generation=1, current=VLLM_DEFAULTS,
                       spec_eplb=VLLM_DEFAULTS, data_window=None, load_error=("NoData", "x"), calibration=rec)
    crd = autotune_status_to_crd(out.status)
    assert crd["lastEvaluation"]["calibration"] == {
        "parameters": {"moe_time_share": {"value": 0.581235, "uncertainty": 0.0312345, "source": "measured"},
                       "sync_stall_s": {"value": 1.21, "uncertainty": 0.05, "source": "measured"},
                       "async_s_per_moved_byte": {"value": 3.9e-11, "source": "default"}},
        "measured": ["moe_time_share", "sync_stall_s"], "useAsync": False}
    back = parse_autotune_status(crd)
    assert back.notes == () and back.last_evaluation.calibration == rec


def test_a_malformed_record_is_dropped_with_a_note():
    back = parse_autotune_status({"lastEvaluation": {"time": "2027-01-15T08:00:00Z",
                                                     "calibration": {"parameters": {"x": {"value": "high"}}}}})
    assert back.last_evaluation is None and "calibration" in back.notes[0]


def _value(param: str, source: str | None = None) -> float | None:
    labels = {"namespace": "ns", "name": "cal-test", "parameter": param}
    if source is None:
        return REGISTRY.get_sample_value("moe_eplb_calibration_uncertainty", labels)
    return REGISTRY.get_sample_value("moe_eplb_calibration_value", {**labels, "source": source})


def test_metrics_keep_one_series_per_parameter():
    opmetrics.record_calibration("ns", "cal-test", dec.calibration_record(_cal("default")))
    assert _value("moe_time_share", "default") == 0.35 and _value("moe_time_share") is None
    opmetrics.record_calibration("ns", "cal-test", dec.calibration_record(_cal("measured")))
    assert _value("moe_time_share", "measured") == 0.581235
    assert _value("moe_time_share", "default") is None  # the other source's series is gone
    assert _value("moe_time_share") == 0.0312345
    assert _value("async_s_per_moved_byte", "default") == 3.9e-11 and _value("async_s_per_moved_byte") is None
    opmetrics.record_calibration("ns", "cal-test", CalibrationRecord({"moe_time_share": CalibratedParameter(0.35)}))
    assert _value("moe_time_share", "measured") is None and _value("moe_time_share") is None
