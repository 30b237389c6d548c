"""The closed tuning loop: a kopf timer per MoEInference (thin), and the I/O around the pure parts.

Every ``tick_seconds`` (wall) the timer of each MoEInference runs :func:`tick`:

1. a rollout in progress (``status.autotune.rollout``) is advanced (:mod:`.rollout`): the child
   Deployments and Pods are read into a :class:`~.rollout.WorkloadView`, the new pods' measured
   balancedness is read when the rollout is ready to be judged;
2. otherwise, when ``spec.autotune.mode`` is not ``Off`` and ``evaluationIntervalSeconds`` have
   passed since the last evaluation: the recent load is read (Prometheus range queries, or the pods
   directly when ``spec.monitoring.prometheusUrl`` is unset), the tuner searches within the spec's
   bounds and memory budget (bytes per expert from the catalog or ``spec.model.moe``), and
   :func:`~.decisions.evaluate` decides (Keep / Recommend / Apply / Defer / NoData / Error);
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
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import numpy as np

from moe_eplb import k8s_names, metric_names
from moe_eplb.controller import decisions as dec
from moe_eplb.controller import opmetrics
from moe_eplb.controller import rollout as ro
from moe_eplb.k8s_names import API_GROUP, API_VERSION, KIND, PLURAL

log = logging.getLogger("moe_eplb.autotune")

API = f"{API_GROUP}/{API_VERSION}"

#: The operator's search (a reduced ladder of the tuner's, 27 candidates) on the last 30 minutes
#: of load, sized so one core evaluates >= 200 resources every 5 minutes (bench/bench_autotune.py).
#: Override with MOE_EPLB_AUTOTUNE_SEARCH=full and MOE_EPLB_AUTOTUNE_LOOKBACK_SECONDS.
OPERATOR_SEARCH: dict[str, Any] = {
    "windows": (250, 1000, 4000),
    "intervals": (500, 2000, 8000),
    "max_redundancy_levels": 3,
    "segments": 4,
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


LoadSource = Callable[[dict, float, float, list], Awaitable[tuple[Any, dict]]]
Measure = Callable[[dict, list[dict], float, float], Awaitable[dict | None]]


@dataclass
class AutotuneRuntime:
    """Process-wide settings of the loop (the demo and tests replace parts of it).

    Attributes:
        clock: ``now()`` and ``to_wall(t)``; spec durations are in its seconds.
        tick_seconds: wall seconds between two ticks of one resource's timer.
        lookback_seconds: how much load history (clock seconds) the tuner sees.
        min_steps: fewer engine steps than this in the history -> ``NoData`` (too little data).
        search: keyword arguments for the tuner's search ladder.
        read_load: ``await read_load(resource, start, end, pods) -> (LoadTrace, window_info)``;
            raises :class:`LoadUnavailable`. Default: :func:`read_load_default`.
        bucket_seconds: bucket length (clock seconds) of the load read for the tuner; also how
            often pods are scraped when there is no Prometheus.
        min_wall_bucket_seconds: floor of the bucket in wall seconds (>= 2 scrape intervals when
            the clock is accelerated).
        measure: ``await measure(resource, pods, start, end) -> {"balancedness": ...} | None``.
        crashloop_restarts: restarts of a pod of the new template that count as a crash loop.
        observer: called with ``(kind, resource, payload)`` after each successful write
            (``evaluation`` with lastEvaluation, ``history`` with a finished rollout entry,
            ``rollout`` with a phase change) -- the demo prints these.
        http_timeout: seconds for a Prometheus or pod scrape request.
    """

    clock: Any = field(default_factory=WallClock)
    tick_seconds: float = 15.0
    lookback_seconds: float = 1800.0
    min_steps: int = 2000
    search: dict = field(default_factory=lambda: dict(OPERATOR_SEARCH))
    read_load: LoadSource | None = None
    measure: Measure | None = None
    crashloop_restarts: int = 3
    observer: Callable[[str, dict, dict], None] | None = None
    http_timeout: float = 10.0
    bucket_seconds: float = 15.0
    min_wall_bucket_seconds: float = 0.0
    _direct_snapshots: dict = field(default_factory=dict, repr=False)
    _scrapers: dict = field(default_factory=dict, repr=False)
    _last_collect: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_env(cls) -> "AutotuneRuntime":
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
    :class:`~moe_eplb.controller.k8s.KubeClient`); default ``memo.controller``.
    """
    import kopf

    rt = rt or runtime()

    @kopf.timer(API_GROUP, API_VERSION, PLURAL, id="autotune", interval=rt.tick_seconds,
                initial_delay=min(rt.tick_seconds, 1.0), backoff=max(1.0, 4 * rt.tick_seconds), registry=registry)
    async def autotune_timer(body: Any, memo: Any, **_: Any) -> None:
        ctl = controller if controller is not None else getattr(memo, "controller", None)
        client = getattr(ctl, "client", None)
        if client is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        import copy

        resource = with_default_prometheus(copy.deepcopy(dict(body)),
                                           getattr(getattr(ctl, "settings", None), "prometheus_url", None))

        async def rerender() -> None:
            # A status change does not trigger kopf's update handlers: have the reconciler render the
            # new override now (idempotent; resume and resync would also do it).
            meta = resource["metadata"]
            fresh = await client.get(API, KIND, meta.get("namespace"), meta["name"])
            if fresh is not None and hasattr(ctl, "reconcile"):
                await ctl.reconcile(fresh)

        await tick(resource, client, rt, actor=f"{os.environ.get('HOSTNAME', 'operator')}/{id(memo):x}",
                   rerender=rerender)


