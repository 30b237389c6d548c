"""The closed tuning loop: a kopf timer per MoEInference (thin), and the I/O around the pure parts.

Every ``tick_seconds`` (wall) the timer of each MoEInference parses the resource once
(:func:`moe_eplb.api.spec.parse`) and runs :func:`tick`:

1. a rollout in progress (``status.autotune.rollout``) is advanced (:mod:`.rollout`): the child
   workloads and pods are read into a :class:`~.rollout.WorkloadView` (:func:`workload_view`: the
   Deployment, or for a multi-node resource the LeaderWorkerSet, its groups and their
   ``RecreateGroupOnPodRestart`` Events), the new pods' measured balancedness is read when the rollout is ready to
   be judged;
2. otherwise, when ``spec.autotune.mode`` is not ``Off`` and ``evaluationIntervalSeconds`` have
   passed since the last evaluation: the recent load is read (:mod:`moe_eplb.metrics`: Prometheus,
   or the pods directly when no Prometheus URL is set), the tuner searches within the spec's bounds
   and memory budget, and :func:`~.decisions.evaluate` decides (Keep / Recommend / Apply / Defer /
   NoData / Error);
3. the result is written to ``status.autotune`` (and the ``MetricsAvailable`` / ``Tuned``
   conditions) in ONE status patch conditional on the resource's ``resourceVersion``: a concurrent
   spec edit makes it fail with 409 and the tick is simply redone on fresh data. Events and the
   operator metrics (:mod:`.opmetrics`) follow a successful write only.

An operator restart therefore resumes from the resource alone. kopf peering makes only one of
several operator replicas run handlers, so only one acts.

The clock may be accelerated for the demo and tests (``AutotuneRuntime.clock``, e.g. a
:class:`moe_eplb.sim.engine.SimClock`): spec durations are in the clock's seconds, Prometheus is
queried in wall time (``clock.to_wall``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import kopf

from moe_eplb import k8s_names
from moe_eplb.api.autotune_status import (
    ROLLING,
    ROLLING_BACK,
    AutotuneStatus,
    DataWindow,
    Evaluation,
    Measurement,
    Rollout,
    autotune_status_patch,
    parse_iso,
)
from moe_eplb.api.knobs import Knobs
from moe_eplb.api.spec import MoEInference, SpecError, parse
from moe_eplb.controller import decisions as dec
from moe_eplb.controller import opmetrics
from moe_eplb.controller import rollout as ro
from moe_eplb.controller.k8s import ApiError
from moe_eplb.controller.status import workload_observed_generation
from moe_eplb.eplb.calibrate import Calibration, calibrate
from moe_eplb.eplb.capacity import KvCapacity, capacity_from_trace
from moe_eplb.eplb.costmodel import CostModel
from moe_eplb.eplb.trace import LoadTrace
from moe_eplb.eplb.tuner import MIN_TUNE_STEPS, TuneResult, tune
from moe_eplb.k8s_names import API, API_GROUP, API_VERSION, KIND, PLURAL
from moe_eplb.metrics import measure as measure_mod
from moe_eplb.metrics import reader
from moe_eplb.metrics.assemble import per_engine
from moe_eplb.metrics.errors import LoadReadError
from moe_eplb.metrics.promclient import PrometheusClient
from moe_eplb.metrics.scrape import PodScraper, targets_from_pods

log = logging.getLogger("moe_eplb.autotune")

#: The operator's search (a reduced ladder of the tuner's, 27 candidates, the 6 best of the screening
#: re-scored on every layer) on the last 30 minutes of load, sized so one core evaluates >= 200
#: resources every 5 minutes (bench/bench_autotune.py). Override with MOE_EPLB_AUTOTUNE_SEARCH=full
#: and MOE_EPLB_AUTOTUNE_LOOKBACK_SECONDS.
OPERATOR_SEARCH: dict[str, Any] = {
    "windows": (250, 1000, 4000),
    "intervals": (500, 2000, 8000),
    "max_redundancy_levels": 3,
    "segments": 4,
    "finalists": 6,
}


class LoadUnavailable(Exception):
    """The load could not be read or is not enough to tune on; ``reason`` is a condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


class WallClock:
    """The real clock (POSIX seconds); the default."""

    scale = 1.0

    @staticmethod
    def now() -> float:
        return time.time()

    @staticmethod
    def to_wall(t: float) -> float:
        return t


@dataclass
class _Direct:
    """Per-resource state of direct mode (no Prometheus): scrape rounds for the reader, rank
    counters for the judge."""

    scraper: PodScraper
    ranks: measure_mod.RankHistory = field(default_factory=measure_mod.RankHistory)
    last_collect: float | None = None  # clock time the pods were last listed
    pods: list = field(default_factory=list)  # as last listed: what the scrape loop scrapes
    touched: float = 0.0  # time.monotonic() of the last tick that wanted the loop
    task: asyncio.Task | None = None  # the scrape loop (:func:`_scrape_loop`)


