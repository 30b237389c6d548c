"""The closed tuning loop: :class:`AutotuneLoop`, owned by the handlers' ``Controller``, and the kopf timer.

Every ``tick_seconds`` (wall) the loop's kopf timer parses each MoEInference once
(:func:`moe_eplb.api.spec.parse`) and runs :meth:`AutotuneLoop.tick`:

1. a rollout in progress (``status.autotune.rollout``) is advanced (:meth:`AutotuneLoop.advance_rollout`,
   deciding with :func:`.rollout.advance`): the child workloads and pods are read into a
   :class:`~.rollout.WorkloadView` (:func:`.workload.workload_view`: the Deployment, or for a
   multi-node resource the LeaderWorkerSet, its groups and their ``RecreateGroupOnPodRestart``
   Events), the new pods' measured balancedness is read when the rollout is ready to be judged;
2. otherwise, when ``spec.autotune.mode`` is not ``Off`` and ``evaluationIntervalSeconds`` have
   passed since the last evaluation (:meth:`AutotuneLoop.evaluate`): the recent load is read
   (:class:`.observe.LoadObserver`: Prometheus, or the pods directly when no Prometheus URL is set),
   the tuner searches within the spec's bounds and memory budget (:meth:`AutotuneLoop.tune`), and
   :func:`~.decisions.evaluate` decides (Keep / Recommend / Apply / Defer / NoData / Error);
3. the result is written to ``status.autotune`` (and the ``MetricsAvailable`` / ``Tuned``
   conditions) in ONE status patch conditional on the resource's ``resourceVersion``: a concurrent
   spec edit makes it fail with 409 and the tick is simply redone on fresh data. Events and the
   operator metrics (:mod:`.opmetrics`) follow a successful write only.

Before 1., for every resource with EPLB on (whatever ``spec.autotune.mode``), the ``RebalanceFailed``
condition follows vLLM's async EPLB worker failures the exporter counts (:mod:`.rebalance`), with a
Warning Event when it turns true.

The loop meets the reconciler through one seam, :class:`Reconciles` (the ``Controller``: its current
API client and ``reconcile(body)``, called to render a new override at once). An operator restart
resumes from the resource alone; the loop's own state is the direct-mode scraping (no Prometheus) of
its :class:`~.observe.LoadObserver`. kopf peering makes only one of several operator replicas run
handlers, so only one acts.

The clock may be accelerated for the demo and tests (``AutotuneSettings.clock``, e.g. a
:class:`moe_eplb_harness.engines.engine.SimClock`): spec durations are in the clock's seconds, Prometheus is
queried in wall time (``clock.to_wall``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import kopf

from moe_eplb.api.autotune_status import (
    BASELINE,
    INTERLEAVED,
    ROLLING,
    ROLLING_BACK,
    RUNNING,
    AutotuneStatus,
    DataWindow,
    Evaluation,
    LearnedParameter,
    Measurement,
    Rollout,
    autotune_status_patch,
)
from moe_eplb.api.knobs import Knobs
from moe_eplb.api.spec import MoEInference, SpecError, parse
from moe_eplb.api.validation import all2all_backend
from moe_eplb.contracts import k8s_names
from moe_eplb.contracts.k8s_names import API, API_GROUP, API_VERSION, KIND, PLURAL
from moe_eplb.controller import control, live, opmetrics
from moe_eplb.controller import decisions as dec
from moe_eplb.controller import experiment as exm
from moe_eplb.controller import interleaved as il
from moe_eplb.controller import rollout as ro
from moe_eplb.controller.autotune_settings import AutotuneSettings
from moe_eplb.controller.k8s import KubeClient
from moe_eplb.controller.observe import LoadObserver, LoadUnavailable
from moe_eplb.controller.rebalance import CONDITION as REBALANCE_CONDITION
from moe_eplb.controller.rebalance import RebalanceWatch
from moe_eplb.controller.rebalance import event_of as rebalance_event
from moe_eplb.controller.recovery_loop import tuning_pause
from moe_eplb.controller.scale_down import REASON as SCALE_DOWN_PAUSED
from moe_eplb.controller.scale_down import ScaleDownWatch
from moe_eplb.controller.settings import OperatorSettings
from moe_eplb.controller.shift import Shift, ShiftSettings, ShiftWatch
from moe_eplb.controller.workload import read_scaling, workload_view
from moe_eplb.eplb.replay.capacity import KvCapacity, capacity_from_trace
from moe_eplb.eplb.replay.costmodel import CostModel
from moe_eplb.eplb.tuning import experiment as stats
from moe_eplb.eplb.tuning.calibrate import Calibration, calibrate
from moe_eplb.eplb.tuning.exploration import LearnedRange
from moe_eplb.eplb.tuning.options import MIN_TUNE_BUCKETS, TuneOptions
from moe_eplb.eplb.tuning.overlap import OverlapContext, context_for
from moe_eplb.eplb.tuning.replicas import PerReplica, replay_score, tune_per_replica
from moe_eplb.eplb.tuning.tuner import TuneResult, tune
from moe_eplb.eplb.workload.trace import LoadTrace
from moe_eplb.metrics import arms as arms_mod
from moe_eplb.render.engine_args import termination_grace_seconds
from moe_eplb.render.experiment import control_settings, trial_settings

log = logging.getLogger("moe_eplb.autotune")


#: Why the loop does not tune while the tuner's EPLB off runs (docs/autotune.md, "EPLB off").
EPLB_OFF_BY_TUNER = ("EPLB runs off by the tuner's choice (spec.autotune.allowDisable): without EPLB vLLM keeps no "
                     "expert-load state, so the exporter counts nothing and the loop cannot tune; it stays off until "
                     "spec.autotune.allowDisable is set false or spec.eplb is edited (EPLB then runs again)")


class Reconciles(Protocol):
    """The loop's seam to the reconciler: what it needs of its owner (the handlers' ``Controller``)."""

    @property
    def client(self) -> KubeClient | None:
        """The operator's API client as of now (None before login)."""

    @property
    def settings(self) -> OperatorSettings:
        """The operator process's settings: its ``defaults`` fill in what a resource leaves unset."""

    async def reconcile(self, body: Mapping[str, Any], *, prune: bool = True) -> Any:
        """Render and apply the children of the MoEInference ``body`` (as stored now)."""


@dataclass
class _Gathered:
    """What an evaluation read and computed before deciding (:meth:`AutotuneLoop._gather`)."""

    view: ro.WorkloadView
    blocker: str | None
    trace: LoadTrace | None = None
    data_window: DataWindow | None = None
    load_error: tuple[str, str] | None = None
    result: TuneResult | None = None
    calibration: Calibration | None = None
    tune_error: str | None = None
    answer: dec.TunerAnswer | None = None
    tuner_seconds: float | None = None
    baseline: Measurement | None = None
    replicas: PerReplica | None = None  # the replicas' loads: their divergence, per-replica picks
    pods: list[dict] = dataclasses.field(default_factory=list)
    shift: Shift | None = None  # the evaluation runs on the load since this shift


