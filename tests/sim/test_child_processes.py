"""No child process of the simulation (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
the LeaderWorkerSet controller, Prometheus) outlives the Python process that started it
(:mod:`moe_eplb_harness.floor.procs`): a demo-like process killed with SIGTERM or SIGKILL, or ending on an
exception without stopping what it started, leaves none behind. Checked in ``/proc``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_eplb_harness.real.controlplane import find_binaries

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")]

ROOT = Path(__file__).resolve().parents[2]

#: a whole world (the real control plane when built, a real Prometheus, the real operator); prints
#: its children's (pid, start time) as one JSON line, then waits to be killed
WORLD = r"""
import asyncio, json, sys
from moe_eplb.eplb.workload import synth
from moe_eplb_harness.floor import procs
from moe_eplb_harness.cluster.world import SimWorld

def start_time(pid):
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]

async def main():
    trace = synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=1,
                           bucket_seconds=15, seed=1)
    world = SimWorld(workload=trace, api=sys.argv[1], prometheus=True)
    async with world.run():
        await world.start_operator()
        print(json.dumps([[p.pid, start_time(p.pid)] for p in procs.running()]), flush=True)
        await asyncio.sleep(600)

asyncio.run(main())
"""

#: a Prometheus started and never stopped; the program then ends on an exception (``raise``, once the
#: test has seen its child alive and closed its stdin) or waits to be killed (``wait``)
PROMETHEUS = r"""
import asyncio, json, sys, time
from moe_eplb_harness.floor import procs
from moe_eplb_harness.cluster.world import LocalPrometheus
from moe_eplb_harness.floor.prometheus import prometheus_binary

def start_time(pid):
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]

prom = LocalPrometheus(prometheus_binary())
asyncio.run(prom.start())
print(json.dumps([[p.pid, start_time(p.pid)] for p in procs.running()]), flush=True)
if sys.argv[1] == "raise":
    sys.stdin.read()
    raise RuntimeError("the demo failed")
time.sleep(600)
"""


def _alive(pid: int, started: str) -> bool:
    """Whether that process (same pid AND start time) still runs (a zombie does not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return fields[0] != "Z" and fields[19] == started


def _start(script: str, *args: str) -> tuple[subprocess.Popen[str], list[tuple[int, str]]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "operator"), str(ROOT)]))
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        proc.kill()
        raise AssertionError(f"the child printed nothing (exit {proc.wait()}):\n{proc.stderr.read()[-3000:]}")
    return proc, [(int(pid), started) for pid, started in json.loads(line)]


def _wait_gone(children: list[tuple[int, str]], timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = [pid for pid, started in children if _alive(pid, started)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _kill(proc: subprocess.Popen[str], children: list[tuple[int, str]], sig: signal.Signals) -> None:
    try:
        assert all(_alive(pid, started) for pid, started in children)
        proc.send_signal(sig)
        assert proc.wait(30) == -sig  # an operator in it did not turn the signal into a graceful stop
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _wait_gone(children) == [], "children outlived the killed process"


@pytest.mark.prometheus
def test_a_world_killed_by_sigterm_leaves_no_child_process() -> None:
    api = "real" if find_binaries() is not None else "emulated"
    proc, children = _start(WORLD, api)
    assert len(children) >= (5 if api == "real" else 1), children  # etcd, apiserver, kcm, scheduler, ..., prometheus
    _kill(proc, children, signal.SIGTERM)


@pytest.mark.prometheus
def test_a_process_killed_by_sigkill_leaves_no_child_process() -> None:
    """Nothing runs in the process any more: only the parent-death signal can end its children."""
    proc, children = _start(PROMETHEUS, "wait")
    assert len(children) == 1
    _kill(proc, children, signal.SIGKILL)


@pytest.mark.prometheus
def test_a_program_ending_on_an_exception_leaves_no_child_process() -> None:
    proc, children = _start(PROMETHEUS, "raise")
    # the program raises only once its stdin is closed: it did not wait for this check once on a
    # loaded machine, and its Prometheus was (rightly) gone before it
    assert len(children) == 1 and _alive(*children[0])
    assert proc.stdin is not None
    proc.stdin.close()
    code = proc.wait(30)
    err = proc.stderr.read() if proc.stderr else ""
    assert code == 1 and "RuntimeError: the demo failed" in err, (code, err[-2000:])
    # gone when the process ended: at exit, not by the parent-death signal after it
    assert _wait_gone(children, timeout=0.0) == [], err[-2000:]
