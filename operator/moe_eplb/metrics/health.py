"""Rearrangement health of a MoEInference's engines, from the exporter's
``moe_eplb_rebalance_failures_total`` (vLLM >= 0.34: async EPLB worker failures, docs/metrics.md).

Read as the operator reads its other series: from Prometheus when the resource has a URL
(:func:`failures_prometheus`: the failures within the last ``window`` seconds, by model), else from
the pods' exporters directly (:func:`scrape_failures`, one counter per pod and model) with
:class:`FailureHistory` remembering when a pod's counter went up. :func:`rebalance_condition` turns
the count into the ``RebalanceFailed`` condition (pure).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from moe_eplb.contracts import metric_names
from moe_eplb.metrics.measure import scrape_ready_pods
from moe_eplb.metrics.promclient import PrometheusClient
from moe_eplb.metrics.reader import selector
from moe_eplb.metrics.scrape import exposition_samples
from moe_eplb.metrics.series import parse_vector

CONDITION = "RebalanceFailed"
REASON_FAILED = "AsyncWorkerFailed"
REASON_OK = "NoFailures"


def failures_prometheus(client: PrometheusClient, namespace: str, name: str, window_s: float,
                        at: float | None = None) -> dict[str, float]:
    """Async EPLB worker failures in the last ``window_s`` seconds, by ``model_name`` (every pod
    counts the failure of its own engine; the engines of the resource are summed)."""
    rng = max(1, int(math.ceil(window_s)))
    q = (f"sum by ({metric_names.LABEL_MODEL}) "
         f"(increase({metric_names.REBALANCE_FAILURES}{selector(namespace, name)}[{rng}s]))")
    out: dict[str, float] = {}
    for s in parse_vector(client.query(q, time=at), "rebalance failures"):
        if s.vs.size and float(s.vs[0]) > 0:
            out[s.label(metric_names.LABEL_MODEL, "") or ""] = float(s.vs[0])
    return out


def failures_from_exposition(text: str) -> dict[str, float]:
    """``{model_name: failures}`` of one exporter ``/metrics`` body (empty: vLLM without the signal)."""
    return {labels.get(metric_names.LABEL_MODEL, ""): value
            for _, labels, value in exposition_samples(text, (metric_names.REBALANCE_FAILURES,))}


def scrape_failures(pods: Iterable[Mapping], timeout: float) -> dict[tuple[str, str], float]:
    """``{(pod, model_name): failures}`` of every ready pod whose exporter answers."""
    per_pod = scrape_ready_pods(pods, timeout, failures_from_exposition)
    return {(pod, model): value for pod, counts in per_pod.items() for model, value in counts.items()}


@dataclass
class FailureHistory:
    """When the directly scraped counters went up: a pod seen for the first time with failures
    counts them (its exporter started at 0), a counter that dropped is a restarted exporter."""

    last: dict[tuple[str, str], float] = field(default_factory=dict)
    events: list[tuple[float, str, float]] = field(default_factory=list)  # (time, model, failures)

    def remember(self, now: float, counts: Mapping[tuple[str, str], float]) -> None:
        for key, value in counts.items():
            before = self.last.get(key, 0.0)
            grown = value - before if value >= before else value
            if grown > 0:
                self.events.append((now, key[1], grown))
            self.last[key] = value

    def recent(self, now: float, window_s: float) -> dict[str, float]:
        self.events = [e for e in self.events if e[0] > now - window_s]
        out: dict[str, float] = {}
        for _, model, n in self.events:
            out[model] = out.get(model, 0.0) + n
        return out


def rebalance_condition(failures: Mapping[str, float], window_s: float) -> tuple[str, str, str]:
    """``(status, reason, message)`` of the ``RebalanceFailed`` condition for the failures seen in
    the last ``window_s`` seconds by model."""
    if not failures:
        return "False", REASON_OK, f"no async EPLB worker failure in the last {window_s:.0f}s"
    what = ", ".join(f"{int(n)} for model {m or '(unnamed)'}" for m, n in sorted(failures.items()))
    return ("True", REASON_FAILED,
            f"vLLM's async EPLB worker failed in the last {window_s:.0f}s ({what}; "
            f"{metric_names.REBALANCE_FAILURES}): vLLM raised 'Async EPLB worker failed on at least one rank' "
            "on every rank, which stops the engine unless --enable-fault-tolerance keeps it; expert placement "
            "does not change until the engine restarts. Check the engine logs for 'async loop error'.")
