"""``moe-eplb demo --scenario autoscale`` on the REAL control plane (issue 20, part 4): the real HPA
controller of kube-controller-manager scales the MoEInference through ``/scale`` on vLLM's waiting
requests, read from a real Prometheus through prometheus-adapter (``make kube``), and the operator's
tuner defers its rollout until the new replicas have settled, then applies. Skipped with the reason
when a part is not built, except with ``MOE_EPLB_REQUIRE_KUBE=1``."""

from __future__ import annotations

import asyncio
import os

import pytest

from moe_eplb.sim import demo_autoscale as A
from tests.sim.autoscale_story import assert_autoscale_story

pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def requirements() -> None:
    from moe_eplb.sim.controlplane import default_bin_dir, find_binaries
    from moe_eplb.sim.metricsadapter import default_adapter_binary, find_adapter
    from moe_eplb.sim.world import prometheus_binary

    missing = []
    if find_binaries() is None:
        missing.append(f"no control plane built in {default_bin_dir()} (run `make kube`)")
    if find_adapter() is None:
        missing.append(f"no prometheus-adapter built at {default_adapter_binary()} (run `make kube`)")
    if prometheus_binary() is None:
        missing.append("no Prometheus binary (apt-get install prometheus)")
    if missing:
        if os.environ.get("MOE_EPLB_REQUIRE_KUBE") == "1":
            pytest.fail("MOE_EPLB_REQUIRE_KUBE=1 but " + "; ".join(missing))
        pytest.skip("; ".join(missing))


def test_autoscale_scenario_with_the_real_hpa_controller(requirements, tmp_path):
    lines: list[str] = []
    summary = asyncio.run(A.run_autoscale_demo(out_dir=str(tmp_path), api="real", prometheus=True, echo=lines.append))
    log = "\n".join(lines)
    assert (summary["api"], summary["load_source"]) == ("real", "prometheus")
    assert summary["autoscaler"].startswith("the real HPA controller (kube-controller-manager)"), summary["autoscaler"]
    assert_autoscale_story(summary, log)
