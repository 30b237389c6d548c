"""The experiment judge on noise it did not design: A/A and planted +3 % experiments, before and after.

    python bench/bench_experiments.py [--seeds 40] [--only CASE] [--jobs 2] [--json OUT.json]

Each run is a deployment of REPLICAS simulated engines (``moe_eplb_harness.engines.fleet``: the
project's simulated vLLM engines, their EPLB replay and physics, in-process on a simulated clock, a
15 s tick as the operator's loop) serving a synthetic chat -> math workload, and one experiment of a
trial setting against the running one, played to its verdict with the operator's own state machine
(``moe_eplb.controller.experiment.advance``: the arms' buckets from the pods' counters as the loop's
arm tracker reads them, ``moe_eplb.metrics.arms``). Two kinds of run per case and seed:

* **A/A**: the trial's settings are the control's (window 1000, interval 3000, no redundancy): any
  promotion is false, and so is any "loses";
* **+3 %**: the trial's settings (window 2000) are planted 3 % faster in the engines' physics
  (``TrueCost.planted_gain``, less whatever EPLB itself makes of the bigger window, measured on a
  noise-free fleet first): a promotion is right, "loses" is wrong.

Three judges, the defaults of ``spec.autotune.experiments`` (minSeconds 900, maxSeconds 3600,
confidence 0.9) and the restart charge the issue measured (1.39 %):

* **before** -- the judge as it was at commit 62f59ae (transcribed in
  :func:`before_verdict`): the trial restarted on one replica beside the others, every 15 s bucket
  from the moment it is ready counted, a Student-t interval on the per-bucket differences
  re-checked at every tick after minSeconds, at maxSeconds the point estimate decides;
* **after, cross-pod** -- the same restart, judged by the new state machine: an 1800 s pre-period
  on the running settings (each node's difference from the others, subtracted from the trial's: its
  GPUs are the same), every difference adjusted for the arms' batch ratio by the elasticity of the
  control pods' own step-time model, a 300 s warm-up not counted, batch-means errors, the
  O'Brien-Fleming-type spending rule at every completed batch, undecided at maxSeconds keeps the
  running settings;
* **after, interleaved** -- the same replicas take turns (the design for window and interval, applied
  live; promotion threshold 0: no restart to pay for), blocks of one discarded and one counted
  rearrangement of the slower arm, the block pairs' contrasts under the same spending rule.

Cases (``TrueCost``'s realism; every engine also has 2 % log-normal step noise and 2 % outlier
buckets of +20-60 %, as before):

=================  ============================================================================
identical          the simulator as it was: identical pods, independent noise
pod-speed          a fixed speed per pod (its GPUs), log-sd 2 %
slow-trial-pod     the trial's replica (the interleaved design: group A's) 3 % slower
cold-start         a restarted pod's cold prefix cache: +10 % step time decaying with tau 100 s
realistic          all of them at once (the trial's replica drawn, not fixed), plus noise
                   correlated between ticks (lag-1 0.33) and a cache-affine router's uneven split
                   (fixed log-sd 5 % per pod, drifting 3 % over 15 minutes)
=================  ============================================================================

Printed: per case and judge, the verdicts out of N runs -- A/A promoted, A/A "loses", +3 % promoted,
+3 % "loses" -- with the targets (A/A promoted <= 5 %, A/A loses <= 10 %, +3 % promoted >= 80 %,
+3 % never called a loss). Exit 1 when an "after" figure misses a target.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from moe_eplb.api.autotune_status import BASELINE, PROMOTING, RUNNING, STARTING, AutotuneStatus  # noqa: E402
from moe_eplb.api.knobs import Knobs  # noqa: E402
from moe_eplb.api.spec import AutotuneSpec, ExperimentsSpec  # noqa: E402
from moe_eplb.controller import experiment as exm  # noqa: E402
from moe_eplb.controller import interleaved  # noqa: E402
from moe_eplb.eplb.tuning import experiment as stats  # noqa: E402
from moe_eplb.eplb.workload import synth  # noqa: E402
from moe_eplb.metrics.arms import ArmTracker, arm_bucket  # noqa: E402
from moe_eplb_harness.engines.fleet import Fleet  # noqa: E402
from moe_eplb_harness.engines.physics import TrueCost  # noqa: E402

REPLICAS = 2
EP = 4
GPUS = EP  # per replica: EP ranks of one GPU each
SHAPE = (4, 16, 1, 2)  # MoE layers, experts, groups, top-k: small, so a run takes seconds
TICK = 15.0
#: tokens per engine step at the peak (for all replicas): half of a step's time is per token, as in a
#: loaded decode batch (so a replica's share of the traffic shows in its step time)
PEAK_TOKENS = 3000.0
BURN_IN = 300.0  # the fleet serves this long before the experiment starts (its first rearrangements)
CHARGE = 0.0139  # the restart charge the issue measured (the defaults: restart_s / horizon_s)
CONTROL = Knobs(1000, 3000, 0)
TRIAL = Knobs(2000, 3000, 0)
GAIN = 0.03
CFG = AutotuneSpec(mode="Apply", experiments=ExperimentsSpec())  # 900 / 3600 / 0.9, pre-period 1800, warm-up 300

REAL = dict(pod_speed_sd=0.02, cold_start_penalty=0.10, cold_start_tau_s=100.0, noise_autocorr=0.33,
            router_skew_sd=0.05, router_drift_sd=0.03, router_drift_tau_s=900.0)


@dataclass(frozen=True)
class Case:
    what: str
    true: dict
    slow_trial: float = 1.0  # the trial slot's speed factor, fixed (1.0: as drawn)


CASES = {
    "identical": Case("identical pods, independent noise (the simulator as it was)", {}),
    "pod-speed": Case("a fixed speed per pod, log-sd 2 %", dict(pod_speed_sd=0.02)),
    "slow-trial-pod": Case("the trial's replica 3 % slower", {}, slow_trial=0.97),
    "cold-start": Case("a restart's cold prefix cache, +10 % decaying with tau 100 s",
                       dict(cold_start_penalty=0.10, cold_start_tau_s=100.0)),
    "realistic": Case("all of it, correlated noise, a cache-affine router's uneven split", REAL),
}


def before_verdict(diffs: list[float], elapsed: float, *, min_s: float, max_s: float, confidence: float,
                   charge: float) -> str | None:
    """The judge as it was (``controller/experiment.py`` and ``eplb/tuning/experiment.py``
    at commit 62f59ae): "wins", "loses", "undecided-promoted" / "undecided-discarded" at
    maxSeconds, or None. Every bucket since the trial was ready counts; a plain Student-t interval on
    them, looked at every tick after ``min_s``."""
    if elapsed < min_s or len(diffs) < stats.MIN_BUCKETS:
        return "undecided-discarded" if elapsed >= max_s else None
    mean, lo, hi = stats.interval(diffs, confidence)
    if math.expm1(lo) > charge:
        return "wins"
    if math.expm1(hi) < 0:
        return "loses"
    if elapsed >= max_s:
        return "undecided-promoted" if math.expm1(mean) > charge else "undecided-discarded"
    return None


def _fleet(trace, case: Case, seed: int, gain: float, knobs: Knobs = CONTROL) -> Fleet:
    true = TrueCost(**case.true, planted_gain=((TRIAL, gain),) if gain else ())
    speeds = {0: case.slow_trial} if case.slow_trial != 1.0 else None  # slot 0: the trial / group A
    return Fleet(trace, knobs, replicas=REPLICAS, ep_size=EP, true=true, seed=seed, key_base=seed * 100, speeds=speeds)


def _baseline_buckets(fleet: Fleet, prev: dict, cur: dict) -> dict:
    """The pre-period's buckets: each pod and the others together, by the node (GPUs) it runs on."""
    out = {}
    for i, pod in enumerate(fleet.names):
        others = [n for n in fleet.names if n != pod]
        own = arm_bucket(prev, cur, [pod], gpus_per_replica=GPUS)
        rest = arm_bucket(prev, cur, others, gpus_per_replica=GPUS)
        if own is not None and rest is not None:
            out[f"gpus-{fleet.keys[i]}"] = (own, rest)
    return out