@dataclass
class AutotuneRuntime:
    """Process-wide settings of the loop (the demo and tests replace parts of it).

    Attributes:
        clock: ``now()`` and ``to_wall(t)``; spec durations are in its seconds.
        tick_seconds: wall seconds between two ticks of one resource's timer.
        lookback_seconds: how much load history (clock seconds) the tuner sees.
        min_steps: fewer engine steps than this in the history -> ``NoData`` (too little data).
        search: keyword arguments for the tuner's search ladder.
        bucket_seconds: bucket length (clock seconds) of the load read for the tuner; also how
            often pods are scraped when there is no Prometheus.
        min_wall_bucket_seconds: floor of the bucket in wall seconds (>= 2 scrape intervals when
            the clock is accelerated).
        crashloop_restarts: restarts of a pod of the new template that count as a crash loop.
        observer: called with ``(kind, resource, record)`` after each successful write
            (``evaluation`` with the :class:`Evaluation`, ``history`` with a finished rollout's
            :class:`HistoryEntry`, ``rollout`` with a phase change's :class:`Rollout`) -- the demo
            prints these.
        http_timeout: seconds for a Prometheus or pod scrape request.
        prometheus_budget_seconds: wall seconds one read of the load (or one measurement) may spend
            on Prometheus, retries of transient errors included.
    """

    clock: Any = field(default_factory=WallClock)
    tick_seconds: float = 15.0
    lookback_seconds: float = 1800.0
    min_steps: int = MIN_TUNE_STEPS
    search: dict = field(default_factory=lambda: dict(OPERATOR_SEARCH))
    crashloop_restarts: int = 3
    observer: Callable[[str, MoEInference, Any], None] | None = None
    http_timeout: float = 10.0
    prometheus_budget_seconds: float = 30.0
    bucket_seconds: float = 15.0
    min_wall_bucket_seconds: float = 0.0
    _direct: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_env(cls) -> AutotuneRuntime:
        """Defaults, with ``MOE_EPLB_AUTOTUNE_TICK_SECONDS``, ``MOE_EPLB_AUTOTUNE_LOOKBACK_SECONDS``
        and ``MOE_EPLB_AUTOTUNE_SEARCH=full`` (the tuner's full ladder) applied."""
        rt = cls()
        if os.environ.get("MOE_EPLB_AUTOTUNE_TICK_SECONDS"):
            rt.tick_seconds = float(os.environ["MOE_EPLB_AUTOTUNE_TICK_SECONDS"])
        if os.environ.get("MOE_EPLB_AUTOTUNE_LOOKBACK_SECONDS"):
            rt.lookback_seconds = float(os.environ["MOE_EPLB_AUTOTUNE_LOOKBACK_SECONDS"])
        if os.environ.get("MOE_EPLB_AUTOTUNE_SEARCH") == "full":
            rt.search = {}
        return rt

    def direct(self, inf: MoEInference) -> _Direct:
        key = (inf.namespace or "default", inf.name)
        if key not in self._direct:
            self._direct[key] = _Direct(PodScraper(timeout=self.http_timeout, keep=2000))
        return self._direct[key]


_RUNTIME: AutotuneRuntime | None = None


def configure(runtime: AutotuneRuntime | None) -> None:
    """Set the runtime that :func:`register` uses when given none (demo, tests); None resets."""
    global _RUNTIME
    _RUNTIME = runtime


def runtime() -> AutotuneRuntime:
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = AutotuneRuntime.from_env()
    return _RUNTIME


# --- the kopf part (thin) ------------------------------------------------------------------------


def register(registry: Any, controller: Any = None, rt: AutotuneRuntime | None = None) -> None:
    """Add the autotune timer to a ``kopf.OperatorRegistry``.

    ``controller``: the object holding the operator's client (``.client``, a
    :class:`~moe_eplb.controller.k8s.KubeClient`) and settings; default ``memo.controller``.
    """
    rt = rt or runtime()

    @kopf.timer(API_GROUP, API_VERSION, PLURAL, id="autotune", interval=rt.tick_seconds,
                initial_delay=min(rt.tick_seconds, 1.0), backoff=max(1.0, 4 * rt.tick_seconds), registry=registry)
    async def autotune_timer(body: Any, memo: Any, **_: Any) -> None:
        ctl = controller if controller is not None else getattr(memo, "controller", None)
        client = getattr(ctl, "client", None)
        if client is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        try:
            inf = parse(body)
        except SpecError as exc:  # the reconciler reports it (SpecValid=False); nothing to tune
            log.info("autotune: %s/%s: %s", (body.get("metadata") or {}).get("namespace"),
                     (body.get("metadata") or {}).get("name"), exc)
            return
        # what the spec leaves unset takes the operator's defaults, e.g. --prometheus-url (this copy only)
        settings = getattr(ctl, "settings", None)
        if settings is not None:
            inf = inf.with_operator_defaults(settings.defaults)

        async def rerender() -> None:
            # A status change does not trigger kopf's update handlers: have the reconciler render the
            # new override now (idempotent; resume and resync would also do it).
            fresh = await client.get(API, KIND, inf.namespace, inf.name)
            if fresh is not None and hasattr(ctl, "reconcile"):
                await ctl.reconcile(fresh)

        await tick(inf, client, rt, actor=f"{os.environ.get('HOSTNAME', 'operator')}/{id(memo):x}",
                   rerender=rerender)


# --- one tick ------------------------------------------------------------------------------------


