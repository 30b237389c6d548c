"""What the exporter costs Prometheus per replica group: every pod's own L x E copy (before) against
one copy per group (after: the leader exports the group's expert counters, :mod:`moe_eplb.exporter.group`).

    PYTHONPATH=operator python bench/bench_exporter_cost.py [--interval 15] [--scrapes 3]
        [--layers 58] [--experts 256] [--redundant 32] [--ep 32] [--pods 4] [--replicas 3]
        [--modes reduced,full]

A DeepSeek-V3 replica group (58 MoE layers x 256 experts, EP 32 with 32 redundant experts, over 4
pods of 8 ranks) is served by the exporter's real collector and HTTP server (the per-rank snapshot
files its workers write, ``PodCollector``, ``make_registry``, ``serve``; no GPU needed), in both
layouts side by side; the group's leader fetches its workers' totals with its real ``PeerPoller``.
A real Prometheus (``moe_eplb_harness.floor.prometheus.start_prometheus``) scrapes every pod at the
PodMonitor's interval (15 s) with the labels the PodMonitor copies. Figures per layout and mode,
from Prometheus itself: series stored (``count``), samples per scrape (``scrape_samples_scraped``),
samples/s at the interval; and the body of one scrape (plain and gzip, as Prometheus asks for it).
Three replicas are three such groups (x ``--replicas``). Exit status 1 when the after layout holds
more than one L x E copy per group.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

from moe_eplb.contracts import metric_names
from moe_eplb.exporter import snapshot as snap
from moe_eplb.exporter.collector import PodCollector
from moe_eplb.exporter.group import GROUP_PATH, GroupMerge, GroupRole, PeerPoller, WorkerTotals, encode
from moe_eplb.exporter.server import make_registry, serve
from moe_eplb_harness.floor.prometheus import start_prometheus


def write_pod(directory: Path, pod: int, ranks_per_pod: int, L: int, E: int, EP: int, R: int, rng) -> None:
    """The snapshot files of one pod's workers (DeepSeek-V3 shape), as the recorder writes them."""
    directory.mkdir(parents=True, exist_ok=True)
    replicas = np.ones((L, E), np.int64)
    for layer in range(L):  # R redundant slots per layer on distinct experts (reduced mode exports these)
        replicas[layer, rng.choice(E, size=R, replace=False)] += 1
    for i in range(ranks_per_pod):
        r = pod * ranks_per_pod + i
        snap.write(str(directory), snap.WorkerSnapshot(pid=100_000 + r, time=time.time(), models=[snap.ModelSnapshot(
            name="deepseek-ai/DeepSeek-V3", ep_rank=r, ep_size=EP,
            expert_tokens=rng.integers(1, 10**6, (L, E)).astype(np.float64),
            rank_tokens=rng.integers(1, 10**6, (L, EP)).astype(np.float64), replicas=replicas,
            steps=12_345, rearrangements=4, duration_sum=3.2, window_size=1000, step_interval=3000,
            num_redundant_experts=R, use_async=True, start_time=1.7e9, kv_cache_bytes=40 << 30,
            step_seconds_buckets=rng.integers(0, 1000, len(metric_names.STEP_SECONDS_BUCKETS) + 1),
            step_tokens_buckets=rng.integers(0, 1000, len(metric_names.STEP_TOKENS_BUCKETS) + 1))]))


def serve_layout(dirs: list[Path], layout: str, mode: str, flush: float):
    """Servers of one group's pods: ``before`` every pod on its own, ``after`` one leader + workers."""
    servers, pollers = [], []
    if layout == "before":
        for d in dirs:
            servers.append(serve(make_registry(PodCollector(str(d), mode)), "127.0.0.1", 0))
        return servers, pollers
    for w, d in enumerate(dirs[1:], start=1):
        c = PodCollector(str(d), mode, role=GroupRole("worker", w, len(dirs)))
        servers.append(serve(make_registry(c), "127.0.0.1", 0, group_totals=WorkerTotals(c.own)))
    role = GroupRole("leader", 0, len(dirs), tuple(f"http://127.0.0.1:{s.server_address[1]}" for s in servers))
    merge = GroupMerge(start_time=1.7e9)
    poller = PeerPoller(role, merge, interval=flush)
    poller.poll_once()
    poller.start()
    pollers.append(poller)
    servers.insert(0, serve(make_registry(PodCollector(str(dirs[0]), mode, role=role, merge=merge)), "127.0.0.1", 0))
    return servers, pollers


def query(url: str, expr: str) -> list:
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=60) as r:
        return json.load(r)["data"]["result"]


def scalar(url: str, expr: str) -> float:
    res = query(url, expr)
    return float(res[0]["value"][1]) if res else 0.0