def run_cross_pod(trace, case: Case, seed: int, trial: Knobs, gain: float) -> dict:
    """One cross-pod experiment judged by the new state machine and, on the same engines from the
    trial's readiness, by the judge as it was before. Returns both outcomes."""
    fleet = _fleet(trace, case, seed, gain)
    fleet.advance(BURN_IN)
    t = BURN_IN
    state = exm.start(AutotuneStatus(), now=t, current=CONTROL, target=trial, replicas=REPLICAS, generation=1,
                      spec_eplb=CONTROL, from_hash="h", restart_charge=CHARGE, predicted_gain=0.05,
                      baseline_s=CFG.experiments.baseline_s)
    slot, tracker, prev = 0, ArmTracker(started_at=t), fleet.counters()
    diffs: list[float] = []
    ready_at = None
    before = after = None
    xp = CFG.experiments
    while after is None or before is None:
        t += TICK
        fleet.advance(t)
        exp = state.experiment
        if exp is not None and exp.phase == BASELINE:
            cur = fleet.counters()
            base, prev = _baseline_buckets(fleet, prev, cur), cur
            view = exm.ArmsView(replicas=REPLICAS, trial_ready=0, control_ready=REPLICAS)
            state = exm.advance(CFG, state, view, now=t, baseline=base).status
            if state.experiment.phase == STARTING:
                fleet.restart(slot, trial, t)  # the same GPUs: the renderer pins the trial to the measured node
            continue
        trial_pod = fleet.names[slot]
        serving = fleet.serving()
        pair = None
        if trial_pod in serving:
            ready_at = t if ready_at is None else ready_at
            pair = tracker.bucket(t, fleet.counters(), [trial_pod], [n for n in serving if n != trial_pod],
                                  gpus_per_replica=GPUS)
        if before is None and ready_at is not None:
            d = stats.bucket_difference(*pair) if pair is not None else None
            if d is not None:
                diffs.append(d[1])
            before = before_verdict(diffs, t - ready_at, min_s=xp.min_s, max_s=xp.max_s, confidence=xp.confidence,
                                    charge=CHARGE)
        if after is None:
            view = exm.ArmsView(replicas=REPLICAS, trial_ready=int(trial_pod in serving), control_ready=REPLICAS - 1,
                                trial_node=f"gpus-{fleet.keys[slot]}")
            step = exm.advance(CFG, state, view, now=t, bucket=pair if state.experiment.phase == RUNNING else None)
            state = step.status
            if step.verdict is not None:
                after = state.experiment.outcome
        if t > BURN_IN + 4 * 3600:
            raise RuntimeError("cross-pod run did not end")
    return {"before": before, "after": after}