def with_default_prometheus(resource: dict, default_url: str | None) -> dict:
    """``resource`` (a private copy, changed in place and returned) with ``spec.monitoring.prometheusUrl``
    set to the operator's ``--prometheus-url`` / ``MOE_EPLB_PROMETHEUS_URL`` default when the spec
    leaves it empty. Only the loop's copy changes: the default is never written to the spec."""
    if not default_url:
        return resource
    spec = resource.setdefault("spec", {})
    monitoring = spec.get("monitoring")
    if not isinstance(monitoring, dict):
        monitoring = spec["monitoring"] = {}
    if not monitoring.get("prometheusUrl"):
        monitoring["prometheusUrl"] = default_url
    return resource


# --- one tick ------------------------------------------------------------------------------------


async def tick(resource: dict, client: Any, rt: AutotuneRuntime, *, actor: str = "",
               rerender: Callable[[], Awaitable[None]] | None = None) -> str | None:
    """One tick of the loop for one MoEInference. Returns what happened (for tests and logs):
    ``rollout:<phase or action>``, ``evaluation:<decision>``, ``override:dropped`` (a stale
    override was removed), ``conflict`` or None (nothing).

    ``rerender()`` makes the reconciler render the children from the resource as stored now
    (called after the override changed, and while a rollout waits for its template)."""
    meta = resource.get("metadata") or {}
    ns, name = meta.get("namespace") or "default", meta.get("name")
    status = resource.get("status") or {}
    state = dict(status.get("autotune") or {})
    now = rt.clock.now()
    generation = int(meta.get("generation") or 1)
    try:
        cfg = dec.autotune_config(resource)
    except dec.AutotuneSpecError as exc:
        if state.get("rollout") is None and _condition(status, "Tuned") != ("False", "InvalidAutotune"):
            await _write(client, resource, state, {"Tuned": ("False", "InvalidAutotune", str(exc))}, now)
        return None

    if not state.get("rollout") and state.get("override") is not None:
        from moe_eplb.api.spec import current_override

        if current_override(resource) is None:
            # The user edited spec.eplb (or the override no longer fits the spec): spec.eplb runs.
            # Drop the stale override so that editing spec.eplb back cannot revive it.
            new = dict(state)
            new.pop("override", None)
            if await _write(client, resource, new, {}, now):
                log.info("autotune %s/%s: the tuner's override no longer applies (spec.eplb changed); dropped",
                         ns, name)
                return "override:dropped"
            return "conflict"
    direct = not ((resource.get("spec") or {}).get("monitoring") or {}).get("prometheusUrl")
    if direct and cfg.mode != "Off" and rt.read_load is None:
        await collect_direct(client, resource, rt, now)
    if state.get("rollout"):
        result = await _advance_rollout(resource, client, rt, cfg, state, now, generation, ns, name, rerender)
    elif cfg.mode == "Off" or not dec.due(cfg, state, now):
        return None
    else:
        result = await _evaluate(resource, client, rt, cfg, state, now, generation, ns, name, actor)
    if rerender is not None and result in ("evaluation:Apply", "rollout:RollingBack", "rollout:Superseded"):
        await rerender()
    return result


