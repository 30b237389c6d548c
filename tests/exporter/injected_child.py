"""Run by test_injected_minimal.py in a Python that has only numpy and prometheus-client, with
``PYTHONPATH`` = an injected copy of the plugin (what the init container writes into a stock vLLM
image). The test copies this file out of the source tree before it runs it, so that nothing of the
project is on ``sys.path`` but the copy; prints one JSON object.

1. what this interpreter can import (the proof that it is the bare one);
2. every module of ``moe_eplb.exporter`` and ``moe_eplb.contracts``, imported from the copy;
3. the plugin loaded the way vLLM loads it (the ``vllm.general_plugins`` entry point), which starts
   the pod's exporter process with trace capture on (``MOE_EPLB_TRACE_DIR``);
4. a worker's snapshots (the recorder's writer) of two steps of known load; the trace file the
   exporter process writes, read back here with the contracts' reader; ``/metrics`` scraped;
5. the exporter process stopped like a pod ends (SIGTERM): it writes its last bucket and exits 0.
"""

from __future__ import annotations

import glob
import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import pkgutil
import signal
import sys
import time
import urllib.request

MODEL = "org/Tiny-MoE"
ABSENT = ("torch", "vllm", "kopf", "kubernetes", "yaml", "click", "scipy", "numba", "hypothesis", "pytest",
          "moe_eplb.api", "moe_eplb.eplb", "moe_eplb.metrics", "moe_eplb.controller", "moe_eplb.render",
          "moe_eplb.cli", "moe_eplb_harness", "tests")


def _wait(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {check.__doc__}")


def main() -> None:
    out: dict = {"sys_path": sys.path, "prefix": sys.prefix, "executable": sys.executable}
    out["origin"] = {n: importlib.util.find_spec(n).origin for n in ("moe_eplb", "numpy", "prometheus_client")}
    out["absent"] = {n: importlib.util.find_spec(n) is None for n in ABSENT}
    out["distributions"] = sorted(d.metadata["Name"] for d in md.distributions())

    import moe_eplb.contracts
    import moe_eplb.exporter

    files = {}
    for pkg in (moe_eplb.exporter, moe_eplb.contracts):
        for info in pkgutil.iter_modules(pkg.__path__):
            module = importlib.import_module(f"{pkg.__name__}.{info.name}")
            files[module.__name__] = module.__file__
    out["modules"] = files
    out["heavy_loaded"] = sorted(m for m in ("torch", "vllm", "yaml", "click") if m in sys.modules)

    (ep,) = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "moe_eplb_exporter"]
    register = ep.load()
    register()
    import numpy as np

    from moe_eplb.contracts.trace_format import read_trace_file
    from moe_eplb.exporter import plugin, settings
    from moe_eplb.exporter import snapshot as snap
    from moe_eplb.exporter.recorder import SnapshotWriter

    assert plugin.wait_until_serving(30), "the exporter process did not start"
    env = settings.Settings.from_env()
    out["settings"] = {"trace_dir": env.trace_dir, "bucket": env.trace_bucket_seconds, "port": env.port}
    writer = SnapshotWriter(env.directory)  # a worker's writer (the recorder hands it its snapshots)
    first = np.arange(12, dtype=np.float64).reshape(3, 4)
    second = first * 2 + 1
    for steps, tokens in ((10, first), (25, first + second)):
        writer.submit(snap.WorkerSnapshot(pid=os.getpid(), time=time.time(), models=[snap.ModelSnapshot(
            name=MODEL, ep_rank=0, ep_size=1, expert_tokens=tokens, rank_tokens=tokens.sum(axis=1, keepdims=True),
            replicas=np.ones((3, 4), np.int64), steps=steps, start_time=float(env.start_time or 0.0))]))
        writer.flush()

        def written(steps=steps):
            """a trace bucket with the snapshot"""
            for path in glob.glob(os.path.join(env.trace_dir, "*.npz")):
                try:
                    data = read_trace_file(path)
                except Exception:  # noqa: BLE001 - being replaced (atomic rename): try again
                    continue
                if int(np.sum(data["bucket_steps"])) == steps:
                    return path, data
            return None

        path, data = _wait(written)
    out["trace"] = {"path": path, "model": str(np.asarray(data["model"])), "bucket_seconds": float(data["bucket_seconds"]),
                    "load_sum": np.asarray(data["load"]).sum(axis=0).tolist(),
                    "bucket_steps": np.asarray(data["bucket_steps"]).tolist()}
    with urllib.request.urlopen(f"http://127.0.0.1:{env.port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out["metrics_lines"] = [ln for ln in text.splitlines() if ln.startswith("moe_eplb_engine_steps_total{")]
    server = plugin._state["server_process"]
    server.send_signal(signal.SIGTERM)
    out["server_exit"] = server.wait(timeout=30)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