def run_interleaved(trace, case: Case, seed: int, trial: Knobs, gain: float) -> str:
    """One interleaved experiment on the same replicas, judged by the new state machine."""
    fleet = _fleet(trace, case, seed, gain)
    fleet.advance(BURN_IN)
    t = BURN_IN
    steps = float(trace.bucket_steps.sum()) / (trace.num_buckets * trace.bucket_seconds)
    sched = interleaved.plan(trial, CONTROL, pods=fleet.names, steps_per_second=steps, tick_s=TICK,
                             max_s=CFG.experiments.max_s)
    if isinstance(sched, str):
        raise RuntimeError(sched)
    state = exm.start(AutotuneStatus(), now=t, current=CONTROL, target=trial, replicas=REPLICAS, generation=1,
                      spec_eplb=CONTROL, from_hash="h", restart_charge=0.0, predicted_gain=0.05, schedule=sched)
    tracker = ArmTracker(started_at=t)
    slot_of = {n: i for i, n in enumerate(fleet.names)}
    while True:
        t += TICK
        fleet.advance(t)
        exp = state.experiment
        trial_pods, control_pods = interleaved.arms_now(exp)
        pair = tracker.bucket(t, fleet.counters(), list(trial_pods), list(control_pods), gpus_per_replica=GPUS)
        pair = pair if trial_pods else None
        view = exm.ArmsView(replicas=REPLICAS, trial_ready=len(trial_pods), control_ready=len(control_pods),
                            engine_pods=tuple(fleet.names))
        step = exm.advance(CFG, state, view, now=t, bucket=pair)
        if step.verdict is not None:
            return step.status.experiment.outcome
        results = []
        for req in step.live:
            for pod in req.pods:
                fleet.apply_live(slot_of[pod], req.knobs)
            results.append((req, True, "applied"))
        step = exm.applied(step, results, now=t)
        state = step.status
        if state.experiment is None or state.experiment.phase not in (RUNNING, PROMOTING):
            return state.experiments[-1].outcome if state.experiment is None else state.experiment.outcome
        if t > BURN_IN + 3 * 3600:
            raise RuntimeError("interleaved run did not end")


def workload(seed: int):
    return synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=SHAPE, hours=2.5, bucket_seconds=TICK,
                          seed=seed, peak_tokens_per_step=PEAK_TOKENS)


def planted(trace) -> float:
    """The gain to plant so that the trial is 3 % faster in all: EPLB's own effect of the trial's
    settings, measured on noise-free identical fleets over the judged hour, taken out."""
    calm = Case("noise-free", dict(step_noise=0.0, outlier_share=0.0))
    means = []
    for knobs in (CONTROL, TRIAL):
        fleet = Fleet(trace, knobs, replicas=1, ep_size=EP, true=TrueCost(**calm.true), seed=0)
        fleet.advance(BURN_IN + 1800.0)
        a = fleet.counters()[fleet.names[0]]
        fleet.advance(BURN_IN + 1800.0 + 3600.0)
        b = fleet.counters()[fleet.names[0]]
        means.append((b["moe_eplb_step_duration_seconds_sum"] - a["moe_eplb_step_duration_seconds_sum"])
                     / (b["moe_eplb_step_duration_seconds_count"] - a["moe_eplb_step_duration_seconds_count"]))
    physics = means[0] / means[1] - 1.0
    return (1.0 + GAIN) / (1.0 + physics) - 1.0, physics


