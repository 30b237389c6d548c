"""register() in a plain process: it starts the pod's exporter process, which serves the port and
exits with the vLLM process that started it; bad settings never raise into vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from moe_eplb.eplb.workload.tracefile import load_trace
from moe_eplb.exporter import snapshot
from moe_eplb_harness.floor.procs import free_port
from tests.exporter.exporter_helpers import env_without_exporter

pytestmark = pytest.mark.integration  # exporter server processes

SCRIPT = """
import os, sys
from moe_eplb.exporter import plugin
plugin.register()
plugin.register()  # vLLM may call it more than once
ok = plugin.wait_until_serving(20)
print("serving" if ok else "not-serving", plugin._state["server_process"].pid, os.environ["MOE_EPLB_EXPORTER_DIR"],
      flush=True)
sys.stdin.readline()  # exit when told
"""


def _get(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
        return resp.status, resp.headers["Content-Type"]


def test_server_process_lives_and_dies_with_the_vllm_process(tmp_path):
    port = free_port()
    env = env_without_exporter()
    env.update(MOE_EPLB_EXPORTER_PORT=str(port), MOE_EPLB_EXPORTER_ADDRESS="127.0.0.1",
               MOE_EPLB_TRACE_DIR=str(tmp_path / "traces"), MOE_EPLB_TRACE_BUCKET_SECONDS="0.2")
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        state, server_pid, directory = proc.stdout.readline().split()
        assert state == "serving"
        assert os.path.isdir(directory)
        status, ctype = _get(port)
        assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
        # a worker's snapshot appears: the exporter process captures it as trace buckets
        tokens = np.array([[1.0, 2.0, 3.0]])
        snapshot.write(directory, snapshot.WorkerSnapshot(pid=4242, time=0, models=[snapshot.ModelSnapshot(
            name="org/m", ep_rank=0, ep_size=1, expert_tokens=tokens, rank_tokens=np.ones((1, 1)),
            replicas=np.ones((1, 3), np.int64), steps=7)]))
        deadline = time.time() + 15
        while time.time() < deadline and not list((tmp_path / "traces").glob("*.npz")):
            time.sleep(0.1)
        (trace_file,) = list((tmp_path / "traces").glob("org_m-*.npz"))
        time.sleep(0.3)
        tr = load_trace(trace_file)
        assert tr.model == "org/m" and tr.bucket_seconds == 0.2
        np.testing.assert_array_equal(tr.load.sum(axis=0), tokens)  # first bucket: all of it, then zeros
        assert tr.total_steps == 7
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=10)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                os.kill(int(server_pid), 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the exporter process outlived the vLLM process")
        assert not os.path.exists(directory), "the per-pod directory the plugin created was left behind"
    finally:
        proc.kill()


def test_bad_settings_disable_the_exporter_without_raising():
    env = env_without_exporter()
    env.update(MOE_EPLB_EXPORTER_MODE="everything")
    out = subprocess.run([sys.executable, "-c", "from moe_eplb.exporter import plugin; plugin.register(); "
                          "print(sorted(plugin._state))"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "MOE_EPLB_EXPORTER_MODE='everything'" in out.stderr
    assert out.stdout.strip() == "['registered']"