async def tick(inf: MoEInference, client: Any, rt: AutotuneRuntime, *, actor: str = "",
               rerender: Callable[[], Awaitable[None]] | None = None) -> str | None:
    """One tick of the loop for one parsed MoEInference. Returns what happened (for tests and
    logs): ``rollout:<phase or action>``, ``evaluation:<decision>``, ``override:dropped`` (a stale
    override was removed), ``conflict`` or None (nothing).

    ``rerender()`` makes the reconciler render the children from the resource as stored now
    (called after the override changed, and while a rollout waits for its template)."""
    state = inf.status
    now = rt.clock.now()
    if state.rollout is None and inf.override_problem is not None:
        # The user edited spec.eplb (or the override no longer fits the spec): spec.eplb runs.
        # Drop the stale override so that editing spec.eplb back cannot revive it.
        if await _write(client, inf, state.replace(override=None), {}, now):
            log.info("autotune %s/%s: the tuner's override no longer applies (%s); dropped",
                     inf.namespace, inf.name, inf.override_problem)
            return "override:dropped"
        return "conflict"
    if inf.prometheus_url is None and inf.autotune.mode != "Off":
        await collect_direct(client, inf, rt, now)
    if state.rollout is not None:
        result = await _advance_rollout(inf, client, rt, now, rerender)
    elif inf.autotune.mode == "Off" or not dec.due(inf.autotune, state, now):
        return None
    else:
        result = await _evaluate(inf, client, rt, now, actor)
    if rerender is not None and (result in ("evaluation:Apply", "rollout:RollingBack", "rollout:Superseded") or (
            inf.autoscaling is not None and result is not None and result.startswith("rollout:"))):
        # with an autoscaler, every rollout phase change re-renders it (its minReplicas holds the
        # rollout's replica count only while pods restart: render.autoscaler.rollout_min_replicas)
        await rerender()
    return result


async def _advance_rollout(inf: MoEInference, client: Any, rt: AutotuneRuntime, now: float,
                           rerender: Callable[[], Awaitable[None]] | None) -> str | None:
    state, cfg = inf.status, inf.autotune
    cur = state.rollout
    assert cur is not None
    target = cur.to_knobs if cur.kind == "apply" else None
    since = _crash_evidence_since(cur)
    view, pods = await workload_view(client, inf, rt, target=target, since=since)
    stale = (cur.phase == ROLLING and view.template_hash == cur.from_hash) or (
        cur.phase == ROLLING_BACK and cur.to_hash and view.template_hash == cur.to_hash)
    if stale and rerender is not None and ro.superseded_reason(cur, view) is None:
        await rerender()  # the template still shows the settings before the change: render it again
        view, pods = await workload_view(client, inf, rt, target=target, since=since)
    measured = None
    window = ro.measurement_window(cfg, state, now, view.newest_replica_at)
    if window is not None and not view.crashlooping:
        measured = await _measure(rt, inf, pods, *window)
    step = ro.advance(cfg, state, view, now=now, measured=measured)
    log.debug("autotune %s/%s: rollout %s, %s, measured %s", inf.namespace, inf.name, cur.phase, view, measured)
    if not step.changed:
        return None
    if not await _write(client, inf, step.status, step.conditions, now):
        return "conflict"
    for etype, reason, message in step.events:
        await _event(client, inf, etype, reason, message)
    if step.rollback_reason:
        opmetrics.record_rollback(inf.namespace or "default", inf.name, step.rollback_reason)
    new_ro = step.status.rollout
    if rt.observer:
        rt.observer("rollout" if new_ro is not None else "history", inf,
                    new_ro if new_ro is not None else step.status.history[-1])
    return f"rollout:{new_ro.phase if new_ro is not None else step.status.history[-1].action}"


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


