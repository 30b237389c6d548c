"""``moe-eplb demo --scenario autoscale`` on the emulated API (issue 20, part 4): the emulated HPA
controller (moe_eplb_harness.emulated.hpa) scales the MoEInference out on its pods' waiting requests after the
traffic rises, and the real operator's tuner defers its rollout until the new replicas have settled,
then applies. The real control plane's run (the real HPA controller through prometheus-adapter) is
tests/kube/test_demo_autoscale_real.py. Runs the scenario as the CLI does (2 simulated hours at 40x,
about 3 min)."""

from __future__ import annotations

import asyncio
import json

import pytest

from moe_eplb_harness.demo import autoscale as A

from .autoscale_story import assert_autoscale_story

pytestmark = pytest.mark.integration  # the real operator, an emulated API server and simulated engine pods


def test_autoscale_scenario_scales_out_and_the_tuner_waits_for_it(tmp_path):
    lines: list[str] = []
    summary = asyncio.run(A.run_autoscale_demo(out_dir=str(tmp_path), api="emulated",
                                               summary_path=str(tmp_path / "summary.json"), echo=lines.append))
    log = "\n".join(lines)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["scenario"] == "autoscale" and summary["api"] == "emulated"
    assert summary["autoscaler"].startswith("the emulated HPA controller"), summary["autoscaler"]
    assert "autoscaler: the emulated HPA controller" in lines[0]
    assert_autoscale_story(summary, log)
    report = (tmp_path / "autoscale-report.md").read_text()
    assert "| scale |" in report and "deferred: " in report
