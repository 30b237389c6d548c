"""``moe-eplb demo --scenario autoscale``: a traffic rise, a scale-out, and the tuner waiting for it
to settle -- on a SIMULATED cluster in accelerated time (the parts of :mod:`moe_eplb_harness.demo.tuning`).

One MoEInference, ``qwen3-autoscale-demo`` (Qwen3-VL-30B-A3B, EP 16 on one node, a Deployment), with
``spec.autoscaling`` (backend HPA, vLLM's waiting requests per replica, target
:data:`TARGET_WAITING`, 1 to :data:`MAX_REPLICAS` replicas) and autotune in ``Apply`` mode from
:data:`INITIAL_EPLB` (a long rearrangement interval). The engines replay the
``qwen3-vl-30b-a3b-steady`` workload without its bursts (each replica the same routing mix); the
traffic is the KV-cache demand of the requests, :func:`demand`: a share :data:`DEMAND_BEFORE` of one
replica's cache until :data:`RISE_AT_S`, then :data:`DEMAND_AFTER` (ramped over :data:`RAMP_S`),
split evenly over the ready replicas (:func:`per_replica_demand`). One replica then cannot hold the
running requests: requests wait (``vllm:num_requests_waiting``), the autoscaler scales the resource
out through its ``/scale``, the new pods load (3 simulated minutes), and the waiting stops once the
new replicas serve.

Which autoscaler acts (printed, and ``autoscaler`` in the summary): on the real control plane with
prometheus-adapter built (``make kube``) and Prometheus installed, the REAL HPA controller of
kube-controller-manager, reading the metric from Prometheus through prometheus-adapter; otherwise the
emulated HPA controller (:mod:`moe_eplb_harness.emulated.hpa`: the same HPA object, algorithm and status, reading
the pods' ``/metrics``). The HPA lives in wall time (it knows no simulated clock), so the demo's
``scaleUp`` allows a replica every :data:`SCALE_UP_PERIOD_S` wall seconds.

The tuner's rules under test (``controller.decisions.scaling_blocker``): no rollout starts while the
replica count changes or for ``observeSeconds`` after the autoscaler last scaled (the evaluation is
``Defer``, condition ``Tuned`` reason ``WaitingForAutoscaler``); once settled it decides. The summary
(:func:`summary_record`) lists the scale events, the deferrals with their reasons, the first decision
after settling and the rollouts started while scaling (none, when the rule holds).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moe_eplb.api.autotune_status import parse_iso
from moe_eplb.api.convert import to_crd
from moe_eplb.contracts import k8s_names
from moe_eplb_harness.demo.tuning import API_WORDS, QWEN, _cell, _fmt_t, _kn, api_of, prepare_run, short

NAME = "qwen3-autoscale-demo"
PROFILE = "qwen3-vl-30b-a3b-steady"
#: the traffic (simulated seconds from when the resource is applied): KV-cache demand of all
#: requests, in caches of one replica at the workload's median batch; a cache is full from 0.97 on:
#: after the rise one replica queues 140-180 requests, two ~20 each, three none (below their target)
RISE_AT_S, RAMP_S = 120.0, 60.0
DEMAND_BEFORE, DEMAND_AFTER = 0.5, 2.4
MAX_REPLICAS = 3
TARGET_WAITING = 5
#: wall seconds per added replica (the HPA's behavior runs in wall time)
SCALE_UP_PERIOD_S = 15
#: the tuner judges only with this many engine steps in its window (about 21 simulated minutes of
#: load): the scale-out, 2 minutes after the rise when the emulated controller reacts and 10-15 when
#: the real one does (Prometheus, the adapter and its sync in wall time, on a loaded machine), comes first
MIN_STEPS = 24000
DEFAULT_HOURS, DEFAULT_SPEED = 2.0, 40.0
#: the resource's EPLB settings at the start: vLLM's window, a long rearrangement interval (~17
#: simulated minutes at this traffic), no redundant experts -- every replica the autoscaler adds
#: serves that long on vLLM's initial placement, so the tuner wants a shorter interval
INITIAL_EPLB = {"windowSize": 1000, "stepInterval": 20000, "numRedundantExperts": 0}
def hpa_path(namespace: str) -> str:
    """Where the operator's HPA of the scenario's MoEInference lives."""
    return f"/apis/{k8s_names.HPA_API_VERSION}/namespaces/{namespace}/horizontalpodautoscalers/{NAME}"


def resource() -> dict[str, Any]:
    """The scenario's MoEInference: the default demo's Qwen3-VL resource with ``spec.autoscaling``."""
    res = copy.deepcopy(QWEN)
    res["metadata"]["name"] = NAME
    res["spec"]["eplb"].update(INITIAL_EPLB)
    res["spec"]["replicas"] = 1  # the autoscaler scales it out
    # this scenario shows the tuner waiting for the autoscaler; its change is applied to every replica
    res["spec"]["autotune"].update({"evaluationIntervalSeconds": 300, "observeSeconds": 2700,
                                    "experiments": {"enabled": False}})
    res["spec"]["autoscaling"] = {
        "minReplicas": 1, "maxReplicas": MAX_REPLICAS, "backend": "HPA", "hpa": {"metricsApi": "Pods"},
        "metric": {"type": "RequestsWaiting", "target": TARGET_WAITING},
        "scaleUp": {"stabilizationWindowSeconds": 0, "replicas": 1, "periodSeconds": SCALE_UP_PERIOD_S},
        "scaleDown": {"stabilizationWindowSeconds": 3600, "replicas": 1, "periodSeconds": 600},
    }
    return res


def demand(t: float) -> float:
    """KV-cache demand of the whole traffic at simulated second ``t`` (see the module docstring)."""
    ramp = min(1.0, max(0.0, (t - RISE_AT_S) / RAMP_S))
    return DEMAND_BEFORE + ramp * (DEMAND_AFTER - DEMAND_BEFORE)


def per_replica_demand(t: float, ready: int) -> float:
    """The traffic split evenly over the ``ready`` replicas (all of it on one while none is ready)."""
    return demand(t) / max(ready, 1)


@dataclass
class AutoscaleRecord:
    """What the scenario saw (simulated seconds since the workload's start)."""

    evaluations: list[dict] = field(default_factory=list)  # {at_s, decision, reason, recommended, gain}
    rollouts: list[dict] = field(default_factory=list)  # {at_s, kind, phase}
    history: list[dict] = field(default_factory=list)  # finished rollouts
    scale_events: list[dict] = field(default_factory=list)  # {at_s, from, to}
    ready: list[dict] = field(default_factory=list)  # {at_s, ready}


def autoscaler_deferral(reason: str) -> bool:
    """An evaluation deferred because of the autoscaler (``scaling_blocker``'s reasons)."""
    from moe_eplb.controller.decisions import SCALING_WAITS

    return any(f"deferred: {w}" in reason for w in SCALING_WAITS)


def summary_record(rec: AutoscaleRecord, *, api: str, load_source: str, autoscaler: str, observe_s: float,
                   final: dict, rise_at_s: float = RISE_AT_S) -> dict:
    """The ``--summary`` object of the scenario: ``scenario``, ``api``, ``load_source``, ``autoscaler``,
    ``name``, ``traffic_rise_at_s`` (``rise_at_s``), ``scale_events`` (``[{at_s, from, to}]``), ``replicas`` (``start``,
    ``max``, ``end``), ``settled_at_s`` (the last scale event + ``observeSeconds``), ``deferrals``
    (``[{at_s, reason}]``: the autoscaler's), ``decision_after_settling`` (the first evaluation from
    ``settled_at_s`` on that judged, i.e. not NoData or Error: ``{at_s, decision, reason}`` or None), ``rollouts_started``
    (``[{at_s, to}]``), ``rollouts_started_while_scaling`` (started less than ``observe_s`` after a
    scale event: what the tuner's rule forbids) and ``applied_changes`` (``[{at_s, window_size, step_interval,
    num_redundant_experts, kept}]``, ``at_s`` when the rollout started)."""
    events = rec.scale_events
    last = events[-1]["at_s"] if events else None
    settled = last + observe_s if last is not None else None
    deferrals = [{"at_s": e["at_s"], "reason": e["reason"]} for e in rec.evaluations
                 if e["decision"] == "Defer" and autoscaler_deferral(e["reason"])]
    after = next((e for e in rec.evaluations if settled is not None and e["at_s"] >= settled
                  and e["decision"] not in ("NoData", "Error")), None)
    started = [{"at_s": e["at_s"], "to": _kn(e["recommended"])} for e in rec.evaluations if e["decision"] == "Apply"]
    changes = [{"at_s": h.get("started_s", h["at_s"]), **{k: (h.get("to") or {}).get(c) for k, c in (
        ("window_size", "windowSize"), ("step_interval", "stepInterval"), ("num_redundant_experts", "numRedundantExperts"))},
        "kept": h.get("action") == "Kept"} for h in rec.history if h.get("action") in ("Kept", "RolledBack")]
    return {
        "scenario": "autoscale", "api": api, "load_source": load_source, "autoscaler": autoscaler, "name": NAME,
        "traffic_rise_at_s": rise_at_s,
        "scale_events": [dict(e) for e in events],
        "replicas": {"start": 1, "max": max([1] + [e["to"] for e in events]),
                     "end": int((final.get("spec") or {}).get("replicas", 1))},
        "settled_at_s": settled,
        "deferrals": deferrals,
        "decision_after_settling": {k: after[k] for k in ("at_s", "decision", "reason")} if after else None,
        "rollouts_started": started,
        "rollouts_started_while_scaling": sum(1 for s in started if any(0 <= s["at_s"] - e["at_s"] < observe_s
                                                                        for e in events)),
        "applied_changes": changes,
    }


def _world(speed: float, hours: float, seed: int, use_prom: bool, api: str, observer: Callable,
           shared_plane: Any = None) -> Any:
    """The simulated cluster of the scenario, with the real HPA controller where it can read the metric."""
    from moe_eplb.eplb.workload import profiles, synth
    from moe_eplb_harness.cluster.world import SimWorld, resolve_api
    from moe_eplb_harness.engines.physics import TrueCost
    from moe_eplb_harness.real.metricsadapter import find_adapter

    api = resolve_api(api)
    real_hpa = api == "real" and use_prom and find_adapter() is not None
    # without the profile's bursts: the traffic's one change is the rise (a burst on three replicas would
    # queue requests again); longer than the run: the scenario's clock starts when the resource is
    # applied, after the API is up
    profile = dataclasses.replace(profiles.BUILTIN_PROFILES[PROFILE], bursts=None)
    workload = synth.generate(profile, hours=hours + 0.5, bucket_seconds=15.0, seed=seed)
    return SimWorld(workload={NAME: workload}, scale=speed, startup_seconds=180.0, prometheus=use_prom,
                    scrape_interval=2.0, tick_seconds=0.5, lookback_seconds=1800.0, bucket_seconds=max(60.0, speed * 2.0),
                    min_steps=MIN_STEPS, observer=observer, engine_tick=0.1, http_timeout=30.0, kubelet_poll=0.25,
                    api=api, metrics_adapter=real_hpa, emulated_hpa=not real_hpa,
                    true_cost=TrueCost(kv_demand=DEMAND_BEFORE), shared_plane=shared_plane)


async def run_autoscale_demo(*, hours: float = DEFAULT_HOURS, speed: float = DEFAULT_SPEED, out_dir: str = "out/demo",
                             prometheus: bool | None = None, seed: int = 0, summary_path: str | None = None,
                             echo: Callable[[str], None] = print, api: str = "auto", shared_plane: Any = None) -> dict:
    """Run the scenario; returns :func:`summary_record` (also written to ``summary_path`` when given).
    ``shared_plane``: on the real API, a running control plane to run on in a namespace of its own (a
    test session's, see ``SimWorld.shared_plane``) instead of starting one."""

    use_prom = prepare_run(out_dir, prometheus)
    rec = AutoscaleRecord()
    box: dict[str, Any] = {}
    t_wall0 = time.time()

    def observer(kind: str, res: Any, record: Any) -> None:
        if res.name != NAME:
            return
        world = box["world"]
        payload = to_crd(record)
        # an evaluation is timed when it was decided (the rollout it starts too), a rollout step when written
        at = parse_iso(payload.get("time")) if kind == "evaluation" and payload.get("time") else None
        t = round(world.clock.workload_seconds(at), 1)
        tag = f"[sim {_fmt_t(t)}] tuner     "
        if kind == "evaluation":
            gain = payload.get("predictedGain")
            rec.evaluations.append({"at_s": t, "decision": payload.get("decision"), "reason": payload.get("reason", ""),
                                    "recommended": payload.get("recommended"), "gain": gain})
            g = f"{100 * gain:+.1f}%" if isinstance(gain, (int, float)) else "   - "
            echo(f"{tag} {payload.get('decision', '?'):9s} best {_kn(payload.get('recommended')):>12s} gain {g:>7s}  "
                 f"{short(payload.get('reason'), 110)}")
        elif kind == "rollout":
            rec.rollouts.append({"at_s": t, "kind": payload.get("kind"), "phase": payload.get("phase")})
            echo(f"{tag} rollout   {payload.get('kind')} -> {payload.get('phase')}")
        elif kind == "history":
            started = parse_iso(payload["startedAt"]) if payload.get("startedAt") else None
            rec.history.append({"at_s": t, **payload, **({"started_s": round(world.clock.workload_seconds(started), 1)}
                                                          if started is not None else {})})
            echo(f"{tag} {payload.get('action'):9s} {short(payload.get('reason'), 130)}")

    world = _world(speed, hours, seed, use_prom, api, observer, shared_plane)
    box["world"] = world
    res = resource()
    observe_s = float(res["spec"]["autotune"]["observeSeconds"])
    async with world.run():
        api_name, load_source = api_of(world), "prometheus" if use_prom else "direct"
        echo(f"moe-eplb demo --scenario autoscale (SIMULATED cluster): {hours:g} simulated hours at {speed:g}x "
             f"(~{hours * 3600 / speed / 60:.1f} min); {api_name} Kubernetes API{API_WORDS.get(api_name, '')}; "
             f"autoscaler: {world.autoscaler}; report -> {out_dir}")
        echo(f"MoEInference {NAME}: Qwen3-VL-30B-A3B, EP 16, a Deployment; autoscaling 1..{MAX_REPLICAS} replicas "
             f"on vLLM's waiting requests (target {TARGET_WAITING} per replica, HPA); autotune Apply from "
             f"{_kn(INITIAL_EPLB)} every {res['spec']['autotune']['evaluationIntervalSeconds']} s, "
             f"observeSeconds {observe_s:g}; traffic rises {DEMAND_BEFORE:g} -> {DEMAND_AFTER:g} replica caches "
             f"{RISE_AT_S / 60:g} simulated minutes after the resource is created")
        await world.start_operator()
        if use_prom:
            res["spec"]["monitoring"] = {"prometheusUrl": world.prometheus_url}
        await world.apply(res)
        t0 = round(world.clock.workload_seconds(), 1)  # the traffic's clock: from the resource's creation
        await _drive(world, rec, t0, t0 + hours * 3600.0, echo)
        final = await world.get(NAME)
    wall = time.time() - t_wall0
    summary = summary_record(rec, api=api_name, load_source=load_source, autoscaler=str(world.autoscaler),
                             observe_s=observe_s, final=final, rise_at_s=t0 + RISE_AT_S)
    _write_report(out_dir, rec, summary, hours, wall)
    if summary_path:
        with open(summary_path, "w") as f:
            json.dump(summary, f, indent=1)
    _echo_summary(summary, echo)
    echo(f"{len(rec.evaluations)} evaluations in {wall:.0f} s wall; report: {os.path.join(out_dir, 'autoscale-report.md')}"
         + (f"; summary: {summary_path}" if summary_path else ""))
    return summary


async def _drive(world: Any, rec: AutoscaleRecord, t0: float, end_s: float, echo: Callable[[str], None]) -> None:
    """Until ``end_s``: split the traffic (:func:`demand` from ``t0`` on) over the ready replicas, and
    record the replica count the autoscaler sets (``spec.replicas``) and the ready replicas as they
    change."""
    from moe_eplb_harness.engines.physics import TrueCost

    replicas, ready_prev, demand_prev = 1, -1, None
    while (t := world.clock.workload_seconds()) < end_s:
        ready = sum(1 for x in world.kubelet.targets() if x.get("moeinference") == NAME)
        want = round(per_replica_demand(t - t0, ready), 3)
        if want != demand_prev:
            world.set_true_cost(TrueCost(kv_demand=want))
            demand_prev = want
        if ready != ready_prev:
            rec.ready.append({"at_s": round(t, 1), "ready": ready})
            if ready_prev >= 0:
                echo(f"[sim {_fmt_t(t)}] replicas  {ready} ready (KV-cache demand {want:.2f} of each replica's cache)")
            ready_prev = ready
        got = await world.get(NAME)
        now = int((got.get("spec") or {}).get("replicas", 1))
        if now != replicas:
            # when the autoscaler scaled, as the operator reads it (the HPA's lastScaleTime), else when
            # seen; the HPA writes its status after /scale: a lastScaleTime not past the previous scale
            # is the previous one's (read again for up to 2 s, then the time seen)
            before = rec.scale_events[-1]["at_s"] if rec.scale_events else None
            for _ in range(20):
                hpa = await world.cluster.get_or_none(hpa_path(world.namespace))
                status = (hpa or {}).get("status") or {}
                wall = parse_iso(status.get("lastScaleTime")) if status.get("lastScaleTime") else None
                at = world.clock.workload_seconds(world.clock.to_sim(wall)) if wall is not None else t
                if wall is not None and (before is None or at > before + 1.0):
                    break
                await asyncio.sleep(0.1)
            else:
                at = t
            rec.scale_events.append({"at_s": round(at, 1), "from": replicas, "to": now})
            echo(f"[sim {_fmt_t(at)}] autoscaler scaled {NAME} {replicas} -> {now} replicas through /scale "
                 f"({_hpa_metric(status)})")
            replicas = now
        await asyncio.sleep(0.5)


def _hpa_metric(status: dict) -> str:
    """The HPA's current metric as its status says it, in words."""
    for m in status.get("currentMetrics") or []:
        cur = (m.get(m.get("type", "").lower()) or {}).get("current") or {}
        if "averageValue" in cur:
            from moe_eplb.api.quantity import quantity_number as quantity

            return f"the HPA read {quantity(cur['averageValue']):.1f} waiting requests per replica, target {TARGET_WAITING}"
    return "the HPA's metric not in its status yet"


def _echo_summary(s: dict, echo: Callable[[str], None]) -> None:
    echo("")
    events = ", ".join(f"{_fmt_t(e['at_s'])} {e['from']} -> {e['to']}" for e in s["scale_events"]) or "none"
    echo(f"traffic rise at {_fmt_t(s['traffic_rise_at_s'])}; scale-out ({s['autoscaler']}): {events}; "
         f"settled (last scale + observeSeconds) at {_fmt_t(s['settled_at_s']) if s['settled_at_s'] is not None else '-'}")
    from moe_eplb.controller.decisions import SCALING_WAITS

    kinds = [next((w for w in SCALING_WAITS if f"deferred: {w}" in d["reason"]), "?") for d in s["deferrals"]]
    echo(f"tuner deferred {len(kinds)} time(s) for the autoscaler: "
         + ("; ".join(f"{kinds.count(k)}x {k}" for k in dict.fromkeys(kinds)) or "-"))
    after = s["decision_after_settling"]
    echo("first decision after the scale-out: " + (f"{_fmt_t(after['at_s'])} {after['decision']}: "
                                                   f"{short(after['reason'], 140)}" if after else "none"))
    echo(f"rollouts started while scaling: {s['rollouts_started_while_scaling']}; started: "
         + (", ".join(f"{_fmt_t(r['at_s'])} {r['to']}" for r in s["rollouts_started"]) or "none"))


def _write_report(out_dir: str, rec: AutoscaleRecord, summary: dict, hours: float, wall: float) -> None:
    with open(os.path.join(out_dir, "autoscale-summary.json"), "w") as f:
        json.dump({**summary, "simulated": True, "hours": hours, "wall_seconds": round(wall, 1),
                   "evaluations": rec.evaluations, "rollouts": rec.rollouts, "ready": rec.ready}, f, indent=1, default=str)
    lines = ["# moe-eplb demo --scenario autoscale (SIMULATED cluster)", "",
             f"{hours:g} simulated hours, {wall:.0f} s wall; {summary['api']} Kubernetes API; autoscaler: "
             f"{summary['autoscaler']}; traffic rise at {_fmt_t(summary['traffic_rise_at_s'])}.", "",
             "| sim time | event | detail |", "| --- | --- | --- |"]
    rows = [(e["at_s"], "scale", f"{e['from']} -> {e['to']} replicas (spec.replicas, set by the autoscaler)")
            for e in rec.scale_events]
    rows += [(r["at_s"], "ready", f"{r['ready']} replica(s) ready") for r in rec.ready]
    rows += [(e["at_s"], f"tuner {e['decision']}", e["reason"]) for e in rec.evaluations]
    rows += [(r["at_s"], f"rollout {r['phase']}", r["kind"]) for r in rec.rollouts]
    rows += [(h["at_s"], f"rollout {h.get('action')}", h.get("reason", "")) for h in rec.history]
    for at, what, detail in sorted(rows, key=lambda r: r[0]):
        lines.append(f"| {_fmt_t(at)} | {what} | {_cell(detail)} |")
    with open(os.path.join(out_dir, "autoscale-report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")

