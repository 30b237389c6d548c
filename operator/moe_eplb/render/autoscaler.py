"""The autoscaler child of a MoEInference (``spec.autoscaling``): pure, no I/O.

:func:`autoscaler` returns a KEDA ``ScaledObject`` (a Prometheus trigger on the resource's
Prometheus) or an ``autoscaling/v2`` ``HorizontalPodAutoscaler`` (a Pods or External metric served
by prometheus-adapter), or None without autoscaling. Both scale the MoEInference itself through its
``/scale`` subresource (``spec.replicas``: pods of a Deployment, replica *groups* of a
LeaderWorkerSet) with the same HPA behavior (``scaleUp``/``scaleDown``), so the operator renders
the workload from one replica count whoever set it.

The metric is vLLM's own series, selected by ``namespace`` and vLLM's ``model_name`` label (the
served model name), named per engine version (:func:`moe_eplb.contracts.vllm_facts.autoscaling_metric`):

==================  ==============================================================  ============
type                query (KEDA)                                                    target type
==================  ==============================================================  ============
RequestsWaiting     ``sum(vllm:num_requests_waiting{...})``                          AverageValue
KVCacheUsage        ``avg(vllm:kv_cache_usage_perc{...})``                           Value
TTFT                ``histogram_quantile(q, sum by (le) (rate(..._bucket{...}[w])))``  Value
==================  ==============================================================  ============

AverageValue divides the value by the current replica count, so the target of RequestsWaiting is
per replica group; the others compare the value itself.

While a tuner rollout restarts pods (``status.autotune.rollout`` Rolling or RollingBack) the
rendered ``minReplicas`` is raised to the replica count the rollout started with
(:func:`rollout_min_replicas`): the autoscaler may add replicas but not remove them, so the
rollout's capacity rule (ready replicas never below replicas - maxUnavailable) holds.
"""

from __future__ import annotations

from typing import Any

from moe_eplb.api.spec import AutoscalingSpec, MoEInference
from moe_eplb.contracts import metric_names, vllm_facts
from moe_eplb.contracts.k8s_names import (
    API,
    HPA_API_VERSION,
    HPA_KIND,
    KEDA_API_VERSION,
    KEDA_HPA_PREFIX,
    KEDA_KIND,
    KIND,
)
from moe_eplb.render.labels import labels

#: how each metric type is compared with its target (HPA MetricTarget type)
TARGET_TYPES = {"RequestsWaiting": "AverageValue", "KVCacheUsage": "Value", "TTFT": "Value"}
#: the PodMonitor copies the pod label eplb.ai/name into this series label (metric_names.MOEINFERENCE_LABEL)
_ROLLING_PHASES = ("Rolling", "RollingBack")


def _q(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def metric_series(inf: MoEInference) -> str:
    """vLLM's series for ``spec.autoscaling.metric.type`` in the engine's version (validation has
    refused a resource whose version has none)."""
    a = _spec(inf)
    name = vllm_facts.autoscaling_metric(a.metric.type, inf.engine.version)
    if name is None:
        raise ValueError(f"spec.autoscaling.metric.type: vLLM {inf.engine.version} has no {a.metric.type} metric")
    return name


def query(inf: MoEInference) -> str:
    """The PromQL the autoscaler holds at its target (one value for the whole resource)."""
    a = _spec(inf)
    sel = f'{{namespace="{_q(inf.namespace or "default")}", {vllm_facts.VLLM_MODEL_LABEL}="{_q(inf.served_model_name)}"}}'
    series = metric_series(inf)
    if a.metric.type == "RequestsWaiting":
        return f"sum({series}{sel})"
    if a.metric.type == "KVCacheUsage":
        return f"avg({series}{sel})"
    return (f"histogram_quantile({a.metric.quantile:g}, sum by (le) "
            f"(rate({series}_bucket{sel}[{a.metric.window_seconds}s])))")


def hpa_metric_name(inf: MoEInference) -> str:
    """The metric's name in the custom/external metrics API: ``spec.autoscaling.hpa.metricName``,
    else the name prometheus-adapter gives vLLM's series (:func:`moe_eplb.contracts.metric_names.adapter_metric_name`;
    TTFT: ``..._p90`` for quantile 0.9)."""
    a = _spec(inf)
    if a.hpa is not None and a.hpa.metric_name:
        return a.hpa.metric_name
    return metric_names.adapter_metric_name(metric_series(inf), a.metric.quantile if a.metric.type == "TTFT" else None)


def quantity(value: float) -> str:
    """A Kubernetes quantity for a target: whole numbers as they are, else in milli-units (0.8 -> 800m)."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(float(value) * 1000)}m"


def rollout_min_replicas(inf: MoEInference) -> int:
    """``minReplicas`` to render: ``spec.autoscaling.minReplicas``, raised to the replica count a
    tuner rollout started with while it restarts pods (so the autoscaler cannot scale in under it),
    never above ``maxReplicas``."""
    a = _spec(inf)
    ro = inf.status.rollout
    floor = a.min_replicas
    if ro is not None and ro.phase in _ROLLING_PHASES and ro.replicas is not None:
        floor = max(floor, int(ro.replicas))
    return min(floor, a.max_replicas)


def behavior(a: AutoscalingSpec) -> dict[str, Any]:
    """The HPA ``behavior`` of ``scaleUp``/``scaleDown`` (one Pods policy each)."""
    def rule(r: Any) -> dict[str, Any]:
        return {"stabilizationWindowSeconds": r.stabilization_window_seconds,
                "selectPolicy": "Max",
                "policies": [{"type": "Pods", "value": r.replicas, "periodSeconds": r.period_seconds}]}

    return {"scaleUp": rule(a.scale_up), "scaleDown": rule(a.scale_down)}


def scale_target(inf: MoEInference) -> dict[str, Any]:
    return {"apiVersion": API, "kind": KIND, "name": inf.name}


def _autoscaler_object(inf: MoEInference, api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """An autoscaler of ``inf`` (KEDA's or the HPA): named after it, with its labels, scaling it
    (``scaleTargetRef``), then the kind's own ``spec``."""
    return {"apiVersion": api_version, "kind": kind, "metadata": {"name": inf.name, "labels": labels(inf.name)},
            "spec": {"scaleTargetRef": scale_target(inf), **spec}}


def scaled_object(inf: MoEInference) -> dict[str, Any]:
    """KEDA ScaledObject (keda.sh/v1alpha1) with one Prometheus trigger on the resource's Prometheus."""
    a = _spec(inf)
    if not inf.prometheus_url:
        raise ValueError("spec.monitoring.prometheusUrl: KEDA's Prometheus trigger needs an address")
    trigger_meta = {"serverAddress": inf.prometheus_url, "query": query(inf),
                    "threshold": f"{a.metric.target:g}"}
    if a.min_replicas == 0:
        trigger_meta["activationThreshold"] = "0"
    return _autoscaler_object(inf, KEDA_API_VERSION, KEDA_KIND, {
        "minReplicaCount": rollout_min_replicas(inf),
        "maxReplicaCount": a.max_replicas,
        "pollingInterval": a.keda.polling_interval_seconds,
        # only used when scaling to zero: the last active trigger must be this old -- and, as
        # KEDA ignores cooldownPeriod until a trigger was first active, the ScaledObject too
        # (KEDA's default initialCooldownPeriod, 0, took a resource just created to zero at its
        # first poll, while its engines still loaded)
        "cooldownPeriod": a.scale_down.stabilization_window_seconds,
        "initialCooldownPeriod": a.scale_down.stabilization_window_seconds,
        "advanced": {"horizontalPodAutoscalerConfig": {"name": KEDA_HPA_PREFIX + inf.name,
                                                       "behavior": behavior(a)}},
        "triggers": [{"type": "prometheus", "name": a.metric.type.lower(),
                      "metricType": TARGET_TYPES[a.metric.type], "metadata": trigger_meta}]
                    + _activation_trigger(inf, a),
    })


#: the activation trigger's per-replica target: so high that it asks for one replica group at most
ACTIVATION_THRESHOLD = "1000000000"


def _activation_trigger(inf: MoEInference, a: AutoscalingSpec) -> list[dict[str, Any]]:
    """``spec.autoscaling.keda.activationQuery`` as a second Prometheus trigger: active (KEDA wakes
    the resource from zero) when the query is above 0; an AverageValue target of
    :data:`ACTIVATION_THRESHOLD` makes it ask for one replica group at most, so once an engine
    serves, vLLM's metric decides."""
    if not a.keda.activation_query:
        return []
    return [{"type": "prometheus", "name": "activation", "metricType": "AverageValue",
             "metadata": {"serverAddress": inf.prometheus_url, "query": a.keda.activation_query,
                          "threshold": ACTIVATION_THRESHOLD, "activationThreshold": "0"}}]


def horizontal_pod_autoscaler(inf: MoEInference) -> dict[str, Any]:
    """autoscaling/v2 HorizontalPodAutoscaler on a metric prometheus-adapter serves: External (one
    value, selected by the ``moeinference`` series label) or Pods (averaged over the engine pods)."""
    a = _spec(inf)
    assert a.hpa is not None  # the CRD requires it with backend HPA
    name = hpa_metric_name(inf)
    ttype = "AverageValue" if a.hpa.metrics_api == "Pods" else TARGET_TYPES[a.metric.type]
    target = {"type": ttype, ("averageValue" if ttype == "AverageValue" else "value"): quantity(a.metric.target)}
    if a.hpa.metrics_api == "Pods":
        metric = {"type": "Pods", "pods": {"metric": {"name": name}, "target": target}}
    else:
        selector = {"matchLabels": {metric_names.MOEINFERENCE_LABEL: inf.name}}
        metric = {"type": "External", "external": {"metric": {"name": name, "selector": selector}, "target": target}}
    return _autoscaler_object(inf, HPA_API_VERSION, HPA_KIND, {
        "minReplicas": rollout_min_replicas(inf),
        "maxReplicas": a.max_replicas,
        "metrics": [metric],
        "behavior": behavior(a),
    })


def autoscaler(inf: MoEInference) -> dict[str, Any] | None:
    """The autoscaler child of ``inf``, or None without (enabled) ``spec.autoscaling``."""
    a = inf.autoscaling
    if a is None:
        return None
    return scaled_object(inf) if a.backend == "KEDA" else horizontal_pod_autoscaler(inf)


def describe(inf: MoEInference) -> str | None:
    """One line for the ``Autoscaling`` condition: who scales what on which metric; None without."""
    a = inf.autoscaling
    if a is None:
        return None
    what = (f"KEDA ScaledObject {inf.name} (HPA {KEDA_HPA_PREFIX + inf.name})" if a.backend == "KEDA"
            else f"HorizontalPodAutoscaler {inf.name} ({a.hpa.metrics_api if a.hpa else '?'} metric "
                 f"{hpa_metric_name(inf)})")
    per = " per replica group" if a.metric.type == "RequestsWaiting" else ""
    metric = metric_series(inf) if a.metric.type != "TTFT" else f"p{a.metric.quantile * 100:g} of {metric_series(inf)}"
    return (f"{what} scales spec.replicas between {rollout_min_replicas(inf)} and {a.max_replicas} on {metric} "
            f"(target {a.metric.target:g}{per})")


def hpa_name(inf: MoEInference) -> str | None:
    """The HorizontalPodAutoscaler that scales ``inf``: ours (backend HPA) or KEDA's."""
    a = inf.autoscaling
    if a is None:
        return None
    return inf.name if a.backend == "HPA" else KEDA_HPA_PREFIX + inf.name


def _spec(inf: MoEInference) -> AutoscalingSpec:
    a = inf.autoscaling
    if a is None:
        raise ValueError("spec.autoscaling: not enabled")
    return a