async def _evaluate(inf: MoEInference, client: Any, rt: AutotuneRuntime, now: float, actor: str) -> str | None:
    state, cfg = inf.status, inf.autotune
    current = inf.effective.knobs
    if not inf.effective.enabled:
        reason = "spec.eplb.enabled is false: nothing to tune (enable EPLB to tune it)"
        ev = Evaluation(time=now, current=current, decision=dec.KEEP, reason=reason)
        if await _write(client, inf, state.replace(last_evaluation=ev), {"Tuned": ("False", "EplbDisabled", reason)}, now):
            return f"evaluation:{dec.KEEP}"
        return "conflict"

    # a group recreated over and over since the last evaluation crash-loops (not merely "not ready")
    view, pods = await workload_view(client, inf, rt, since=now - cfg.evaluation_interval_s)
    blocker = _blocker(view)
    start = now - rt.lookback_seconds
    load_error = answer = tune_error = data_window = tuner_seconds = None
    try:
        trace, data_window = await _read_load(rt, inf, start, now, pods)
        if trace.total_steps < rt.min_steps:
            raise LoadUnavailable("TooLittleData", f"{trace.total_steps} engine steps in the last "
                                  f"{rt.lookback_seconds:.0f}s; need at least {rt.min_steps}")
    except LoadUnavailable as exc:
        load_error = (exc.reason, exc.message)
    calibration = None
    if load_error is None:
        t0 = time.process_time()
        try:
            result, calibration = await asyncio.to_thread(run_calibrated_tuner, trace, inf, current,
                                                          {**rt.search, "min_steps": rt.min_steps})
            answer = dec.TunerAnswer.of(result)
        except Exception as exc:  # TuneError or a bug in the search: no change, say why
            tune_error = f"{type(exc).__name__}: {exc}"
        tuner_seconds = time.process_time() - t0
    baseline = None
    if answer is not None and cfg.mode == "Apply" and blocker is None:
        baseline = await _measure(rt, inf, pods, max(start, now - cfg.evaluation_interval_s), now)
    # the decision's time: reading and tuning took a while, and a rollout it starts is timed from here
    now = rt.clock.now()
    scaling = await read_scaling(client, inf, rt, view) if answer is not None and cfg.mode == "Apply" else None
    out = dec.evaluate(cfg, state, now=now, generation=inf.generation, current=current, spec_eplb=inf.spec_knobs,
                       data_window=data_window, load_error=load_error, answer=answer, tune_error=tune_error,
                       workload_blocker=blocker, baseline=baseline, from_hash=view.template_hash,
                       calibration=dec.calibration_record(calibration) if calibration is not None else None,
                       scaling=scaling)
    ev = dataclasses.replace(out.status.last_evaluation, evaluated_by=actor,
                             tuner_cpu_seconds=round(tuner_seconds, 3) if tuner_seconds is not None else None,
                             replica_costs=dec.replica_costs(result, kv_capacity(inf, trace, current),
                                                             num_moe_layers=inf.moe_shape.num_moe_layers,
                                                             bytes_per_expert=inf.moe_shape.bytes_per_expert,
                                                             ep_size=inf.parallelism.ep_size)
                             if answer is not None and inf.autoscaling is not None else ())
    new_status = out.status.replace(last_evaluation=ev)
    if not await _write(client, inf, new_status, out.conditions, now):
        return "conflict"
    for etype, reason, message in out.events:
        if etype == "Warning":
            log.warning("autotune %s/%s: %s: %s", inf.namespace, inf.name, reason, message)
        await _event(client, inf, etype, reason, message)
    opmetrics.record_evaluation(inf.namespace or "default", inf.name, decision=out.decision,
                                predicted_gain=out.predicted_gain, tuner_seconds=tuner_seconds, now=now)
    if ev.calibration is not None:
        opmetrics.record_calibration(inf.namespace or "default", inf.name, ev.calibration)
    if rt.observer:
        rt.observer("evaluation", inf, ev)
    return f"evaluation:{out.decision}"


def kv_capacity(inf: MoEInference, trace: LoadTrace, current: Knobs) -> KvCapacity | None:
    """Today's KV cache from the trace's telemetry (:func:`moe_eplb.eplb.capacity.capacity_from_trace`)
    at the autoscaler's target usage (its KVCacheUsage target, else a full cache)."""
    auto = inf.autoscaling
    target = auto.metric.target if auto is not None and auto.metric.type == "KVCacheUsage" else 1.0
    return capacity_from_trace(trace, replicas=inf.replicas, redundant=current.num_redundant_experts, target=target)


def calibrate_for(trace: LoadTrace, inf: MoEInference) -> Calibration | None:
    """The cost model calibrated from the trace's telemetry (:func:`moe_eplb.eplb.calibrate.calibrate`),
    or None when the trace has none or the calibration fails (the constants are used then)."""
    if trace.telemetry is None:
        return None
    try:
        return calibrate(trace, cost=CostModel(bytes_per_expert=inf.moe_shape.bytes_per_expert),
                         num_nodes=max(1, int(inf.parallelism.nodes or 1)),
                         num_groups=int(inf.moe_shape.num_expert_groups or 1))
    except Exception as exc:  # noqa: BLE001 - calibration is an improvement, never a reason not to tune
        log.warning("autotune %s/%s: calibration failed, using the cost model's constants: %s: %s",
                    inf.namespace, inf.name, type(exc).__name__, exc)
        return None


def run_calibrated_tuner(trace: LoadTrace, inf: MoEInference, current: Knobs,
                         search: dict) -> tuple[TuneResult, Calibration | None]:
    """Calibrate on the trace's telemetry (when it has some), then tune with that cost model, the
    decision held over the ranges of what the telemetry cannot pin down (CPU-bound; called in a
    thread)."""
    calibration = calibrate_for(trace, inf)
    cost = calibration.apply(CostModel()) if calibration is not None else CostModel()
    robust = calibration.robustness() if calibration is not None else None
    return run_tuner(trace, inf, current, search, cost=cost, robust=robust), calibration


def run_tuner(trace: LoadTrace, inf: MoEInference, current: Knobs, search: dict, *,
              cost: CostModel = CostModel(), robust=None) -> TuneResult:
    """Run the tuner for a parsed MoEInference (CPU-bound; called in a thread)."""
    shape, cfg = inf.moe_shape, inf.autotune
    return tune(
        trace,
        ep_size=inf.parallelism.ep_size,
        num_nodes=max(1, int(inf.parallelism.nodes or 1)),
        num_groups=int(shape.num_expert_groups or 1),
        memory_budget_bytes=cfg.memory_budget_bytes,
        bytes_per_expert=shape.bytes_per_expert,
        bounds=cfg.bounds,
        current=current,
        cost=cost,
        min_gain=cfg.min_gain,
        workers=1,
        robust=robust,
        **search,
    )


# --- reading the cluster -------------------------------------------------------------------------