class AutotuneLoop:
    """The tuning loop of one operator process (see the module docstring).

    ``host``: the reconciler seam (:class:`Reconciles`); ``settings``: the loop's clock, tick, search
    and read settings (default :meth:`AutotuneSettings.from_env`); ``actor``: who evaluates
    (``status.autotune.lastEvaluation.evaluatedBy``).
    """

    def __init__(self, host: Reconciles, settings: AutotuneSettings | None = None, *,
                 actor: str | None = None) -> None:
        self.host = host
        self.settings = settings or AutotuneSettings.from_env()
        self.load_observer = LoadObserver(self.settings)
        self.rebalance = RebalanceWatch(self.settings)
        self.scale_down_watch = ScaleDownWatch()
        self.arm_trackers: dict[tuple[str, str], arms_mod.ArmTracker] = {}
        #: per resource, the calibration and cost model of its last tuning (an experiment it started
        #: learns against them; lost with the process, then nothing is learned from that experiment)
        self.last_calibration: dict[tuple[str, str], tuple[Calibration, CostModel]] = {}
        #: per resource, the workload-shift watch between evaluations (:mod:`.shift`; in memory: a
        #: restarted operator starts watching again, the regular evaluations go on meanwhile)
        self.shift_watches: dict[tuple[str, str], ShiftWatch] = {}
        #: resource -> when to try a pending shift's evaluation again (its load was too short)
        self.shift_retry: dict[tuple[str, str], float] = {}
        self.actor = actor or f"{os.environ.get('HOSTNAME', 'operator')}/{id(self):x}"

    def now(self) -> float:
        """The loop's clock, in its seconds."""
        return self.settings.clock.now()

    # --- the kopf part (thin) --------------------------------------------------------------------

    def register(self, registry: kopf.OperatorRegistry) -> None:
        """Add the loop's timer (one per MoEInference) to a ``kopf.OperatorRegistry``."""
        tick_s = self.settings.tick_seconds

        @kopf.timer(API_GROUP, API_VERSION, PLURAL, id="autotune", interval=tick_s,
                    initial_delay=min(tick_s, 1.0), backoff=max(1.0, 4 * tick_s), registry=registry)
        async def autotune_timer(body: Any, **_: Any) -> None:
            await self.on_timer(body)

    async def on_timer(self, body: Mapping[str, Any]) -> str | None:
        """One timer call for a MoEInference body: parse it, fill in the operator's defaults, tick."""
        if self.host.client is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        try:
            inf = parse(body)
        except SpecError as exc:  # the reconciler reports it (SpecValid=False); nothing to tune
            log.info("autotune: %s/%s: %s", (body.get("metadata") or {}).get("namespace"),
                     (body.get("metadata") or {}).get("name"), exc)
            return None
        # what the spec leaves unset takes the operator's defaults, e.g. --prometheus-url (this copy only)
        return await self.tick(inf.with_operator_defaults(self.host.settings.defaults))

    async def close(self) -> None:
        """Stop what runs in the background (the direct-mode scrape loops)."""
        await self.load_observer.close()

    # --- one tick --------------------------------------------------------------------------------

    async def tick(self, inf: MoEInference) -> str | None:
        """One tick of the loop for one parsed MoEInference. Returns what happened (for tests and
        logs): ``rollout:<phase or action>``, ``evaluation:<decision>``, ``override:dropped`` (a stale
        override was removed), ``rebalance:<reason>`` (the ``RebalanceFailed`` condition changed:
        :mod:`.rebalance`), ``conflict`` or None (nothing)."""
        client = self.host.client
        if client is None:
            return None
        state = inf.status
        now = self.now()
        if state.rollout is None and state.experiment is None and state.live is not None and inf.live is None:
            # the pods' template changed since the live values were applied (a change that restarted
            # them, or the user's edit): the template's values run; drop the record (and the ConfigMap's)
            if await self._write(client, inf, state.replace(live=None), {}, now):
                await self._rerender(client, inf)
                return "live:dropped"
            return "conflict"
        if state.rollout is None and inf.override_problem is not None:
            # The user edited spec.eplb (or the override no longer fits the spec): spec.eplb runs.
            # Drop the stale override so that editing spec.eplb back cannot revive it.
            if await self._write(client, inf, state.replace(override=None), {}, now):
                log.info("autotune %s/%s: the tuner's override no longer applies (%s); dropped",
                         inf.namespace, inf.name, inf.override_problem)
                return "override:dropped"
            return "conflict"
        health = await self.rebalance.check(client, inf, now)
        if health is not None:
            return await self._write_rebalance(client, inf, health, now)
        if inf.prometheus_url is None and inf.autotune.mode != "Off":
            await self.load_observer.collect(client, inf, now)
        if state.experiment is not None or state.rollout is not None:
            self._shift_watch(inf).reset(now)  # pods restart: balancedness before and after do not compare
            result = await (self.advance_experiment(client, inf, now) if state.experiment is not None
                            else self.advance_rollout(client, inf, now))
        elif inf.autotune.mode == "Off":
            return None
        else:
            # a shift ready to evaluate on goes first, also when the regular evaluation is due: its
            # load is the post-shift part of the lookback only
            due = dec.due(inf.autotune, state, now)
            shift = await self._watch_shift(inf, now)
            pending = self._shift_watch(inf).pending
            if shift is None and pending is not None and now - pending.at < 2 * inf.autotune.evaluation_interval_s:
                # a shift was seen and its evaluation comes once the load since it suffices: the
                # regular one would tune on a lookback of two workloads, mostly the old (held at most
                # two intervals from the shift, should the load since it stay short)
                due = False
            if not due and shift is None:
                return None
            result = await self.evaluate(client, inf, now, shift=shift)
        if result in ("evaluation:Apply", "evaluation:Experiment", "rollout:RollingBack", "rollout:Superseded",
                      "evaluation:ApplyLive") or (
                result is not None and result.startswith("experiment:")) or (
                inf.autoscaling is not None and result is not None and result.startswith("rollout:")):
            # with an autoscaler, every rollout phase change re-renders it (its minReplicas holds the
            # rollout's replica count only while pods restart: render.autoscaler.rollout_min_replicas)
            await self._rerender(client, inf)
        return result

    async def _write_rebalance(self, client: KubeClient, inf: MoEInference, condition: tuple[str, str, str],
                               now: float) -> str:
        """Write the ``RebalanceFailed`` condition (:mod:`.rebalance`) and post its Event; the rest of
        the tick waits for the next one (the write changed the resource version)."""
        if not await self._write(client, inf, inf.status, {REBALANCE_CONDITION: condition}, now):
            return "conflict"
        etype, reason, message = rebalance_event(condition)
        if etype == "Warning":
            log.warning("autotune %s/%s: %s: %s", inf.namespace, inf.name, reason, message)
        await self._event(client, inf, etype, reason, message)
        return f"rebalance:{condition[1]}"

    async def _rerender(self, client: KubeClient, inf: MoEInference) -> None:
        """Have the reconciler render the children from the resource as stored now: a status change
        does not trigger kopf's update handlers (idempotent; resume and resync would also do it)."""
        fresh = await client.get(API, KIND, inf.namespace, inf.name)
        if fresh is not None:
            await self.host.reconcile(fresh)

    async def _view(self, client: KubeClient, inf: MoEInference, *, target: Knobs | None = None,
                    since: float | None = None) -> tuple[ro.WorkloadView, list[dict]]:
        return await workload_view(client, inf, crashloop_restarts=self.settings.crashloop_restarts,
                                   to_clock=self.settings.to_clock, to_wall=self.settings.clock.to_wall,
                                   target=target, since=since)

    # --- a rollout in progress -------------------------------------------------------------------

    async def advance_rollout(self, client: KubeClient, inf: MoEInference, now: float) -> str | None:
        """Read the workload (and, when due, the new pods' balancedness) and let
        :func:`.rollout.advance` decide the rollout's next step; write it."""
        state, cfg = inf.status, inf.autotune
        cur = state.rollout
        assert cur is not None
        target = cur.to_knobs if cur.kind == "apply" else None
        since = _crash_evidence_since(cur)
        view, pods = await self._view(client, inf, target=target, since=since)
        stale = (cur.phase == ROLLING and view.template_hash == cur.from_hash) or (
            cur.phase == ROLLING_BACK and cur.to_hash and view.template_hash == cur.to_hash)
        if stale and ro.superseded_reason(cur, view) is None:
            await self._rerender(client, inf)  # the template still shows the settings before the change
            view, pods = await self._view(client, inf, target=target, since=since)
        measured = None
        window = ro.measurement_window(cfg, state, now, view.newest_replica_at)
        if window is not None and not view.crashlooping:
            measured = await self.load_observer.measure(inf, pods, *window)
            measured = await self._objective_after(inf, cur, pods, window, measured)
        timeout = ro.rollout_timeout_s(cfg, stop_seconds=termination_grace_seconds(inf), replicas=inf.replica_groups,
                                       max_surge=inf.rollout.max_surge, max_unavailable=inf.rollout.max_unavailable)
        step = ro.advance(cfg, state, view, now=now, measured=measured, timeout_s=timeout)
        log.debug("autotune %s/%s: rollout %s, %s, measured %s", inf.namespace, inf.name, cur.phase, view, measured)
        if not step.changed:
            return None
        if not await self._write(client, inf, step.status, step.conditions, now):
            return "conflict"
        for etype, reason, message in step.events:
            await self._event(client, inf, etype, reason, message)
        if step.rollback_reason:
            opmetrics.record_rollback(inf.namespace or "default", inf.name, step.rollback_reason)
        new_ro = step.status.rollout
        if self.settings.observer:
            self.settings.observer("rollout" if new_ro is not None else "history", inf,
                                   new_ro if new_ro is not None else step.status.history[-1])
        return f"rollout:{new_ro.phase if new_ro is not None else step.status.history[-1].action}"

    def _objective_before(self, inf: MoEInference, trace: LoadTrace | None) -> dict | None:
        """The objective's buckets of the load read for the evaluation (the time before a change)."""
        if trace is None:
            return None
        buckets = stats.buckets_of_trace(trace, gpus_per_engine=_gpus_per_engine(inf))
        return stats.buckets_record(buckets) if buckets else None

    async def _objective_after(self, inf: MoEInference, cur: Rollout, pods: list[dict],
                               window: tuple[float, float], measured: Measurement | None) -> Measurement | None:
        """``measured`` with the change's gain on the objective across time (one replica, or every
        replica at once): the buckets before the change (recorded with the rollout) against those of
        the judging window, normalised by the offered load, with its interval."""
        before = stats.buckets_from_record(cur.objective_before)
        if not before:
            return measured
        try:
            trace, _ = await self.load_observer.read_load(inf, window[0], window[1], pods)
        except LoadUnavailable as exc:
            log.info("autotune %s/%s: the objective after the change: %s", inf.namespace, inf.name, exc)
            return measured
        after = stats.buckets_of_trace(trace, gpus_per_engine=_gpus_per_engine(inf))
        est = stats.before_after_estimate(before, after, inf.autotune.experiments.confidence)
        if est is None:
            return measured
        return dataclasses.replace(measured or Measurement(), objective=est.objective, estimate=round(est.estimate, 6),
                                   ci_low=round(est.ci_low, 6), ci_high=round(est.ci_high, 6), dof=est.dof)

    # --- an experiment in progress ----------------------------------------------------------------

    async def advance_experiment(self, client: KubeClient, inf: MoEInference, now: float) -> str | None:
        """Read the arms (their pods, and while both serve one more bucket of the objective) and let
        :func:`.experiment.advance` decide the experiment's next step; write it. Returns
        ``experiment:<phase>`` on a change of phase, ``experiment:<verdict>`` when it is decided,
        ``experiment:done`` when it ended."""
        state, cfg = inf.status, inf.autotune
        exp = state.experiment
        assert exp is not None
        view, pods = await self._view(client, inf, since=exp.started_at)
        arms = experiment_arms(inf, pods, view.crashlooping)
        engine_pods = tuple(sorted(arms.trial_ready + arms.control_ready))
        superseded = None
        if not inf.eplb.enabled:
            superseded = "spec.eplb.enabled was set to false"
        elif exp.spec_eplb is not None and exp.spec_eplb != inf.spec_knobs:
            superseded = f"spec.eplb changed ({dec.describe(exp.spec_eplb)} -> {dec.describe(inf.spec_knobs)})"
        aview = exm.ArmsView(replicas=int(inf.replica_groups), trial_ready=len(arms.trial_ready),
                             control_ready=len(arms.control_ready), trial_crashlooping=arms.trial_crashlooping,
                             settled=_arms_settled(inf, view, arms), superseded=superseded,
                             trial_node=_node_of(pods, arms.trial_ready[0]) if arms.trial_ready else None,
                             engine_pods=engine_pods)
        key = (inf.namespace or "default", inf.name)
        tracker = self.arm_trackers.get(key)
        if tracker is None or tracker.started_at != exp.started_at:
            tracker = self.arm_trackers[key] = arms_mod.ArmTracker(started_at=exp.started_at)
        bucket, baseline = await self._arm_buckets(inf, exp, pods, engine_pods, arms, tracker, now)
        observations = _observations(exp, tracker, now)
        learned = _learned(inf, exp, tracker, now, self.last_calibration.get(key))
        step = exm.advance(cfg, state, aview, now=now, bucket=bucket, observations=observations,
                           learned=tuple(dataclasses.asdict(r) for r in learned), baseline=baseline)
        if step.live:  # an interleaved experiment's block, promotion or return: applied before it is recorded
            done = [(req, await self._apply_block(client, inf, pods, req)) for req in step.live]
            step = exm.applied(step, [(req, o.ok, o.reason) for req, o in done], now=now)
            running = inf.running_knobs
            for req, o in done:  # a promotion applied live: recorded as any live change (pods that restart keep it)
                if req.block is None and o.ok and req.knobs != running:
                    step.status = dec.record_live(step.status, now=now, current=running, target=req.knobs,
                                                  config_hash=inf.effective.config_hash(), step=o.step,
                                                  steps=o.steps, reason=req.why)
                    step.changed = True
        if not step.changed:
            return None
        if step.verdict is not None and learned:  # the tick the verdict is reached
            step.status = step.status.with_learned(learned_entries(learned))  # kept for later decisions
        if not await self._write(client, inf, step.status, step.conditions, now):
            return "conflict"
        for etype, reason, message in step.events:
            await self._event(client, inf, etype, reason, message)
        new = step.status.experiment
        if self.settings.observer:
            self.settings.observer("experiment", inf, new if new is not None else step.status.experiments[-1])
            if new is None and step.status.history != state.history:  # a promotion: the change is kept
                self.settings.observer("history", inf, step.status.history[-1])
        if new is None:
            self.arm_trackers.pop(key, None)
            return "experiment:done"
        if step.verdict is not None:
            return f"experiment:{step.verdict}"
        return f"experiment:{new.phase}" if new.phase != exp.phase else "experiment:bucket"

    async def _arm_buckets(self, inf: MoEInference, exp, pods: list[dict], engine_pods: tuple[str, ...], arms,
                           tracker: arms_mod.ArmTracker, now: float):
        """One round of the arms' pods: ``(the (trial, control) bucket, the pre-period's buckets by
        node)``. Cross-pod: the trial's pods against the control's while Running; in the pre-period
        every engine pod against the others, keyed by the node it runs on. Interleaved: the
        replica groups by the block in force."""
        if exp.phase not in (RUNNING, BASELINE):
            return None, None
        names = set(engine_pods)
        targets = [p for p in pods if p["metadata"]["name"] in names]
        counters = await asyncio.to_thread(arms_mod.scrape_arm_counters, targets, self.settings.http_timeout)
        gpus = _gpus_per_engine(inf)
        if exp.design == INTERLEAVED:
            trial, control = il.arms_now(exp)
            if not trial:
                tracker.previous, tracker.previous_time = dict(counters), now
                return None, None
            return tracker.bucket(now, counters, list(trial), list(control), gpus_per_replica=gpus), None
        if exp.phase == BASELINE:
            each = tracker.each_against_rest(now, counters, list(engine_pods), gpus_per_replica=gpus)
            return None, {_node_of(pods, pod) or pod: pair for pod, pair in each.items()}
        return tracker.bucket(now, counters, list(arms.trial_ready), list(arms.control_ready),
                              gpus_per_replica=gpus), None

    async def _apply_block(self, client: KubeClient, inf: MoEInference, pods: list[dict],
                           req: exm.LiveRequest) -> live.LiveOutcome:
        """Apply ``req`` (window and interval on some engine pods: an interleaved experiment's block,
        its promotion or its return) through the live apply (:func:`moe_eplb.controller.live.apply_live`),
        from what those pods' ranks run now (the other arm's settings, or the same)."""
        targets = live.live_pods(inf, _group_pods(pods, req.pods))
        token = await control.read_token(client, inf.namespace or "default", inf.name)
        if not token:
            return live.LiveOutcome(False, None, "the control Secret is missing (the next reconcile makes it)")
        try:
            return await live.apply_live(targets, token, req.knobs, None)
        except Exception as exc:  # noqa: BLE001 - any failure ends the experiment with the running settings
            return live.LiveOutcome(False, None, f"{type(exc).__name__}: {exc}")

    def _interleave_planner(self, inf: MoEInference, got: _Gathered):
        """``(target, current) -> schedule or why not`` for :func:`.decisions.evaluate`: the
        interleaved design where the engines take the change live (:func:`moe_eplb.controller.live.live_capable`)
        and blocks of the slower arm fit in ``maxSeconds`` (:func:`.interleaved.plan`)."""
        why = live.live_capable(inf)
        w = got.data_window
        span = (w.end - w.start) if w is not None and w.start is not None and w.end is not None else 0.0
        rate = (w.steps or 0) / span if w is not None and span > 0 else 0.0
        names = tuple(p["metadata"]["name"] for p in got.pods if _pod_ready(p) and (
            (p["metadata"].get("labels") or {}).get(k8s_names.LWS_WORKER_INDEX_LABEL, "0") == "0"))
        tick = self.settings.tick_seconds * self.settings.scale

        def plan(target: Knobs, current: Knobs) -> dict | str:
            if why is not None:
                return why
            return il.plan(target, current, pods=names, steps_per_second=rate, tick_s=tick,
                           max_s=inf.autotune.experiments.max_s)

        return plan

    # --- an evaluation ---------------------------------------------------------------------------

    async def evaluate(self, client: KubeClient, inf: MoEInference, now: float, *,
                       shift: Shift | None = None) -> str | None:
        """Read the load, tune, and let :func:`.decisions.evaluate` decide; write the evaluation. A
        change of window and interval the decision applies live is carried out here (:mod:`.live`)
        and recorded only once every EP rank confirmed it. ``shift``: a workload shift the watch saw
        (:mod:`.shift`): the load is read from the shift on."""
        if not inf.effective.enabled:
            off_by_tuner = inf.effective.source == "autotune"
            reason = (EPLB_OFF_BY_TUNER if off_by_tuner else
                      "spec.eplb.enabled is false: nothing to tune (enable EPLB to tune it)")
            ev = Evaluation(time=now, current=inf.effective.knobs, decision=dec.KEEP, reason=reason)
            condition = ("True", "EplbOff", reason) if off_by_tuner else ("False", "EplbDisabled", reason)
            if await self._write(client, inf, inf.status.replace(last_evaluation=ev), {"Tuned": condition}, now):
                return f"evaluation:{dec.KEEP}"
            return "conflict"
        if inf.fault_tolerance.enabled:  # vLLM >= 0.34 stops EPLB after a scale_down: pause
            _, pods = await self._view(client, inf)
            # the operator's own record first (status.faultTolerance), then vLLM's log line (a scale_down
            # another orchestrator sent)
            paused = tuning_pause(inf) or await self.scale_down_watch.paused(client, inf, pods,
                                                                             self.settings.clock.to_wall(now))
            if paused is not None:
                ev = Evaluation(time=now, current=inf.effective.knobs, decision=dec.KEEP, reason=paused)
                if await self._write(client, inf, inf.status.replace(last_evaluation=ev),
                                     {"Tuned": ("False", SCALE_DOWN_PAUSED, paused)}, now):
                    return f"evaluation:{dec.KEEP}"
                return "conflict"
        got = await self._gather(client, inf, now, since=shift.at if shift is not None else None)
        got.shift = shift
        if shift is not None and got.load_error is not None and got.load_error[0] == "TooLittleData":
            # the load since the shift is still too short to tune on (the step rate the wait assumed
            # was higher): no evaluation yet; the shift stays pending and is tried again once the
            # steps at the rate seen since it should be there (the regular evaluation comes anyway)
            have = got.trace.total_steps if got.trace is not None else 0
            buckets = got.trace.num_buckets if got.trace is not None else 0
            rate = have / max(now - shift.at, 1e-9)
            again = (self.settings.min_steps - have) / rate if rate > 0 else inf.autotune.evaluation_interval_s / 3.0
            again = max(again, (MIN_TUNE_BUCKETS - buckets) * self.load_observer.bucket_seconds())
            retry_at = now + max(again, self.settings.tick_seconds * self.settings.scale)
            self.shift_retry[(inf.namespace or "default", inf.name)] = retry_at
            return None
        # the decision's time: reading and tuning took a while, and a rollout it starts is timed from here
        now = self.now()
        out, ev = await self._decide(client, inf, got, now)
        if out.live is not None:
            out, ev = await self._apply_live(client, inf, got, out, ev)
            now = self.now()
        if shift is not None:
            ev = dataclasses.replace(ev, reason=f"{shift.describe()}; evaluated on the load since: {ev.reason}")
        if shift is not None or out.decision in (dec.APPLY, dec.EXPERIMENT):
            # a change moves balancedness by itself, and a shift evaluated on is the new normal:
            # watch from here (an evaluation that changes nothing keeps the history)
            self._shift_watch(inf).reset(now)
        applied = out.live is not None and out.decision == dec.APPLY
        if not await self._write(client, inf, out.status.replace(last_evaluation=ev), out.conditions, now):
            if not applied:
                return "conflict"
            # the engines run the new values: record them on the resource as it is now, whatever changed
            if not await self._record_live_again(client, inf, out.status, ev, out.conditions, now):
                log.error("autotune %s/%s: the live change %s runs on the engines but could not be recorded",
                          inf.namespace, inf.name, dec.describe(out.live))
                return "conflict"
        if applied and self.settings.observer:
            self.settings.observer("live", inf, out.status.live_changes[-1])
        for etype, reason, message in out.events:
            if etype == "Warning":
                log.warning("autotune %s/%s: %s: %s", inf.namespace, inf.name, reason, message)
            await self._event(client, inf, etype, reason, message)
        if out.live is not None and out.decision == dec.APPLY:
            await self._event(client, inf, "Normal", "AppliedLive", out.reason)
        opmetrics.record_evaluation(inf.namespace or "default", inf.name, decision=out.decision,
                                    predicted_gain=out.predicted_gain, tuner_seconds=got.tuner_seconds, now=now)
        if ev.calibration is not None:
            opmetrics.record_calibration(inf.namespace or "default", inf.name, ev.calibration)
        if self.settings.observer:
            self.settings.observer("evaluation", inf, ev)
        return "evaluation:ApplyLive" if out.live is not None and out.decision == dec.APPLY else \
            f"evaluation:{out.decision}"

    async def _record_live_again(self, client: KubeClient, inf: MoEInference, status: AutotuneStatus,
                                 ev: Evaluation, conditions: dec.Conditions, now: float, tries: int = 3) -> bool:
        """The status write of a confirmed live change failed with a conflict: write its records
        (``live``, the new ``liveChanges`` entry, the evaluation) over the resource as stored now."""
        for _ in range(tries):
            fresh = await client.get(API, KIND, inf.namespace, inf.name)
            if fresh is None:
                return False
            cur = parse(fresh)
            merged = cur.status.with_live_change(status.live_changes[-1]).replace(live=status.live, last_evaluation=ev)
            if await self._write(client, cur, merged, conditions, now):
                return True
        return False

    def _shift_watch(self, inf: MoEInference) -> ShiftWatch:
        key = (inf.namespace or "default", inf.name)
        watch = self.shift_watches.get(key)
        if watch is None:
            sample = max(self.settings.tick_seconds, inf.autotune.evaluation_interval_s / 10.0)
            watch = self.shift_watches[key] = ShiftWatch(ShiftSettings(
                sample_seconds=sample, min_read_seconds=self.load_observer.min_read_seconds()))
        return watch

    async def _watch_shift(self, inf: MoEInference, now: float) -> Shift | None:
        """Between evaluations: one more balancedness window when due (:mod:`.shift`); the shift to
        evaluate on once one showed and the load since it holds enough engine steps for the tuner
        (``min_steps`` at the rate measured before it) in the tuner's least buckets, else None."""
        watch = self._shift_watch(inf)
        start = watch.due(now)
        if start is not None and watch.pending is None:
            _, pods = await self._view(self.host.client, inf)
            # from Prometheus, windows the loop missed while busy are measured after the fact (the
            # grid stays sample_seconds wide); scraping the pods, only the window up to now can be
            ends = watch.window_ends(start, now) if inf.prometheus_url else [now]
            for end in ends:
                measured = await self.load_observer.measure(inf, pods, *watch.read_window(start, end))
                shift = watch.add(start, end, measured.balancedness if measured is not None else None)
                start = end
                if shift is not None:
                    log.info("autotune %s/%s: %s", inf.namespace, inf.name, shift.describe())
                    break
        shift = watch.pending
        if shift is None:
            return None
        last = inf.status.last_evaluation
        steps = last.data_window.steps if last is not None and last.data_window is not None else None
        span = (last.data_window.end - last.data_window.start) if steps and last.data_window.end and \
            last.data_window.start else None
        rate = steps / span if steps and span else None
        wait = self.settings.min_steps / rate if rate else inf.autotune.evaluation_interval_s / 3.0
        # and the tuner's least buckets, one more for the read's edges
        wait = max(wait, (MIN_TUNE_BUCKETS + 1) * self.load_observer.bucket_seconds())
        retry = self.shift_retry.get((inf.namespace or "default", inf.name), 0.0)
        return shift if now - shift.at >= wait and now >= retry else None

    async def _apply_live(self, client: KubeClient, inf: MoEInference, got: _Gathered, out: dec.Evaluated,
                          ev: Evaluation) -> tuple[dec.Evaluated, Evaluation]:
        """Carry out a live change the decision made (:func:`.live.apply_live`) and record it when
        every EP rank confirmed; else the evaluation says why: a deferral (tried again at the next
        evaluation), or -- where the pods cannot take it live at all -- the same change as a restart."""
        target, current = out.live, inf.running_knobs
        assert target is not None
        token = await control.read_token(client, inf.namespace or "default", inf.name)
        outcome = await live.apply_live(live.live_pods(inf, got.pods), token or "", target, current) if token \
            else live.LiveOutcome(False, None, "the control Secret is missing (the next reconcile makes it)")
        now = self.now()
        if outcome.ok:
            status = dec.record_live(out.status, now=now, current=current, target=target,
                                     config_hash=inf.effective.config_hash(), step=outcome.step, steps=outcome.steps,
                                     reason=out.reason)
            out.status, out.reason = status, f"{out.reason}: {outcome.reason}"
            out.conditions["Tuned"] = ("True", "AppliedLive", out.reason)
        elif outcome.unsupported:
            log.info("autotune %s/%s: live apply not possible (%s); the change restarts the pods instead",
                     inf.namespace, inf.name, outcome.reason)
            out, ev = await self._decide(client, inf, got, now, live_problem=outcome.reason)
            return out, ev
        else:
            out.decision = dec.DEFER
            out.reason = f"{out.reason}; the live change failed, retried at the next evaluation: {outcome.reason}"
            out.conditions["Tuned"] = ("True", "Deferred", out.reason)
            out.events.append(("Warning", "LiveApplyFailed", outcome.reason))
            out.live = None
        ev = dataclasses.replace(ev, decision=out.decision, reason=out.reason,
                                 apply_mode=dec.LIVE if outcome.ok else None)
        out.status = out.status.replace(last_evaluation=ev)
        return out, ev

    async def _gather(self, client: KubeClient, inf: MoEInference, now: float, *,
                      since: float | None = None) -> _Gathered:
        """The evaluation's inputs: the workload (a group recreated over and over since the last
        evaluation crash-loops, not merely "not ready"), the load, the tuner's answer on it and, when
        the answer may be applied, the balancedness measured now (the baseline)."""
        rt, cfg = self.settings, inf.autotune
        view, pods = await self._view(client, inf, since=now - cfg.evaluation_interval_s)
        got = _Gathered(view=view, blocker=_blocker(view), pods=pods)
        start = now - rt.lookback_seconds if since is None else max(since, now - rt.lookback_seconds)
        try:
            got.trace, got.data_window = await self.load_observer.read_load(inf, start, now, pods)
            if got.trace.total_steps < rt.min_steps or got.trace.num_buckets < MIN_TUNE_BUCKETS:
                raise LoadUnavailable("TooLittleData", f"{got.trace.total_steps} engine steps in "
                                      f"{got.trace.num_buckets} bucket(s) of the last {now - start:.0f}s; need at "
                                      f"least {rt.min_steps} in {MIN_TUNE_BUCKETS}")
        except LoadUnavailable as exc:
            got.load_error = (exc.reason, exc.message)
        if got.load_error is None and got.trace is not None:
            t0 = time.process_time()
            try:
                got.result, got.calibration = await self.tune(got.trace, inf, inf.running_knobs)
                if got.calibration is not None:
                    self.last_calibration[(inf.namespace or "default", inf.name)] = (got.calibration, got.result.cost)
                got.answer = dec.TunerAnswer.of(got.result)
            except Exception as exc:  # TuneError or a bug in the search: no change, say why
                got.tune_error = f"{type(exc).__name__}: {exc}"
            got.tuner_seconds = time.process_time() - t0
        if got.result is not None and int(inf.replicas or 1) >= 2 and since is None:
            # (not on a shift: that evaluation answers the shift on the short load since it, where
            # the replicas' divergence is noise; the regular evaluations check it)
            got.replicas = await self.per_replica(inf, start, now, pods, got.result)
        if got.answer is not None and cfg.mode == "Apply" and got.blocker is None:
            since = max(start, now - cfg.evaluation_interval_s)
            got.baseline = await self.load_observer.measure(inf, pods, since, now)
        return got

    async def per_replica(self, inf: MoEInference, start: float, now: float, pods: list[dict],
                          shared: TuneResult) -> PerReplica | None:
        """The replicas' own loads over the evaluation's window: their Jensen-Shannon divergence (the
        ``moe_eplb_replica_load_divergence_bits`` gauge) and, above :data:`DIVERGENCE_THRESHOLD`, each
        replica tuned on its own load with the shared evaluation's cost model, scored against the shared
        pick (:func:`moe_eplb.eplb.tuning.replicas.tune_per_replica`). None with fewer than two replicas
        read, or when per-replica tuning fails (logged; the shared decision stands)."""
        ns = inf.namespace or "default"
        traces = await self.load_observer.read_replica_traces(inf, start, now, pods)
        shapes = {t.load.shape[1:] for t in traces.values()}
        if len(traces) < 2 or len(shapes) != 1:
            opmetrics.record_divergence(ns, inf.name, None)
            return None
        search = replace(self.settings.search, min_steps=1)
        par, shape = inf.parallelism, inf.moe_shape
        topo = dict(ep_size=par.ep_size, num_nodes=max(1, int(par.nodes or 1)), num_groups=int(shape.num_expert_groups or 1))

        def run() -> PerReplica:
            return tune_per_replica(
                traces, shared.recommendation,
                tune=lambda tr: run_tuner(tr, inf, inf.effective.knobs, search, cost=shared.cost),
                score=lambda tr, k: replay_score(tr, k, cost=shared.cost, segments=search.segments, **topo))
        try:
            per = await asyncio.to_thread(run)
        except Exception as exc:  # noqa: BLE001 - per-replica advice must never stop an evaluation
            log.warning("autotune %s/%s: per-replica tuning failed: %s: %s", ns, inf.name, type(exc).__name__, exc)
            return None
        opmetrics.record_divergence(ns, inf.name, per.divergence)
        return per

    async def tune(self, trace: LoadTrace, inf: MoEInference, current: Knobs) -> tuple[TuneResult, Calibration | None]:
        """The tuner on the trace, with the cost model calibrated from its telemetry (in a thread:
        CPU-bound)."""
        return await asyncio.to_thread(run_calibrated_tuner, trace, inf, current,
                                       replace(self.settings.search, live=live.live_capable(inf) is None))

    async def _decide(self, client: KubeClient, inf: MoEInference, got: _Gathered,
                      now: float, *, live_problem: str | None = None) -> tuple[dec.Evaluated, Evaluation]:
        """:func:`.decisions.evaluate` on what was gathered (and the autoscaler's state when the answer
        may be applied); the evaluation record with who evaluated, the tuner's CPU time and, with an
        autoscaler, the replica costs."""
        cfg, current, answer = inf.autotune, inf.running_knobs, got.answer
        scaling = await read_scaling(client, inf, got.view, self.settings.to_clock) \
            if answer is not None and cfg.mode == "Apply" else None
        out = dec.evaluate(cfg, inf.status, now=now, generation=inf.generation, current=current,
                           spec_eplb=inf.spec_knobs, data_window=got.data_window, load_error=got.load_error,
                           answer=answer, tune_error=got.tune_error, workload_blocker=got.blocker,
                           baseline=got.baseline, from_hash=got.view.template_hash,
                           calibration=dec.calibration_record(got.calibration) if got.calibration is not None else None,
                           scaling=scaling, replicas=int(inf.replica_groups),
                           objective_before=self._objective_before(inf, got.trace) if cfg.mode == "Apply" else None,
                           live_problem=live_problem or live.live_capable(inf),
                           live_wait=live.live_wait(inf.status, now, got.trace),
                           interleave=self._interleave_planner(inf, got))
        replica_costs: tuple = ()
        if answer is not None and got.result is not None and got.trace is not None and inf.autoscaling is not None:
            replica_costs = dec.replica_costs(got.result, kv_capacity(inf, got.trace, current),
                                              num_moe_layers=inf.moe_shape.num_moe_layers,
                                              bytes_per_expert=inf.moe_shape.bytes_per_expert,
                                              ep_size=inf.parallelism.ep_size)
        ev = dataclasses.replace(out.status.last_evaluation, evaluated_by=self.actor,
                                 tuner_cpu_seconds=round(got.tuner_seconds, 3) if got.tuner_seconds is not None else None,
                                 replica_costs=replica_costs,
                                 replicas=dec.replicas_record(got.replicas) if got.replicas is not None else None)
        event = dec.replicas_event(got.replicas, inf.status.last_evaluation, cfg.min_gain)
        if event is not None:
            out.events.append(event)
        return out, ev

    # --- writing ---------------------------------------------------------------------------------

    async def _write(self, client: KubeClient, inf: MoEInference, status: AutotuneStatus,
                     conditions: dec.Conditions, now: float) -> bool:
        """One conditional status patch; False on a 409 (the resource changed: redo on fresh data)."""
        patch: dict[str, Any] = {"autotune": autotune_status_patch(inf.status, status)}
        if conditions:
            patch["conditions"] = dec.set_conditions(list(inf.conditions), conditions, now=now, generation=inf.generation)
        if not await client.patch_status(API, KIND, inf.namespace, inf.name, patch,
                                         resource_version=inf.resource_version):
            log.info("autotune: %s/%s changed meanwhile (or is gone); retrying next tick", inf.namespace, inf.name)
            return False
        return True

    async def _event(self, client: KubeClient, inf: MoEInference, etype: str, reason: str, message: str) -> None:
        await client.try_post_event(inf.object_ref, type=etype, reason=reason, message=message)


