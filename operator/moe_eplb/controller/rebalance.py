"""The ``RebalanceFailed`` condition: vLLM's async EPLB worker failures seen by the exporter.

vLLM 0.34 raises its async EPLB worker's failure on every rank; the exporter counts it in
``moe_eplb_rebalance_failures_total`` (docs/metrics.md). At most every :data:`CHECK_SECONDS` (wall
time, so an accelerated test clock does not multiply the scrapes), for each MoEInference with EPLB
on, :class:`RebalanceWatch` reads the failures of the last :data:`WINDOW_SECONDS` (clock seconds)
as the loop reads its other series (Prometheus when the resource has a URL, else the pods'
exporters directly; :mod:`moe_eplb.metrics.health`) and says which condition to write when it
differs from the stored one: ``True`` (reason ``AsyncWorkerFailed``; the loop also posts a Warning
Event ``RebalanceFailed``) while a failure lies in the window, ``False`` (``NoFailures``, Normal
Event ``RebalanceRecovered``) once the window holds none. A resource that never failed gets no
condition. A read that fails changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from moe_eplb.api.spec import MoEInference
from moe_eplb.contracts import k8s_names
from moe_eplb.controller.autotune_settings import AutotuneSettings
from moe_eplb.metrics import health
from moe_eplb.metrics.promclient import PrometheusClient

log = logging.getLogger("moe_eplb.autotune")

CONDITION = health.CONDITION
#: how often (wall seconds) a resource's failures are read at most
CHECK_SECONDS = 30.0
#: failures within this many clock seconds keep the condition true
WINDOW_SECONDS = 900.0
EVENT_FAILED = "RebalanceFailed"
EVENT_RECOVERED = "RebalanceRecovered"


def event_of(condition: tuple[str, str, str]) -> tuple[str, str, str]:
    """``(type, reason, message)`` of the Event that goes with writing ``condition``."""
    status, _, message = condition
    return ("Warning", EVENT_FAILED, message) if status == "True" else ("Normal", EVENT_RECOVERED, message)


def changed(stored: tuple[dict[str, Any], ...], condition: tuple[str, str, str]) -> bool:
    """Whether ``condition`` differs from the stored ``RebalanceFailed`` (absent counts as never failed)."""
    current = next((c for c in stored if c.get("type") == CONDITION), None)
    if current is None:
        return condition[0] == "True"
    if (current.get("status"), current.get("reason")) != condition[:2]:
        return True
    return condition[0] == "True" and current.get("message") != condition[2]


class RebalanceWatch:
    """Per-resource read times and (direct mode) counter history of the failures."""

    def __init__(self, settings: AutotuneSettings, wall: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.wall = wall
        self._last: dict[tuple[str, str], float] = {}
        self._history: dict[tuple[str, str], health.FailureHistory] = {}

    async def check(self, client: Any, inf: MoEInference, now: float) -> tuple[str, str, str] | None:
        """The ``RebalanceFailed`` condition ``(status, reason, message)`` to write now, or None
        (EPLB off, not due, unreadable, or the same as stored)."""
        if not inf.effective.enabled:
            return None
        key = (inf.namespace or "default", inf.name)
        last, wall = self._last.get(key), self.wall()
        if last is not None and wall - last < CHECK_SECONDS:
            return None
        self._last[key] = wall
        try:
            failures = await self._read(client, inf, key, now)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - no reading: the condition stays as it is
            log.info("autotune %s/%s: reading rebalance failures: %s", key[0], key[1], exc)
            return None
        condition = health.rebalance_condition(failures, WINDOW_SECONDS)
        return condition if changed(inf.conditions, condition) else None

    async def _read(self, client: Any, inf: MoEInference, key: tuple[str, str], now: float) -> dict[str, float]:
        rt = self.settings
        if inf.prometheus_url:
            prom = PrometheusClient(inf.prometheus_url, timeout=rt.http_timeout, budget=rt.prometheus_budget_seconds)
            return await asyncio.to_thread(health.failures_prometheus, prom, key[0], key[1],
                                           WINDOW_SECONDS / rt.scale, rt.clock.to_wall(now))
        pods = await client.list("v1", "Pod", key[0], label_selector=f"{k8s_names.NAME_LABEL}={key[1]}")
        counts = await asyncio.to_thread(health.scrape_failures, pods, rt.http_timeout)
        history = self._history.setdefault(key, health.FailureHistory())
        history.remember(now, counts)
        return history.recent(now, WINDOW_SECONDS)
