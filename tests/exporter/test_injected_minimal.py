"""The injected exporter runs where nothing of moe-eplb is installed: every ``moe_eplb.exporter``
module imports, and trace capture works, from a copy written by ``python -m
moe_eplb.exporter.inject DIR`` (the init container's command), in a Python that has numpy and
prometheus-client and nothing else -- the minimum a stock vLLM image is promised to carry.

The interpreter is a fresh ``venv --without-pip`` whose site-packages holds links to this
environment's numpy and prometheus_client (with their metadata) and nothing more; it runs from an
empty directory with ``PYTHONPATH`` = the injected copy alone, so neither the project's source tree
nor this test environment can be imported, which the child reports and the test asserts.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import prometheus_client
import pytest

import moe_eplb
from moe_eplb.eplb.workload.tracefile import load_trace
from tests import ROOT

pytestmark = pytest.mark.integration

SOURCE = Path(moe_eplb.__file__).resolve().parent
CHILD = Path(__file__).with_name("injected_child.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bare_python(where: Path) -> Path:
    """A new virtual environment with only numpy and prometheus_client (linked from this one)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    site = Path(subprocess.run([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    assert site.is_dir() and not any(site.iterdir()), sorted(site.iterdir())
    for module in (np, prometheus_client):
        package = Path(module.__file__).resolve().parent
        dist = [p for p in package.parent.glob(f"{package.name}-*.dist-info")]
        libs = [p for p in package.parent.glob(f"{package.name}.libs")]  # numpy's bundled BLAS (manylinux)
        for path in [package, *dist, *libs]:
            (site / path.name).symlink_to(path, target_is_directory=True)
    return python


def test_every_exporter_module_and_trace_capture_from_an_injected_copy(tmp_path):
    plugin_dir, trace_dir, snap_dir, work = (tmp_path / n for n in ("plugin", "traces", "snapshots", "work"))
    work.mkdir()
    inject = subprocess.run([sys.executable, "-m", "moe_eplb.exporter.inject", str(plugin_dir)], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(SOURCE.parent)})
    assert inject.returncode == 0, inject.stderr
    assert "VLLM_PLUGINS=moe_eplb_exporter" in inject.stdout
    python = _bare_python(tmp_path / "venv")
    script = Path(shutil.copy(CHILD, work / CHILD.name))  # run from outside the source tree
    port = _free_port()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work), "PYTHONNOUSERSITE": "1",
           "PYTHONPATH": str(plugin_dir), "VLLM_PLUGINS": "moe_eplb_exporter",
           "MOE_EPLB_TRACE_DIR": str(trace_dir), "MOE_EPLB_TRACE_BUCKET_SECONDS": "0.2",
           "MOE_EPLB_TRACE_MAX_BUCKETS": "1000", "MOE_EPLB_EXPORTER_DIR": str(snap_dir),
           "MOE_EPLB_EXPORTER_PORT": str(port), "MOE_EPLB_EXPORTER_ADDRESS": "127.0.0.1"}
    run = subprocess.run([str(python), str(script)], cwd=work, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])

    # the interpreter is the bare one: its own prefix, the copy, the two linked packages, nothing else
    assert Path(out["prefix"]) == tmp_path / "venv"
    assert out["distributions"] == sorted(["moe_eplb_exporter", "numpy", "prometheus_client"])
    assert all(out["absent"].values()), [n for n, gone in out["absent"].items() if not gone]
    assert out["origin"]["moe_eplb"] == str(plugin_dir / "moe_eplb" / "__init__.py")
    for name in ("numpy", "prometheus_client"):
        assert out["origin"][name].startswith(str(tmp_path / "venv")), out["origin"]
    for entry in out["sys_path"]:
        assert not entry.startswith((str(ROOT), sys.prefix, os.path.realpath(sys.prefix))), entry
    assert str(plugin_dir) in out["sys_path"]

    # every module of the exporter (and the contracts it copies) imported from the copy
    want = {f"moe_eplb.{pkg}.{p.stem}" for pkg in ("exporter", "contracts") for p in (SOURCE / pkg).glob("*.py")
            if p.stem != "__init__"}
    assert set(out["modules"]) == want
    assert all(path.startswith(str(plugin_dir)) for path in out["modules"].values()), out["modules"]
    assert out["heavy_loaded"] == []

    # trace capture by the exporter process the plugin started, read back in the child and here
    assert out["settings"] == {"trace_dir": str(trace_dir), "bucket": 0.2, "port": port}
    first = np.arange(12, dtype=np.float64).reshape(3, 4)
    total = first + (first * 2 + 1)
    assert out["trace"]["model"] == "org/Tiny-MoE" and out["trace"]["bucket_seconds"] == 0.2
    np.testing.assert_array_equal(out["trace"]["load_sum"], total)
    assert sum(out["trace"]["bucket_steps"]) == 25 and 10 in np.cumsum(out["trace"]["bucket_steps"])
    assert any('model_name="org/Tiny-MoE"' in ln and ln.endswith(" 25.0") for ln in out["metrics_lines"]), \
        out["metrics_lines"]
    assert out["server_exit"] == 0  # SIGTERM: last bucket written, clean exit
    (path,) = trace_dir.glob("*.npz")
    assert Path(out["trace"]["path"]) == path and path.name.startswith("org_Tiny-MoE-")
    trace = load_trace(path)  # the operator side's reader (moe-eplb tune --trace)
    np.testing.assert_array_equal(trace.load.sum(axis=0), total)
    assert trace.bucket_steps.sum() == 25 and trace.num_layers == 3 and trace.num_experts == 4
