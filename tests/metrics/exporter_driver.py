"""A stand-in "vLLM pod" for the end-to-end test: the REAL exporter (plugin.register(): server on
the given port, per-pod directory, hook + recorder + snapshot writer) driven by known load.

Reads one JSON command per line on stdin: ``{"steps": n, "load": [[...] per layer]}`` runs n engine
steps whose pass is ``load`` (identity expert map, so physical = logical), then reads the counters
back and waits until the snapshot is on disk, and answers ``ok``. Prints ``ready <port>`` first
(with ``DRIVER_WAIT`` set: ``warm`` once imported, then waits for a ``go`` line before starting).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    import torch

    from moe_eplb.exporter import hook, plugin, settings
    from tests.exporter.exporter_helpers import make_standin_v012

    L, E = int(os.environ["DRIVER_LAYERS"]), int(os.environ["DRIVER_EXPERTS"])
    if os.environ.get("DRIVER_WAIT"):  # pre-warmed (imports done): start the exporter on "go"
        print("warm", flush=True)
        assert sys.stdin.readline().strip() == "go"
    plugin.register()
    assert plugin.wait_until_serving(), "the exporter process did not start"
    port = settings.Settings.from_env().port
    cls = make_standin_v012(L=L, E=E, R=0, name=os.environ.get("DRIVER_MODEL", "org/moe"))
    hook.patch_eplb_state(cls, plugin._recorder_factory(settings.Settings.from_env()))
    st = cls()
    rec = hook.recorder_of(st, plugin._recorder_factory(settings.Settings.from_env()))  # attach, 0 steps
    rec.flush_now()
    plugin._state["writer"].flush()
    print(f"ready {port}", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        load = torch.tensor(cmd["load"], dtype=torch.int32)
        for _ in range(int(cmd["steps"])):
            st.model_states["h"].expert_load_pass.copy_(load)
            st.step()
        rec.flush_now()
        plugin._state["writer"].flush()
        print("ok", flush=True)


if __name__ == "__main__":
    main()
