"""The experiment state machine: a change tried on one replica (group) before all. Pure, no I/O.

Where a resource has two or more replicas (or replica groups) and ``spec.autotune.experiments`` is
enabled, a change the evaluation would apply (or one the tuner wants explored,
``TuneResult.explore``) first runs on ONE replica -- the **trial** arm -- while the others keep the
running settings -- the **control** arm --, on the same traffic (the Service splits it). The
reconciler renders the arms from ``status.autotune.experiment`` (:mod:`moe_eplb.render.experiment`):
a Deployment's trial is a second Deployment of one pod behind the same Service (the main one runs
one replica fewer: total capacity unchanged); a LeaderWorkerSet's trial is its highest group, by
the rolling update's ``partition``. Every tick of the loop calls :func:`advance` with the arms as
the cluster shows them (:class:`ArmsView`) and, while both serve, one more bucket of their
objective; the phases::

    Starting --(trial ready)--> Running --(interval: wins)--> Promoting --(every replica on the
       |                           |                            trial's settings)--> done (promoted)
       |                           |--(interval: loses, or maxSeconds without a win)--> Restoring
       |--(crash loop, a scale-in to one replica, not ready in time)--> Restoring --(trial replica
                                                          back on the running settings)--> done (discarded)
    any phase --(the user edited spec.eplb)--> done (discarded; the user's settings win)

Promotion writes the override (the trial's settings) and counts a restart, as a rollout does. The
finished experiment is appended to ``status.autotune.experiments`` with its verdict, estimate and
interval, the two arms' observations and what was learned (:func:`learned_ranges`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from moe_eplb.api.autotune_status import (
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
from moe_eplb.controller.outcome import StatusStep, describe
from moe_eplb.eplb.replay.costmodel import CostModel
from moe_eplb.eplb.tuning import experiment as stats
from moe_eplb.eplb.tuning.calibrate import Calibration
from moe_eplb.eplb.tuning.exploration import ArmObservation, LearnedRange
from moe_eplb.eplb.tuning.learn import learn

__all__ = ["ArmsView", "ExperimentStep", "possible", "start", "advance", "learned_ranges", "estimate_of"]


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
    """

    replicas: int
    trial_ready: int
    control_ready: int
    trial_crashlooping: tuple[str, ...] = ()
    settled: bool = True
    superseded: str | None = None


@dataclass
class ExperimentStep(StatusStep):
    """The result of :func:`advance`: the complete new ``status.autotune`` plus side effects."""

    verdict: str | None = None  # set at the tick the verdict is reached


def possible(cfg: AutotuneSpec, replicas: int) -> bool:
    """Whether a change may run as an experiment: enabled and two or more replicas (groups)."""
    return bool(cfg.experiments.enabled) and int(replicas) >= 2


def start(state: AutotuneStatus, *, now: float, current: Knobs, target: Knobs, replicas: int, generation: int,
          spec_eplb: Knobs, from_hash: str | None, restart_charge: float, predicted_gain: float | None,
          explore: str | None = None) -> AutotuneStatus:
    """``state`` with a new experiment of ``target`` on one of ``replicas`` replicas (phase Starting)."""
    exp = Experiment(phase=STARTING, trial=Arm(ARM_TRIAL, target, 1), control=Arm(ARM_CONTROL, current, replicas - 1),
                     started_at=now, restart_charge=round(float(restart_charge), 6), predicted_gain=predicted_gain,
                     explore=explore, previous_override=state.override, spec_eplb=spec_eplb,
                     spec_generation=generation, from_hash=from_hash)
    return state.replace(experiment=exp, last_change_time=now, restarts=state.recent_restarts(now) + (now,))


def estimate_of(exp: Experiment, confidence: float) -> stats.Estimate | None:
    """The estimate and interval from the experiment's stored per-bucket differences."""
    diffs = list(exp.samples)
    if len(diffs) < stats.MIN_BUCKETS:
        return None
    mean, lo, hi = stats.interval(diffs, confidence)
    ttft = None
    if len(exp.ttft_seconds) == 2 and exp.ttft_seconds[1] > 0:
        ttft = exp.ttft_seconds[0] / exp.ttft_seconds[1]
    name = "+".join(k for k in (stats.THROUGHPUT, stats.STEP_TIME) if k in exp.sample_objectives)
    return stats.Estimate(objective=name, buckets=len(diffs), estimate=math.expm1(mean), ci_low=math.expm1(lo),
                          ci_high=math.expm1(hi), confidence=confidence, ttft_ratio=ttft)


def _with_bucket(exp: Experiment, pair: tuple[stats.ArmBucket, stats.ArmBucket] | None) -> Experiment:
    if pair is None:
        return exp
    trial, control = pair
    diff = stats.bucket_difference(trial, control)
    ttft = exp.ttft_seconds or (0.0, 0.0)
    if trial.ttft_seconds is not None and control.ttft_seconds is not None:
        ttft = (ttft[0] + trial.ttft_seconds, ttft[1] + control.ttft_seconds)
    if diff is None:
        return dataclasses.replace(exp, ttft_seconds=ttft if any(ttft) else ())
    kind, value = diff
    return dataclasses.replace(exp, samples=exp.samples + (round(value, 6),),
                               sample_objectives=exp.sample_objectives + (kind,),
                               ttft_seconds=ttft if any(ttft) else ())


