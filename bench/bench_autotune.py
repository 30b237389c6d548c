"""Cost of one autotune evaluation per MoEInference, and how many resources one operator core can
tune every 5 minutes (target >= 200).

One evaluation = what the operator's timer does on the CPU for one resource: turn the Prometheus
range-query answers into a load trace (the reader's pure part, on synthetic query results of the
right size: one series per pod and counter, as many pods as one replica group spans), run the tuner
with the operator's search ladder (``OPERATOR_SEARCH``) on the operator's default data window
(``AutotuneRuntime.lookback_seconds``, 30 min) in 60 s buckets, and decide
(``controller.decisions.evaluate``). HTTP time is not CPU time and is not counted. Workloads come
from the built-in generator profiles.

A multi-node replica group (a LeaderWorkerSet group of ``nodes`` pods) is read as the operator reads
it: every pod reports the expert tokens its own ranks routed (the group's load is their sum) and the
engine's step counter (counted once per group), with the group labels the PodMonitor copies.

Run: ``python bench/bench_autotune.py`` (prints a table; ``--quick`` for one shape).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from moe_eplb import metric_names
from moe_eplb.api.autotune_status import DataWindow, Measurement
from moe_eplb.api.spec import parse
from moe_eplb.controller import decisions as dec
from moe_eplb.controller.autotune import OPERATOR_SEARCH, AutotuneRuntime, run_tuner
from moe_eplb.eplb import synth

RT = AutotuneRuntime()  # the operator's defaults: lookback window and search

CASES = [
    # (label, profile, model name, tensor, data, nodes)
    ("Qwen3-VL-30B-A3B, EP 8", "qwen3-vl-30b-a3b-chat-to-math", "Qwen/Qwen3-VL-30B-A3B-Instruct", 1, 8, 1),
    ("Qwen3-VL-30B-A3B, EP 16", "qwen3-vl-30b-a3b-chat-to-math", "Qwen/Qwen3-VL-30B-A3B-Instruct", 2, 8, 1),
    ("DeepSeek-V3, EP 8", "deepseek-v3-chat-to-code", "deepseek-ai/DeepSeek-V3-0324", 1, 8, 1),
    ("DeepSeek-V3, EP 32, 4 nodes", "deepseek-v3-chat-to-code", "deepseek-ai/DeepSeek-V3-0324", 1, 32, 4),
]


def resource(model: str, tensor: int, data: int, nodes: int) -> dict:
    return {
        "apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference",
        "metadata": {"name": "bench", "namespace": "default", "generation": 1},
        "spec": {
            "model": {"name": model},
            "engine": {"image": "vllm/vllm-openai:v0.12.0"},
            "parallelism": {"tensor": tensor, "data": data, "nodes": nodes},
            "eplb": {"enabled": True, "windowSize": 1000, "stepInterval": 3000, "numRedundantExperts": 0},
            "autotune": {"mode": "Apply", "memoryBudgetPerGpu": "8Gi", "minGain": 0.005},
        },
    }


def prometheus_bodies(trace, pods: int) -> tuple[dict, dict, dict, np.ndarray]:
    """Range-query answers (raw counters of ``pods`` pods of one replica group) for a trace, as
    Prometheus returns them: each pod routed an uneven share of every bucket's tokens."""
    T, L, E = trace.load.shape
    grid = 1_800_000_000.0 + 60.0 * np.arange(T + 1)
    steps = np.concatenate([[0], np.cumsum(trace.bucket_steps)])
    shares = np.random.default_rng(0).dirichlet(np.full(pods, 8.0), size=(L, E)).transpose(2, 0, 1)  # [P, L, E]
    wrap = lambda r: {"status": "success", "data": {"resultType": "matrix", "result": r}}  # noqa: E731
    expert, step, start = [], [], []
    for k in range(pods):
        labels = {"namespace": "default", "moeinference": "bench", "pod": f"bench-0-{k}" if k else "bench-0",
                  "model_name": "m"}
        if pods > 1:
            labels.update({metric_names.GROUP_LABEL: "0", metric_names.GROUP_WORKER_LABEL: str(k),
                           metric_names.GROUP_SIZE_LABEL: str(pods)})
        cum = np.concatenate([np.zeros((1, L, E)), np.cumsum(np.round(trace.load * shares[k]), axis=0)])
        expert += [{"metric": {**labels, "__name__": metric_names.EXPERT_TOKENS, "layer": str(l), "expert": str(e)},
                    "values": [[float(t), f"{cum[i, l, e]:.1f}"] for i, t in enumerate(grid)]}
                   for l in range(L) for e in range(E)]
        step.append({"metric": {**labels, "__name__": metric_names.ENGINE_STEPS},
                     "values": [[float(t), str(int(steps[i]))] for i, t in enumerate(grid)]})
        start.append({"metric": {**labels, "__name__": metric_names.EXPORTER_START_TIME},
                      "values": [[float(t), str(grid[0] - 1)] for t in grid]})
    return wrap(expert), wrap(step), wrap(start), grid


