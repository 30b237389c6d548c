"""``moe-eplb demo --scenario autoscale`` on the REAL control plane (issue 20, part 4): the real HPA
controller of kube-controller-manager scales the MoEInference through ``/scale`` on vLLM's waiting
requests, read from a real Prometheus through prometheus-adapter (``make kube``), and the operator's
tuner defers its rollout until the new replicas have settled, then applies. Skipped with the reason
when a part is not built, except with ``MOE_EPLB_REQUIRE_KUBE=1``."""

from __future__ import annotations

import asyncio

import pytest

from moe_eplb_harness.demo import autoscale as A
from tests.sim.autoscale_story import assert_autoscale_story

pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")
pytestmark = pytest.mark.integration


def test_autoscale_scenario_with_the_real_hpa_controller(hpa_adapter_parts, real_control_plane, tmp_path):
    """On the session's control plane (a namespace and Nodes of its own)."""
    lines: list[str] = []
    summary = asyncio.run(A.run_autoscale_demo(out_dir=str(tmp_path), api="real", prometheus=True, echo=lines.append,
                                               shared_plane=real_control_plane))
    log = "\n".join(lines)
    assert (summary["api"], summary["load_source"]) == ("real", "prometheus")
    assert summary["autoscaler"].startswith("the real HPA controller (kube-controller-manager)"), summary["autoscaler"]
    assert_autoscale_story(summary, log)