# --- pure helpers and the tuner call -------------------------------------------------------------


@dataclass(frozen=True)
class _Arms:
    """An experiment's engine pods by arm: ready pods (one per replica; a group's leader) running
    the trial's / the control's settings, and the trial's crash-looping pods."""

    trial_ready: tuple[str, ...]
    control_ready: tuple[str, ...]
    trial_crashlooping: tuple[str, ...]


def experiment_arms(inf: MoEInference, pods: list[dict], crashlooping: tuple[str, ...]) -> _Arms:
    """The arms of ``inf``'s experiment among its pods, by each pod's config-hash annotation."""
    exp = inf.status.experiment
    assert exp is not None
    trial_hash, control_hash = trial_settings(inf, exp).config_hash(), control_settings(inf, exp).config_hash()
    trial, control, trial_all = [], [], set()
    for p in pods:
        meta = p.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        h = (meta.get("annotations") or {}).get(k8s_names.CONFIG_HASH_ANNOTATION)
        if h == trial_hash:
            trial_all.add(meta["name"])
        leader = (meta.get("labels") or {}).get(k8s_names.LWS_WORKER_INDEX_LABEL, "0") == "0"
        if not leader or not _pod_ready(p):
            continue
        if h == trial_hash:
            trial.append(meta["name"])
        elif h == control_hash:
            control.append(meta["name"])
    crash = tuple(n for n in crashlooping if n in trial_all or (trial_hash != control_hash and n not in control))
    return _Arms(tuple(sorted(trial)), tuple(sorted(control)), crash)


def _group_pods(pods: list[dict], engines: tuple[str, ...]) -> list[dict]:
    """The pods of the engines named by their engine pod (a Deployment's pod, or a LeaderWorkerSet
    group's leader): a group's settings change on all of its pods' ranks."""
    names = set(engines)

    def group(p: dict) -> str | None:
        return ((p.get("metadata") or {}).get("labels") or {}).get(k8s_names.LWS_GROUP_KEY_LABEL)

    keys = {group(p) for p in pods if p["metadata"]["name"] in names} - {None}
    return [p for p in pods if p["metadata"]["name"] in names or (group(p) is not None and group(p) in keys)]


def _node_of(pods: list[dict], name: str) -> str | None:
    """The node pod ``name`` runs on (``spec.nodeName``; None: not scheduled or unknown)."""
    for p in pods:
        if p["metadata"]["name"] == name:
            return (p.get("spec") or {}).get("nodeName") or None
    return None


def _gpus_per_engine(inf: MoEInference) -> int:
    return inf.parallelism.gpus_per_pod * max(1, int(inf.parallelism.nodes or 1))


def _pod_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _arms_settled(inf: MoEInference, view: ro.WorkloadView, arms: _Arms) -> bool:
    """Whether the arms have rolled out what they were rendered with: a Deployment's as usual; a
    LeaderWorkerSet held at a partition never counts as settled by the rollout's rule, so its
    groups are counted: every replica group has a ready leader on the trial's or the control's
    settings."""
    if int(inf.parallelism.nodes or 1) == 1:
        return view.settled
    return view.template_hash is not None and len(arms.trial_ready) + len(arms.control_ready) >= int(inf.replicas)