def one_case(label, profile, model, tensor, data, nodes, repeats: int) -> dict:
    from moe_eplb.metrics.assemble import trace_from_raw_counters
    from moe_eplb.metrics.series import parse_matrix

    full = synth.generate(profile, hours=RT.lookback_seconds / 3600.0, bucket_seconds=60.0, seed=3, shift_at=0.5)
    inf = parse(resource(model, tensor, data, nodes))
    current = inf.effective.knobs
    eb, sb, st, grid = prometheus_bodies(full, nodes)
    read_s, tune_s = [], []
    decision = None
    for _ in range(repeats):
        t0 = time.process_time()
        trace = trace_from_raw_counters(parse_matrix(eb, "experts"), parse_matrix(sb, "steps"), grid,
                                        num_layers=full.num_layers, num_experts=full.num_experts,
                                        start_times=parse_matrix(st, "starts"), pods_per_engine=nodes)
        t1 = time.process_time()
        answer = dec.TunerAnswer.of(run_tuner(trace, inf, current, OPERATOR_SEARCH))
        o = dec.evaluate(inf.autotune, inf.status, now=time.time(), generation=1, current=current,
                         spec_eplb=inf.spec_knobs, data_window=DataWindow(buckets=trace.num_buckets),
                         answer=answer, baseline=Measurement(balancedness=0.9))
        t2 = time.process_time()
        read_s.append(t1 - t0)
        tune_s.append(t2 - t1)
        decision = o.decision
    read_ms, tune_ms = 1000 * float(np.median(read_s)), 1000 * float(np.median(tune_s))
    total = read_ms + tune_ms
    return {"case": label, "shape": f"{full.num_layers}x{full.num_experts}", "pods": nodes,
            "buckets": full.num_buckets, "read_ms": read_ms, "tune_ms": tune_ms, "total_ms": total,
            "per_5min": int(300_000 // total), "decision": decision}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one case, one repeat")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--case", type=int, action="append", help="only these cases (0-based index; repeatable)")
    args = ap.parse_args()
    cases = CASES[:1] if args.quick else [CASES[i] for i in args.case] if args.case else CASES
    rows = [one_case(*c, repeats=1 if args.quick else args.repeats) for c in cases]
    print(f"autotune evaluation cost (CPU, one core; search {OPERATOR_SEARCH}; "
          f"{RT.lookback_seconds / 60:.0f} min of load in 60 s buckets)")
    print(f"{'case':30s} {'shape':>8s} {'pods':>5s} {'read ms':>9s} {'tune ms':>9s} {'total ms':>9s} "
          f"{'per 5 min':>10s}  decision")
    for r in rows:
        print(f"{r['case']:30s} {r['shape']:>8s} {r['pods']:5d} {r['read_ms']:9.0f} {r['tune_ms']:9.0f} "
              f"{r['total_ms']:9.0f} {r['per_5min']:10d}  {r['decision']}")
    worst = min(r["per_5min"] for r in rows)
    print(f"resources one core can evaluate every 5 min: {worst} (worst case above; target >= 200)")


if __name__ == "__main__":
    main()