async def workload_view(client: Any, inf: MoEInference, rt: AutotuneRuntime, target: Knobs | None = None,
                        since: float | None = None) -> tuple[ro.WorkloadView, list[dict]]:
    """The child workload and Pods of a MoEInference -> (WorkloadView, pods).

    Single-node replicas: the Deployment(s). Multi-node replicas (``parallelism.nodes > 1``): the
    LeaderWorkerSet, settled by group (:func:`lws_settled`), its template hash from both the leader
    and the worker template, and crash loops of any pod of a group on the current template -- also
    the ones LeaderWorkerSet hides by recreating the group on every restart, counted from its
    ``RecreateGroupOnPodRestart`` Events since ``since`` (clock seconds; None: not counted).
    ``target``: a rollout's target knobs, checked against the spec now (``target_invalid``)."""
    ns = inf.namespace or "default"
    selector = f"{k8s_names.NAME_LABEL}={inf.name}"
    extra = dict(spec_eplb=inf.spec_knobs, eplb_enabled=inf.eplb.enabled,
                 target_invalid=inf.knobs_problem(target) if target is not None else None)
    multinode = int(inf.parallelism.nodes or 1) > 1
    if multinode:
        workloads = await client.list(k8s_names.LWS_API_VERSION, k8s_names.LWS_KIND, ns, label_selector=selector)
    else:
        workloads = await client.list("apps/v1", "Deployment", ns, label_selector=selector)
    pods = await client.list("v1", "Pod", ns, label_selector=selector)
    extra["newest_replica_at"] = newest_pod_start(pods, rt)
    if not workloads:
        return ro.WorkloadView(inf.generation, False, None, **extra), pods
    hashes = sorted({_config_hash(t) for w in workloads for t in _pod_templates(w)})
    crashes = list(crashlooping(pods, hashes, rt))
    if multinode:
        settled = all(lws_settled(w, pods, hashes) for w in workloads)
        if since is not None:
            for w in workloads:
                crashes += await recreated_groups(client, w, pods, hashes, since, rt)
    else:
        settled = all(_deployment_settled(d) for d in workloads)
    extra["replicas"] = sum(int((w.get("spec") or {}).get("replicas", 1)) for w in workloads)
    return ro.WorkloadView(inf.generation, settled, ",".join(hashes), tuple(sorted(set(crashes))), **extra), pods


def _to_clock(rt: AutotuneRuntime, wall: float) -> float:
    to_sim = getattr(rt.clock, "to_sim", None)
    return to_sim(wall) if to_sim is not None else wall


def newest_pod_start(pods: list[dict], rt: AutotuneRuntime) -> float | None:
    """When the youngest engine pod (not being deleted) was created, in clock seconds; None without pods."""
    times = [parse_iso((p.get("metadata") or {}).get("creationTimestamp")) for p in pods
             if not (p.get("metadata") or {}).get("deletionTimestamp")]
    times = [t for t in times if t is not None]
    return _to_clock(rt, max(times)) if times else None


async def read_scaling(client: Any, inf: MoEInference, rt: AutotuneRuntime,
                       view: ro.WorkloadView) -> dec.ScalingState | None:
    """The replica autoscaler's state (:class:`~.decisions.ScalingState`) from the resource, the
    workload's replica count and the HorizontalPodAutoscaler (ours, or the one KEDA made for the
    ScaledObject); None without ``spec.autoscaling``. A missing HPA (KEDA not reconciled yet) leaves
    its fields unknown."""
    auto = inf.autoscaling
    if auto is None:
        return None
    from moe_eplb.render.autoscaler import hpa_name

    try:
        hpa = await client.get(k8s_names.HPA_API_VERSION, k8s_names.HPA_KIND, inf.namespace or "default",
                               hpa_name(inf))
    except ApiError as exc:
        log.info("autotune %s/%s: cannot read the autoscaler's HPA: %s", inf.namespace, inf.name, exc)
        hpa = None
    return scaling_state(inf.replicas, view.replicas, auto.max_replicas, auto.metric.type, hpa,
                         lambda wall: _to_clock(rt, wall))


def scaling_state(desired: int, running: int | None, max_replicas: int, metric_type: str, hpa: dict | None,
                  to_clock: Callable[[float], float] = lambda t: t) -> dec.ScalingState:
    """:class:`~.decisions.ScalingState` from an ``autoscaling/v2`` HorizontalPodAutoscaler object
    (its status: desiredReplicas, lastScaleTime, the ScalingLimited condition, the current metric)."""
    st = (hpa or {}).get("status") or {}
    last = parse_iso(st.get("lastScaleTime"))
    limited = any(c.get("type") == "ScalingLimited" and c.get("status") == "True" and c.get("reason") == "TooManyReplicas"
                  for c in st.get("conditions") or [])
    waiting = None
    if metric_type == "RequestsWaiting":
        for m in st.get("currentMetrics") or []:
            current = (m.get(m.get("type", "").lower() or "external") or {}).get("current") or {}
            value = current.get("averageValue", current.get("value"))
            if value is not None:
                waiting = quantity_value(value)
    desired_hpa = st.get("desiredReplicas")
    return dec.ScalingState(desired=desired, running=desired if running is None else running,
                            max_replicas=max_replicas, hpa_desired=int(desired_hpa) if desired_hpa is not None else None,
                            last_scale_time=to_clock(last) if last is not None else None, limited=limited,
                            waiting=waiting)


