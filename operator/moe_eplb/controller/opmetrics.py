"""The autotune loop's metrics on the operator's ``/metrics`` (prometheus_client default registry).

Names are pinned in :mod:`moe_eplb.contracts.metric_names`:

- ``moe_eplb_tuner_evaluations_total{namespace,name,result}`` -- evaluations by result
  (``ok``, ``nodata``, ``error``);
- ``moe_eplb_tuner_decisions_total{namespace,name,decision}`` -- decisions (Keep, Recommend,
  Apply, Defer, NoData, Error; see :mod:`moe_eplb.controller.decisions`);
- ``moe_eplb_tuner_predicted_gain_ratio{namespace,name}`` -- the last recommendation's predicted
  relative throughput gain over the running settings;
- ``moe_eplb_tuner_duration_seconds`` -- histogram of one tuner run (CPU-bound, seconds);
- ``moe_eplb_tuner_last_success_timestamp_seconds{namespace,name}`` -- when the last evaluation
  with a tuner result finished (POSIX seconds, of the operator's clock);
- ``moe_eplb_rollbacks_total{namespace,name,reason}`` -- rollbacks by reason (``regression``,
  ``crashloop``, ``timeout``);
- ``moe_eplb_calibration_value{namespace,name,parameter,source}`` -- each cost-model parameter the
  last evaluation used (``parameter``: the cost model's name, e.g. ``moe_time_share``; ``source``:
  ``measured`` or ``default``; the series of the other source is removed);
- ``moe_eplb_calibration_uncertainty{namespace,name,parameter}`` -- its standard error (absent for
  a default).
- ``moe_eplb_replicas{namespace,name,state}`` -- replica groups ``desired`` (spec.replicas) and
  ``ready``, set by the reconciler at every status write;
- ``moe_eplb_autoscaler_min_replicas`` / ``_max_replicas{namespace,name}`` and
  ``moe_eplb_autoscaler_target{namespace,name,metric}`` -- ``spec.autoscaling`` while an autoscaler
  runs (removed when it is turned off or the resource is deleted).

Created once per process (the registry refuses duplicates), on first use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

from moe_eplb.contracts import metric_names


@dataclass(frozen=True)
class _Metrics:
    evaluations: Any
    decisions: Any
    predicted_gain: Any
    duration: Any
    last_success: Any
    rollbacks: Any
    calibration_value: Any
    calibration_uncertainty: Any
    replicas: Any
    autoscaler_min: Any
    autoscaler_max: Any
    autoscaler_target: Any
    divergence: Any


def no_created_series() -> None:
    """Turn off prometheus_client's ``*_created`` series (one extra series per counter and
    histogram that no query of ours uses) before any metric is created."""
    disable_created_metrics()


@functools.cache
def metrics() -> _Metrics:
    """The process-wide metric objects (created on first call)."""
    no_created_series()
    strip = lambda n: n.removesuffix("_total")  # noqa: E731 - prometheus_client adds the suffix
    return _Metrics(
        evaluations=Counter(strip(metric_names.TUNER_EVALUATIONS), "Autotune evaluations by result (ok, nodata, error)",
                            ["namespace", "name", "result"]),
        decisions=Counter(strip(metric_names.TUNER_DECISIONS),
                          "Autotune decisions (Keep, Recommend, Apply, Defer, NoData, Error)",
                          ["namespace", "name", "decision"]),
        predicted_gain=Gauge(metric_names.TUNER_PREDICTED_GAIN, "Predicted relative throughput gain of the last recommendation",
                             ["namespace", "name"]),
        duration=Histogram(metric_names.TUNER_DURATION_SECONDS, "Seconds one tuner run takes",
                           buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)),
        last_success=Gauge(metric_names.TUNER_LAST_SUCCESS, "POSIX time of the last successful tuner evaluation",
                           ["namespace", "name"]),
        rollbacks=Counter(strip(metric_names.ROLLBACKS), "Rollbacks of tuner changes by reason (regression, crashloop, timeout)",
                          ["namespace", "name", "reason"]),
        calibration_value=Gauge(metric_names.CALIBRATION_VALUE,
                                "Cost-model parameter the last autotune evaluation used (measured or default)",
                                ["namespace", "name", "parameter", "source"]),
        calibration_uncertainty=Gauge(metric_names.CALIBRATION_UNCERTAINTY,
                                      "Standard error of a measured cost-model parameter",
                                      ["namespace", "name", "parameter"]),
        replicas=Gauge(metric_names.REPLICAS, "Replica groups of a MoEInference: desired (spec.replicas) and ready",
                       ["namespace", "name", "state"]),
        autoscaler_min=Gauge(metric_names.AUTOSCALER_MIN_REPLICAS, "spec.autoscaling.minReplicas while an autoscaler runs",
                             ["namespace", "name"]),
        autoscaler_max=Gauge(metric_names.AUTOSCALER_MAX_REPLICAS, "spec.autoscaling.maxReplicas while an autoscaler runs",
                             ["namespace", "name"]),
        autoscaler_target=Gauge(metric_names.AUTOSCALER_TARGET,
                                "Target of the autoscaler's metric (waiting requests per replica group, KV-cache "
                                "usage 0..1 or TTFT seconds)", ["namespace", "name", "metric"]),
        divergence=Gauge(metric_names.REPLICA_LOAD_DIVERGENCE,
                         "Jensen-Shannon divergence (bits) between the replicas' expert loads of the last evaluation",
                         ["namespace", "name"]),
    )


def record_evaluation(namespace: str, name: str, *, decision: str, predicted_gain: float | None,
                      tuner_seconds: float | None, now: float) -> None:
    """Count one evaluation and its decision; set the gain and last-success gauges."""
    m = metrics()
    result = {"NoData": "nodata", "Error": "error"}.get(decision, "ok")
    m.evaluations.labels(namespace=namespace, name=name, result=result).inc()
    m.decisions.labels(namespace=namespace, name=name, decision=decision).inc()
    if tuner_seconds is not None:
        m.duration.observe(tuner_seconds)
    if result == "ok":
        m.last_success.labels(namespace=namespace, name=name).set(now)
        if predicted_gain is not None:
            m.predicted_gain.labels(namespace=namespace, name=name).set(predicted_gain)


def record_rollback(namespace: str, name: str, reason: str) -> None:
    metrics().rollbacks.labels(namespace=namespace, name=name, reason=reason).inc()


def record_divergence(namespace: str, name: str, bits: float | None) -> None:
    """Set (None: remove, fewer than two replicas read) the replicas' load divergence gauge."""
    if bits is None:
        _remove(metrics().divergence, namespace, name)
    else:
        metrics().divergence.labels(namespace=namespace, name=name).set(bits)


