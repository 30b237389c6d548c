"""The one error type of the load reader."""

from __future__ import annotations

# Status reasons (CamelCase, for the MetricsAvailable condition's ``reason``).
PROMETHEUS_UNAVAILABLE = "PrometheusUnavailable"  # connection refused, timeout, HTTP error, bad JSON
PROMETHEUS_QUERY_FAILED = "PrometheusQueryFailed"  # Prometheus answered status=error
SCRAPE_FAILED = "ScrapeFailed"  # a pod's /metrics could not be read
NO_TARGETS = "NoTargets"  # no running pod exposes the eplb-metrics port
NO_DATA = "NoData"  # no exporter series at all
INSUFFICIENT_DATA = "InsufficientData"  # fewer than one full bucket of samples
INCONSISTENT_SERIES = "InconsistentSeries"  # missing layers, mixed models, shape mismatch
SCRAPE_GAPS = "ScrapeGaps"  # too much of the window's load fell in scrape gaps (spread by time, not measured)
INCOMPLETE_GROUP = "IncompleteGroup"  # a pod of a multi-node replica group reports no series: its load is unknown


class LoadReadError(Exception):
    """Reading the load failed. ``reason`` is a short CamelCase status reason (constants above),
    ``message`` a sentence for ``status.conditions[].message`` that says what to check."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