def one(args: tuple[str, int, float]) -> dict:
    name, seed, plant = args
    case = CASES[name]
    trace = workload(seed)
    out = {"case": name, "seed": seed}
    for kind, trial, gain in (("aa", CONTROL, 0.0), ("gain", TRIAL, plant)):
        cp = run_cross_pod(trace, case, seed, trial, gain)
        out[f"{kind}_before"] = cp["before"]
        out[f"{kind}_cross_pod"] = cp["after"]
        out[f"{kind}_interleaved"] = run_interleaved(trace, case, seed, trial, gain)
    return out


def _count(rows: list[dict], key: str, *outcomes: str) -> int:
    return sum(1 for r in rows if r[key] in outcomes)


def table(rows: list[dict], n: int) -> tuple[list[str], list[str]]:
    """The printed table and the targets an "after" figure missed."""
    lines = [f"{'case':<16} {'judge':<22} {'A/A promoted':>13} {'A/A loses':>10} {'+3% promoted':>13} "
             f"{'+3% loses':>10} {'+3% undecided':>14}"]
    lines.append("-" * len(lines[0]))
    misses = []
    for name in CASES:
        mine = [r for r in rows if r["case"] == name]
        if not mine:
            continue
        for judge_key, label in (("before", "before"), ("cross_pod", "after: cross-pod"),
                                 ("interleaved", "after: interleaved")):
            win = ("wins", "undecided-promoted")
            aa_p = _count(mine, f"aa_{judge_key}", *win)
            aa_l = _count(mine, f"aa_{judge_key}", "loses")
            g_p = _count(mine, f"gain_{judge_key}", *win)
            g_l = _count(mine, f"gain_{judge_key}", "loses")
            g_u = _count(mine, f"gain_{judge_key}", "undecided", "undecided-discarded")
            m = len(mine)
            lines.append(f"{name:<16} {label:<22} {aa_p:>5} of {m:<4} {aa_l:>3} of {m:<3} {g_p:>5} of {m:<4} "
                         f"{g_l:>3} of {m:<3} {g_u:>6} of {m:<4}")
            if judge_key != "before" and (aa_p > 0.05 * m or aa_l > 0.10 * m or g_p < 0.80 * m or g_l > 0):
                misses.append(f"{name}/{label}")
    return lines, misses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=40, help="runs per case (each: an A/A and a +3 %% experiment)")
    ap.add_argument("--only", choices=sorted(CASES), action="append")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    plant, physics = planted(workload(0))
    print(f"{REPLICAS} replicas of EP {EP} ({SHAPE[0]} MoE layers x {SHAPE[1]} experts), {TICK:g} s ticks; control "
          f"{CONTROL.label}, trial {TRIAL.label}: EPLB's own effect {physics:+.2%}, planted {plant:+.2%} "
          f"(true effect {GAIN:+.0%}); minSeconds {CFG.experiments.min_s:.0f}, maxSeconds {CFG.experiments.max_s:.0f}, "
          f"confidence {CFG.experiments.confidence}, restart charge {CHARGE:.2%} (cross-pod), {args.seeds} seeds a case",
          flush=True)
    work = [(name, seed, plant) for name in (args.only or CASES) for seed in range(args.seeds)]
    rows: list[dict] = []

    def progress(done: int) -> None:
        if done % 10 == 0 or done == len(work):
            print(f"  {done} of {len(work)} runs, {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)

    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            for row in pool.map(one, work, chunksize=1):
                rows.append(row)
                progress(len(rows))
    else:
        for w in work:
            rows.append(one(w))
            progress(len(rows))
    lines, misses = table(rows, args.seeds)
    print("\n".join(lines))
    print(f"\n{len(work)} seeds x 2 experiments x 2 designs in {time.perf_counter() - t0:.0f}s "
          f"(before and cross-pod share each run's engines)")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as fh:
            json.dump({"rows": rows, "planted": plant, "physics": physics}, fh, indent=1)
    if misses:
        print(f"MISSED a target: {', '.join(misses)}")
        return 1
    print("OK: after, A/A promoted <= 5 %, A/A loses <= 10 %, +3 % promoted >= 80 % and never a loss, every case")
    return 0


if __name__ == "__main__":
    sys.exit(main())