def quantity_value(q: Any) -> float | None:
    """A Kubernetes quantity as a number (``"1500m"`` -> 1.5, ``"3"`` -> 3.0); None when unreadable."""
    text = str(q).strip()
    scale = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9}
    try:
        if text and text[-1] in scale:
            return float(text[:-1]) * scale[text[-1]]
        return float(text)
    except ValueError:
        return None


def _pod_templates(workload: dict) -> list[dict]:
    spec = workload.get("spec") or {}
    if workload.get("kind") == k8s_names.LWS_KIND:
        lwt = spec.get("leaderWorkerTemplate") or {}
        return [t for t in (lwt.get("leaderTemplate"), lwt.get("workerTemplate")) if t]
    return [spec.get("template") or {}]


def _config_hash(template: dict) -> str:
    return ((template.get("metadata") or {}).get("annotations") or {}).get(k8s_names.CONFIG_HASH_ANNOTATION, "")


def _pod_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def lws_groups(lws: dict, pods: list[dict]) -> dict[int, dict[int, dict]]:
    """The pods of a LeaderWorkerSet by group index and worker index (0 = leader)."""
    name = lws["metadata"]["name"]
    out: dict[int, dict[int, dict]] = {}
    for p in pods:
        labels = (p.get("metadata") or {}).get("labels") or {}
        if labels.get(k8s_names.LWS_NAME_LABEL) != name or (p.get("metadata") or {}).get("deletionTimestamp"):
            continue
        try:
            group, worker = int(labels[k8s_names.LWS_GROUP_INDEX_LABEL]), int(labels[k8s_names.LWS_WORKER_INDEX_LABEL])
        except (KeyError, ValueError):
            continue
        out.setdefault(group, {})[worker] = p
    return out


def lws_settled(lws: dict, pods: list[dict], hashes: list[str]) -> bool:
    """A LeaderWorkerSet has rolled out its current template: its status observed the generation and
    counts every group updated and ready with no surge group left, and the pods agree -- each of
    the ``replicas`` groups has its leader and all ``size - 1`` workers, every one ready and on the
    current template, and no pod of a group beyond ``replicas`` remains."""
    spec, st = lws.get("spec") or {}, lws.get("status") or {}
    want = int(spec.get("replicas", 1))
    size = int((spec.get("leaderWorkerTemplate") or {}).get("size") or 1)
    if not (int(workload_observed_generation(lws) or 0) >= int(lws["metadata"].get("generation") or 1)
            and int(st.get("updatedReplicas") or 0) >= want and int(st.get("readyReplicas") or 0) >= want
            and int(st.get("replicas") or 0) == want):
        return False
    groups = lws_groups(lws, pods)
    if set(groups) != set(range(want)):
        return False
    for members in groups.values():
        if set(members) != set(range(size)):
            return False
        for p in members.values():
            ann = (p.get("metadata") or {}).get("annotations") or {}
            if ann.get(k8s_names.CONFIG_HASH_ANNOTATION) not in hashes or not _pod_ready(p):
                return False
    return True


_RECREATE_MESSAGE = re.compile(r"[Ww]orker pod (?P<pod>\S+) failed.*recreate group (?P<group>\d+)")


async def recreated_groups(client: Any, lws: dict, pods: list[dict], hashes: list[str], since: float,
                           rt: AutotuneRuntime) -> list[str]:
    """Crash loops that LeaderWorkerSet's ``RecreateGroupOnPodRestart`` hides: a pod that restarts
    makes it recreate the whole group (fresh pods, ``restartCount`` 0), so the restarts are counted
    from its ``RecreateGroupOnPodRestart`` Events on the LWS since ``since`` (one per recreation; an Event
    series that began earlier counts once). A group recreated at least ``rt.crashloop_restarts``
    times whose pods now run a current template crash-loops; returns
    ``"<pod> (group <i> recreated <n>x)"``."""
    ns = lws["metadata"].get("namespace") or "default"
    try:
        events = await client.list("v1", "Event", ns, field_selector=(
            f"involvedObject.kind={k8s_names.LWS_KIND},involvedObject.name={lws['metadata']['name']},"
            f"reason={k8s_names.LWS_RECREATE_GROUP_REASON}"))
    except ApiError as exc:  # no Events (RBAC): crash loops are then seen as restarts only
        log.info("autotune: cannot list events of LeaderWorkerSet %s/%s: %s", ns, lws["metadata"]["name"], exc)
        return []
    # An Event's times are wall-clock, and whole seconds where the legacy core/v1 recorder wrote them
    # (the real LWS controller's): compared with ``since`` on the wall clock (the runtime's clock may
    # run accelerated) and at that precision (an Event in the second the rollout began counts)
    since_wall = math.floor(rt.clock.to_wall(since))
    counts: dict[int, int] = {}
    failed: dict[int, str] = {}
    for e in events:
        uid = (e.get("involvedObject") or {}).get("uid")
        if uid and uid != lws["metadata"].get("uid"):
            continue  # an earlier LWS of the same name
        series = e.get("series") or {}
        first = parse_iso(e.get("eventTime") or e.get("firstTimestamp"))
        last = parse_iso(series.get("lastObservedTime") or e.get("lastTimestamp")) or first
        m = _RECREATE_MESSAGE.search(e.get("message") or "")
        if last is None or last < since_wall or m is None:
            continue
        group = int(m.group("group"))
        repeats = max(int(series.get("count") or 0), int(e.get("count") or 0), 1)
        counts[group] = counts.get(group, 0) + (repeats if first is not None and first >= since_wall else 1)
        failed[group] = m.group("pod")
    groups = lws_groups(lws, pods)
    out = []
    for group, n in sorted(counts.items()):
        members = groups.get(group, {})
        current = bool(members) and all(
            ((p.get("metadata") or {}).get("annotations") or {}).get(k8s_names.CONFIG_HASH_ANNOTATION) in hashes
            for p in members.values())
        if n >= rt.crashloop_restarts and current:
            out.append(f"{failed[group]} (group {group} recreated {n}x)")
    return out