def record_calibration(namespace: str, name: str, record: Any) -> None:
    """Set the calibration gauges from a :class:`~moe_eplb.api.autotune_status.CalibrationRecord`
    (one series per parameter: the series of the other source, and the uncertainty of a default,
    are removed)."""
    m = metrics()
    for param, p in record.parameters.items():
        other = "default" if p.source == "measured" else "measured"
        _remove(m.calibration_value, namespace, name, param, other)
        m.calibration_value.labels(namespace=namespace, name=name, parameter=param, source=p.source).set(p.value)
        if p.uncertainty is None:
            _remove(m.calibration_uncertainty, namespace, name, param)
        else:
            m.calibration_uncertainty.labels(namespace=namespace, name=name, parameter=param).set(p.uncertainty)


_TARGET_METRICS = ("RequestsWaiting", "KVCacheUsage", "TTFT")


def record_replicas(namespace: str, name: str, *, desired: int, ready: int, autoscaling: Any = None) -> None:
    """Set the replica gauges of one MoEInference, and the autoscaler's (``autoscaling``: a
    :class:`~moe_eplb.api.spec.AutoscalingSpec`, None: removed)."""
    m = metrics()
    m.replicas.labels(namespace=namespace, name=name, state="desired").set(desired)
    m.replicas.labels(namespace=namespace, name=name, state="ready").set(ready)
    for metric in _TARGET_METRICS:
        if autoscaling is None or autoscaling.metric.type != metric:
            _remove(m.autoscaler_target, namespace, name, metric)
    if autoscaling is None:
        _remove(m.autoscaler_min, namespace, name)
        _remove(m.autoscaler_max, namespace, name)
        return
    m.autoscaler_min.labels(namespace=namespace, name=name).set(autoscaling.min_replicas)
    m.autoscaler_max.labels(namespace=namespace, name=name).set(autoscaling.max_replicas)
    m.autoscaler_target.labels(namespace=namespace, name=name, metric=autoscaling.metric.type).set(
        autoscaling.metric.target)


def forget(namespace: str, name: str) -> None:
    """Remove the replica and autoscaler gauges of a deleted MoEInference."""
    m = metrics()
    for state in ("desired", "ready"):
        _remove(m.replicas, namespace, name, state)
    for metric in _TARGET_METRICS:
        _remove(m.autoscaler_target, namespace, name, metric)
    _remove(m.autoscaler_min, namespace, name)
    _remove(m.autoscaler_max, namespace, name)


def _remove(metric: Any, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass
