"""The autotune loop's metrics on the operator's ``/metrics`` (prometheus_client default registry).

Names are pinned in :mod:`moe_eplb.metric_names`:

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
  ``crashloop``, ``timeout``).

Created once per process (the registry refuses duplicates), on first use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

from moe_eplb import metric_names


@dataclass(frozen=True)
class _Metrics:
    evaluations: Any
    decisions: Any
    predicted_gain: Any
    duration: Any
    last_success: Any
    rollbacks: Any


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
        decisions=Counter(strip(metric_names.TUNER_DECISIONS), "Autotune decisions (Keep, Recommend, Apply, Defer, NoData, Error)",
                          ["namespace", "name", "decision"]),
        predicted_gain=Gauge(metric_names.TUNER_PREDICTED_GAIN, "Predicted relative throughput gain of the last recommendation",
                             ["namespace", "name"]),
        duration=Histogram(metric_names.TUNER_DURATION_SECONDS, "Seconds one tuner run takes",
                           buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)),
        last_success=Gauge(metric_names.TUNER_LAST_SUCCESS, "POSIX time of the last successful tuner evaluation",
                           ["namespace", "name"]),
        rollbacks=Counter(strip(metric_names.ROLLBACKS), "Rollbacks of tuner changes by reason (regression, crashloop, timeout)",
                          ["namespace", "name", "reason"]),
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
