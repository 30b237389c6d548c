"""Exporter overhead on the REAL engine: decode step time with and without the exporter.

    python bench/bench_exporter_real.py [--runs 7] [--requests 8] [--tokens 64] [--concurrency 4]
                                        [--sequential] [--json FILE]

"vLLM on CPU with the test bridge": vLLM 0.32.0's CPU wheel serving the tiny Qwen3-MoE of
harness/moe_eplb_harness/vllm_engine (TP 2 = EP 2, sync EPLB every 32 steps, 2 redundant experts), started from the
args ``moe-eplb render`` makes for the "full" MoEInference (harness/moe_eplb_harness/vllm_engine/harness.py). Two
engines, identical but for ``VLLM_PLUGINS``: A with the rendered ``moe_eplb_exporter``, B without.
Both stay up (an idle engine uses no CPU) and the runs alternate A, B, A, B, ... so drift on the
shared machine hits both arms alike (``--sequential``: one engine at a time, for small machines).

Each run sends the same requests (``--requests`` prompts, ``--tokens`` generated tokens each, greedy,
``--concurrency`` in flight). Two figures:

* A/B: the decode step time of each run = vLLM's own mean inter-token latency
  (``vllm:inter_token_latency_seconds`` sum/count over the run), with the exporter (A) and without
  (B); overhead = median(A) / median(B) - 1. On two shared cores the run-to-run spread is several
  percent, so this bounds the overhead only coarsely; it includes everything (the snapshot writer
  thread, the exporter process serving scrapes -- none here).
* in engine: the exporter times its own per-step work in each worker (the patched
  ``EplbState.step``/``prepare_forward`` around vLLM's code, ``exporter_seconds`` in its snapshot)
  next to the step durations it records; overhead = exporter time / step time over the measured
  runs. This is the headline figure (``exporter_step_overhead_pct`` of scripts/e2e_vllm_cpu.sh):
  precise, but it leaves out work off the step path (the snapshot writer thread, once per flush).

Exit status 1 if the in-engine overhead is 1 % of the step or more (the target).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the engine rig: the package moe_eplb_harness.vllm_engine (the harness distribution, harness/)
sys.path[:0] = [os.path.join(ROOT, "harness"), os.path.join(ROOT, "operator")]

from moe_eplb_harness.vllm_engine import harness  # noqa: E402
from moe_eplb_harness.vllm_engine.overhead import TARGET_PCT, measure, one_run, table  # noqa: E402


def make_engines(work: str) -> list[harness.Engine]:
    """[with, without]: engines (not started) built from the rendered "full" MoEInference."""
    from moe_eplb_harness.vllm_engine import tiny_model

    model = tiny_model.build_tiny_moe(os.path.join(work, "tiny-qwen3-moe"))
    bridge = harness.bridge_site(os.path.join(work, "bridge-site"))
    rendered = harness.render(harness.manifest("full"), work)
    return [harness.Engine(rendered, model, bridge, os.path.join(work, name), exporter=(name == "with"))
            for name in ("with", "without")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--sequential", action="store_true", help="one engine at a time (less memory, more drift)")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    problem = harness.cpu_wheel_problem()
    if problem:
        print(f"bench_exporter_real: {problem}", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="bench-exporter-real-")
    with_e, without_e = make_engines(work)
    kw = dict(runs=args.runs, requests=args.requests, tokens=args.tokens, concurrency=args.concurrency)
    try:
        if args.sequential:
            # arm B first, alone; then arm A alone (its in-engine figure needs no partner)
            with without_e:
                one_run(without_e, args.requests, 8, args.concurrency)
                b = [one_run(without_e, args.requests, args.tokens, args.concurrency) for _ in range(args.runs)]
            with with_e:
                res = measure(with_e, None, **kw)
            res["itl_ms"]["without"] = [1e3 * x for x in b]
            a, bm = statistics.median(res["itl_ms"]["with"]), statistics.median(res["itl_ms"]["without"])
            res["ab_overhead_pct"] = 100.0 * (a / bm - 1.0)
            res["ab_spread_pct"] = 100.0 * (max(b) - min(b)) / statistics.median(b)
        else:
            with with_e, without_e:
                res = measure(with_e, without_e, **kw)
    finally:
        with_e.stop()
        without_e.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["exporter_step_overhead_pct"] < TARGET_PCT else 1


if __name__ == "__main__":
    sys.exit(main())