def _observations(exp, tracker: arms_mod.ArmTracker, now: float) -> dict | None:
    """The two arms' observations so far (stored with the experiment when it is decided)."""
    if not tracker.trial:
        return None
    since = exp.ready_at if exp.ready_at is not None else exp.started_at
    seconds = max(0.0, now - since)
    obs = {arm.arm: exm.observation_dict(arms_mod.observation(arm.knobs, buckets, pods=arm.replicas, seconds=seconds))
           for arm, buckets in ((exp.trial, tracker.trial), (exp.control, tracker.control))}
    return obs


def _learned(inf: MoEInference, exp, tracker: arms_mod.ArmTracker, now: float,
             calibrated: tuple[Calibration, CostModel] | None) -> list[LearnedRange]:
    """The ranges the experiment's arms narrow against the calibration it was started from
    (:func:`.experiment.learned_ranges`); [] without that calibration or before both arms served."""
    if calibrated is None or not tracker.trial or not tracker.control:
        return []
    since = exp.ready_at if exp.ready_at is not None else exp.started_at
    seconds = max(0.0, now - since)
    trial = arms_mod.observation(exp.trial.knobs, tracker.trial, pods=exp.trial.replicas, seconds=seconds)
    control = arms_mod.observation(exp.control.knobs, tracker.control, pods=exp.control.replicas, seconds=seconds)
    shape, ep = inf.moe_shape, inf.parallelism.ep_size
    per_r = (shape.num_moe_layers * shape.bytes_per_expert / ep
             if shape.num_moe_layers and shape.bytes_per_expert and ep else None)
    return exm.learned_ranges(*calibrated, trial, control, source=f"experiment {dec.describe(exp.trial.knobs)} "
                              f"started at {exp.started_at:.0f}", bytes_per_redundant_expert=per_r)


def _crash_evidence_since(cur: Rollout) -> float | None:
    """From when a group recreation counts against the rollout's pods: the rollback's start while
    rolling back (the crashes that caused it are the new settings' ones), else the rollout's."""
    if cur.phase == ROLLING_BACK and cur.rollback_started_at is not None:
        return cur.rollback_started_at
    return cur.started_at


def _blocker(view: ro.WorkloadView) -> str | None:
    if view.template_hash is None:
        return "the workload does not exist yet"
    if not view.settled:
        return "pods are rolling or not all ready"
    if view.crashlooping:
        return f"pods are crash-looping ({', '.join(view.crashlooping[:3])})"
    return None


def kv_capacity(inf: MoEInference, trace: LoadTrace, current: Knobs) -> KvCapacity | None:
    """Today's KV cache from the trace's telemetry (:func:`moe_eplb.eplb.replay.capacity.capacity_from_trace`)
    at the autoscaler's target usage (its KVCacheUsage target, else a full cache)."""
    auto = inf.autoscaling
    target = auto.metric.target if auto is not None and auto.metric.type == "KVCacheUsage" else 1.0
    return capacity_from_trace(trace, replicas=inf.replicas, redundant=current.num_redundant_experts, target=target)


def learned_ranges(status: AutotuneStatus | None) -> list[LearnedRange]:
    """``status.autotune.learned`` as the calibration takes it (:class:`LearnedRange`); an entry
    without its prior ends keeps its own range as the prior."""
    if status is None:
        return []
    return [LearnedRange(e.parameter, e.low, e.high, e.low if e.prior_low is None else e.prior_low,
                         e.high if e.prior_high is None else e.prior_high, e.source or "")
            for e in status.learned]


