"""The experiment state machine: a change tried against the running settings before all. Pure, no I/O.

Where a resource has two or more replicas (or replica groups) and ``spec.autotune.experiments`` is
enabled, a change the evaluation would apply (or one the tuner wants explored,
``TuneResult.explore``) is first tried -- the **trial** arm -- against the running settings -- the
**control** arm --, on the same traffic (the Service splits it), in one of two designs:

* **interleaved** (window and interval, where the engines take them live): the arms take turns on
  the same replicas, half of them on each arm, swapped every block (:mod:`.interleaved`: the
  schedule and that design's steps; its live applies are requests the loop carries out);
* **cross-pod** (a change of redundancy, or where settings cannot change live): ONE replica
  restarts with the trial's settings while the others keep the running ones. The reconciler
  renders the arms from ``status.autotune.experiment`` (:mod:`moe_eplb.render.experiment`): a
  Deployment's trial is a second Deployment of one pod behind the same Service (the main one runs
  one replica fewer: total capacity unchanged); a LeaderWorkerSet's trial is its highest group, by
  the rolling update's ``partition``. Two guards keep a pod's own speed and a restart's cold start
  out of the verdict: a **pre-period** (phase ``Baseline``) measures every engine pod's difference
  from the others on the same settings, by the node it runs on, and the trial's difference is
  taken less the pre-period's of its node (difference in differences); and the trial's first
  ``warmupSeconds`` after it is ready are not counted.

Every tick of the loop calls :func:`advance` with the arms as the cluster shows them
(:class:`ArmsView`) and, while both serve, one more bucket of their objective; the cross-pod
phases::

    Baseline --(baselineSeconds)--> Starting --(trial ready)--> Running --(wins)--> Promoting --(every
       |                               |                          |        replica on the trial's
       |                               |                          |        settings)--> done (promoted)
       |                               |                          |--(loses, or undecided at
       |                               |                          |    maxSeconds)--> Restoring
       |--(a scale-in to one replica)--+--(crash loop, a scale-in, not ready in time)--> Restoring
                                             --(trial replica back on the running settings)--> done (discarded)
    any phase --(the user edited spec.eplb)--> done (discarded; the user's settings win)

The verdict is the sequential rule of :mod:`moe_eplb.eplb.tuning.judge`: looks at every completed
batch of buckets once ``minSeconds`` were judged, each spending part of the error, the errors
autocorrelation-robust; an experiment that crossed neither boundary by ``maxSeconds`` is
**undecided** and keeps the running settings. Promotion writes the override (the trial's settings)
and counts a restart, as a rollout does. The finished experiment is appended to
``status.autotune.experiments`` with its verdict, outcome, estimate and interval, the two arms'
observations and what was learned (:func:`learned_ranges`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from moe_eplb.api.autotune_status import (
    BASELINE,
    CROSS_POD,
    INTERLEAVED,
    PROMOTING,
    RESTORING,
    RUNNING,
    STARTING,
    Arm,
    AutotuneStatus,
    Experiment,
    HistoryEntry,
    Override,
)
from moe_eplb.api.knobs import Knobs
from moe_eplb.api.spec import AutotuneSpec
from moe_eplb.contracts.k8s_names import ARM_CONTROL, ARM_TRIAL
from moe_eplb.controller import interleaved as il
from moe_eplb.controller.interleaved import LiveRequest
from moe_eplb.controller.outcome import StatusStep, describe
from moe_eplb.eplb.replay.costmodel import CostModel
from moe_eplb.eplb.tuning import experiment as stats
from moe_eplb.eplb.tuning import judge
from moe_eplb.eplb.tuning.calibrate import Calibration
from moe_eplb.eplb.tuning.exploration import ArmObservation, LearnedRange
from moe_eplb.eplb.tuning.learn import learn

#: the most pre-period buckets kept per node (2 hours of 15 s ticks)
BASELINE_LIMIT = 480
#: the most judged buckets kept (the longest maxSeconds at 15 s ticks is 7 days: keep the last 12 h)
SAMPLES_LIMIT = 2880

__all__ = ["ArmsView", "ExperimentStep", "LiveRequest", "possible", "start", "advance", "applied", "learned_ranges",
           "estimate_of", "judged", "BASELINE_LIMIT"]


@dataclass(frozen=True)
class ArmsView:
    """The arms as the cluster shows them now.

    Attributes:
        replicas: ``spec.replicas`` now (the autoscaler's count; the trial counts as one of them).
        trial_ready: ready replicas (groups) running the trial's settings.
        control_ready: ready replicas (groups) running the control's settings.
        trial_crashlooping: pods of the trial's settings that crash-loop.
        settled: every child workload has rolled out what it was rendered with.
        superseded: why the user's settings now win (an edit of ``spec.eplb``), else None.
        trial_node: the node the trial's engine (pod, or group leader) runs on (None: unknown).
        engine_pods: the ready engine pods (one per replica; a group's leader), by name: an
            interleaved experiment ends when they change.
    """

    replicas: int
    trial_ready: int
    control_ready: int
    trial_crashlooping: tuple[str, ...] = ()
    settled: bool = True
    superseded: str | None = None
    trial_node: str | None = None
    engine_pods: tuple[str, ...] = ()


@dataclass
class ExperimentStep(StatusStep):
    """The result of :func:`advance`: the complete new ``status.autotune`` plus side effects;
    ``live``: what the loop must apply live before it writes ``status`` (interleaved), then report
    back with :func:`moe_eplb.controller.interleaved.applied`."""

    verdict: str | None = None  # set at the tick the verdict is reached
    live: tuple[LiveRequest, ...] = ()


def possible(cfg: AutotuneSpec, replicas: int) -> bool:
    """Whether a change may run as an experiment: enabled and two or more replicas (groups)."""
    return bool(cfg.experiments.enabled) and int(replicas) >= 2


def start(state: AutotuneStatus, *, now: float, current: Knobs, target: Knobs, replicas: int, generation: int,
          spec_eplb: Knobs, from_hash: str | None, restart_charge: float, predicted_gain: float | None,
          explore: str | None = None, baseline_s: float = 0.0, schedule: dict | None = None) -> AutotuneStatus:
    """``state`` with a new experiment of ``target``: interleaved where ``schedule`` is given
    (:func:`moe_eplb.controller.interleaved.plan`; no restart, no charge: phase Running, no block
    yet), else cross-pod on one of ``replicas`` replicas (phase Baseline for ``baseline_s`` > 0, else
    Starting; the trial's restart counted now)."""
    common = dict(started_at=now, predicted_gain=predicted_gain, explore=explore, previous_override=state.override,
                  spec_eplb=spec_eplb, spec_generation=generation, from_hash=from_hash)
    if schedule is not None:
        half = len(schedule["groups"][0])
        exp = Experiment(phase=RUNNING, trial=Arm(ARM_TRIAL, target, half), control=Arm(ARM_CONTROL, current, replicas - half),
                         design=INTERLEAVED, restart_charge=0.0, schedule=schedule, block=-1, **common)
        return state.replace(experiment=exp)
    exp = Experiment(phase=BASELINE if baseline_s > 0 else STARTING, trial=Arm(ARM_TRIAL, target, 1),
                     control=Arm(ARM_CONTROL, current, replicas - 1), restart_charge=round(float(restart_charge), 6),
                     design=CROSS_POD, **common)
    return state.replace(experiment=exp, last_change_time=now, restarts=state.recent_restarts(now) + (now,))


def _alpha(confidence: float) -> float:
    """Each side's error (a promotion, a "loses"): half of ``1 - confidence``."""
    return max(1e-6, (1.0 - float(confidence)) / 2.0)


def _ttft_ratio(exp: Experiment) -> float | None:
    if len(exp.ttft_seconds) == 2 and exp.ttft_seconds[1] > 0:
        return exp.ttft_seconds[0] / exp.ttft_seconds[1]
    return None


def _objective(exp: Experiment) -> str:
    return "+".join(k for k in (stats.THROUGHPUT, stats.STEP_TIME) if k in exp.sample_objectives)


_KIND = {"s": stats.STEP_TIME, "t": stats.THROUGHPUT}


def _base_period(entry: dict) -> tuple[list[float], list[float], list[str]]:
    """One node's pre-period as ``(differences, log batch ratios, objective kinds)``."""
    d = [float(v) for v in entry.get("d", [])]
    x = [float(v) for v in entry.get("x", [])]
    k = [_KIND.get(c, stats.STEP_TIME) for c in str(entry.get("k", ""))]
    return d, (x + [0.0] * len(d))[:len(d)], (k + [stats.STEP_TIME] * len(d))[:len(d)]


def judged(exp: Experiment, seconds: float | None = None) -> judge.Robust | None:
    """The cross-pod estimate so far: the judged buckets' mean difference (batch means), less the
    pre-period's difference of the trial's node (difference in differences), both after what the
    arms' different batch sizes explain is taken out (:func:`moe_eplb.eplb.tuning.judge.adjust`).
    Where the trial runs on a node the pre-period did not measure, its own bias is unknown: the
    estimate keeps the judged buckets' mean and its error widens by the spread of the measured
    nodes' biases. ``seconds``: the judged time (default the record's), which sets how many buckets
    make a batch (:func:`moe_eplb.eplb.tuning.judge.batch_size`), as the pre-period's length does
    for its own."""
    n = len(exp.samples)
    post_batch = judge.batch_size(n, (exp.elapsed_seconds or 0.0) if seconds is None else seconds)
    pre_s = (exp.trial_started_at - exp.started_at) if exp.trial_started_at is not None else 0.0
    post = (list(exp.samples), (list(exp.covariates) + [0.0] * n)[:n],
            (list(exp.sample_objectives) + [stats.STEP_TIME] * n)[:n])
    base = exp.baseline or {}
    pre = _base_period(base[exp.trial_node]) if exp.trial_node in base else None
    adjusted = judge.adjust([post, pre] if pre is not None else [post], elasticity=control_elasticity(exp))
    post_r = judge.batch_means(adjusted[0], min_batch=post_batch)
    if post_r is None:
        return None
    if not base:  # no pre-period, or one that could compare no pods: their own speeds are unknown
        return post_r if exp.trial_started_at is None else judge.did(post_r, None, unknown_sd=judge.UNMEASURED_POD_SD)
    pre_r = judge.batch_means(adjusted[1], min_batch=judge.batch_size(len(pre[0]), pre_s)) \
        if pre is not None else None
    if pre_r is not None:
        return judge.did(post_r, pre_r)
    means = [sum(v) / len(v) for v in (_base_period(e)[0] for e in base.values()) if v]
    spread = float(math.sqrt(sum((m - sum(means) / len(means)) ** 2 for m in means) / (len(means) - 1))) \
        if len(means) > 1 else 0.0
    return judge.did(post_r, None, unknown_sd=spread)


#: the three level series of a bucket's control side: step seconds, tokens per step, balancedness
_LEVELS = ("s", "t", "b")


def levels_of(bucket: stats.ArmBucket) -> tuple[float, float, float]:
    """``(step seconds, tokens per step, served balancedness)`` of one arm's bucket as stored (0: unknown)."""
    return (round(bucket.step_seconds or 0.0, 7), round(bucket.tokens_per_step or 0.0, 3),
            round(bucket.balancedness or 0.0, 5))


def _with_levels(store: dict | None, bucket: stats.ArmBucket, limit: int) -> dict:
    out = dict(store or {})
    for key, value in zip(_LEVELS, levels_of(bucket)):
        out[key] = (list(out.get(key, [])) + [value])[-limit:]
    return out


def control_elasticity(exp: Experiment) -> float | None:
    """The step time's elasticity to the batch from the control side's own buckets: the trial node's
    pre-period "others" and the control arm since (the same pods on the same settings throughout),
    by the calibration's step-time model (:func:`moe_eplb.eplb.tuning.judge.batch_elasticity`);
    None where too few carry a served balancedness (then the batch slope is fitted)."""
    pre = (exp.baseline or {}).get(exp.trial_node or "", {})
    post = exp.control_levels or {}
    s, t, b = ([float(v) for v in pre.get(k, [])] + [float(v) for v in post.get(k, [])] for k in _LEVELS)
    n = min(len(s), len(t), len(b))
    return judge.batch_elasticity(s[:n], t[:n], b[:n])


def estimate_of(exp: Experiment, confidence: float) -> stats.Estimate | None:
    """The experiment's estimate and its plain (fixed-sample) interval at ``confidence``, for the
    record where a verdict comes without a look (an early end); None before two batches."""
    if exp.design == INTERLEAVED:
        est = judge.crossover(exp.block_values)
    else:
        est = judged(exp)
    if est is None:
        return None
    half = stats.t_quantile(0.5 + confidence / 2, max(1.0, est.dof)) * est.se
    return stats.Estimate(objective=_objective(exp), buckets=est.n, estimate=math.expm1(est.mean),
                          ci_low=math.expm1(est.mean - half), ci_high=math.expm1(est.mean + half),
                          confidence=confidence, ttft_ratio=_ttft_ratio(exp), dof=int(est.dof))


def with_bucket(exp: Experiment, pair: tuple[stats.ArmBucket, stats.ArmBucket] | None, *, counted: bool) -> Experiment:
    """``exp`` with one more ``(trial, control)`` bucket: its TTFT always (the guard), its paired
    difference when it is ``counted`` (after the warm-up / the block's discarded start)."""
    if pair is None:
        return exp
    trial, control = pair
    ttft = exp.ttft_seconds or (0.0, 0.0)
    if trial.ttft_seconds is not None and control.ttft_seconds is not None:
        ttft = (ttft[0] + trial.ttft_seconds, ttft[1] + control.ttft_seconds)
    if exp.design != INTERLEAVED:  # the control pods' own buckets, warm-up included: their settings never change
        exp = dataclasses.replace(exp, control_levels=_with_levels(exp.control_levels, control, SAMPLES_LIMIT))
    diff = stats.bucket_difference(trial, control, step_time_only=exp.design == INTERLEAVED,
                                   batch_tolerance=_tolerance(exp)) if counted else None
    if diff is None:
        return dataclasses.replace(exp, ttft_seconds=ttft if any(ttft) else ())
    kind, value = diff
    n = len(exp.samples)
    covariates = (list(exp.covariates) + [0.0] * n)[:n] + [round(batch_ratio(trial, control), 6)]
    return dataclasses.replace(exp, samples=(exp.samples + (round(value, 6),))[-SAMPLES_LIMIT:],
                               sample_objectives=(exp.sample_objectives + (kind,))[-SAMPLES_LIMIT:],
                               covariates=tuple(covariates[-SAMPLES_LIMIT:]), ttft_seconds=ttft if any(ttft) else ())


def _tolerance(exp: Experiment) -> float:
    """How far the arms' batch sizes may differ in a comparable bucket: the wide tolerance where the
    design takes the difference out (the interleaved arms swap replicas; a cross-pod experiment
    with a pre-period subtracts the pods' own and adjusts for the batch ratio), else
    :data:`moe_eplb.eplb.tuning.experiment.BATCH_TOLERANCE`."""
    if exp.design == INTERLEAVED or exp.phase == BASELINE or exp.trial_started_at is not None:
        return stats.SWAPPED_BATCH_TOLERANCE
    return stats.BATCH_TOLERANCE


def batch_ratio(trial: stats.ArmBucket, control: stats.ArmBucket) -> float:
    """The log ratio of the trial's tokens per step over the control's (0 where one is unknown)."""
    a, b = trial.tokens_per_step, control.tokens_per_step
    return math.log(a / b) if a and b and a > 0 and b > 0 else 0.0


def _counted_since(exp: Experiment) -> float | None:
    """When the judged time of a cross-pod experiment starts: the trial ready plus its warm-up."""
    if exp.ready_at is None:
        return None
    return exp.ready_at + float(exp.warmup_seconds or 0.0)


def _record(exp: Experiment, now: float, decision: judge.Decision | None = None,
            est: stats.Estimate | None = None) -> Experiment:
    since = _counted_since(exp) if exp.design == CROSS_POD else exp.started_at
    changes: dict = {"elapsed_seconds": round(max(0.0, now - (since if since is not None else exp.started_at)), 1)}
    if decision is not None:
        changes.update(objective=_objective(exp) or None, buckets=len(exp.samples) if exp.design == CROSS_POD
                       else len(exp.block_values), estimate=round(decision.estimate, 6),
                       ci_low=round(decision.ci_low, 6), ci_high=round(decision.ci_high, 6) if math.isfinite(
                           decision.ci_high) else None)
    elif est is not None:
        changes.update(objective=est.objective or None, buckets=est.buckets, estimate=round(est.estimate, 6),
                       ci_low=round(est.ci_low, 6), ci_high=round(est.ci_high, 6), confidence=est.confidence)
    return dataclasses.replace(exp, **changes)


def _decide(step: ExperimentStep, exp: Experiment, verdict: str, reason: str, now: float,
            observations: dict | None = None, learned: tuple[dict, ...] = (), outcome: str = "ended") -> None:
    """Carry out a verdict: promote (the override becomes the trial's settings, a restart counted
    for a cross-pod experiment) or discard (the trial replica returns to the running settings; an
    interleaved experiment's replicas take them back live). The arms' observations and what was
    learned are stored with it."""
    state = step.status
    exp = dataclasses.replace(exp, verdict=verdict, reason=reason, ended_at=now, outcome=outcome,
                              phase=PROMOTING if verdict == stats.PROMOTED else RESTORING,
                              observations=observations or exp.observations, learned=learned or exp.learned)
    changes: dict = {"experiment": exp}
    if verdict == stats.PROMOTED:
        changes.update(override=Override.of(exp.trial.knobs, spec_generation=exp.spec_generation,
                                            spec_eplb=exp.spec_eplb), last_change_time=now)
        if exp.design == CROSS_POD:
            changes["restarts"] = state.recent_restarts(now) + (now,)
        msg = f"trial {describe(exp.trial.knobs)} promoted to every replica: {reason}"
        step.events.append(("Normal", "ExperimentPromoted", msg))
        step.conditions["Tuned"] = ("True", "ExperimentPromoted", msg)
    else:
        msg = f"trial {describe(exp.trial.knobs)} discarded, keeping {describe(exp.control.knobs)}: {reason}"
        step.events.append(("Warning" if "crash" in reason else "Normal", "ExperimentDiscarded", msg))
        step.conditions["Tuned"] = ("True", "ExperimentDiscarded", msg)
    step.status = state.replace(**changes)
    step.changed = True
    step.verdict = verdict


def finish(step: ExperimentStep, exp: Experiment, observations: dict | None = None,
           learned: tuple[dict, ...] = ()) -> None:
    """Move the experiment to ``status.autotune.experiments`` (its per-bucket state dropped)."""
    done = dataclasses.replace(exp, observations=observations or exp.observations, learned=learned or exp.learned,
                               samples=(), sample_objectives=(), covariates=(), ttft_seconds=(), baseline=None,
                               control_levels=None, block_values=())
    step.status = step.status.with_experiment_done(done)
    if exp.verdict == stats.PROMOTED and exp.phase == PROMOTING:  # a change applied to every replica
        step.status = step.status.with_history(HistoryEntry(
            time=done.ended_at or exp.started_at, action="Kept", from_knobs=exp.control.knobs,
            to_knobs=exp.trial.knobs, reason=f"promoted after its experiment: {exp.reason}",
            predicted_gain=exp.predicted_gain, started_at=exp.started_at))
    step.changed = True
    step.events.append(("Normal", "ExperimentDone", f"experiment of {describe(exp.trial.knobs)} ended: {exp.verdict}"))


def _end_early(exp: Experiment, view: ArmsView, now: float, cfg: AutotuneSpec) -> str | None:
    """Why the experiment must end now whatever its numbers say (discarded), else None."""
    if view.trial_crashlooping:
        return f"the trial crash-loops ({', '.join(view.trial_crashlooping[:3])}); the running settings are restored"
    if view.replicas < 2:
        return f"a scale-in left {view.replicas} replica: no control arm to compare with"
    began = exp.trial_started_at or exp.started_at
    if exp.phase == STARTING and now - began > cfg.rollout_timeout_s:
        return f"the trial was not ready after {now - began:.0f}s"
    return None


def advance(cfg: AutotuneSpec, state: AutotuneStatus, view: ArmsView, *, now: float,
            bucket: tuple[stats.ArmBucket, stats.ArmBucket] | None = None,
            observations: dict | None = None, learned: tuple[dict, ...] = (),
            baseline: dict[str, tuple[stats.ArmBucket, stats.ArmBucket]] | None = None) -> ExperimentStep:
    """Move the experiment in ``state.experiment`` one step (see the module docstring).

    ``bucket``: one more ``(trial, control)`` bucket of the objective while both arms serve;
    ``baseline``: in the pre-period, one bucket of each engine pod and of the others together, by
    the node the pod runs on; ``observations``/``learned``: stored with the experiment when it ends
    (the two arms' :class:`ArmObservation` as dicts, :func:`learned_ranges`)."""
    step = ExperimentStep(status=state)
    exp = state.experiment
    if exp is None:
        return step
    if view.superseded is not None:
        done = dataclasses.replace(exp, verdict=stats.DISCARDED, ended_at=now, outcome="ended",
                                   reason=f"{view.superseded}: the user's settings win")
        step.status = state.replace(override=None)
        finish(step, done, observations, learned)
        step.conditions["Tuned"] = ("True", "Superseded", done.reason or "")
        return step
    if exp.design == INTERLEAVED:
        _interleaved(step, cfg, exp, view, now, bucket, observations, learned)
        return step
    if exp.phase in (BASELINE, STARTING, RUNNING) and (why := _end_early(exp, view, now, cfg)) is not None:
        _decide(step, _record(exp, now, est=estimate_of(exp, cfg.experiments.confidence)), stats.DISCARDED, why, now,
                observations, learned)
        return step
    if exp.phase == BASELINE:
        _baseline(step, cfg, exp, now, baseline)
    elif exp.phase == STARTING:
        if view.trial_ready >= 1 and view.settled:
            exp = dataclasses.replace(exp, phase=RUNNING, ready_at=now, trial_node=view.trial_node,
                                      warmup_seconds=float(cfg.experiments.warmup_s))
            step.status = state.replace(experiment=exp)
            step.changed = True
            pre = "" if not exp.baseline else (
                f"; its pre-period on node {view.trial_node} is subtracted" if view.trial_node in exp.baseline
                else f"; it runs on node {view.trial_node or '(unknown)'}, which the pre-period did not measure: "
                     "its own speed is unknown and widens the interval")
            msg = (f"experiment: trial {describe(exp.trial.knobs)} on 1 replica, control {describe(exp.control.knobs)} "
                   f"on {max(1, view.replicas - 1)}; judged after a {cfg.experiments.warmup_s:.0f}s warm-up, at least "
                   f"{cfg.experiments.min_s:.0f}s{pre}")
            step.events.append(("Normal", "ExperimentRunning", msg))
            step.conditions["Tuned"] = ("True", "Experimenting", msg)
    elif exp.phase == RUNNING:
        _running(step, cfg, exp, now, bucket, observations, learned)
    elif exp.phase == PROMOTING:
        if view.settled and view.control_ready == 0 and view.trial_ready >= view.replicas:
            finish(step, exp)
            step.conditions["Tuned"] = ("True", "Kept", f"kept {describe(exp.trial.knobs)} after its experiment")
    elif exp.phase == RESTORING:
        if view.settled and view.trial_ready == 0:
            finish(step, exp)
    return step


def _baseline(step: ExperimentStep, cfg: AutotuneSpec, exp: Experiment, now: float,
              baseline: dict[str, tuple[stats.ArmBucket, stats.ArmBucket]] | None) -> None:
    """The pre-period: keep each node's difference from the others on the running settings; after
    ``baselineSeconds`` the trial starts (the reconciler renders it once the phase is Starting)."""
    base = {k: dict(v) for k, v in (exp.baseline or {}).items()}
    for node, (own, others) in sorted((baseline or {}).items()):
        diff = stats.bucket_difference(own, others, batch_tolerance=_tolerance(exp))
        if diff is not None:
            d, x, k = _base_period(base.get(node, {}))
            levels = _with_levels({key: base.get(node, {}).get(key, []) for key in _LEVELS}, others, BASELINE_LIMIT)
            base[node] = {"d": (d + [round(diff[1], 6)])[-BASELINE_LIMIT:],
                          "x": (x + [round(batch_ratio(own, others), 6)])[-BASELINE_LIMIT:],
                          "k": ("".join("t" if kind == stats.THROUGHPUT else "s" for kind in k)
                                + ("t" if diff[0] == stats.THROUGHPUT else "s"))[-BASELINE_LIMIT:], **levels}
    changed = base != (exp.baseline or {})
    exp = dataclasses.replace(exp, baseline=base or None)
    if now - exp.started_at >= cfg.experiments.baseline_s:
        exp = dataclasses.replace(exp, phase=STARTING, trial_started_at=now)
        nodes = ", ".join(f"{k} ({len(v.get('d', []))})" for k, v in sorted(base.items())) or "none measured"
        msg = (f"experiment: pre-period done (buckets by node: {nodes}); trial {describe(exp.trial.knobs)} "
               "starting on 1 replica")
        step.conditions["Tuned"] = ("True", "Experimenting", msg)
        changed = True
    if changed:
        step.status = step.status.replace(experiment=exp)
        step.changed = True


def _running(step: ExperimentStep, cfg: AutotuneSpec, exp: Experiment, now: float,
             bucket: tuple[stats.ArmBucket, stats.ArmBucket] | None, observations: dict | None,
             learned: tuple[dict, ...]) -> None:
    since = _counted_since(exp)
    counted = since is not None and now >= since
    exp = with_bucket(exp, bucket, counted=counted)
    xp = cfg.experiments
    elapsed = max(0.0, now - since) if counted and since is not None else 0.0
    ttft = _ttft_ratio(exp)
    if elapsed >= xp.min_s and ttft is not None and ttft > 1.0 + stats.TTFT_GUARD:
        exp = _record(exp, now, est=estimate_of(exp, xp.confidence))
        _decide(step, exp, stats.DISCARDED, f"TTFT guard: the trial's mean TTFT is {ttft - 1:+.0%} of the control's "
                f"(more than {stats.TTFT_GUARD:.0%})", now, observations, learned, outcome="guard")
        return
    est = judged(exp, elapsed) if counted else None
    last = elapsed >= xp.max_s
    exp = _record(exp, now)
    if est is not None and elapsed >= xp.min_s:
        tau = _information(exp, elapsed, xp.max_s)
        if last or not exp.looks or tau - exp.looks[-1] >= judge.MIN_LOOK_STEP:
            looks = exp.looks + (round(tau, 6),)
            dec = judge.decide(est, looks, alpha=_alpha(xp.confidence), threshold=exp.restart_charge,
                               last=last)
            exp = _record(dataclasses.replace(exp, looks=looks, confidence=xp.confidence), now, decision=dec)
            if dec.outcome is not None:
                verdict, reason = _verdict_text(exp, dec, elapsed)
                _decide(step, exp, verdict, reason, now, observations, learned, outcome=dec.outcome)
                return
    elif last:  # maxSeconds without two batches of comparable buckets
        _decide(step, exp, stats.DISCARDED, f"undecided at maxSeconds: {len(exp.samples)} comparable buckets after "
                f"{elapsed:.0f}s judged; the running settings stay", now, observations, learned, outcome="undecided")
        return
    if exp != step.status.experiment:
        step.status = step.status.replace(experiment=exp)
        step.changed = True


# --- the interleaved design (the schedule's arithmetic: .interleaved) -----------------------------


def _interleaved(step: ExperimentStep, cfg: AutotuneSpec, exp: Experiment, view: ArmsView, now: float,
                 bucket: tuple[stats.ArmBucket, stats.ArmBucket] | None, observations: dict | None,
                 learned: tuple[dict, ...]) -> None:
    """One tick of an interleaved experiment: Running -- count the bucket of the block in force,
    close the block when its time is up (a look at every completed pair), ask for the next block's
    applies; Promoting / Restoring -- ask for every pod's apply until :func:`applied` confirms."""
    everyone = il.groups(exp)[0] + il.groups(exp)[1]
    if exp.phase == PROMOTING:
        step.live = (LiveRequest(tuple(sorted(set(everyone) | set(view.engine_pods))), exp.trial.knobs, "promote"),)
        return
    if exp.phase == RESTORING:
        step.live = (LiveRequest(tuple(sorted(set(everyone) | set(view.engine_pods))), exp.control.knobs,
                                 "back to the running settings"),)
        return
    if view.replicas < 2 or (view.engine_pods and set(view.engine_pods) != set(everyone)):
        gone = sorted(set(everyone) - set(view.engine_pods))
        came = sorted(set(view.engine_pods) - set(everyone))
        why = (f"the replicas changed (left: {', '.join(gone) or '-'}; joined: {', '.join(came) or '-'}): the arms "
               "cannot swap on the same replicas; the running settings are applied everywhere")
        _decide(step, _record(exp, now, est=estimate_of(exp, cfg.experiments.confidence)), stats.DISCARDED, why,
                now, observations, learned)
        return
    if exp.block is None or exp.block < 0:
        step.live = il.block_requests(exp, 0)
        return
    exp = with_bucket(exp, bucket, counted=il.counted(exp, now))
    sched = exp.schedule or {}
    if now < (exp.block_started_at or now) + float(sched.get("blockSeconds", 0.0)) - 1e-6:
        if exp != step.status.experiment:
            step.status = step.status.replace(experiment=_record(exp, now))
            step.changed = True
        return
    value = il.block_value(exp.samples)
    if value is None:  # no comparable buckets: the block runs again (its orientation must alternate)
        step.live = il.block_requests(exp, exp.block)
        step.status = step.status.replace(experiment=_record(exp, now))
        step.changed = True
        return
    exp = dataclasses.replace(exp, block_values=exp.block_values + (round(value, 6),), samples=(),
                              sample_objectives=tuple(sorted(set(exp.sample_objectives))))
    exp = _interleaved_look(step, cfg, exp, now, observations, learned)
    if exp is None:
        return
    step.live = il.block_requests(exp, len(exp.block_values))
    step.status = step.status.replace(experiment=_record(exp, now))
    step.changed = True


def _interleaved_look(step: ExperimentStep, cfg: AutotuneSpec, exp: Experiment, now: float,
                      observations: dict | None, learned: tuple[dict, ...]) -> Experiment | None:
    """A look after a completed block pair (once ``minSeconds`` passed since the first block): the
    experiment with the look recorded, or None when it decided (``step`` carries the verdict)."""
    xp = cfg.experiments
    elapsed = now - (exp.ready_at or exp.started_at)
    planned = int((exp.schedule or {}).get("pairs", 1))
    pairs = len(exp.block_values) // 2
    est = judge.crossover(exp.block_values)
    if len(exp.block_values) % 2 or elapsed < xp.min_s:
        return exp
    last = elapsed >= xp.max_s or pairs >= planned
    ttft = _ttft_ratio(exp)
    if ttft is not None and ttft > 1.0 + stats.TTFT_GUARD:
        _decide(step, _record(exp, now, est=estimate_of(exp, xp.confidence)), stats.DISCARDED,
                f"TTFT guard: the trial's mean TTFT is {ttft - 1:+.0%} of the control's (more than {stats.TTFT_GUARD:.0%})",
                now, observations, learned, outcome="guard")
        return None
    if est is None:
        if last:
            _decide(step, _record(exp, now), stats.DISCARDED, f"undecided at maxSeconds: {pairs} block pairs with "
                    "comparable buckets; the running settings stay", now, observations, learned, outcome="undecided")
            return None
        return exp
    tau = min(1.0, pairs / max(1, planned))
    looks = exp.looks + (round(tau, 6),)
    at = tuple(int(round(x * planned)) for x in looks)
    dec = judge.decide(est, looks, alpha=_alpha(xp.confidence), threshold=exp.restart_charge, last=last,
                       pairs=(at, planned))
    exp = _record(dataclasses.replace(exp, looks=looks, confidence=xp.confidence), now, decision=dec)
    if dec.outcome is None:
        return exp
    verdict, reason = _verdict_text(exp, dec, elapsed)
    _decide(step, exp, verdict, reason, now, observations, learned, outcome=dec.outcome)
    return None


def applied(step: ExperimentStep, results: list[tuple[LiveRequest, bool, str]], *, now: float) -> ExperimentStep:
    """``step`` (from :func:`advance`) once the loop carried out its live requests: ``results`` has
    ``(request, ok, reason)`` for each. Running: every apply confirmed starts the requested block
    (the first one starts the judged time); a failed one ends the experiment (discarded, the
    running settings applied everywhere). Promoting / Restoring: every pod confirmed ends it (the
    override, written at the promotion, runs); a failure waits for the next tick's retry."""
    exp = step.status.experiment
    if exp is None or not results:
        return step
    failed = [(r, why) for r, ok, why in results if not ok]
    if exp.phase == RUNNING:
        if failed:
            req, why = failed[0]
            msg = (f"the live apply of {describe(req.knobs)} on {', '.join(req.pods)} failed ({why}); the running "
                   "settings are restored")
            _decide(step, exp, stats.DISCARDED, msg, now, outcome="ended")
            step.events.append(("Warning", "LiveApplyFailed", msg))
            return step
        block = results[0][0].block
        if block is not None:
            first = exp.block is None or exp.block < 0
            exp = dataclasses.replace(exp, block=block, block_started_at=now, samples=(),
                                      ready_at=now if first else exp.ready_at)
            if first:
                a, b = il.groups(exp)
                msg = (f"experiment: trial {describe(exp.trial.knobs)} and control {describe(exp.control.knobs)} take "
                       f"turns on the same replicas (groups {', '.join(a)} | {', '.join(b)}), blocks of "
                       f"{(exp.schedule or {}).get('blockSeconds', 0):.0f}s, the first "
                       f"{(exp.schedule or {}).get('discardSeconds', 0):.0f}s of each discarded")
                step.events.append(("Normal", "ExperimentRunning", msg))
                step.conditions["Tuned"] = ("True", "Experimenting", msg)
            step.status = step.status.replace(experiment=exp)
            step.changed = True
        return step
    if exp.phase in (PROMOTING, RESTORING):
        if failed:
            req, why = failed[0]
            step.conditions["Tuned"] = ("True", "ExperimentEnding", f"applying {describe(req.knobs)} live on "
                                        f"{', '.join(req.pods)} failed ({why}); retrying")
            return step
        finish(step, exp)
        if exp.phase == PROMOTING:
            step.conditions["Tuned"] = ("True", "Kept", f"kept {describe(exp.trial.knobs)} after its experiment")
    return step


def _information(exp: Experiment, elapsed: float, max_s: float) -> float:
    """The information fraction of a cross-pod experiment now: its estimate's precision over the
    precision at maxSeconds (``1 / (1/n_pre + 1/n_post)``, the judged buckets extrapolated at their
    rate to maxSeconds); without a pre-period of the trial's node, the judged time's share."""
    n_post = len(exp.samples)
    if elapsed <= 0 or n_post == 0:
        return 0.0
    n_max = n_post * max(1.0, max_s / elapsed)
    pre = (exp.baseline or {}).get(exp.trial_node or "", {}).get("d")
    if not pre:
        return min(1.0, n_post / n_max)
    n_pre = len(pre)
    return min(1.0, (1.0 / (1.0 / n_pre + 1.0 / n_post)) / (1.0 / (1.0 / n_pre + 1.0 / n_max)))


def _verdict_text(exp: Experiment, dec: judge.Decision, elapsed: float) -> tuple[str, str]:
    """The verdict and its reason for a decided look."""
    rci = (f"{dec.estimate:+.2%} [{dec.ci_low:+.2%}, {dec.ci_high:+.2%}] ({_objective(exp) or 'no objective'}, "
           f"look {len(exp.looks)} at {dec.tau:.0%} of the information, {elapsed:.0f}s judged)")
    if dec.outcome == judge.WINS:
        return stats.PROMOTED, f"wins {rci}: the interval is above the promotion threshold {exp.restart_charge:.2%}"
    if dec.outcome == judge.LOSES:
        return stats.DISCARDED, f"loses {rci}: the interval is below 0"
    return stats.DISCARDED, f"undecided at maxSeconds: {rci} crosses neither boundary; the running settings stay"


def observation_dict(obs: ArmObservation) -> dict:
    """An :class:`ArmObservation` as the status stores it (knobs flat, None left out)."""
    out = {k: v for k, v in dataclasses.asdict(obs).items() if v is not None and k != "knobs"}
    out.update(windowSize=obs.knobs.window_size, stepInterval=obs.knobs.step_interval,
               numRedundantExperts=obs.knobs.num_redundant_experts)
    return out


def learned_ranges(calibration: Calibration | None, cost: CostModel | None, trial: ArmObservation | None,
                   control: ArmObservation | None, *, source: str,
                   bytes_per_redundant_expert: float | None = None) -> list[LearnedRange]:
    """What the experiment taught the calibration: the parameter ranges the two arms narrow
    (:func:`moe_eplb.eplb.tuning.learn.learn`); [] without the calibration the experiment was started from
    (an operator restarted since) or without both arms' observations."""
    if calibration is None or cost is None or trial is None or control is None:
        return []
    return learn(calibration, cost, trial, control, source=source,
                 bytes_per_redundant_expert=bytes_per_redundant_expert)
