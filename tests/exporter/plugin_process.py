"""Run as a script by test_plugin_vllm.py: the plugin loaded by vLLM's REAL plugin loader.

Role ``server``: ``vllm.plugins.load_general_plugins()`` (entry point group
``vllm.general_plugins``, ``VLLM_PLUGINS=moe_eplb_exporter``) -> serves /metrics; then vLLM's real
EplbState (imported after the plugin, so patched by the import hook) records known load; then a
``worker`` child (same environment, as vLLM's workers inherit it) records a second model; finally
prints the pod's /metrics as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request


def worker() -> None:
    import numpy as np
    import torch

    from moe_eplb.exporter import hook, plugin, settings
    from tests.exporter.exporter_helpers import make_standin_v012

    plugin.register()
    assert plugin._state.get("server_process") is None, "a child process must not start a server"
    cls = make_standin_v012(L=2, E=4, R=2, name="child/model")
    factory = plugin._recorder_factory(settings.Settings.from_env())
    hook.patch_eplb_state(cls, factory)
    st = cls()
    for _ in range(3):
        st.model_states["h"].expert_load_pass.copy_(torch.tensor([[1, 2, 3, 4, 5, 6]] * 2, dtype=torch.int32))
        st.step()
    rec = st.__dict__["_moe_eplb_recorder"]
    rec.flush_now()
    plugin._state["writer"].flush()
    print(json.dumps({"child_tokens": rec.models[0].expert_tokens.tolist()}))
    del np


def server() -> None:
    import numpy as np
    import torch
    from vllm.plugins import load_general_plugins

    from tests.exporter.exporter_helpers import (
        CpuEvent,
        logical_counts,
        make_real_state,
        route,
    )

    torch.Event = CpuEvent
    before = "vllm.distributed.eplb.eplb_state" in sys.modules
    load_general_plugins()
    from moe_eplb.exporter import plugin

    assert plugin.wait_until_serving(), "the exporter process did not start"
    state, model = make_real_state(L=2, E=4, R=0, window=2, interval=10**6, name="server/model")
    from vllm.distributed.eplb.eplb_state import EplbState

    rng = np.random.default_rng(11)
    total = np.zeros((2, 4))
    for _ in range(4):
        ids = rng.integers(0, 4, size=(2, 3, 2))
        route(model, ids)
        total += logical_counts(ids, 4)
        state.step()
    rec = state.__dict__["_moe_eplb_recorder"]
    rec.flush_now()
    plugin._state["writer"].flush()
    child = subprocess.run([sys.executable, "-m", "tests.exporter.plugin_process", "worker"], capture_output=True, text=True, timeout=120)
    if child.returncode != 0:
        raise SystemExit(f"worker failed: {child.stderr[-3000:]}")
    child_out = json.loads(child.stdout.strip().splitlines()[-1])
    port = int(os.environ["MOE_EPLB_EXPORTER_PORT"])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    print(json.dumps({
        "eplb_module_loaded_before_plugins": before,
        "patched": bool(getattr(EplbState, "_moe_eplb_patched", False)),
        "server_total": total.tolist(),
        "child": child_out,
        "metrics": text,
        "dir": os.environ["MOE_EPLB_EXPORTER_DIR"],
        "server_pid": os.environ["MOE_EPLB_EXPORTER_SERVER_PID"],
        "pid": os.getpid(),
        "server_process_parent": plugin._state["server_process"].pid and os.getpid(),
    }))
    plugin._state["server_process"].terminate()


if __name__ == "__main__":
    {"worker": worker, "server": server}[sys.argv[1]]()