def body_sizes(port: int) -> tuple[int, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        body = r.read()
    return len(body), len(gzip.compress(body, 6))


def measure(prom_url: str, targets: dict, args) -> list[dict]:
    """One row per (mode, layout) from Prometheus' own figures and one fetch of each body."""
    rows = []
    for (mode, layout), ports in targets.items():
        sel = f'mode="{mode}", layout="{layout}"'
        per_pod = {r["metric"]["pod"]: float(r["value"][1])
                   for r in query(prom_url, f'count by (pod) ({{__name__=~"moe_eplb_.+", {sel}}})')}
        lxe = scalar(prom_url, f"count({metric_names.EXPERT_TOKENS}{{{sel}}})")
        samples = scalar(prom_url, f"sum(scrape_samples_scraped{{{sel}}})")
        sizes = [body_sizes(p) for p in ports]
        rows.append({"mode": mode, "layout": layout, "leader": per_pod.get("ds-0", 0.0),
                     "worker": max((v for k, v in per_pod.items() if k != "ds-0"), default=0.0),
                     "group": sum(per_pod.values()), "lxe_copies": lxe / (args.layers * args.experts),
                     "samples": samples, "bytes": sum(s[0] for s in sizes), "gzip": sum(s[1] for s in sizes),
                     "leader_bytes": sizes[0][0]})
    return rows


def table(rows: list[dict], args, poll_bytes: int) -> str:
    n = args.replicas
    out = [f"DeepSeek-V3 shape: {args.layers} MoE layers x {args.experts} experts, EP {args.ep} "
           f"(+{args.redundant} redundant) over {args.pods} pods; scrape interval {args.interval:g} s "
           "(the PodMonitor renders 15 s); figures from a real Prometheus", "",
           "| mode | layout | series/pod (leader / worker) | series/group | series x"
           f"{n} replicas | L x E copies/group | samples/scrape/group | samples/s/group (x{n}) | "
           "bytes/scrape/group (gzip) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        pod = (f"{r['leader']:.0f}" if r["layout"] == "before"
               else f"{r['leader']:.0f} / {r['worker']:.0f}")
        out.append(f"| {r['mode']} | {r['layout']} | {pod} | {r['group']:.0f} | {n * r['group']:.0f} | "
                   f"{r['lxe_copies']:g} | {r['samples']:.0f} | {r['samples'] / args.interval:.0f} "
                   f"({n * r['samples'] / args.interval:.0f}) | {r['bytes'] / 1e6:.2f} MB ({r['gzip'] / 1e6:.2f} MB) |")
    out += ["", f"after: the leader fetches {args.pods - 1} x {poll_bytes / 1e3:.0f} kB of worker totals every "
            f"{args.flush:g} s over the pod network ({GROUP_PATH}); nothing runs in vLLM's step loop"]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--redundant", type=int, default=32)
    ap.add_argument("--ep", type=int, default=32)
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--interval", type=float, default=15.0, help="scrape interval, s (the PodMonitor's: 15)")
    ap.add_argument("--scrapes", type=int, default=2, help="scrapes of every target to wait for")
    ap.add_argument("--flush", type=float, default=1.0, help="the leader's fetch interval, s")
    ap.add_argument("--modes", default="reduced,full")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    tmp = Path(tempfile.mkdtemp(prefix="bench-exporter-cost-"))
    dirs = [tmp / f"pod{p}" for p in range(args.pods)]
    for p, d in enumerate(dirs):
        write_pod(d, p, args.ep // args.pods, args.layers, args.experts, args.ep, args.redundant, rng)
    servers, pollers, targets, static = [], [], {}, []
    for mode in args.modes.split(","):
        for layout in ("before", "after"):
            s, pl = serve_layout(dirs, layout, mode, args.flush)
            servers += s
            pollers += pl
            targets[(mode, layout)] = [x.server_address[1] for x in s]
            for w, x in enumerate(s):
                static.append({"targets": [f"127.0.0.1:{x.server_address[1]}"], "labels": {
                    "mode": mode, "layout": layout, "pod": "ds-0" if w == 0 else f"ds-0-{w}", "namespace": "bench",
                    metric_names.MOEINFERENCE_LABEL: f"ds-{mode}-{layout}", metric_names.GROUP_LABEL: "0",
                    metric_names.GROUP_WORKER_LABEL: str(w), metric_names.GROUP_SIZE_LABEL: str(args.pods)}})
    poll_bytes = len(encode(PodCollector(str(dirs[1]), "full").own()))  # one worker's answer to its leader
    iv = f"{args.interval:g}s"
    config = {"global": {"scrape_interval": iv, "scrape_timeout": f"{min(args.interval, 10.0):g}s"},
              "scrape_configs": [{"job_name": "moe-eplb-exporter", "static_configs": static}]}
    prom = start_prometheus(tmp / "prom", config)
    try:
        deadline = time.time() + args.interval * (args.scrapes + 2) + 60
        while time.time() < deadline:
            done = scalar(prom.url, f"count(count_over_time(up[{int(args.interval * (args.scrapes + 2))}s]) "
                                    f">= {args.scrapes})")
            if done >= len(static):
                break
            time.sleep(1.0)
        else:
            print(f"not every target was scraped {args.scrapes} times; see {prom.log_path}", file=sys.stderr)
            return 1
        rows = measure(prom.url, targets, args)
    finally:
        prom.stop()
        for p in pollers:
            p.stop()
        for s in servers:
            s.shutdown()
            s.server_close()
    print(table(rows, args, poll_bytes))
    bad = [r for r in rows if r["layout"] == "after" and r["lxe_copies"] > 1]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
