"""Time a full tune on a one-hour DeepSeek-V3 trace vs the same search done naively.

    python bench/bench_tune_speed.py [--exhaustive] [--max-seconds 10] [--min-ratio 25]

Trace: ``synth.generate("deepseek-v3-chat-code-math", hours=1)`` -- 240 buckets of 15 s,
58 MoE layers x 256 experts, ~20 engine steps/s. Topology: EP 32 on 4 nodes, 8 expert groups
(hierarchical policy). Search: the default window and interval ladders (5 x 5) x redundancy
0:128 (R = 0, 32, 64, 96, 128: (256 + R) % 32 == 0) = 125 candidates.

Rows, measured in this one run:

- ``tune``: :func:`moe_eplb.eplb.tuner.tune` as shipped (screen every candidate on every 4th
  layer, then the 12 best plus defaults on all 58 layers), one process;
- ``tune --exhaustive`` (with ``--exhaustive``): every candidate on all layers;
- ``naive``: one vLLM ``DefaultEplbPolicy.rebalance_experts`` call per rearrangement per
  candidate (no sharing, no batching). Its time is the number of such calls times the measured
  median time of one call on windows from this trace (estimated, not run: it takes minutes);
  replaying the load is not even counted, so the ratio is a lower bound. Without the vllm wheel
  the project's own single-call policy time is used instead (said so in the output).

Exit status 1 if the tune takes longer than ``--max-seconds`` or the ratio is below
``--min-ratio``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from moe_eplb.eplb import synth  # noqa: E402
from moe_eplb.eplb.policy import rebalance  # noqa: E402
from moe_eplb.eplb.simulator import Replay, Topology  # noqa: E402
from moe_eplb.eplb.tuner import parse_bounds, tune  # noqa: E402

TOPO = dict(ep_size=32, num_nodes=4, num_groups=8)


def _single_call_timer():
    """(label, fn(weight, replicas)) for one policy call: vLLM's if installed, else ours."""
    try:
        import torch

        torch.set_num_threads(1)
        from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

        def call(w, replicas):
            DefaultEplbPolicy.rebalance_experts(torch.from_numpy(w), replicas, 8, 4, 32)

        return "vLLM 0.32 DefaultEplbPolicy", call
    except Exception as exc:  # noqa: BLE001
        print(f"(vllm not importable: {exc}; timing the project's policy for the naive row)")

        def call(w, replicas):
            rebalance(w, replicas, 8, 4, 32)

        return "moe-eplb rebalance (no vLLM here)", call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exhaustive", action="store_true", help="also time the all-layers search")
    ap.add_argument("--max-seconds", type=float, default=10.0)
    ap.add_argument("--min-ratio", type=float, default=25.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    trace = synth.generate("deepseek-v3-chat-code-math", hours=1.0, seed=args.seed)
    bounds = parse_bounds("redundant=0:128")
    print(f"trace: {trace.num_buckets} buckets x {trace.num_layers} layers x {trace.num_experts} "
          f"experts, {trace.total_steps} steps ({trace.total_steps / 3600:.1f} steps/s); EP 32, "
          f"4 nodes, 8 groups")

    t0 = time.perf_counter()
    res = tune(trace, bounds=bounds, **TOPO)
    t_tune = time.perf_counter() - t0
    n_cand = len(res.candidates)

    exhaustive = None
    if args.exhaustive:
        t0 = time.perf_counter()
        ex = tune(trace, bounds=bounds, screen_layers=None, **TOPO)
        exhaustive = (time.perf_counter() - t0, ex)

    # Naive: one policy call per rearrangement per candidate.
    replay = Replay(trace, Topology(**TOPO))
    calls = sum(len(replay.windows(c.knobs)) for c in res.candidates)
    label, call = _single_call_timer()
    rng = np.random.default_rng(1)
    times = []
    for _ in range(15):
        k = res.candidates[int(rng.integers(0, n_cand))].knobs
        wins = replay.windows(k)
        s, e = wins[int(rng.integers(0, len(wins)))]
        w = (replay.cumulative(np.array([e])) - replay.cumulative(np.array([s])))[0]
        w = np.round(w).astype(np.float32)
        t0 = time.perf_counter()
        call(w, 256 + k.num_redundant_experts)
        times.append(time.perf_counter() - t0)
    per_call = statistics.median(times[1:])
    t_naive = calls * per_call

    print()
    print(f"{'search':<34} {'candidates':>10} {'policy calls':>13} {'seconds':>9} {'speed-up':>9}")
    print("-" * 79)
    print(f"{'naive (' + label + ')':<34} {n_cand:>10} {calls:>13} {t_naive:>9.1f} {1.0:>8.1f}x"
          f"   ({per_call * 1000:.1f} ms/call, estimated)")
    if exhaustive:
        t_ex, ex = exhaustive
        print(f"{'tune, all layers':<34} {len(ex.candidates):>10} {ex.policy_windows:>13} "
              f"{t_ex:>9.2f} {t_naive / t_ex:>8.1f}x")
    print(f"{'tune (screen 1/4 layers + finals)':<34} {n_cand:>10} {res.policy_windows:>13} "
          f"{t_tune:>9.2f} {t_naive / t_tune:>8.1f}x")
    print()
    print(f"recommendation: {res.recommendation.label} ({res.decision}); best searched "
          f"{res.best.knobs.label} score {res.best.score:.4f}")
    if exhaustive:
        same = exhaustive[1].best.knobs == res.best.knobs
        print(f"all-layers search best: {exhaustive[1].best.knobs.label} "
              f"(score {exhaustive[1].best.score:.4f}); same pick as screened: {same}")
    ok = t_tune <= args.max_seconds and t_naive / t_tune >= args.min_ratio and n_cand >= 100
    print(f"{'OK' if ok else 'FAIL'}: {n_cand} candidates in {t_tune:.2f} s (target <= "
          f"{args.max_seconds:g} s), {t_naive / t_tune:.1f}x faster than naive (target >= "
          f"{args.min_ratio:g}x)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