def crashlooping(pods: list[dict], hashes: list[str], rt: AutotuneRuntime) -> tuple[str, ...]:
    """Names of the pods of the current templates (``hashes``) that crash-loop."""
    bad = []
    for p in pods:
        ann = (p.get("metadata") or {}).get("annotations") or {}
        if ann.get(k8s_names.CONFIG_HASH_ANNOTATION) not in hashes or (p["metadata"].get("deletionTimestamp")):
            continue
        for cs in (p.get("status") or {}).get("containerStatuses") or []:
            waiting = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
            if waiting == "CrashLoopBackOff" or int(cs.get("restartCount") or 0) >= rt.crashloop_restarts:
                bad.append(p["metadata"]["name"])
                break
    return tuple(sorted(bad))


def _deployment_settled(d: dict) -> bool:
    spec, st = d.get("spec") or {}, d.get("status") or {}
    want = int(spec.get("replicas", 1))
    return (int(st.get("observedGeneration") or 0) >= int(d["metadata"].get("generation") or 1)
            and int(st.get("updatedReplicas") or 0) == want
            and int(st.get("readyReplicas") or 0) >= want
            and int(st.get("availableReplicas") or 0) >= want
            and int(st.get("replicas") or 0) == want)


async def _write(client: Any, inf: MoEInference, status: AutotuneStatus, conditions: dec.Conditions,
                 now: float) -> bool:
    """One conditional status patch; False on a 409 (the resource changed: redo on fresh data)."""
    body: dict[str, Any] = {"metadata": {"resourceVersion": inf.resource_version},
                            "status": {"autotune": autotune_status_patch(inf.status, status)}}
    if conditions:
        body["status"]["conditions"] = dec.set_conditions(list(inf.conditions), conditions, now=now,
                                                          generation=inf.generation)
    try:
        await client.patch(API, KIND, inf.namespace, inf.name, body, subresource="status")
    except ApiError as exc:
        if exc.status in (409, 404):
            log.info("autotune: %s/%s changed meanwhile (%s); retrying next tick", inf.namespace, inf.name, exc.status)
            return False
        raise
    return True


async def _event(client: Any, inf: MoEInference, etype: str, reason: str, message: str) -> None:
    ref = {"apiVersion": API, "kind": KIND, "metadata": {"name": inf.name, "namespace": inf.namespace,
                                                         "uid": inf.uid}}
    try:
        await client.post_event(ref, type=etype, reason=reason, message=message)
    except Exception as exc:  # an Event is best effort
        log.warning("autotune: could not post event %s: %s", reason, exc)


# --- load and measurements -----------------------------------------------------------------------


async def _read_load(rt: AutotuneRuntime, inf: MoEInference, start: float, end: float,
                     pods: list[dict]) -> tuple[LoadTrace, DataWindow]:
    """The load of the last ``end - start`` clock seconds (:func:`moe_eplb.metrics.reader.read_load_trace`):
    from Prometheus when a URL is known, in buckets of ``rt.bucket_seconds`` clock seconds; else from
    the rounds :func:`collect_direct` scraped on earlier ticks plus one now. The trace's
    ``bucket_seconds`` is in clock seconds (an accelerated clock keeps the step rate right)."""
    url = inf.prometheus_url
    shape = inf.moe_shape
    scale = float(getattr(rt.clock, "scale", 1.0) or 1.0)
    kwargs = dict(namespace=inf.namespace or "default", name=inf.name, window_seconds=(end - start) / scale,
                  bucket_seconds=max(rt.bucket_seconds / scale, rt.min_wall_bucket_seconds),
                  num_layers=shape.num_moe_layers, num_experts=shape.num_experts,
                  pods_per_engine=max(1, int(inf.parallelism.nodes or 1)), timeout=rt.http_timeout,
                  budget=rt.prometheus_budget_seconds)
    try:
        if url:
            trace = await asyncio.to_thread(reader.read_load_trace, prometheus_url=url, now=rt.clock.to_wall(end),
                                            **kwargs)
            log.debug("autotune %s/%s: load read from Prometheus, %s (%s pods summed at the bucket edges, %s raw)",
                      inf.namespace, inf.name, trace.meta.get("read"), trace.meta.get("pods_at_edges"),
                      trace.meta.get("pods_raw"))
        else:
            trace = await asyncio.to_thread(reader.read_load_trace, pods=pods, scraper=rt.direct(inf).scraper,
                                            **kwargs)
            log.debug("autotune %s/%s: load %s", inf.namespace, inf.name, trace.meta.get("read"))
    except LoadReadError as exc:
        raise LoadUnavailable(exc.reason, exc.message) from exc
    except (asyncio.CancelledError, LoadUnavailable):
        raise
    except Exception as exc:  # noqa: BLE001 - a bug in the reader must not kill the loop
        raise LoadUnavailable("LoadReadError", f"{type(exc).__name__}: {exc}") from exc
    trace = per_engine(trace)  # one engine's load and steps, whatever the replica count (autoscaling)
    if trace.bucket_seconds and scale != 1.0:
        trace = LoadTrace(load=trace.load, bucket_steps=trace.bucket_steps, bucket_seconds=trace.bucket_seconds * scale,
                          top_k=trace.top_k, model=trace.model, meta=trace.meta, telemetry=trace.telemetry)
    span = trace.num_buckets * (trace.bucket_seconds or 0.0)
    window = DataWindow(start=end - span if span else start, end=end, buckets=trace.num_buckets,
                        steps=trace.total_steps, source="prometheus" if url else "pods")
    return trace, window


