"""Cost of one autotune evaluation per MoEInference, and how many resources one operator core can
tune every 5 minutes (target >= 200).

One evaluation = what the operator's timer does on the CPU for one resource: turn the Prometheus
range-query answers into a load trace and its largest telemetry key, ``rank_load`` (the reader's
pure part, on synthetic query results of the right size: one series per pod and counter, as many
pods as one replica group spans; the small telemetry families -- step-time sums and counts,
rearrangements, KV-cache gauges -- are left out), run the tuner
with the operator's search ladder (``OPERATOR_SEARCH``) on the operator's default data window
(``AutotuneSettings.lookback_seconds``, 30 min) in 60 s buckets, and decide
(``controller.decisions.evaluate``). HTTP time is not CPU time and is not counted; decoding the
JSON answers (the client's ``json.loads``) is. Workloads come from the built-in
generator profiles.

The reader reads the expert counters of *regular* pods (no restart, join, leave or missed scrape in
the window: every pod here) as Prometheus' sums at the bucket edges (``metrics.edges``,
``reader.read_expert_tokens``): the answers to its three range queries are built from the same raw
samples as Prometheus evaluates them (the newest sample at or before each edge), and the ``read``
column times what the reader does with them (parse, the regularity and consistency checks, the
trace). The ``raw`` column times the fallback for a window where no pod is regular: every raw
sample, one per scrape (``--scrape-seconds``, default 15 s: the PodMonitor's interval, 121 samples
per series in 30 min), a family denser than ``reader.MAX_SAMPLES_PER_ANSWER`` in groups of whole
layers. Both give the same trace (asserted). ``MB`` is the memory the largest answer takes decoded
(tracemalloc of ``json.loads``).

A multi-node replica group (a LeaderWorkerSet group of ``nodes`` pods) is read as the operator reads
it: every pod reports the expert tokens its own ranks routed (the group's load is their sum) and the
engine's step counter (counted once per group), with the group labels the PodMonitor copies.

Run: ``python bench/bench_autotune.py`` (prints a table; ``--quick`` for one shape).
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc

import numpy as np

from moe_eplb.api.autotune_status import DataWindow, Measurement
from moe_eplb.api.spec import parse
from moe_eplb.contracts import metric_names
from moe_eplb.controller import decisions as dec
from moe_eplb.controller.autotune import run_tuner
from moe_eplb.controller.autotune_settings import OPERATOR_SEARCH, AutotuneSettings
from moe_eplb.eplb.workload import synth
from moe_eplb.metrics import edges
from moe_eplb.metrics.assemble import trace_from_raw_counters
from moe_eplb.metrics.reader import MAX_SAMPLES_PER_ANSWER, pack_layers
from moe_eplb.metrics.series import parse_matrix
from moe_eplb.metrics.telemetry_keys import TelemetrySeries, telemetry_from_series

RT = AutotuneSettings()  # the operator's defaults: lookback window and search
SCRAPE_SECONDS = 15.0  # the PodMonitor's scrape interval (render/objects.py SCRAPE_INTERVAL)

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


def prometheus_bodies(trace, pods: int, ep: int,
                      scrape_seconds: float = SCRAPE_SECONDS) -> tuple[dict, dict, dict, dict, np.ndarray]:
    """Range-query answers (raw counters of ``pods`` pods of one replica group) for a trace, as
    Prometheus returns them: one raw sample per scrape (``scrape_seconds``; the PodMonitor scrapes
    every 15 s, so a 30 min window holds 121 samples per series), each pod routing an uneven share
    of every bucket's tokens. Returns the bodies of the expert tokens, engine steps, exporter start
    times and rank tokens (each pod reports its ``ep / pods`` ranks: the tokens the experts on them,
    placed statically, received from the whole group), and the 60 s bucket grid."""
    T, L, E = trace.load.shape
    per = int(round(trace.bucket_seconds / scrape_seconds))  # scrapes per bucket
    grid = 1_800_000_000.0 + trace.bucket_seconds * np.arange(T + 1)
    times = grid[0] + scrape_seconds * np.arange(T * per + 1)
    # counters at every scrape: the bucket's load accrues evenly over its scrapes (whole tokens)
    fine = np.repeat(trace.load / per, per, axis=0)  # [T*per, L, E]
    fine_steps = np.repeat(trace.bucket_steps / per, per)
    steps = np.round(np.concatenate([[0], np.cumsum(fine_steps)])).astype(np.int64)
    shares = np.random.default_rng(0).dirichlet(np.full(pods, 8.0), size=(L, E)).transpose(2, 0, 1)  # [P, L, E]
    wrap = lambda r: {"status": "success", "data": {"resultType": "matrix", "result": r}}  # noqa: E731
    expert, step, start, rank = [], [], [], []
    total = np.round(np.concatenate([np.zeros((1, L, E)), np.cumsum(fine, axis=0)]))
    per_rank = total.reshape(total.shape[0], L, ep, E // ep).sum(axis=3)  # [n, L, ep]
    local = ep // pods
    for k in range(pods):
        labels = {"namespace": "default", "moeinference": "bench", "pod": f"bench-0-{k}" if k else "bench-0",
                  "model_name": "m"}
        if pods > 1:
            labels.update({metric_names.GROUP_LABEL: "0", metric_names.GROUP_WORKER_LABEL: str(k),
                           metric_names.GROUP_SIZE_LABEL: str(pods)})
        cum = np.round(np.concatenate([np.zeros((1, L, E)), np.cumsum(fine * shares[k], axis=0)]))
        ts = times.tolist()
        expert += [{"metric": {**labels, "__name__": metric_names.EXPERT_TOKENS, "layer": str(l), "expert": str(e)},
                    "values": [[t, f"{v:.1f}"] for t, v in zip(ts, cum[:, l, e].tolist())]}
                   for l in range(L) for e in range(E)]
        step.append({"metric": {**labels, "__name__": metric_names.ENGINE_STEPS},
                     "values": [[t, str(int(v))] for t, v in zip(ts, steps.tolist())]})
        start.append({"metric": {**labels, "__name__": metric_names.EXPORTER_START_TIME},
                      "values": [[t, str(grid[0] - 1)] for t in ts]})
        rank += [{"metric": {**labels, "__name__": metric_names.RANK_TOKENS, "layer": str(l), "rank": str(r)},
                  "values": [[t, f"{v:.1f}"] for t, v in zip(ts, per_rank[:, l, r].tolist())]}
                 for l in range(L) for r in range(k * local, (k + 1) * local)]
    return wrap(expert), wrap(step), wrap(start), wrap(rank), grid


def _at_edges(values: list, grid: np.ndarray) -> np.ndarray:
    """A raw series' newest sample at or before each grid edge (Prometheus' instant evaluation)."""
    ts = np.array([v[0] for v in values])
    vs = np.array([float(v[1]) for v in values])
    return vs[np.searchsorted(ts, grid, side="right") - 1]


def _matrix(result: list) -> dict:
    return {"status": "success", "data": {"resultType": "matrix", "result": result}}


def family_at_edges(raw: dict, per_series: str, grid: np.ndarray) -> tuple[dict, dict]:
    """What Prometheus answers to the edge path's two range queries of a counter family (``step`` =
    bucket, from ``grid[0]`` to ``grid[-1]``) over the same pods, all of them regular:
    ``sum by (model_name, layer, <per_series>)`` and ``count without (<per_series>)``."""
    edges_t = grid.tolist()
    sums: dict[tuple, np.ndarray] = {}
    counts: dict[tuple, int] = {}
    for r in raw["data"]["result"]:
        m = r["metric"]
        key = (m[metric_names.LABEL_MODEL], m["layer"], m[per_series])
        sums[key] = sums.get(key, 0.0) + _at_edges(r["values"], grid)
        pod = tuple((k, v) for k, v in m.items() if k not in ("__name__", per_series))
        counts[pod] = counts.get(pod, 0) + 1
    return (_matrix([{"metric": {metric_names.LABEL_MODEL: k[0], "layer": k[1], per_series: k[2]},
                      "values": [[t, f"{v:.1f}"] for t, v in zip(edges_t, vs.tolist())]} for k, vs in sums.items()]),
            _matrix([{"metric": dict(pod), "values": [[t, str(n)] for t in edges_t]} for pod, n in counts.items()]))


def steps_at_edges(raw_steps: dict, grid: np.ndarray) -> dict:
    """The answer to ``sum(moe_eplb_engine_steps_total{regular pods})`` at the grid edges."""
    total = sum(_at_edges(r["values"], grid) for r in raw_steps["data"]["result"])
    return _matrix([{"metric": {}, "values": [[t, f"{v:.1f}"] for t, v in zip(grid.tolist(), total.tolist())]}])


def _layer_groups(body: dict, max_samples: int) -> list[dict]:
    """A matrix answer split as the reader asks for it: whole layers packed by
    :func:`moe_eplb.metrics.reader.pack_layers`, ~max_samples samples per answer."""
    by_layer: dict[str, list] = {}
    for r in body["data"]["result"]:
        by_layer.setdefault(r["metric"]["layer"], []).append(r)
    groups = pack_layers({k: sum(len(r["values"]) for r in v) for k, v in by_layer.items()}, max_samples)
    return [{"status": "success", "data": {"resultType": "matrix", "result": [r for k in g for r in by_layer[k]]}}
            for g in (groups or [sorted(by_layer, key=int)])]


def one_case(label, profile, model, tensor, data, nodes, repeats: int, scrape_seconds: float = SCRAPE_SECONDS) -> dict:

    full = synth.generate(profile, hours=RT.lookback_seconds / 3600.0, bucket_seconds=60.0, seed=3, shift_at=0.5)
    inf = parse(resource(model, tensor, data, nodes))
    current = inf.effective.knobs
    eb, sb, st, rb, grid = prometheus_bodies(full, nodes, tensor * data, scrape_seconds)
    read_s, tune_s = [], []
    decision = None
    # the operator reads a dense family in groups of whole layers, ~MAX_SAMPLES_PER_ANSWER samples per
    # answer (reader.layer_groups): the same series, in several disjoint answers
    samples = sum(len(r["values"]) for b in (eb, sb, st, rb) for r in b["data"]["result"])
    chunks = _layer_groups(eb, MAX_SAMPLES_PER_ANSWER) + _layer_groups(rb, MAX_SAMPLES_PER_ANSWER)
    # memory: one answer decoded from JSON (as the Prometheus client does)
    text = json.dumps(max(chunks, key=lambda c: sum(len(r["values"]) for r in c["data"]["result"])))
    tracemalloc.start()
    json.loads(text)
    answer_mb = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    del text
    sums_b, counts_b = family_at_edges(eb, metric_names.LABEL_EXPERT, grid)
    rank_sums_b, rank_counts_b = family_at_edges(rb, metric_names.LABEL_RANK, grid)
    step_sums_b = steps_at_edges(sb, grid)
    edge_bodies = (step_sums_b, counts_b, sums_b, rank_counts_b, rank_sums_b)
    numbers = sum(len(r["values"]) for b in edge_bodies + (sb, st) for r in b["data"]["result"])
    text = json.dumps(sums_b)
    tracemalloc.start()
    json.loads(text)
    edge_mb = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    del text
    raw_s = []
    # the answers as they come over HTTP: decoding them is part of the read
    raw_texts = [json.dumps(c) for c in chunks]
    sb_t, st_t = json.dumps(sb), json.dumps(st)
    edge_texts = [json.dumps(b) for b in edge_bodies]
    decode_s, raw_decode_s = [], []
    L = full.num_layers
    for _ in range(repeats):
        # the fallback: every pod's raw samples (a window where no pod is regular)
        t0 = time.process_time()
        parsed, decoding = [], 0.0
        for t in raw_texts:  # one answer at a time, as the reader asks for them (each body dropped once parsed)
            d0 = time.process_time()
            body = json.loads(t)
            decoding += time.process_time() - d0
            parsed += parse_matrix(body, "raw")
            del body
        d0 = time.process_time()
        sbody, stbody = json.loads(sb_t), json.loads(st_t)
        raw_decode_s.append(decoding + time.process_time() - d0)
        steps, starts = parse_matrix(sbody, "steps"), parse_matrix(stbody, "starts")
        experts = [x for x in parsed if x.labels["__name__"] == metric_names.EXPERT_TOKENS]
        ranks = [x for x in parsed if x.labels["__name__"] == metric_names.RANK_TOKENS]
        raw_trace = trace_from_raw_counters(experts, steps, grid, num_layers=L, num_experts=full.num_experts,
                                            start_times=starts, pods_per_engine=nodes)
        raw_tel = telemetry_from_series(TelemetrySeries(rank_tokens=ranks), grid, raw_trace.bucket_steps,
                                        num_layers=L, pods_per_engine=nodes, start_times=starts)
        raw_s.append(time.process_time() - t0)
        del experts, ranks, parsed
        # the usual read: regular pods summed at the bucket edges (reader.read_expert_tokens, read_rank_tokens)
        t0 = time.process_time()
        sbody, stbody = json.loads(sb_t), json.loads(st_t)
        step_sums_body, counts_body, sums_body, rank_counts_body, rank_sums_body = (json.loads(t) for t in edge_texts)
        decode_s.append(time.process_time() - t0)
        steps, starts = parse_matrix(sbody, "steps"), parse_matrix(stbody, "starts")
        pods = edges.regular_pods(steps, starts, grid)
        step_sums, counts = parse_matrix(step_sums_body, "step sums"), parse_matrix(counts_body, "counts")
        assert edges.check_edges(pods, steps, starts, step_sums, counts, grid) is None
        sums = parse_matrix(sums_body, "sums")
        assert edges.check_sums(sums, grid) is None
        rank_counts, rank_sums = parse_matrix(rank_counts_body, "rank counts"), parse_matrix(rank_sums_body, "ranks")
        assert edges.check_counts(pods, rank_counts, grid) is None and edges.check_sums(rank_sums, grid) is None
        trace = trace_from_raw_counters([], steps, grid, start_times=starts, edge_sums=sums, edge_counts=counts,
                                        num_layers=L, num_experts=full.num_experts, pods_per_engine=nodes)
        tel = telemetry_from_series(TelemetrySeries(rank_edge_sums=rank_sums), grid, trace.bucket_steps,
                                    num_layers=L, pods_per_engine=nodes, start_times=starts)
        t1 = time.process_time()
        assert len(pods) == nodes and trace.meta["pods_at_edges"] == nodes
        np.testing.assert_array_equal(trace.load, raw_trace.load)  # the same trace either way
        np.testing.assert_array_equal(tel.telemetry.rank_load, raw_tel.telemetry.rank_load)
        answer = dec.TunerAnswer.of(run_tuner(trace, inf, current, OPERATOR_SEARCH))
        o = dec.evaluate(inf.autotune, inf.status, now=time.time(), generation=1, current=current,
                         spec_eplb=inf.spec_knobs, data_window=DataWindow(buckets=trace.num_buckets),
                         answer=answer, baseline=Measurement(balancedness=0.9))
        t2 = time.process_time()
        read_s.append(t1 - t0)
        tune_s.append(t2 - t1)
        decision = o.decision
    read_ms, tune_ms = 1000 * float(np.median(read_s)), 1000 * float(np.median(tune_s))
    raw_ms = 1000 * float(np.median(raw_s))
    total = read_ms + tune_ms
    return {"case": label, "shape": f"{full.num_layers}x{full.num_experts}", "pods": nodes,
            "series": len(eb["data"]["result"]), "samples": samples, "numbers": numbers, "answers": len(chunks),
            "answer_mb": answer_mb, "edge_mb": edge_mb,
            "buckets": full.num_buckets, "read_ms": read_ms, "raw_ms": raw_ms, "tune_ms": tune_ms,
            "decode_ms": 1000 * float(np.median(decode_s)), "raw_decode_ms": 1000 * float(np.median(raw_decode_s)),
            "total_ms": total, "per_5min": int(300_000 // total), "raw_per_5min": int(300_000 // (raw_ms + tune_ms)),
            "decision": decision}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one case, one repeat")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--case", type=int, action="append", help="only these cases (0-based index; repeatable)")
    ap.add_argument("--scrape-seconds", type=float, default=SCRAPE_SECONDS,
                    help="seconds between raw samples (default 15, the PodMonitor's interval; 60 = one per bucket)")
    args = ap.parse_args()
    cases = CASES[:1] if args.quick else [CASES[i] for i in args.case] if args.case else CASES
    rows = [one_case(*c, repeats=1 if args.quick else args.repeats, scrape_seconds=args.scrape_seconds) for c in cases]
    s = OPERATOR_SEARCH
    print(f"autotune evaluation cost (CPU, one core; search: windows {s.windows}, intervals {s.intervals}, "
          f"{s.max_redundancy_levels} redundancy levels, {s.segments} segments, {s.finalists} finalists; "
          f"{RT.lookback_seconds / 60:.0f} min of load in 60 s buckets, raw samples every {args.scrape_seconds:g} s)")
    print("read = regular pods summed at the bucket edges (the usual path); raw = every raw sample (the fallback "
          "when no pod is regular); both include decoding the JSON answers (of which: decode); MB = the largest "
          "answer decoded")
    print(f"{'case':28s} {'pods':>4s} {'raw samples':>11s} {'numbers read':>12s} {'MB raw':>7s} {'MB read':>8s} "
          f"{'read ms':>8s} {'decode':>7s} {'raw ms':>7s} {'decode':>7s} {'tune ms':>8s} {'total ms':>9s} "
          f"{'per 5 min':>10s} {'(raw)':>6s}  decision")
    for r in rows:
        print(f"{r['case']:28s} {r['pods']:4d} {r['samples']:11d} {r['numbers']:12d} {r['answer_mb']:7.0f} "
              f"{r['edge_mb']:8.0f} {r['read_ms']:8.0f} {r['decode_ms']:7.0f} {r['raw_ms']:7.0f} "
              f"{r['raw_decode_ms']:7.0f} {r['tune_ms']:8.0f} {r['total_ms']:9.0f} "
              f"{r['per_5min']:10d} {r['raw_per_5min']:6d}  {r['decision']}")
    worst = min(r["per_5min"] for r in rows)
    print(f"resources one core can evaluate every 5 min: {worst} (worst case above; target >= 200); "
          f"with every pod read raw: {min(r['raw_per_5min'] for r in rows)}")


if __name__ == "__main__":
    main()
