#!/usr/bin/env python3
"""Fault recovery on real GPUs: the operator's decision and client against real vLLM engines.

    python scripts/gpu_smoke_recovery.py --model /models/Qwen3-30B-A3B --gpus 4     # results in $OUT/gpu_recovery

Not run in CI (no GPUs there): a sibling of scripts/gpu_smoke.sh for a machine with >= 2 GPUs, vLLM
>= 0.34 (CUDA) with DeepEP (``--all2all-backend deepep_low_latency``) or NIXL-EP, and a MoE model on
local disk. It starts one ``vllm serve`` per data-parallel rank (external load balancing, rank r on
GPU r and port 8000 + r: the operator's layout with one rank per pod) with fault tolerance and EPLB
with enough redundant experts for one lost rank, serves requests, then:

1. ``retry``: SIGSTOPs rank 1 for longer than the collectives' timeout and resumes it (a transient
   fault), and lets the operator's own code recover it;
2. ``scale_down``: SIGKILLs rank ``--kill`` (0 by default: the store master, so the round carries the
   new master's address) and lets the operator's code recover the survivors;

where "the operator's code" is :func:`moe_eplb.controller.recovery.step` fed by
:class:`moe_eplb.controller.recovery_client.RecoveryClient` (no cluster: each rank is a "pod" on
127.0.0.1). Writes the timeline (phases, rounds, requests served meanwhile) to ``timeline.json`` and
prints PASS/FAIL per stage; exits 1 when a stage that could run failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "operator"))

from moe_eplb.api import ft_protocol as ftp  # noqa: E402
from moe_eplb.api.recovery_status import RecoveryStatus  # noqa: E402
from moe_eplb.controller import recovery as rec  # noqa: E402
from moe_eplb.controller.recovery_client import Endpoint, RecoveryClient  # noqa: E402


def start_ranks(args: argparse.Namespace, out: Path) -> list[subprocess.Popen]:
    procs = []
    eplb = {"window_size": 1000, "step_interval": 3000, "num_redundant_experts": args.redundant, "use_async": False}
    for r in range(args.gpus):
        cmd = ["vllm", "serve", args.model, "--port", str(8000 + r), "--host", "127.0.0.1",
               "--data-parallel-size", str(args.gpus), "--data-parallel-rank", str(r),
               "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", "13345",
               "--enable-expert-parallel", "--all2all-backend", args.backend, "--enable-eplb",
               "--eplb-config", json.dumps(eplb), "--enable-fault-tolerance",
               *ftp.recovery_timeout_arg(args.timeout), "--max-model-len", "4096", "--enforce-eager"]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(r)}
        log = open(out / f"rank{r}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def wait_healthy(n: int, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        ok = 0
        for r in range(n):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{8000 + r}/health", timeout=2) as f:
                    ok += f.status == 200
            except OSError:
                pass
        if ok == n:
            return True
        time.sleep(2)
    return False


class Traffic(threading.Thread):
    """Completions on every rank, round robin; counts what finished and what failed."""

    def __init__(self, model: str, n: int) -> None:
        super().__init__(daemon=True)
        self.model, self.n, self.done, self.failed, self.stop = model, n, 0, 0, False

    def run(self) -> None:
        i = 0
        while not self.stop:
            r = i % self.n
            i += 1
            body = json.dumps({"model": self.model, "prompt": "Hello", "max_tokens": 16}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{8000 + r}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as f:
                    self.done += f.status == 200
            except OSError:
                self.failed += 1


async def recover(args, version, alive: dict[int, bool], traffic: Traffic, timeline: list, timeout: float) -> RecoveryStatus:
    """The operator's loop without a cluster: every rank a pod on 127.0.0.1."""
    client, st, t0 = RecoveryClient(), RecoveryStatus(), time.time()
    facts = rec.Facts(version=version, num_experts=args.experts, redundant=args.redundant, timeout_s=args.timeout)
    try:
        while time.time() - t0 < timeout:
            eps = [Endpoint(r, "127.0.0.1", 8000 + r) for r in range(args.gpus) if alive[r]]
            readings = await client.statuses(eps, version, None)
            pods = {r: rec.PodView(name=f"rank{r}", ranks=(r,), ip="127.0.0.1", ready=alive[r], running=alive[r])
                    for r in range(args.gpus) if alive[r]}
            view = rec.GroupView("0", args.gpus, 1, pods, readings, leader="rank0")
            s = rec.step(st, view, facts, time.time(), resource="gpu", coord=rec.Coordination())
            st = rec.overall(s.status, ["0"])
            for e in s.events:
                timeline.append({"t": round(time.time() - t0, 2), "event": e[1], "message": e[2],
                                 "served": traffic.done, "failed": traffic.failed})
            if s.send is not None:
                eps_send = [ep for ep in eps if ep.rank in s.send.ranks]
                got = await client.send_round(eps_send, version, ftp.apply_body(s.send.instruction, s.send.request_id,
                                                                                  s.params), None)
                timeline.append({"t": round(time.time() - t0, 2), "event": "sent", "answers": got})
            if st.phase in ("Healthy", "Degraded", "Failed") and any(not r.in_flight for r in st.rounds):
                return st
            await asyncio.sleep(0.5)
        return st
    finally:
        await client.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--experts", type=int, default=128, help="the model's routed experts")
    p.add_argument("--redundant", type=int, default=64, help="R >= experts / (gpus - 1) for one lost rank")
    p.add_argument("--backend", default="deepep_low_latency")
    p.add_argument("--timeout", type=int, default=120, help="engine_recovery_timeout_sec")
    p.add_argument("--kill", type=int, default=0, help="the rank the scale_down stage kills")
    args = p.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out")) / "gpu_recovery"
    out.mkdir(parents=True, exist_ok=True)
    import vllm

    version = tuple(int(x) for x in vllm.__version__.split(".")[:3])
    if version < ftp.V1_PREFIX_SINCE or args.gpus < 2:
        print(f"SKIP recovery: needs vLLM >= 0.34 and >= 2 GPUs (vLLM {vllm.__version__}, --gpus {args.gpus})")
        return 0
    procs, failed, timeline = start_ranks(args, out), 0, []
    try:
        if not wait_healthy(args.gpus, 1800):
            print(f"FAIL start: the ranks did not all turn healthy (logs in {out})")
            return 1
        alive = {r: True for r in range(args.gpus)}
        traffic = Traffic(args.model, args.gpus)
        traffic.start()
        time.sleep(20)
        os.killpg(procs[1].pid, signal.SIGSTOP)  # stage 1: a transient stall of rank 1
        time.sleep(90)
        os.killpg(procs[1].pid, signal.SIGCONT)
        st = asyncio.run(recover(args, version, alive, traffic, timeline, args.timeout + 60))
        ok = st.rounds and st.rounds[-1].result == "Succeeded" and st.rounds[-1].instruction == ftp.RETRY
        print(("PASS" if ok else "FAIL") + f" retry: {[(r.instruction, r.result, r.reason) for r in st.rounds]}")
        failed |= not ok
        os.killpg(procs[args.kill].pid, signal.SIGKILL)  # stage 2: a lost rank
        alive[args.kill] = False
        st = asyncio.run(recover(args, version, alive, traffic, timeline, args.timeout + 60))
        last = st.rounds[-1] if st.rounds else None
        ok = last is not None and last.result == "Succeeded" and last.removed_ranks == (args.kill,)
        rounds = [(r.instruction, r.result, r.store_master, r.reason) for r in st.rounds]
        print(("PASS" if ok else "FAIL") + f" scale_down: {rounds}")
        failed |= not ok
        traffic.stop = True
        (out / "timeline.json").write_text(json.dumps(timeline, indent=1))
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
