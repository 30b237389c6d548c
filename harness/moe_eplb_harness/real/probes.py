"""SIMULATED kubelet probing for the node agent (:mod:`moe_eplb_harness.real.nodeagent`). Not Kubernetes.

A kubelet runs a container's ``livenessProbe`` every ``periodSeconds`` once the container has started
(its startup probe passed), and restarts the container after ``failureThreshold`` failures in a row
(``restartCount`` + 1, ``lastState.terminated`` exit code 137). :class:`LivenessProber` does that
for the probe kind the operator renders, ``httpGet`` on a named or numbered container port (a
status 200-399 within ``timeoutSeconds`` passes); another kind is not run (it always passes). Periods
are seconds of the simulation's clock, the HTTP timeout is wall seconds.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any


def probe_url(probe: Mapping[str, Any], container: Mapping[str, Any], host: str) -> str | None:
    """The URL an ``httpGet`` probe GETs on a pod at ``host``; None for another kind or an unknown port."""
    get = probe.get("httpGet")
    if not isinstance(get, Mapping):
        return None
    port = get.get("port")
    if isinstance(port, str) and not port.isdigit():
        port = next((p.get("containerPort") for p in container.get("ports") or [] if p.get("name") == port), None)
    if port is None:
        return None
    return f"http://{host}:{int(port)}{get.get('path') or '/'}"


def http_check(url: str, timeout: float) -> str | None:
    """None when ``url`` answers 200-399 within ``timeout`` s, else why not (as a kubelet words it)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return None if 200 <= resp.status < 400 else f"HTTP probe failed with statuscode: {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP probe failed with statuscode: {exc.code}"
    except (OSError, ValueError) as exc:
        return f"Get {url}: {exc}"


class LivenessProber:
    """One container's liveness probe on the simulation's clock (see the module doc)."""

    def __init__(self, container: Mapping[str, Any], clock: Callable[[], float],
                 check: Callable[[str, float], str | None] = http_check) -> None:
        self.container, self.clock, self.check_url = container, clock, check
        self.probe: Mapping[str, Any] = container.get("livenessProbe") or {}
        self.period = float(self.probe.get("periodSeconds") or 10)
        self.threshold = int(self.probe.get("failureThreshold") or 3)
        self.timeout = float(self.probe.get("timeoutSeconds") or 1)
        self.failures = 0
        self.next_at: float | None = None
        self.last_failure = ""

    def started(self) -> None:
        """The container started (its startup probe passed): probing begins after the initial delay."""
        if self.next_at is None:
            self.next_at = self.clock() + float(self.probe.get("initialDelaySeconds") or 0)

    async def step(self, host: str) -> str | None:
        """Probe when due; the failure message once ``failureThreshold`` probes failed in a row (the
        container must restart: the prober starts over), else None."""
        if not self.probe or self.next_at is None or self.clock() < self.next_at:
            return None
        self.next_at = self.clock() + self.period
        url = probe_url(self.probe, self.container, host)
        if url is None:
            return None
        failure = await asyncio.to_thread(self.check_url, url, self.timeout)
        if failure is None:
            self.failures = 0
            return None
        self.failures += 1
        self.last_failure = failure
        if self.failures < self.threshold:
            return None
        self.failures, self.next_at = 0, None
        return f"Liveness probe failed: {failure}"