def direct_scrape_seconds(rt: AutotuneRuntime) -> float:
    """Clock seconds between two direct scrapes of a resource's pods: half the load read's bucket
    (the bucket is at least ``rt.min_wall_bucket_seconds`` of wall time), so that every bucket holds a
    scrape as it holds >= 2 of Prometheus'."""
    scale = float(getattr(rt.clock, "scale", 1.0) or 1.0)
    return max(rt.bucket_seconds, rt.min_wall_bucket_seconds * scale) / 2


async def collect_direct(client: Any, inf: MoEInference, rt: AutotuneRuntime, now: float) -> None:
    """Without Prometheus, keep the resource's pods scraped, like Prometheus would, by a loop of its
    own (:func:`_scrape_loop`, every :func:`direct_scrape_seconds`): the reader then has rounds at
    evaluation time in every bucket, also those in which this resource's tick was busy (a tuner run
    takes seconds) -- scraping from the tick left gaps that spoilt the next read. Lists the pods for
    the loop at most once per scrape period. Errors are left to the evaluation."""
    direct = rt.direct(inf)
    direct.touched = time.monotonic()
    if direct.last_collect is None or now - direct.last_collect >= direct_scrape_seconds(rt):
        direct.last_collect = now
        ns = inf.namespace or "default"
        direct.pods = await client.list("v1", "Pod", ns, label_selector=f"{k8s_names.NAME_LABEL}={inf.name}")
    if direct.task is None or direct.task.done():
        direct.task = asyncio.get_running_loop().create_task(_scrape_loop(direct, inf.namespace or "default",
                                                                          inf.name, rt))


async def _scrape_loop(direct: _Direct, namespace: str, name: str, rt: AutotuneRuntime) -> None:
    """Scrape the pods ``direct.pods`` lists every :func:`direct_scrape_seconds` (wall time on an
    accelerated clock) into the reader's and the judge's histories; ends when no tick has asked for
    it for a while (resource deleted, Prometheus configured, operator stopped)."""
    scale = float(getattr(rt.clock, "scale", 1.0) or 1.0)
    period = direct_scrape_seconds(rt) / scale
    idle = max(10 * rt.tick_seconds, 4 * period)
    while time.monotonic() - direct.touched < idle:
        started = time.monotonic()
        pods, now = direct.pods, rt.clock.now()
        targets = targets_from_pods(pods, name)
        if targets:  # one fetch per pod feeds both the reader and the judge
            try:
                rnd = await asyncio.to_thread(direct.scraper.scrape, targets)
                direct.ranks.remember(now, measure_mod.rank_counts_of_round(rnd, pods))
            except LoadReadError as exc:
                log.info("autotune: scraping %s/%s: %s", namespace, name, exc)
            except Exception as exc:  # noqa: BLE001 - a bug must not end the loop silently; the next round tries again
                log.warning("autotune: scraping %s/%s: %s: %s", namespace, name, type(exc).__name__, exc)
        await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))


async def _measure(rt: AutotuneRuntime, inf: MoEInference, pods: list[dict], start: float,
                   end: float) -> Measurement | None:
    """Measured balancedness of the running pods over clock seconds ``[start, end]``: from Prometheus
    when a URL is known, else by scraping the pods and differencing against an earlier round."""
    url = inf.prometheus_url
    try:
        if url:
            client = PrometheusClient(url, timeout=rt.http_timeout, budget=rt.prometheus_budget_seconds)
            return await asyncio.to_thread(measure_mod.measure_prometheus, client, inf.namespace or "default",
                                           inf.name, rt.clock.to_wall(start), rt.clock.to_wall(end))
        counts = await asyncio.to_thread(measure_mod.scrape_rank_counts, pods, rt.http_timeout)
        engines = {p["metadata"]["name"]: measure_mod.engine_of_pod(p) for p in pods}
        return rt.direct(inf).ranks.measure(counts, start, end, engines=engines)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - no measurement: the rollout waits or keeps on prediction
        log.warning("autotune: measuring balancedness failed: %s", exc)
        return None
