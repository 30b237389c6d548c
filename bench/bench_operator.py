"""Operator benchmark: time from applying MoEInference resources to all children created and status
written, and the operator's memory, against the emulated Kubernetes API.

    python bench/bench_operator.py [--counts 1 100] [--ready-delay 0] [--json OUT.json]

Each count runs in fresh processes: the API emulation (``python -m moe_eplb_harness.emulated.kubeapi``, with
the workload-controller stand-in making Deployments ready ``--ready-delay`` s after each change)
and the real operator (``moe-eplb run --standalone``), so the RSS measured is the operator's own.
The driver POSTs all resources at once (copies of ``examples/qwen3-vl-30b-a3b-awq-eplb.yaml``)
and polls the API every 20 ms. Columns:

- ``children s``: until every resource has all its children (Service, Deployment, PDB, PodMonitor);
- ``status s``: until every resource has ``status.observedGeneration == 1``;
- ``running s``: until every resource reports ``phase: Running`` (children ready -> status);
- ``RSS MB``: operator resident memory after the run, and its peak during the run.

Targets: 100 resources reconciled (status written) in < 10 s; operator RSS < 150 MB.
Exit status 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import aiohttp
import psutil
import yaml

from moe_eplb_harness.floor.procs import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "qwen3-vl-30b-a3b-awq-eplb.yaml"
TARGET_SECONDS_100 = 10.0
TARGET_RSS_MB = 150.0
MOE = "/apis/eplb.ai/v1alpha1/namespaces/default/moeinferences"
CHILD_LISTS = ("/apis/apps/v1/namespaces/default/deployments", "/api/v1/namespaces/default/services",
               "/apis/policy/v1/namespaces/default/poddisruptionbudgets",
               "/apis/monitoring.coreos.com/v1/namespaces/default/podmonitors")


async def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url) as resp:
                    if resp.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer within {timeout} s")
            await asyncio.sleep(0.05)


async def run_one(count: int, ready_delay: float) -> dict:
    tmp = tempfile.mkdtemp(prefix="bench-operator-")
    kubeconfig = os.path.join(tmp, "kubeconfig.yaml")
    api_port, live_port = free_port(), free_port()
    api_url = f"http://127.0.0.1:{api_port}"
    api = subprocess.Popen([sys.executable, "-m", "moe_eplb_harness.emulated.kubeapi", "--port", str(api_port),
                            "--kubeconfig", kubeconfig, "--ready-delay", str(ready_delay)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    op = None
    try:
        await wait_http(api_url + "/version")
        op = subprocess.Popen([sys.executable, "-m", "moe_eplb", "run", "--kubeconfig", kubeconfig, "--standalone",
                               "--metrics-port", "0", "--liveness", f"http://127.0.0.1:{live_port}/healthz",
                               "--resync-seconds", "600"],
                              stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "operator.log"), "w"))
        await wait_http(f"http://127.0.0.1:{live_port}/healthz")
        proc = psutil.Process(op.pid)
        rss_idle = proc.memory_info().rss
        base = yaml.safe_load(EXAMPLE.read_text())
        peak = rss_idle
        times: dict[str, float | None] = {"children": None, "status": None, "running": None}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32)) as session:
            async def post(i: int) -> None:
                res = copy.deepcopy(base)
                res["metadata"] = {"name": f"bench-{i}", "namespace": "default"}
                async with session.post(api_url + MOE, json=res) as resp:
                    resp.raise_for_status()

            async def items(path: str) -> list[dict]:
                async with session.get(api_url + path) as resp:
                    return (await resp.json())["items"]

            t0 = time.perf_counter()
            await asyncio.gather(*(post(i) for i in range(count)))
            while time.perf_counter() - t0 < 120 and times["running"] is None:
                await asyncio.sleep(0.02)
                now = time.perf_counter() - t0
                peak = max(peak, proc.memory_info().rss)
                if times["children"] is None:
                    counts = [len([x for x in await items(p) if x["metadata"]["name"].startswith("bench-")])
                              for p in CHILD_LISTS]
                    if all(c >= count for c in counts):
                        times["children"] = now
                objs = await items(MOE)
                if times["status"] is None and sum((o.get("status") or {}).get("observedGeneration") == 1
                                                   for o in objs) >= count:
                    times["status"] = now
                if sum((o.get("status") or {}).get("phase") == "Running" for o in objs) >= count:
                    times["running"] = now
        rss_end = proc.memory_info().rss
        peak = max(peak, rss_end)
        return {"count": count, **{f"{k}_s": v for k, v in times.items()},
                "rss_idle_mb": rss_idle / 2**20, "rss_mb": rss_end / 2**20, "rss_peak_mb": peak / 2**20}
    finally:
        for p in (op, api):
            if p is not None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()


def fmt(v: float | None) -> str:
    return "timeout" if v is None else f"{v:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 100])
    parser.add_argument("--ready-delay", type=float, default=0.0,
                        help="seconds until the emulated workload controllers report ready")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rows = [asyncio.run(run_one(n, args.ready_delay)) for n in args.counts]
    print(f"{'resources':>9} | {'children s':>10} | {'status s':>8} | {'running s':>9} | "
          f"{'RSS idle MB':>11} | {'RSS MB':>6} | {'peak MB':>7}")
    print("-" * 80)
    for r in rows:
        print(f"{r['count']:>9} | {fmt(r['children_s']):>10} | {fmt(r['status_s']):>8} | {fmt(r['running_s']):>9} | "
              f"{r['rss_idle_mb']:>11.1f} | {r['rss_mb']:>6.1f} | {r['rss_peak_mb']:>7.1f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))
    ok = all(r["status_s"] is not None and r["rss_peak_mb"] < TARGET_RSS_MB for r in rows)
    ok = ok and all(r["status_s"] < TARGET_SECONDS_100 for r in rows if r["count"] <= 100)
    print(f"targets: status written for 100 in < {TARGET_SECONDS_100:.0f} s, RSS < {TARGET_RSS_MB:.0f} MB: "
          + ("met" if ok else "MISSED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
