"""Evaluation without peeking: tune on the first half of each workload, score on the second half.

    python bench/bench_tuner.py [--hours 2] [--seed 0] [--only NAME] [--json OUT.json]
                                [--from-real [DIR]]

Workloads (built by ``moe_eplb.eplb.synth`` from the built-in profiles, whose parameters are
fitted to the real routing data in ../shared/traces; by default nothing here reads that folder;
``--from-real`` re-fits the popularity and time structure from the real files at run time:
``olmoe_expert_counts.json`` plus the two Mixtral token-routing files):

- ``deepseek-steady``   DeepSeek-V3 (58 x 256, 8 groups), steady chat, EP 8 on one node
- ``deepseek-shift``    DeepSeek-V3, chat -> code -> math domain mix, EP 8 on one node
- ``qwen-steady``       Qwen3-VL-30B-A3B (48 x 128), steady, EP 4 (the seed PR's TP4 + EP)
- ``qwen-shift``        Qwen3-VL-30B-A3B, chat -> math shift, EP 4

EP sizes where the seed's 3000/1000/8 is a valid vLLM configuration ((E + 8) % ep == 0).
Rows (see ``bench/holdout.py``): no EPLB, vLLM defaults, seed, the tuner's pick,
hindsight-best of the grid on the second half, clairvoyant bound. Every row is replayed on the
second half from a cold start. Exit status 1 if on some workload the pick is below 97 % of the
hindsight best or below the defaults or the seed config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from holdout import ROWS, evaluate_holdout  # noqa: E402  (bench/holdout.py, next to this script)
from moe_eplb.eplb import synth  # noqa: E402

SHARED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "traces")
REAL_FILES = ("olmoe_expert_counts.json", "mixtral_humaneval_token_routing.json",
              "mixtral_gsm8k_token_routing.json")

WORKLOADS = {
    "deepseek-steady": ("deepseek-v3-steady", dict(ep_size=8, num_nodes=1, num_groups=8)),
    "deepseek-shift": ("deepseek-v3-chat-code-math", dict(ep_size=8, num_nodes=1, num_groups=8)),
    "qwen-steady": ("qwen3-vl-30b-a3b-steady", dict(ep_size=4, num_nodes=1, num_groups=1)),
    "qwen-shift": ("qwen3-vl-30b-a3b-chat-to-math", dict(ep_size=4, num_nodes=1, num_groups=1)),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hours", type=float, default=2.0, help="trace length (half to tune, half to score)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=sorted(WORKLOADS), action="append")
    ap.add_argument("--json", dest="json_out", default=None, help="also write the rows as JSON")
    ap.add_argument("--from-real", nargs="?", const=str(SHARED), default=None, metavar="DIR",
                    help=f"fit the workloads on the real routing files in DIR (default {SHARED})")
    args = ap.parse_args()
    source = None
    if args.from_real:
        source = [os.path.join(args.from_real, f) for f in REAL_FILES]
        missing = [f for f in source if not os.path.exists(f)]
        if missing:
            print(f"--from-real: missing {', '.join(missing)}")
            return 2
        print(f"workloads fitted on the real files in {args.from_real}: {', '.join(REAL_FILES)}")

    failures, dump = [], {}
    header = f"{'workload':<16} {'row':<14} {'W/I/R':<14} {'balancedness':>12} {'throughput':>10} {'vs hindsight':>12}  note"
    print(header)
    print("-" * len(header))
    for name in args.only or WORKLOADS:
        profile, topo = WORKLOADS[name]
        trace = synth.generate(profile, hours=args.hours, seed=args.seed, source=source)
        t0 = time.perf_counter()
        ho = evaluate_holdout(trace, **topo)
        secs = time.perf_counter() - t0
        best = ho.rows["hindsight"].throughput
        dump[name] = {}
        for row in ROWS:
            r = ho.rows[row]
            label = r.knobs.label if r.knobs and row != "clairvoyant" else ("every bucket" if row == "clairvoyant" else "-")
            if r.result is None:
                print(f"{name:<16} {row:<14} {label:<14} {'n/a':>12} {'n/a':>10} {'':>12}  {r.note}")
                dump[name][row] = None
                continue
            print(f"{name:<16} {row:<14} {label:<14} {r.balancedness:>12.4f} {r.throughput:>10.4f} "
                  f"{r.throughput / best:>12.2%}  {r.note}")
            dump[name][row] = {"config": r.knobs.to_dict() if r.knobs else None,
                               "balancedness": r.balancedness, "throughput": r.throughput}
        ok_ratio = ho.ratio_to_hindsight() >= 0.97
        ok_def = ho.not_worse_than("vllm_defaults") is not False
        ok_seed = ho.not_worse_than("seed") is not False
        print(f"{name:<16} tuner/hindsight {ho.ratio_to_hindsight():.2%} (>= 97%: {ok_ratio}); "
              f">= defaults: {ok_def}; >= seed: {ok_seed}; decision: {ho.tune_result.reason} "
              f"[{secs:.1f} s, {trace.num_buckets} buckets]")
        print()
        if not (ok_ratio and ok_def and ok_seed):
            failures.append(name)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as fh:
            json.dump(dump, fh, indent=1)
    if failures:
        print(f"FAIL: {', '.join(failures)}")
        return 1
    print("OK: on every workload the tuner's pick is >= 97% of hindsight-best and never below "
          "the vLLM defaults or the seed config")
    return 0


if __name__ == "__main__":
    sys.exit(main())