def _record(exp: Experiment, est: stats.Estimate | None, now: float) -> Experiment:
    since = exp.ready_at if exp.ready_at is not None else exp.started_at
    changes: dict = {"elapsed_seconds": round(max(0.0, now - since), 1)}
    if est is not None:
        changes.update(objective=est.objective, buckets=est.buckets, estimate=round(est.estimate, 6),
                       ci_low=round(est.ci_low, 6), ci_high=round(est.ci_high, 6), confidence=est.confidence)
    return dataclasses.replace(exp, **changes)


def _decide(step: ExperimentStep, exp: Experiment, verdict: str, reason: str, now: float,
            observations: dict | None = None, learned: tuple[dict, ...] = ()) -> None:
    """Carry out a verdict: promote (the override becomes the trial's settings, a restart counted)
    or discard (the trial replica returns to the running settings). The arms' observations and
    what was learned are stored with it."""
    state = step.status
    exp = dataclasses.replace(exp, verdict=verdict, reason=reason, ended_at=now,
                              phase=PROMOTING if verdict == stats.PROMOTED else RESTORING,
                              observations=observations or exp.observations, learned=learned or exp.learned)
    changes: dict = {"experiment": exp}
    if verdict == stats.PROMOTED:
        changes.update(override=Override.of(exp.trial.knobs, spec_generation=exp.spec_generation,
                                            spec_eplb=exp.spec_eplb),
                       last_change_time=now, restarts=state.recent_restarts(now) + (now,))
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


def _finish(step: ExperimentStep, exp: Experiment, observations: dict | None = None,
            learned: tuple[dict, ...] = ()) -> None:
    done = dataclasses.replace(exp, observations=observations or exp.observations, learned=learned or exp.learned,
                               samples=(), sample_objectives=(), ttft_seconds=())
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
    if exp.phase == STARTING and now - exp.started_at > cfg.rollout_timeout_s:
        return f"the trial was not ready after {now - exp.started_at:.0f}s"
    return None


def advance(cfg: AutotuneSpec, state: AutotuneStatus, view: ArmsView, *, now: float,
            bucket: tuple[stats.ArmBucket, stats.ArmBucket] | None = None,
            observations: dict | None = None, learned: tuple[dict, ...] = ()) -> ExperimentStep:
    """Move the experiment in ``state.experiment`` one step (see the module docstring).

    ``bucket``: one more ``(trial, control)`` bucket of the objective while both arms serve;
    ``observations``/``learned``: stored with the experiment when it ends (the two arms'
    :class:`ArmObservation` as dicts, :func:`learned_ranges`)."""
    step = ExperimentStep(status=state)
    exp = state.experiment
    if exp is None:
        return step
    if view.superseded is not None:
        done = dataclasses.replace(exp, verdict=stats.DISCARDED, ended_at=now,
                                   reason=f"{view.superseded}: the user's settings win")
        step.status = state.replace(override=None)
        _finish(step, done, observations, learned)
        step.conditions["Tuned"] = ("True", "Superseded", done.reason or "")
        return step
    if exp.phase in (STARTING, RUNNING) and (why := _end_early(exp, view, now, cfg)) is not None:
        _decide(step, _record(exp, estimate_of(exp, cfg.experiments.confidence), now), stats.DISCARDED, why, now,
                observations, learned)
        return step
    if exp.phase == STARTING:
        if view.trial_ready >= 1 and view.settled:
            exp = dataclasses.replace(exp, phase=RUNNING, ready_at=now)
            step.status = state.replace(experiment=exp)
            step.changed = True
            msg = (f"experiment: trial {describe(exp.trial.knobs)} on 1 replica, control {describe(exp.control.knobs)} "
                   f"on {max(1, view.replicas - 1)}; at least {cfg.experiments.min_s:.0f}s")
            step.events.append(("Normal", "ExperimentRunning", msg))
            step.conditions["Tuned"] = ("True", "Experimenting", msg)
    elif exp.phase == RUNNING:
        _running(step, cfg, exp, now, bucket, observations, learned)
    elif exp.phase == PROMOTING:
        if view.settled and view.control_ready == 0 and view.trial_ready >= view.replicas:
            _finish(step, exp)
            step.conditions["Tuned"] = ("True", "Kept", f"kept {describe(exp.trial.knobs)} after its experiment")
    elif exp.phase == RESTORING:
        if view.settled and view.trial_ready == 0:
            _finish(step, exp)
    return step


def _running(step: ExperimentStep, cfg: AutotuneSpec, exp: Experiment, now: float,
             bucket: tuple[stats.ArmBucket, stats.ArmBucket] | None, observations: dict | None,
             learned: tuple[dict, ...]) -> None:
    exp = _with_bucket(exp, bucket)
    est = estimate_of(exp, cfg.experiments.confidence)
    exp = _record(exp, est, now)
    verdict, reason = stats.verdict(est, elapsed_s=exp.elapsed_seconds or 0.0, min_s=cfg.experiments.min_s,
                                    max_s=cfg.experiments.max_s, restart_charge=exp.restart_charge)
    if verdict is not None:
        _decide(step, exp, verdict, reason, now, observations, learned)
        return
    if exp != step.status.experiment:
        step.status = step.status.replace(experiment=exp)
        step.changed = True


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