def learned_entries(ranges: list[LearnedRange]) -> tuple[LearnedParameter, ...]:
    """What :func:`moe_eplb.eplb.tuning.learn.learn` returned, as ``status.autotune.learned`` entries (keep
    them with :meth:`AutotuneStatus.with_learned`)."""
    return tuple(LearnedParameter(r.parameter, r.low, r.high, r.prior_low, r.prior_high, r.source) for r in ranges)


def calibrate_for(trace: LoadTrace, inf: MoEInference) -> Calibration | None:
    """The cost model calibrated from the trace's telemetry (:func:`moe_eplb.eplb.tuning.calibrate.calibrate`),
    with the ranges earlier experiments learned (``status.autotune.learned``), or None when the trace
    has none or the calibration fails (the constants are used then)."""
    if trace.telemetry is None:
        return None
    try:
        return calibrate(trace, cost=overlap_context(inf).apply(CostModel(bytes_per_expert=inf.moe_shape.bytes_per_expert)),
                         num_nodes=max(1, int(inf.parallelism.nodes or 1)),
                         num_groups=int(inf.moe_shape.num_expert_groups or 1),
                         learned=learned_ranges(inf.status))
    except Exception as exc:  # noqa: BLE001 - calibration is an improvement, never a reason not to tune
        log.warning("autotune %s/%s: calibration failed, using the cost model's constants: %s: %s",
                    inf.namespace, inf.name, type(exc).__name__, exc)
        return None


def run_calibrated_tuner(trace: LoadTrace, inf: MoEInference, current: Knobs,
                         search: TuneOptions) -> tuple[TuneResult, Calibration | None]:
    """Calibrate on the trace's telemetry (when it has some), then tune with that cost model, the
    decision held over the ranges of what the telemetry cannot pin down (CPU-bound; called in a
    thread)."""
    calibration = calibrate_for(trace, inf)
    cost = calibration.apply(CostModel()) if calibration is not None else CostModel()
    robust = calibration.robustness() if calibration is not None else None
    return run_tuner(trace, inf, current, search, cost=cost, robust=robust), calibration


def overlap_context(inf: MoEInference) -> OverlapContext:
    """The resource's shared-expert overlap (:func:`moe_eplb.eplb.tuning.overlap.context_for`): its catalog
    model, all2all backend (``spec.parallelism.all2allBackend`` or extraArgs), vLLM version and GPUs."""
    found = all2all_backend(inf)
    par = inf.parallelism
    return context_for(inf.model.name, found[0] if found else None, inf.engine.version,
                       gpu_resource_name=inf.engine.gpu_resource_name, nodes=max(1, int(par.nodes or 1)),
                       data_parallel=int(par.data or 1))


def run_tuner(trace: LoadTrace, inf: MoEInference, current: Knobs, search: TuneOptions, *,
              cost: CostModel = CostModel(), robust=None) -> TuneResult:
    """Run the tuner for a parsed MoEInference (CPU-bound; called in a thread): ``search`` (the
    operator's ladders and rules) with the resource's deployment filled in. EPLB off is always a
    candidate: :func:`.decisions.evaluate` applies it only with ``spec.autotune.allowDisable``."""
    shape, cfg = inf.moe_shape, inf.autotune
    options = replace(
        search,
        ep_size=inf.parallelism.ep_size,
        num_nodes=max(1, int(inf.parallelism.nodes or 1)),
        num_groups=int(shape.num_expert_groups or 1),
        memory_budget_bytes=cfg.memory_budget_bytes,
        bytes_per_expert=shape.bytes_per_expert,
        bounds=inf.tuner_bounds,  # the fault-tolerance floor is a hard lower end
        min_gain=cfg.min_gain,
        workers=1,
        replicas=inf.replica_groups,  # a trial runs on one of them (TuneResult.explore)
        overlap=overlap_context(inf),
    )
    return tune(trace, options, current=current, cost=cost, robust=robust)

