"""Exporter injection into a stock vLLM (issue 14): a REAL vLLM engine in a Python environment
WITHOUT moe-eplb gets the exporter only through what the rendered pod does -- the init container's
command fills a directory, the engine container runs with the rendered ``PYTHONPATH`` and
``VLLM_PLUGINS`` -- and exports per-expert load.

"vLLM on CPU with the test bridge". The stock environment: a virtual environment whose
site-packages links every package of this one (vLLM, torch, ...) except moe-eplb itself (its
distribution metadata and the editable-install path), so ``import moe_eplb`` fails there -- as in
``vllm/vllm-openai``. Adaptations beyond the ones listed in test_engine_full.py: the init
container's target directory and the engine's ``PYTHONPATH`` entry for the shared ``emptyDir``
(``k8s_names.EXPORTER_INJECT_DIR``) are one local directory.
"""

from __future__ import annotations

import os
import subprocess
import sysconfig

import numpy as np
import pytest
import yaml

from moe_eplb.contracts import k8s_names
from moe_eplb.contracts import metric_names as mn
from moe_eplb_harness.vllm_engine import harness
from moe_eplb_harness.vllm_engine import tiny_model as tm

from .conftest import record_time

pytestmark = [pytest.mark.vllm_engine, pytest.mark.integration]

L, E, EP = tm.NUM_LAYERS, tm.NUM_EXPERTS, 2
STOCK_IMAGE = "vllm/vllm-openai:v0.32.0"


def _ours(name: str) -> bool:
    """site-packages entries of moe-eplb's own installation (editable or not)."""
    low = name.lower()
    return low.startswith(("moe_eplb", "moe-eplb", "__editable__.moe_eplb", "__editable___moe_eplb"))


def stock_python(root: str) -> str:
    """A Python like a stock vLLM image's: this environment's packages, moe-eplb left out."""
    venv = os.path.join(root, "stock-venv")
    py = os.path.join(venv, "bin", "python")
    if os.path.exists(py):
        return py
    subprocess.run([harness.PYTHON, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    ours = sysconfig.get_paths()["purelib"]
    theirs = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    for name in os.listdir(ours):
        if not _ours(name) and not os.path.exists(os.path.join(theirs, name)):
            os.symlink(os.path.join(ours, name), os.path.join(theirs, name))
    return py


@pytest.fixture(scope="module")
def injected(cpu_wheel, tiny_model, bridge_dir, engine_root):
    work = os.path.join(engine_root, "injected")
    os.makedirs(work, exist_ok=True)
    py = stock_python(engine_root)
    resource = harness.manifest("full")
    resource["spec"]["engine"]["image"] = STOCK_IMAGE  # exporter.inject: default (true)
    rendered = harness.render(resource, work)
    workload = next(d for d in yaml.safe_load_all(rendered.yaml_text) if d and d["kind"] == "Deployment")
    (init,) = workload["spec"]["template"]["spec"]["initContainers"]
    # the init container, run with the operator's Python (its image) into a local directory
    target = os.path.join(work, "emptydir")
    command = [harness.PYTHON if c == "python" else target if c == k8s_names.EXPORTER_INJECT_DIR else c
               for c in init["command"]]
    env = dict(os.environ, PYTHONPATH=harness.OPERATOR_DIR)
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    engine = harness.Engine(rendered, tiny_model, bridge_dir, work, python=py, inject_dir=target)
    try:
        engine.start()
        record_time("injected engine (stock env): start until /health (s)", engine.ready_seconds)
        engine.complete("warm up", 2)
        harness.workload(engine, rounds=1, max_tokens=16, concurrency=4)
        after, _ = engine.wait_exported()
        yield {"engine": engine, "rendered": rendered, "init": init, "target": target, "python": py,
               "after": after, "init_output": out.stdout}
    finally:
        engine.stop()


def test_the_stock_environment_has_vllm_but_not_moe_eplb(injected):
    probe = ("import importlib.util as u, importlib.metadata as m; "
             "print(u.find_spec('vllm') is not None, u.find_spec('moe_eplb') is not None, "
             "[e.name for e in m.entry_points(group='vllm.general_plugins')])")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([injected["python"], "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(" ", 2)[:2] == ["True", "False"] and k8s_names.EXPORTER_PLUGIN not in out.stdout
    # with the injected directory on PYTHONPATH (as the pod has it), the plugin is there
    out = subprocess.run([injected["python"], "-c", probe], capture_output=True, text=True, timeout=120,
                         env=dict(env, PYTHONPATH=injected["target"]))
    assert out.stdout.split(" ", 2)[:2] == ["True", "True"] and k8s_names.EXPORTER_PLUGIN in out.stdout


def test_rendered_pod_injects_the_plugin(injected):
    init, env = injected["init"], injected["rendered"].env
    assert init["name"] == k8s_names.EXPORTER_INIT_CONTAINER
    assert init["command"][-1] == k8s_names.EXPORTER_INJECT_DIR
    assert env["PYTHONPATH"].split(os.pathsep)[0] == k8s_names.EXPORTER_INJECT_DIR
    assert k8s_names.EXPORTER_PLUGIN in env["VLLM_PLUGINS"].split(",")
    assert "files in" in injected["init_output"]


def test_the_engine_loaded_the_injected_copy(injected):
    # the plugin says where it was loaded from: the directory the init container's command filled
    where = os.path.join(injected["target"], "moe_eplb")
    assert f"loaded from {where};" in injected["engine"].log(), injected["engine"].tail()


def test_a_stock_engine_exports_expert_load_through_the_injection(injected):
    after, engine = injected["after"], injected["engine"]
    assert after.total(mn.ENGINE_STEPS) > 0
    expert = after.matrix(mn.EXPERT_TOKENS, "layer", "expert", (L, E))
    rank = after.matrix(mn.RANK_TOKENS, "layer", "rank", (L, EP))
    assert expert.sum() > 0
    np.testing.assert_allclose(expert.sum(axis=1), rank.sum(axis=1))  # per layer, every token counted once
    (labels, _), = after.select(mn.CONFIG_INFO)
    assert labels[mn.LABEL_MODEL] == engine.served_name
    assert labels["num_redundant_experts"] == str(harness.REDUNDANT)
