"""What limits the cross-pod judge's power on the realistic case: the same runs as
``bench/bench_experiments.py`` (its engines, workload and state machine), cross-pod design only, with
two what-ifs the operator does not do today.

    python bench/experiments_whatif.py [--case realistic] [--seeds 40] [--baseline-seconds S]
                                       [--elasticity E | --fitted-slope] [--jobs 2]

* ``--baseline-seconds``: the pre-period (default: ``spec.autotune.experiments.baselineSeconds``'s,
  1800; it was 900 before the judge took the control pods' step-time model);
* ``--elasticity E``: the step time's elasticity to the batch (d log step time / d log tokens per
  step) fixed at ``E``: the per-bucket difference is adjusted by ``E`` times the log batch ratio
  (a WHAT-IF: this script replaces :func:`moe_eplb.controller.experiment.control_elasticity` in its
  own process).
  The simulated engines' true value is about 0.5 (``TrueCost``: half of a loaded step's time is
  per token);
* ``--fitted-slope``: the batch slope fitted over the experiment's own differences, as the judge
  did before it took the control pods' step-time model (and still does where the pods export no
  tokens per rank);
* neither: the operator's judge as built (the elasticity from the control pods' step-time model).

Printed: the verdicts out of N (A/A promoted, A/A "loses", +3 % promoted, +3 % "loses"), and the
final estimate's z score against the truth (its spread is 1 where the interval is honest).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_experiments as bx  # noqa: E402

from moe_eplb.api.spec import AutotuneSpec, ExperimentsSpec  # noqa: E402
from moe_eplb.controller import experiment as exm  # noqa: E402

_LAST: dict = {}
_judged = exm.judged


def _recording_judged(exp, seconds=None):
    out = _judged(exp, seconds)
    _LAST["estimate"] = out
    return out


def _setup(baseline_s: float, elasticity: float | None, fitted: bool) -> None:
    bx.CFG = AutotuneSpec(mode="Apply", experiments=dataclasses.replace(ExperimentsSpec(), baseline_s=baseline_s))
    exm.judged = _recording_judged
    if elasticity is not None:  # the judge's own adjustment, with this elasticity instead of the model's
        exm.control_elasticity = lambda exp: elasticity
    elif fitted:
        exm.control_elasticity = lambda exp: None  # no step-time model: the slope is fitted


def one(args: tuple[str, int, float, float, float | None, bool]) -> dict:
    case, seed, plant, baseline_s, elasticity, fitted = args
    _setup(baseline_s, elasticity, fitted)
    trace = bx.workload(seed)
    out = {}
    for kind, trial, gain in (("aa", bx.CONTROL, 0.0), ("gain", bx.TRIAL, plant)):
        _LAST.clear()
        verdict = bx.run_cross_pod(trace, bx.CASES[case], seed, trial, gain)["after"]
        est = _LAST.get("estimate")
        out[kind] = (verdict, None if est is None else est.mean, None if est is None else est.se)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=sorted(bx.CASES), default="realistic")
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--baseline-seconds", type=float, default=ExperimentsSpec().baseline_s)
    ap.add_argument("--elasticity", type=float, default=None)
    ap.add_argument("--fitted-slope", action="store_true")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    plant, _ = bx.planted(bx.workload(0))
    work = [(args.case, s, plant, args.baseline_seconds, args.elasticity, args.fitted_slope) for s in range(args.seeds)]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = list(pool.map(one, work, chunksize=1))
    slope = (f"elasticity fixed at {args.elasticity:g}" if args.elasticity is not None
             else "slope fitted per experiment" if args.fitted_slope else "the control pods' step-time model (as built)")
    print(f"case {args.case}, {args.seeds} seeds, cross-pod, pre-period {args.baseline_seconds:.0f}s, batch adjustment: {slope}")
    print(f"{'run':<6} {'promoted':>9} {'loses':>7} {'undecided':>10} {'z spread':>9}")
    for kind, truth in (("aa", 0.0), ("gain", math.log1p(bx.GAIN))):
        verdicts = [r[kind][0] for r in rows]
        z = [(m - truth) / se for _, m, se in (r[kind] for r in rows) if m is not None and se]
        print(f"{'A/A' if kind == 'aa' else '+3%':<6} {verdicts.count('wins'):>9} {verdicts.count('loses'):>7} "
              f"{verdicts.count('undecided'):>10} {float(np.std(z)):>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
