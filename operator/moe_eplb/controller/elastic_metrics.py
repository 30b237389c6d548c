"""The elastic loop's metrics on the operator's ``/metrics`` (names in :mod:`moe_eplb.contracts.metric_names`):

- ``moe_eplb_elastic_data_parallel`` / ``moe_eplb_elastic_target_data_parallel{namespace,name}`` --
  ``status.elastic.dataParallel`` and ``targetDataParallel``;
- ``moe_eplb_elastic_phase{namespace,name,phase}`` -- 1 for the phase of ``status.elastic`` (the others'
  series are removed);
- ``moe_eplb_elastic_resize_seconds{namespace,name}`` -- how long the operation in progress has run (0
  without one), and ``moe_eplb_elastic_resize_deadline_seconds`` the deadline after which the operator
  restarts the group (the ``MoEEPLBResizeStuck`` alert compares the two);
- ``moe_eplb_elastic_resizes_total{namespace,name,direction,result}`` -- finished operations
  (``direction`` grow or shrink; ``result`` completed, rolled_back, group_restarted), and
  ``moe_eplb_elastic_resize_duration_seconds{namespace,name,direction,result}`` their durations.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from moe_eplb.api import elastic as el
from moe_eplb.contracts import metric_names
from moe_eplb.controller import elastic_plan as plan
from moe_eplb.controller.opmetrics import no_created_series


@dataclass(frozen=True)
class _Metrics:
    data_parallel: Any
    target: Any
    phase: Any
    resize_seconds: Any
    deadline: Any
    resizes: Any
    duration: Any


@functools.cache
def metrics() -> _Metrics:
    no_created_series()
    ns = ["namespace", "name"]
    return _Metrics(
        data_parallel=Gauge(metric_names.ELASTIC_DATA_PARALLEL, "Data-parallel ranks of an elastic group now", ns),
        target=Gauge(metric_names.ELASTIC_TARGET_DATA_PARALLEL, "Data-parallel ranks an elastic group is driven to", ns),
        phase=Gauge(metric_names.ELASTIC_PHASE, "1 for the phase of status.elastic", [*ns, "phase"]),
        resize_seconds=Gauge(metric_names.ELASTIC_RESIZE_SECONDS, "Seconds the resize in progress has run (0: none)", ns),
        deadline=Gauge(metric_names.ELASTIC_RESIZE_DEADLINE,
                       "Seconds a resize may run before the operator restarts the group", ns),
        resizes=Counter(metric_names.ELASTIC_RESIZES.removesuffix("_total"),
                        "Finished resizes of elastic groups by direction and result", [*ns, "direction", "result"]),
        duration=Histogram(metric_names.ELASTIC_RESIZE_DURATION, "Seconds a finished resize took",
                           [*ns, "direction", "result"], buckets=(5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)),
    )


#: Events that end an operation, and the result they count as
_RESULTS = {"Resized": "completed", "RolledBack": "rolled_back", "GroupRestarted": "group_restarted"}


def record(namespace: str, name: str, old: el.ElasticStatus, step: plan.Step, view: plan.ElasticView,
           now: float) -> None:
    """Set the gauges from the step's record; count an operation that ended in this step."""
    m, st = metrics(), step.status
    m.data_parallel.labels(namespace=namespace, name=name).set(st.data_parallel)
    m.target.labels(namespace=namespace, name=name).set(st.target_data_parallel)
    for phase in el.PHASES:
        if phase == st.phase:
            m.phase.labels(namespace=namespace, name=name, phase=phase).set(1)
        else:
            _remove(m.phase, namespace, name, phase)
    running = step.condition[0] and view.since is not None and old.in_progress
    m.resize_seconds.labels(namespace=namespace, name=name).set(max(0.0, now - view.since) if running else 0.0)
    m.deadline.labels(namespace=namespace, name=name).set(plan.deadline(view))
    for _etype, reason, _message in step.events:
        result = _RESULTS.get(reason)
        if result is None or not old.in_progress:  # a stable group's founders restarting ends no operation
            continue
        direction = "grow" if old.target_data_parallel > old.data_parallel else "shrink"
        m.resizes.labels(namespace=namespace, name=name, direction=direction, result=result).inc()
        if view.since is not None:
            m.duration.labels(namespace=namespace, name=name, direction=direction,
                              result=result).observe(max(0.0, now - view.since))


def forget(namespace: str, name: str) -> None:
    m = metrics()
    for g in (m.data_parallel, m.target, m.resize_seconds, m.deadline):
        _remove(g, namespace, name)
    for phase in el.PHASES:
        _remove(m.phase, namespace, name, phase)


def _remove(metric: Any, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass
