"""An EMULATED HorizontalPodAutoscaler controller, for the simulated cluster where the real one cannot
read vLLM's metrics: on the emulated API (there is no kube-controller-manager), or on the real control
plane without prometheus-adapter or Prometheus (then its own HPA controller is not started). Where
both are there, ``SimWorld(metrics_adapter=True)`` runs the real one instead and nothing here runs.

It does what kube-controller-manager's HPA controller does for the HPAs ``render.autoscaler``
writes, on the same objects and in wall time like the real one (its sync period, the behavior's
windows and periods are wall seconds; it knows no simulated clock):

- every ``sync_seconds``, for each ``autoscaling/v2`` HorizontalPodAutoscaler in its namespaces, it
  reads the target's ``/scale`` (``spec.replicas``, ``status.selector``), lists the target's pods and
  scrapes the Ready ones' ``/metrics`` (as prometheus-adapter's rule would, a pod's value is the sum of
  its series over the engines, :func:`moe_eplb_harness.real.metricsadapter.adapter_config`); the HPA's metric
  name is mapped back to vLLM's series by :func:`moe_eplb.contracts.metric_names.adapter_metric_name`;
- Pods metrics (AverageValue) and External metrics (AverageValue: the sum over the pods the
  ``selector`` picks; Value) give the recommendation :func:`recommend` (``ceil``, 10 % tolerance);
- ``behavior`` applies as the real controller applies it (:func:`stabilize`: scale-up and scale-down
  stabilization windows over past recommendations, then :func:`limit`: at most ``value`` Pods per
  ``periodSeconds``, within ``minReplicas``/``maxReplicas``, with the ScalingLimited reason);
- a change is written to the target's ``/scale``; the status -- ``currentReplicas``,
  ``desiredReplicas``, ``lastScaleTime``, ``currentMetrics`` and the ``AbleToScale``,
  ``ScalingActive`` and ``ScalingLimited`` conditions, with the real controller's reasons -- to the
  HPA's ``/status``, which is what the operator's autotune loop reads (``read_scaling``).

Only the metric types the operator renders are served (vLLM's per-pod gauges, ``SERIES``); others
leave the HPA ``ScalingActive=False`` with the reason, as a missing metrics API would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from moe_eplb.api.quantity import quantity_number as _quantity
from moe_eplb.contracts import k8s_names, metric_names, vllm_facts
from moe_eplb.metrics.scrape import exposition_samples, pod_labels, targets_from_pods
from moe_eplb.render.autoscaler import quantity as _quantity_text

log = logging.getLogger("moe_eplb_harness.emulated.hpa")

#: vLLM's gauges the emulated controller reads (by the name prometheus-adapter serves them under)
SERIES = (vllm_facts.REQUESTS_WAITING, vllm_facts.KV_CACHE_USAGE, vllm_facts.KV_CACHE_USAGE_OLD)
#: kube-controller-manager's --horizontal-pod-autoscaler-tolerance default
TOLERANCE = 0.1
#: the controller's name in :attr:`SimWorld.autoscaler` and the demo's output
NAME = "emulated HPA controller (moe_eplb_harness.emulated.hpa)"


def recommend(current: int, value: float, target: float, target_type: str, ready: int) -> int:
    """The replica count a metric asks for (the HPA algorithm): ``value`` is the sum over the ready
    pods (Pods, External AverageValue) or the metric's value (External Value); within
    :data:`TOLERANCE` of the target the count stays."""
    if target <= 0:
        raise ValueError(f"target: {target} must be > 0")
    if target_type == "AverageValue":
        per = value / max(ready, 1)
        ratio = per / target
        if abs(ratio - 1.0) <= TOLERANCE:
            return current
        return math.ceil(value / target)
    ratio = value / target
    if abs(ratio - 1.0) <= TOLERANCE:
        return current
    return math.ceil(current * ratio)


def stabilize(current: int, recommendations: Sequence[tuple[float, int]], now: float, *, up_window: float,
              down_window: float) -> int:
    """The stabilized recommendation (the newest of ``recommendations`` is now's): scaling up goes to
    the smallest recommendation of the last ``up_window`` seconds, scaling down to the largest of the
    last ``down_window`` seconds, never past ``current`` the other way."""
    up = [r for t, r in recommendations if now - t <= up_window]
    down = [r for t, r in recommendations if now - t <= down_window]
    out = current
    if up and min(up) > current:
        out = min(up)
    if down and max(down) < current:
        out = max(down)
    return out


#: the ScalingLimited condition's message for each reason, as kube-controller-manager writes them
LIMIT_MESSAGES = {
    "ScaleUpLimit": "the desired replica count is increasing faster than the maximum scale rate",
    "TooManyReplicas": "the desired replica count is more than the maximum replica count",
    "ScaleDownLimit": "the desired replica count is decreasing faster than the maximum scale rate",
    "TooFewReplicas": "the desired replica count is less than the minimum replica count",
    "DesiredWithinRange": "the desired count is within the acceptable range",
}


def _room(rule: dict, events: Sequence[tuple[float, int]], now: float, sign: int) -> int | None:
    """Replicas a behavior rule's Pods policies still allow in direction ``sign`` (``selectPolicy``
    Max: the loosest policy), counting the changes in ``events`` within each ``periodSeconds``;
    None without a policy."""
    if rule.get("selectPolicy") == "Disabled":
        return 0
    policies = [p for p in rule.get("policies") or [] if p.get("type") == "Pods"]
    if not policies:
        return None
    return max(0, max(int(p["value"]) - sum(sign * d for t, d in events if sign * d > 0 and now - t < int(p["periodSeconds"]))
                      for p in policies))


def limit(current: int, desired: int, events: Sequence[tuple[float, int]], now: float, behavior: dict, *,
          min_replicas: int, max_replicas: int) -> tuple[int, str]:
    """``desired`` within the behavior's rate (:func:`_room`) and ``[min_replicas, max_replicas]``,
    and the ScalingLimited reason (``DesiredWithinRange`` when nothing limited it), as the real
    controller's ``convertDesiredReplicasWithBehaviorRate`` decides them."""
    if desired > current:
        room = _room(behavior.get("scaleUp") or {}, events, now, +1)
        cap = max_replicas if room is None else min(max_replicas, current + room)
        reason = "ScaleUpLimit" if cap < max_replicas else "TooManyReplicas"
        return (cap, reason) if desired > cap else (desired, "DesiredWithinRange")
    if desired < current:
        room = _room(behavior.get("scaleDown") or {}, events, now, -1)
        floor = min_replicas if room is None else max(min_replicas, current - room)
        reason = "ScaleDownLimit" if floor > min_replicas else "TooFewReplicas"
        return (floor, reason) if desired < floor else (desired, "DesiredWithinRange")
    if desired > max_replicas:
        return max_replicas, "TooManyReplicas"
    if desired < min_replicas:
        return min_replicas, "TooFewReplicas"
    return desired, "DesiredWithinRange"


def _condition(type_: str, status: bool, reason: str, message: str, previous: list[dict], now_iso: str) -> dict:
    old = next((c for c in previous if c.get("type") == type_), None)
    same = old is not None and old.get("status") == ("True" if status else "False")
    return {"type": type_, "status": "True" if status else "False", "reason": reason, "message": message,
            "lastTransitionTime": old.get("lastTransitionTime", now_iso) if same else now_iso}


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@dataclass
class _Memory:
    """What the controller remembers of one HPA (the real one keeps it in memory too)."""

    recommendations: list[tuple[float, int]] = field(default_factory=list)
    events: list[tuple[float, int]] = field(default_factory=list)


@dataclass
class EmulatedHpaController:
    """Syncs every HPA of ``namespaces`` on ``cluster`` every ``sync_seconds`` (wall); ``start()`` /
    ``stop()``. ``scaled``: ``(wall time, namespace, name, from, to)`` of every change it made."""

    cluster: Any
    namespaces: tuple[str, ...] = ("default",)
    sync_seconds: float = 5.0
    http_timeout: float = 5.0
    scaled: list[tuple[float, str, str, int, int]] = field(default_factory=list)
    _memory: dict = field(default_factory=dict)
    _task: asyncio.Task | None = None
    _session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.http_timeout))
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            for ns in self.namespaces:
                try:
                    hpas = await self.cluster.list(f"/apis/{k8s_names.HPA_API_VERSION}/namespaces/{ns}/"
                                                   "horizontalpodautoscalers")
                except aiohttp.ClientError as exc:
                    log.info("emulated HPA: listing HPAs in %s: %s", ns, exc)
                    continue
                for hpa in hpas:
                    try:
                        await self.sync(hpa)
                    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
                        log.info("emulated HPA: %s/%s: %s: %s", ns, hpa["metadata"]["name"], type(exc).__name__, exc)
            await asyncio.sleep(max(0.0, self.sync_seconds - (time.monotonic() - started)))

    async def pod_values(self, namespace: str, selector: str, series: str) -> dict[str, tuple[float, dict]]:
        """``pod -> (value, PodMonitor labels)`` of the Ready pods the ``selector`` picks: ``series``
        summed over the pod's engines, as prometheus-adapter's rule sums it."""
        pods = await self.cluster.list(f"/api/v1/namespaces/{namespace}/pods", label_selector=selector)
        ready = [p for p in pods if any(c.get("type") == "Ready" and c.get("status") == "True"
                                        for c in (p.get("status") or {}).get("conditions") or [])]
        out: dict[str, tuple[float, dict]] = {}
        labels = {p["metadata"]["name"]: dict(pod_labels(p)) for p in ready}
        assert self._session is not None
        for target in targets_from_pods(ready):
            try:
                async with self._session.get(target.url) as resp:
                    text = await resp.text()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue  # a pod that does not answer has no value (as a series Prometheus lacks)
            values = [v for _, _, v in exposition_samples(text, {series})]
            if values:
                out[target.pod] = (float(sum(values)), labels.get(target.pod, {}))
        return out

    async def _measure(self, hpa: dict, selector: str) -> tuple[dict, float, str, float, int] | str:
        """``(currentMetrics entry, value, target type, target, ready pods)`` of the HPA's one metric,
        or why it has none."""
        ns = hpa["metadata"]["namespace"]
        metrics = (hpa.get("spec") or {}).get("metrics") or []
        if len(metrics) != 1 or metrics[0].get("type") not in ("Pods", "External"):
            return "FailedGetMetric: the emulated controller reads one Pods or External metric"
        kind = metrics[0]["type"]
        spec = metrics[0][kind.lower()]
        by_name = {metric_names.adapter_metric_name(s): s for s in SERIES}
        series = by_name.get(spec["metric"]["name"])
        if series is None:
            return f"FailedGet{kind}Metric: no metric {spec['metric']['name']!r} (served: {', '.join(by_name)})"
        values = await self.pod_values(ns, selector, series)
        if kind == "External":
            want = ((spec["metric"].get("selector") or {}).get("matchLabels") or {})
            values = {p: v for p, v in values.items() if all(v[1].get(k) == x for k, x in want.items())}
        if not values:
            return f"FailedGet{kind}Metric: no ready pod serves {series}"
        total = sum(v for v, _ in values.values())
        ttype = spec["target"]["type"]
        target = _quantity(spec["target"]["averageValue" if ttype == "AverageValue" else "value"])
        current = {"averageValue": _quantity_text(total / len(values))} if ttype == "AverageValue" else {
            "value": _quantity_text(total)}
        entry = {"type": kind, kind.lower(): {"metric": {"name": spec["metric"]["name"]}, "current": current}}
        return entry, total, ttype, target, len(values)

    async def sync(self, hpa: dict) -> None:
        """One sync of one HPA: measure, recommend, stabilize, limit, scale, write the status."""
        meta, spec = hpa["metadata"], hpa.get("spec") or {}
        ns, name = meta["namespace"], meta["name"]
        ref = spec["scaleTargetRef"]
        group, _, version = ref["apiVersion"].rpartition("/")
        plural = k8s_names.PLURAL if ref["kind"] == k8s_names.KIND else ref["kind"].lower() + "s"
        scale_path = f"/apis/{group}/{version}/namespaces/{ns}/{plural}/{ref['name']}/scale"
        scale = await self.cluster.get(scale_path)
        current = int((scale.get("spec") or {}).get("replicas") or 0)
        selector = (scale.get("status") or {}).get("selector") or ""
        now, previous = time.time(), (hpa.get("status") or {}).get("conditions") or []
        lo, hi = int(spec.get("minReplicas") or 1), int(spec["maxReplicas"])
        mem = self._memory.setdefault((ns, name), _Memory())
        measured = await self._measure(hpa, selector) if selector else "FailedGetScale: the target has no selector yet"
        status: dict[str, Any] = {"currentReplicas": current, "desiredReplicas": current,
                                  "lastScaleTime": (hpa.get("status") or {}).get("lastScaleTime")}
        if isinstance(measured, str):
            reason, _, message = measured.partition(": ")
            status["conditions"] = [_condition("AbleToScale", True, "SucceededGetScale", "the HPA controller was "
                                               "able to get the target's current scale", previous, _iso(now)),
                                    _condition("ScalingActive", False, reason, message, previous, _iso(now))]
            await self._write_status(ns, name, status)
            return
        entry, value, ttype, target, ready = measured
        raw = recommend(current, value, target, ttype, ready)
        mem.recommendations = [(t, r) for t, r in mem.recommendations if now - t <= 3600] + [(now, raw)]
        behavior = spec.get("behavior") or {}
        stable = stabilize(current, mem.recommendations, now,
                           up_window=float((behavior.get("scaleUp") or {}).get("stabilizationWindowSeconds", 0)),
                           down_window=float((behavior.get("scaleDown") or {}).get("stabilizationWindowSeconds", 300)))
        desired, limited = limit(current, stable, mem.events, now, behavior, min_replicas=lo, max_replicas=hi)
        status["desiredReplicas"] = desired
        status["currentMetrics"] = [entry]
        if desired != current:
            await self.cluster.patch(scale_path, {"spec": {"replicas": desired}})
            mem.events = [(t, d) for t, d in mem.events if now - t <= 3600] + [(now, desired - current)]
            self.scaled.append((now, ns, ref["name"], current, desired))
            status["lastScaleTime"] = _iso(now)
            able = ("SucceededRescale", f"the HPA controller was able to update the target scale to {desired}")
        elif raw < current:
            able = ("ScaleDownStabilized", "recent recommendations were higher than current one, applying the "
                    "highest recent recommendation")
        else:
            able = ("ReadyForNewScale", "recommended size matches current size")
        metric = entry[entry["type"].lower()]["metric"]["name"]
        status["conditions"] = [
            _condition("AbleToScale", True, *able, previous, _iso(now)),
            _condition("ScalingActive", True, "ValidMetricFound", "the HPA was able to successfully calculate a "
                       f"replica count from {entry['type'].lower()} metric {metric}", previous, _iso(now)),
            _condition("ScalingLimited", limited != "DesiredWithinRange", limited, LIMIT_MESSAGES[limited], previous,
                       _iso(now)),
        ]
        await self._write_status(ns, name, status)

    async def _write_status(self, ns: str, name: str, status: dict) -> None:
        path = f"/apis/{k8s_names.HPA_API_VERSION}/namespaces/{ns}/horizontalpodautoscalers/{name}/status"
        await self.cluster.patch(path, {"status": {k: v for k, v in status.items() if v is not None}})