async def _advance_rollout(resource, client, rt, cfg, state, now, generation, ns, name, rerender) -> str | None:
    cur = state["rollout"]
    view, pods = await workload_view(client, resource, rt, target=cur.get("to") if cur.get("kind") == "apply" else None)
    stale = (cur.get("phase") == ro.ROLLING and view.template_hash == cur.get("fromHash")) or (
        cur.get("phase") == ro.ROLLING_BACK and cur.get("toHash") and view.template_hash == cur.get("toHash"))
    if stale and rerender is not None and ro.superseded_reason(cur, view) is None:
        await rerender()  # the template still shows the settings before the change: render it again
        view, pods = await workload_view(client, resource, rt, target=cur.get("to") if cur.get("kind") == "apply" else None)
    measured = None
    window = ro.measurement_window(cfg, state, now)
    if window is not None and not view.crashlooping:
        measured = await _measure(rt, resource, pods, *window)
    step = ro.advance(cfg, state, view, now=now, measured=measured)
    log.debug("autotune %s/%s: rollout %s, %s, measured %s", ns, name, cur.get("phase"), view, measured)
    if not step.changed:
        return None
    if not await _write(client, resource, step.autotune, step.conditions, now):
        return "conflict"
    for etype, reason, message in step.events:
        await _event(client, resource, etype, reason, message)
    if step.rollback_reason:
        opmetrics.record_rollback(ns, name, step.rollback_reason)
    new_ro = step.autotune.get("rollout")
    if rt.observer:
        if new_ro is None:
            rt.observer("history", resource, (step.autotune.get("history") or [{}])[-1])
        else:
            rt.observer("rollout", resource, new_ro)
    return f"rollout:{new_ro['phase'] if new_ro else step.autotune['history'][-1]['action']}"


async def _evaluate(resource, client, rt, cfg, state, now, generation, ns, name, actor) -> str | None:
    from moe_eplb.api.spec import effective_eplb, parse, spec_eplb_record

    eplb = effective_eplb(resource)
    current = {"windowSize": eplb.window_size, "stepInterval": eplb.step_interval,
               "numRedundantExperts": eplb.num_redundant_experts}
    if not eplb.enabled:
        new = dict(state)
        new["lastEvaluation"] = {"time": dec.iso(now), "decision": dec.KEEP, "current": current,
                                 "reason": "spec.eplb.enabled is false: nothing to tune (enable EPLB to tune it)"}
        if await _write(client, resource, new, {"Tuned": ("False", "EplbDisabled", new["lastEvaluation"]["reason"])}, now):
            return f"evaluation:{dec.KEEP}"
        return "conflict"

    view, pods = await workload_view(client, resource, rt)
    blocker = None
    if view.template_hash is None:
        blocker = "the workload does not exist yet"
    elif not view.settled:
        blocker = "pods are rolling or not all ready"
    elif view.crashlooping:
        blocker = f"pods are crash-looping ({', '.join(view.crashlooping[:3])})"

    start = now - rt.lookback_seconds
    load_error = tune = tune_error = None
    data_window = None
    tuner_seconds = None
    trace = None
    try:
        trace, data_window = await _read_load(rt, resource, start, now, pods)
        if trace.total_steps < rt.min_steps:
            raise LoadUnavailable("TooLittleData", f"{trace.total_steps} engine steps in the last "
                                  f"{rt.lookback_seconds:.0f}s; need at least {rt.min_steps}")
    except LoadUnavailable as exc:
        load_error = (exc.reason, exc.message)
    if load_error is None:
        inf = parse(resource)
        t0 = time.process_time()
        try:
            tune = await asyncio.to_thread(run_tuner, trace, inf, cfg, current, rt.search)
        except Exception as exc:  # TuneError or a bug in the search: no change, say why
            tune_error = f"{type(exc).__name__}: {exc}"
        tuner_seconds = time.process_time() - t0
    baseline = None
    if tune is not None and cfg.mode == "Apply" and blocker is None:
        baseline = await _measure(rt, resource, pods, max(start, now - cfg.evaluation_interval_s), now)
    out = dec.evaluate(cfg, state, now=now, generation=generation, current=current,
                       current_override=state.get("override"), data_window=data_window,
                       load_error=load_error, tune=tune, tune_error=tune_error, workload_blocker=blocker,
                       baseline=baseline, from_hash=view.template_hash,
                       spec_eplb=spec_eplb_record(resource))
    out.autotune["lastEvaluation"]["evaluatedBy"] = actor
    if tuner_seconds is not None:
        out.autotune["lastEvaluation"]["tunerCpuSeconds"] = round(tuner_seconds, 3)
    if out.decision == dec.APPLY and baseline is None:
        # Without a baseline a regression cannot be judged; the rollout still has crash/timeout guards.
        out.autotune["rollout"]["baseline"] = None
    if not await _write(client, resource, out.autotune, out.conditions, now):
        return "conflict"
    for etype, reason, message in out.events:
        await _event(client, resource, etype, reason, message)
    opmetrics.record_evaluation(ns, name, decision=out.decision, predicted_gain=out.predicted_gain,
                                tuner_seconds=tuner_seconds, now=now)
    if rt.observer:
        rt.observer("evaluation", resource, out.autotune["lastEvaluation"])
    return f"evaluation:{out.decision}"


def run_tuner(trace: Any, inf: Any, cfg: dec.AutotuneConfig, current: dict, search: dict) -> dict:
    """Run the tuner for a parsed MoEInference (CPU-bound; called in a thread). Returns
    ``TuneResult.to_dict()`` without the candidate list (status stays small)."""
    from moe_eplb.eplb.simulator import Knobs
    from moe_eplb.eplb.tuner import Bounds, tune

    shape = inf.moe_shape
    b = cfg.bounds
    bounds = Bounds(window=b.get("windowSize", (None, None)), interval=b.get("stepInterval", (None, None)),
                    redundant=b.get("numRedundantExperts", (None, None)))
    result = tune(
        trace,
        ep_size=inf.parallelism.ep_size,
        num_nodes=max(1, int(inf.parallelism.nodes or 1)),
        num_groups=int(shape.num_expert_groups or 1),
        memory_budget_bytes=cfg.memory_budget_bytes,
        bytes_per_expert=shape.bytes_per_expert,
        bounds=bounds,
        current=Knobs(current["windowSize"], current["stepInterval"], current["numRedundantExperts"]),
        min_gain=cfg.min_gain,
        workers=1,
        **search,
    )
    d = result.to_dict()
    d.pop("candidates", None)
    return d


# --- reading the cluster -------------------------------------------------------------------------


async def workload_view(client: Any, resource: dict, rt: AutotuneRuntime,
                        target: dict | None = None) -> tuple[ro.WorkloadView, list[dict]]:
    """The child Deployments and Pods of a MoEInference -> (WorkloadView, pods).

    ``target``: a rollout's target knobs, checked against the spec now (``target_invalid``)."""
    from moe_eplb.api.spec import (
        apply_defaults,
        override_invalid_reason,
        spec_eplb_record,
    )

    try:
        spec_eplb = spec_eplb_record(resource)
        enabled = bool(apply_defaults(resource)["spec"]["eplb"]["enabled"])
    except (KeyError, TypeError, ValueError):
        spec_eplb, enabled = None, True
    invalid = override_invalid_reason(resource, target) if target else None
    extra = dict(spec_eplb=spec_eplb, eplb_enabled=enabled, target_invalid=invalid)
    meta = resource["metadata"]
    ns, name = meta.get("namespace") or "default", meta["name"]
    selector = f"{k8s_names.NAME_LABEL}={name}"
    deps = await client.list("apps/v1", "Deployment", ns, label_selector=selector)
    pods = await client.list("v1", "Pod", ns, label_selector=selector)
    generation = int(meta.get("generation") or 1)
    if not deps:
        return ro.WorkloadView(generation, False, None, **extra), pods
    hashes = sorted({((d["spec"].get("template") or {}).get("metadata") or {}).get("annotations", {}).get(
        k8s_names.CONFIG_HASH_ANNOTATION, "") for d in deps})
    template_hash = ",".join(hashes)
    settled = all(_deployment_settled(d) for d in deps)
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
    return ro.WorkloadView(generation, settled, template_hash, tuple(sorted(bad)), **extra), pods


def _deployment_settled(d: dict) -> bool:
    spec, st = d.get("spec") or {}, d.get("status") or {}
    want = int(spec.get("replicas", 1))
    return (int(st.get("observedGeneration") or 0) >= int(d["metadata"].get("generation") or 1)
            and int(st.get("updatedReplicas") or 0) == want
            and int(st.get("readyReplicas") or 0) >= want
            and int(st.get("availableReplicas") or 0) >= want
            and int(st.get("replicas") or 0) == want)


def _condition(status: dict, ctype: str) -> tuple[str, str] | None:
    for c in status.get("conditions") or []:
        if c.get("type") == ctype:
            return c.get("status"), c.get("reason")
    return None


async def _write(client: Any, resource: dict, autotune: dict, conditions: dict, now: float) -> bool:
    """One conditional status patch; False on a 409 (the resource changed: redo on fresh data)."""
    from moe_eplb.controller.k8s import ApiError

    meta = resource["metadata"]
    status = resource.get("status") or {}
    body: dict[str, Any] = {"metadata": {"resourceVersion": meta.get("resourceVersion")},
                            "status": {"autotune": dec.merge_patch(status.get("autotune") or {}, autotune)}}
    if conditions:
        body["status"]["conditions"] = dec.set_conditions(status.get("conditions"), conditions, now=now,
                                                          generation=meta.get("generation"))
    try:
        await client.patch(API, KIND, meta.get("namespace"), meta["name"], body, subresource="status")
    except ApiError as exc:
        if exc.status in (409, 404):
            log.info("autotune: %s/%s changed meanwhile (%s); retrying next tick", meta.get("namespace"),
                     meta["name"], exc.status)
            return False
        raise
    return True


async def _event(client: Any, resource: dict, etype: str, reason: str, message: str) -> None:
    try:
        await client.post_event(resource, type=etype, reason=reason, message=message)
    except Exception as exc:  # an Event is best effort
        log.warning("autotune: could not post event %s: %s", reason, exc)


# --- load and measurements -----------------------------------------------------------------------


async def _read_load(rt: AutotuneRuntime, resource: dict, start: float, end: float, pods: list[dict]):
    fn = rt.read_load
    try:
        if fn is None:
            return await read_load_default(resource, start, end, pods, rt=rt)
        return await fn(resource, start, end, pods)
    except LoadUnavailable:
        raise
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        reason = getattr(exc, "reason", None) or type(exc).__name__
        raise LoadUnavailable(str(reason) if str(reason).isidentifier() else "LoadReadError", str(exc)) from exc


async def read_load_default(resource: dict, start: float, end: float, pods: list[dict], *,
                            rt: AutotuneRuntime | None = None):
    """Read the load with the exporter issue's reader (:func:`moe_eplb.metrics.reader.read_load_trace`).

    From Prometheus when ``spec.monitoring.prometheusUrl`` is set (buckets of ``rt.bucket_seconds``
    clock seconds); else from the rounds a per-resource :class:`~moe_eplb.metrics.scrape.PodScraper`
    collected on earlier ticks (:func:`collect_direct`) plus one now. The trace's
    ``bucket_seconds`` is given in clock seconds (so an accelerated clock keeps the step rate right).
    """
    from moe_eplb.api.spec import parse
    from moe_eplb.eplb.trace import LoadTrace
    from moe_eplb.metrics import reader
    from moe_eplb.metrics.errors import LoadReadError

    rt = rt or runtime()
    meta = resource["metadata"]
    ns, name = meta.get("namespace") or "default", meta["name"]
    url = ((resource.get("spec") or {}).get("monitoring") or {}).get("prometheusUrl") or None
    inf = parse(resource)
    shape = inf.moe_shape
    scale = float(getattr(rt.clock, "scale", 1.0) or 1.0)
    window_wall = (end - start) / scale
    bucket_wall = max(rt.bucket_seconds / scale, rt.min_wall_bucket_seconds)
    kwargs = dict(namespace=ns, name=name, window_seconds=window_wall, bucket_seconds=bucket_wall,
                  num_layers=shape.num_moe_layers, num_experts=shape.num_experts,
                  pods_per_engine=max(1, int(inf.parallelism.nodes or 1)), timeout=rt.http_timeout)
    try:
        if url:
            trace = await asyncio.to_thread(reader.read_load_trace, prometheus_url=url, now=rt.clock.to_wall(end),
                                            **kwargs)
        else:
            trace = await asyncio.to_thread(reader.read_load_trace, pods=pods, scraper=_scraper(rt, ns, name),
                                            **kwargs)
    except LoadReadError as exc:
        raise LoadUnavailable(exc.reason, exc.message) from exc
    if trace.bucket_seconds and scale != 1.0:
        trace = LoadTrace(load=trace.load, bucket_steps=trace.bucket_steps, bucket_seconds=trace.bucket_seconds * scale,
                          top_k=trace.top_k, model=trace.model)
    span = trace.num_buckets * (trace.bucket_seconds or 0.0)
    info = {"start": dec.iso(end - span if span else start), "end": dec.iso(end), "buckets": trace.num_buckets,
            "steps": trace.total_steps, "source": "prometheus" if url else "pods"}
    return trace, info


def _scraper(rt: AutotuneRuntime, ns: str, name: str):
    from moe_eplb.metrics.scrape import PodScraper

    key = (ns, name)
    if key not in rt._scrapers:
        rt._scrapers[key] = PodScraper(timeout=rt.http_timeout, keep=2000)
    return rt._scrapers[key]


async def collect_direct(client: Any, resource: dict, rt: AutotuneRuntime, now: float) -> None:
    """Without Prometheus, scrape the pods once per ``rt.bucket_seconds`` (clock) so that the
    reader has a history of rounds at evaluation time. Errors are left to the evaluation."""
    from moe_eplb.metrics.errors import LoadReadError
    from moe_eplb.metrics.scrape import targets_from_pods

    meta = resource["metadata"]
    ns, name = meta.get("namespace") or "default", meta["name"]
    last = rt._last_collect.get((ns, name))
    if last is not None and now - last < rt.bucket_seconds:
        return
    rt._last_collect[(ns, name)] = now
    pods = await client.list("v1", "Pod", ns, label_selector=f"{k8s_names.NAME_LABEL}={name}")
    targets = targets_from_pods(pods, name)
    if not targets:
        return
    try:
        await asyncio.to_thread(_scraper(rt, ns, name).scrape, targets)
    except LoadReadError as exc:
        log.info("autotune: scraping %s/%s: %s", ns, name, exc)
    if rt.measure is None:
        _remember_ranks(rt, (ns, name), now, await _scrape_rank_round(pods, rt))


async def _measure(rt: AutotuneRuntime, resource: dict, pods: list[dict], start: float, end: float) -> dict | None:
    fn = rt.measure or measure_default
    try:
        return await fn(resource, pods, start, end, rt=rt) if fn is measure_default else await fn(resource, pods, start, end)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.warning("autotune: measuring balancedness failed: %s", exc)
        return None


def balancedness_from_rank_tokens(per_pod: dict[str, np.ndarray]) -> float | None:
    """``sum_{pod,l} mean_rank / sum_{pod,l} max_rank`` of tokens per (layer, rank) ``[L, P]``
    arrays, one per pod (None when no tokens)."""
    num = den = 0.0
    for arr in per_pod.values():
        if arr.size == 0:
            continue
        num += float(arr.mean(axis=1).sum())
        den += float(arr.max(axis=1).sum())
    return num / den if den > 0 else None


async def measure_default(resource: dict, pods: list[dict], start: float, end: float, *,
                          rt: AutotuneRuntime | None = None) -> dict | None:
    """Measured balancedness of the running pods over clock seconds ``[start, end]``.

    From Prometheus (``increase`` of ``moe_eplb_rank_tokens_total`` per pod, layer and rank over
    the window) when ``spec.monitoring.prometheusUrl`` is set; else by scraping the pods' exporter
    port and differencing against the counters seen at the previous call (kept in memory; the
    window's start, or a pod set that changed, returns None).
    """
    rt = rt or runtime()
    meta = resource["metadata"]
    url = ((resource.get("spec") or {}).get("monitoring") or {}).get("prometheusUrl")
    if url:
        return await _measure_prometheus(url, meta.get("namespace") or "default", meta["name"], start, end, rt)
    return await _measure_direct(resource, pods, start, end, rt)


async def _measure_prometheus(url: str, ns: str, name: str, start: float, end: float, rt: AutotuneRuntime) -> dict | None:
    import math

    import aiohttp

    w0, w1 = rt.clock.to_wall(start), rt.clock.to_wall(end)
    rng = max(1, int(math.ceil(w1 - w0)))
    q = (f'sum by (pod, layer, rank) (increase({metric_names.RANK_TOKENS}{{namespace="{ns}",'
         f'{metric_names.MOEINFERENCE_LABEL}="{name}"}}[{rng}s]))')
    timeout = aiohttp.ClientTimeout(total=rt.http_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.get(url.rstrip("/") + "/api/v1/query", params={"query": q, "time": f"{w1:.3f}"}) as resp:
            payload = await resp.json(content_type=None)
    if payload.get("status") != "success":
        return None
    per_pod: dict[str, dict[tuple[int, int], float]] = {}
    for item in payload["data"]["result"]:
        m = item["metric"]
        per_pod.setdefault(m.get("pod", ""), {})[(int(m["layer"]), int(m["rank"]))] = float(item["value"][1])
    arrays = {}
    for pod, cells in per_pod.items():
        L = 1 + max(k[0] for k in cells)
        P = 1 + max(k[1] for k in cells)
        a = np.zeros((L, P))
        for (l, r), v in cells.items():
            a[l, r] = v
        arrays[pod] = a
    b = balancedness_from_rank_tokens(arrays)
    if b is None:
        return None
    tokens = sum(float(a.sum()) for a in arrays.values())
    return {"balancedness": round(b, 6), "tokensPerSecond": round(tokens / max(end - start, 1e-9), 3),
            "pods": len(arrays), "source": "prometheus"}


async def scrape_rank_tokens(pod: dict, timeout: float) -> np.ndarray | None:
    """``[L, P]`` counters of ``moe_eplb_rank_tokens_total`` scraped from a pod's exporter port."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    ip = (pod.get("status") or {}).get("podIP")
    port = None
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == k8s_names.EXPORTER_PORT_NAME:
                port = p.get("containerPort")
    if not ip or not port:
        return None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.get(f"http://{ip}:{port}{k8s_names.EXPORTER_PATH}") as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    cells = {}
    want = metric_names.RANK_TOKENS.removesuffix("_total")
    for fam in text_string_to_metric_families(text):
        if fam.name != want:
            continue
        for s in fam.samples:
            if s.name == metric_names.RANK_TOKENS:
                cells[(int(s.labels["layer"]), int(s.labels["rank"]))] = s.value
    if not cells:
        return None
    a = np.zeros((1 + max(k[0] for k in cells), 1 + max(k[1] for k in cells)))
    for (l, r), v in cells.items():
        a[l, r] = v
    return a


async def _scrape_rank_round(pods: list[dict], rt: AutotuneRuntime) -> dict[str, np.ndarray]:
    ready = [p for p in pods if any(c.get("type") == "Ready" and c.get("status") == "True"
                                    for c in (p.get("status") or {}).get("conditions") or [])]
    out = {}
    for p in ready:
        try:
            a = await scrape_rank_tokens(p, rt.http_timeout)
        except Exception:  # noqa: BLE001 - a pod that cannot be scraped is left out of this round
            a = None
        if a is not None:
            out[p["metadata"]["name"]] = a
    return out


def _remember_ranks(rt: AutotuneRuntime, key: tuple, t: float, counts: dict) -> None:
    hist = rt._direct_snapshots.setdefault(key, [])
    if counts:
        hist.append((t, counts))
    del hist[: max(0, len(hist) - 500)]


async def _measure_direct(resource: dict, pods: list[dict], start: float, end: float, rt: AutotuneRuntime) -> dict | None:
    """Balancedness from the rank counters scraped now minus those of the earliest remembered
    round at or after ``start`` with the same pods (rounds are remembered by :func:`collect_direct`
    and by every measurement)."""
    meta = resource["metadata"]
    key = (meta.get("namespace") or "default", meta["name"])
    now_counts = await _scrape_rank_round(pods, rt)
    hist = list(rt._direct_snapshots.get(key, []))
    _remember_ranks(rt, key, end, now_counts)
    base = next(((t, c) for t, c in hist if t >= start - 1e-6 and set(c) == set(now_counts) and t < end), None)
    if base is None or not now_counts:
        return None
    deltas = {p: np.maximum(now_counts[p] - base[1][p], 0.0) for p in now_counts
              if now_counts[p].shape == base[1][p].shape}
    b = balancedness_from_rank_tokens(deltas)
    if b is None:
        return None
    tokens = sum(float(a.sum()) for a in deltas.values())
    return {"balancedness": round(b, 6), "tokensPerSecond": round(tokens / max(end - base[0], 1e-9), 3),
            "pods": len(deltas), "source": "pods"}
