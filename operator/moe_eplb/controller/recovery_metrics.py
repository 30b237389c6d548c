"""The recovery loop's metrics on the operator's ``/metrics`` (names in
:mod:`moe_eplb.contracts.metric_names`, ``RECOVERY_*``):

- ``moe_eplb_recovery_phase{namespace,name,phase}``: 1 for the phase the resource is in, 0 for the others;
- ``moe_eplb_recovery_lost_ranks{namespace,name}``: data-parallel ranks its groups run without;
- ``moe_eplb_recovery_rounds_total{namespace,name,instruction,result}``: finished rounds;
- ``moe_eplb_recovery_round_duration_seconds{instruction,result}``: from the fault to a round's end;
- ``moe_eplb_recovery_deadline_timestamp_seconds{namespace,name,group}``: the engines' deadline of a
  round in flight (removed when none is): the stuck-recovery alert compares it with ``time()``.

Requests a fault aborted are vLLM's own count: ``vllm:request_success_total{finished_reason="abort"}``
(vLLM finishes every request of a faulted engine as aborted); the dashboards read it from there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from moe_eplb.api.recovery_status import PHASES, RecoveryStatus, Round
from moe_eplb.contracts import metric_names as mn
from moe_eplb.controller.opmetrics import no_created_series


@dataclass(frozen=True)
class _Metrics:
    phase: Any
    lost: Any
    rounds: Any
    seconds: Any
    deadline: Any


@functools.cache
def metrics() -> _Metrics:
    no_created_series()
    return _Metrics(
        phase=Gauge(mn.RECOVERY_PHASE, "Fault-recovery phase of a MoEInference (1 for the current one)",
                    ["namespace", "name", "phase"]),
        lost=Gauge(mn.RECOVERY_LOST_RANKS, "Data-parallel ranks the replica groups run without (after scale_down)",
                   ["namespace", "name"]),
        rounds=Counter(mn.RECOVERY_ROUNDS.removesuffix("_total"), "Fault-recovery rounds by instruction and result",
                       ["namespace", "name", "instruction", "result"]),
        seconds=Histogram(mn.RECOVERY_ROUND_SECONDS, "Seconds from a fault to the end of a recovery round",
                          ["instruction", "result"], buckets=mn.RECOVERY_SECONDS_BUCKETS),
        deadline=Gauge(mn.RECOVERY_DEADLINE, "When the engines give up on the round in flight (POSIX seconds of the "
                       "operator's clock)", ["namespace", "name", "group"]),
    )


def record(namespace: str, name: str, st: RecoveryStatus, finished: list[Round], groups_seen: set[str]) -> None:
    """Set the gauges from ``st`` and count the rounds that just ``finished``."""
    m = metrics()
    for phase in PHASES:
        m.phase.labels(namespace=namespace, name=name, phase=phase).set(1 if st.phase == phase else 0)
    m.lost.labels(namespace=namespace, name=name).set(sum(len(lr.ranks) for lr in st.lost_ranks))
    for r in finished:
        instruction = r.instruction or "none"
        m.rounds.labels(namespace=namespace, name=name, instruction=instruction, result=r.result or "").inc()
        if r.finished_at is not None:
            m.seconds.labels(instruction=instruction, result=r.result or "").observe(max(0.0, r.finished_at - r.fault_at))
    live = {r.group: r.deadline for r in st.rounds if r.in_flight}
    for group in groups_seen | set(live):
        if group in live:
            m.deadline.labels(namespace=namespace, name=name, group=group).set(live[group])
        else:
            _remove(m.deadline, namespace, name, group)


def forget(namespace: str, name: str, groups: set[str]) -> None:
    """Remove a resource's series (deleted, or fault tolerance turned off)."""
    m = metrics()
    for phase in PHASES:
        _remove(m.phase, namespace, name, phase)
    _remove(m.lost, namespace, name)
    for group in groups:
        _remove(m.deadline, namespace, name, group)


def _remove(metric: Any, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass
