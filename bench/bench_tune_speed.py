"""Time a full tune on a one-hour DeepSeek-V3 trace: this code, the code before it, and naive.

    python bench/bench_tune_speed.py [--baseline REV] [--repeats 3] [--exhaustive]
                                     [--max-seconds 10] [--min-ratio 25]

Trace: ``synth.generate("deepseek-v3-chat-code-math", hours=1)`` -- 240 buckets of 15 s,
58 MoE layers x 256 experts, ~20 engine steps/s (~300 per bucket). Topology: EP 32 on 4 nodes,
8 expert groups (hierarchical policy). Search: the default window and interval ladders (5 x 5) x
redundancy 0:128 (R = 0, 32, 64, 96, 128: (256 + R) % 32 == 0) = 125 candidates.

Rows, measured in this one run, one thread (BLAS pinned to 1), CPU seconds of the process (wall
seconds beside them; on a shared machine CPU time is the fairer figure), median of ``--repeats``:

- ``tune``: :func:`moe_eplb.eplb.tuning.tuner.tune` as in this checkout (screen every candidate on every
  4th layer, then the 12 best plus defaults on all 58 layers), one process;
- ``tune at REV``: the same call with the package as it was at git revision ``--baseline``
  (default: 8f1a9e4, the code before the second round of issue-21 speed work), extracted with ``git archive`` into
  a temporary directory and run in a child process on the same trace (its own ``synth`` builds it;
  the bench checks the load matrices are identical). Its pick is compared with this code's;
- ``tune, NumPy path``: the same call as ``tune`` with the compiled kernels switched off (what
  runs without numba or with ``MOE_EPLB_NO_JIT=1``), same process, same trace;
- ``tune --exhaustive`` (with ``--exhaustive``): every candidate on all layers;
- ``naive``: one vLLM ``DefaultEplbPolicy.rebalance_experts`` call per rearrangement per
  candidate (no sharing, no batching). Its time is the number of such calls times the measured
  median time of one call on windows from this trace (estimated, not run: it takes minutes);
  replaying the load is not even counted, so the ratio is a lower bound. Without the vllm wheel
  the project's own single-call policy time is used instead (said so in the output).

The compiled kernels (``moe_eplb.eplb.replay.kernels``, Numba) are compiled, or loaded from Numba's
on-disk cache, before anything is timed: the bench prints that one-time cost and whether the cache
served it; no row contains it. (The baseline child has no kernels to compile.)

Exit status 1 if the tune takes longer than ``--max-seconds`` (CPU), the ratio to naive is below
``--min-ratio``, or the pick differs from the baseline's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from moe_eplb.eplb.replay import kernels  # noqa: E402
from moe_eplb.eplb.replay.policy import rebalance  # noqa: E402
from moe_eplb.eplb.replay.simulator import Replay, Topology  # noqa: E402
from moe_eplb.eplb.tuning.tuner import Bounds, TuneOptions, tune  # noqa: E402
from moe_eplb.eplb.workload import synth  # noqa: E402

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


#: The code the speed-up is measured against: the tuner as it was before the second round of
#: issue-21 speed work (the policy's log2phy pass, the tuner split; 8f1a9e4). The first round's
#: baseline (before the simulator batching) is d229aaa: ``--baseline d229aaa``.
BASELINE_REV = "8f1a9e4"
PROFILE = "deepseek-v3-chat-code-math"

# What the child runs (with the baseline's package first on sys.path): time tune like main() does.
# The baseline's modules and tune() as they were then (before eplb/ had rooms and TuneOptions).
_CHILD = r"""
import hashlib, json, os, statistics, sys, time
from moe_eplb.eplb import synth
from moe_eplb.eplb.tuner import Bounds, tune
profile, seed, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
trace = synth.generate(profile, hours=1.0, seed=seed)
cpu, wall = [], []
for _ in range(repeats):
    t0, c0 = time.perf_counter(), time.process_time()
    res = tune(trace, bounds=Bounds(redundant=(0, 128)), ep_size=32, num_nodes=4, num_groups=8)
    cpu.append(time.process_time() - c0); wall.append(time.perf_counter() - t0)
print(json.dumps({"cpu": statistics.median(cpu), "wall": statistics.median(wall),
                  "pick": res.recommendation.label, "best": res.best.knobs.label,
                  "load_sha": hashlib.sha256(trace.load.tobytes()).hexdigest(),
                  "module": __import__("moe_eplb").__file__}))
"""


def _timed_tune(trace, bounds, repeats: int):
    cpu, wall = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        res = tune(trace, TuneOptions(bounds=bounds, **TOPO))
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return res, statistics.median(cpu), statistics.median(wall)


def _baseline(rev: str, seed: int, repeats: int) -> dict:
    """Run the tune at git revision ``rev`` in a child process; {"error": ...} when impossible."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="moe-eplb-baseline-") as tmp:
        archive = subprocess.run(["git", "-C", str(root), "archive", rev, "operator"], capture_output=True)
        if archive.returncode != 0:
            return {"error": f"git archive {rev}: {archive.stderr.decode(errors='replace').strip()}"}
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        env = dict(os.environ, PYTHONPATH=str(Path(tmp) / "operator"))
        proc = subprocess.run([sys.executable, "-c", _CHILD, PROFILE, str(seed), str(repeats)], env=env,
                              capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            return {"error": f"baseline tune failed: {proc.stderr.strip()[-500:]}"}
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        if not out["module"].startswith(tmp):
            return {"error": f"the child imported {out['module']}, not the baseline"}
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exhaustive", action="store_true", help="also time the all-layers search")
    ap.add_argument("--baseline", default=BASELINE_REV, help="git revision to compare with ('' to skip)")
    ap.add_argument("--repeats", type=int, default=3, help="tunes per row (median)")
    ap.add_argument("--max-seconds", type=float, default=10.0, help="CPU seconds allowed for one tune")
    ap.add_argument("--min-ratio", type=float, default=25.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    trace = synth.generate(PROFILE, hours=1.0, seed=args.seed)
    bounds = Bounds(redundant=(0, 128))
    print(f"trace: {trace.num_buckets} buckets x {trace.num_layers} layers x {trace.num_experts} "
          f"experts, {trace.total_steps} steps ({trace.total_steps / 3600:.1f} steps/s); EP 32, "
          f"4 nodes, 8 groups")

    warm = kernels.warm_up()  # one-time compilation (or cache load), outside every timed row
    print(warm.describe())
    base = _baseline(args.baseline, args.seed, args.repeats) if args.baseline else None
    res, t_tune, w_tune = _timed_tune(trace, bounds, args.repeats)
    n_cand = len(res.candidates)
    numpy_path = None
    if warm.enabled:
        kernels.ENABLED = False
        try:
            numpy_path = _timed_tune(trace, bounds, args.repeats)
        finally:
            kernels.ENABLED = True

    exhaustive = None
    if args.exhaustive:
        t0 = time.process_time()
        ex = tune(trace, TuneOptions(bounds=bounds, screen_layers=None, **TOPO))
        exhaustive = (time.process_time() - t0, ex)

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
    print(f"{'search':<34} {'candidates':>10} {'policy calls':>13} {'cpu s':>7} {'wall s':>7} {'speed-up':>9}")
    print("-" * 85)
    print(f"{'naive (' + label + ')':<34} {n_cand:>10} {calls:>13} {t_naive:>7.1f} {'':>7} {1.0:>8.1f}x"
          f"   ({per_call * 1000:.1f} ms/call, estimated)")
    if exhaustive:
        t_ex, ex = exhaustive
        print(f"{'tune, all layers':<34} {len(ex.candidates):>10} {ex.policy_windows:>13} "
              f"{t_ex:>7.2f} {'':>7} {t_naive / t_ex:>8.1f}x")
    same_pick = True
    if base is not None and "error" not in base:
        print(f"{'tune at ' + args.baseline + ' (before)':<34} {n_cand:>10} {'':>13} {base['cpu']:>7.2f} "
              f"{base['wall']:>7.2f} {t_naive / base['cpu']:>8.1f}x")
    if numpy_path is not None:
        print(f"{'tune, NumPy path (no kernels)':<34} {n_cand:>10} {numpy_path[0].policy_windows:>13} "
              f"{numpy_path[1]:>7.2f} {numpy_path[2]:>7.2f} {t_naive / numpy_path[1]:>8.1f}x")
    path = "compiled kernels" if warm.enabled else "NumPy path"
    print(f"{'tune (this code, ' + path + ')':<34} {n_cand:>10} {res.policy_windows:>13} "
          f"{t_tune:>7.2f} {w_tune:>7.2f} {t_naive / t_tune:>8.1f}x")
    print()
    print(f"recommendation: {res.recommendation.label} ({res.decision}); best searched "
          f"{res.best.knobs.label} score {res.best.score:.4f}")
    if base is not None:
        if "error" in base:
            print(f"baseline not measured: {base['error']}")
        else:
            sha = hashlib.sha256(trace.load.tobytes()).hexdigest()
            same_trace = base["load_sha"] == sha
            same_pick = base["pick"] == res.recommendation.label and base["best"] == res.best.knobs.label
            print(f"vs {args.baseline}: {base['cpu'] / t_tune:.2f}x faster (CPU), same trace: {same_trace}, "
                  f"same pick: {same_pick} (before: recommendation {base['pick']}, best {base['best']})")
    if numpy_path is not None:
        np_res = numpy_path[0]
        same_pick = (same_pick and np_res.recommendation.label == res.recommendation.label
                     and np_res.best.knobs == res.best.knobs)
        print(f"vs NumPy path: {numpy_path[1] / t_tune:.2f}x faster (CPU), same pick: "
              f"{np_res.recommendation.label == res.recommendation.label and np_res.best.knobs == res.best.knobs}")
    if exhaustive:
        same = exhaustive[1].best.knobs == res.best.knobs
        print(f"all-layers search best: {exhaustive[1].best.knobs.label} "
              f"(score {exhaustive[1].best.score:.4f}); same pick as screened: {same}")
    print(f"issue-21 target (125 candidates in <= 2 s CPU): {'met' if t_tune <= 2.0 else 'NOT met'} "
          f"({t_tune:.2f} s)")
    ok = t_tune <= args.max_seconds and t_naive / t_tune >= args.min_ratio and n_cand >= 100 and same_pick
    print(f"{'OK' if ok else 'FAIL'}: {n_cand} candidates in {t_tune:.2f} s CPU (limit "
          f"{args.max_seconds:g} s), {t_naive / t_tune:.1f}x faster than naive (target >= "
          f"{args.min_ratio:g}x)" + ("" if same_pick else "; the pick differs from the baseline's or the NumPy path's"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
