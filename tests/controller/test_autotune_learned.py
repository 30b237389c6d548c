"""The autotune loop hands status.autotune.learned to every calibration."""

from __future__ import annotations

from types import SimpleNamespace

from moe_eplb.api.spec import parse
from moe_eplb.controller import autotune
from moe_eplb.eplb.tuning.exploration import LearnedRange
from tests.api.test_api_vllm_034 import deepseek


def test_calibration_gets_the_learned_ranges_from_the_status(monkeypatch):
    res = deepseek(32)
    res["status"] = {"autotune": {"learned": [{"parameter": "moe_time_share", "low": 0.4, "high": 0.5,
                                               "priorLow": 0.03, "priorHigh": 0.6, "source": "trial A"}]}}
    inf = parse(res)
    seen = {}
    monkeypatch.setattr(autotune, "calibrate", lambda trace, **kw: seen.update(kw) or "calibrated")
    assert autotune.calibrate_for(SimpleNamespace(telemetry=object()), inf) == "calibrated"
    assert seen["learned"] == [LearnedRange("moe_time_share", 0.4, 0.5, 0.03, 0.6, "trial A")]
    # nothing learned yet: an empty list, the calibration as before
    assert autotune.calibrate_for(SimpleNamespace(telemetry=object()), parse(deepseek(32))) == "calibrated"
    assert seen["learned"] == []
