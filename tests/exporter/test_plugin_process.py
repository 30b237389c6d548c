"""register() in a plain process: it starts the pod's exporter process, which serves the port and
exits with the vLLM process that started it; bad settings never raise into vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

from exporter_helpers import env_without_exporter, free_port

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
    env.update(MOE_EPLB_EXPORTER_PORT=str(port), MOE_EPLB_EXPORTER_ADDRESS="127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        state, server_pid, directory = proc.stdout.readline().split()
        assert state == "serving"
        assert os.path.isdir(directory)
        status, ctype = _get(port)
        assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
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
