"""A small blocking client for the Prometheus HTTP API (``/api/v1/query``, ``/api/v1/query_range``).

Standard library only. Every failure becomes :class:`~moe_eplb.metrics.errors.LoadReadError`
(``PrometheusUnavailable`` for transport/HTTP/JSON problems, ``PrometheusQueryFailed`` when
Prometheus answers ``status: error``). Call it from async code with ``asyncio.to_thread``.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from moe_eplb.metrics.errors import (
    PROMETHEUS_QUERY_FAILED,
    PROMETHEUS_UNAVAILABLE,
    LoadReadError,
)


class PrometheusClient:
    def __init__(self, url: str, timeout: float = 10.0):
        if not url or not url.startswith(("http://", "https://")):
            raise LoadReadError(PROMETHEUS_UNAVAILABLE,
                                f"spec.monitoring.prometheusUrl {url!r} is not an http(s) URL "
                                "(e.g. http://prometheus-operated.monitoring:9090)")
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _get(self, path: str, params: dict[str, Any]) -> dict:
        query = urllib.parse.urlencode(params)
        url = f"{self.url}{path}"
        req = urllib.request.Request(url, data=query.encode(), method="POST",
                                     headers={"Content-Type": "application/x-www-form-urlencoded",
                                              "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                body = json.loads(raw)
            except ValueError:
                raise LoadReadError(PROMETHEUS_UNAVAILABLE,
                                    f"{url} answered HTTP {exc.code}: {raw[:200]!r}") from None
            raise LoadReadError(PROMETHEUS_QUERY_FAILED,
                                f"{url}: {body.get('errorType', 'error')}: {body.get('error', exc.reason)}") from None
        except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise LoadReadError(PROMETHEUS_UNAVAILABLE,
                                f"cannot reach Prometheus at {self.url} ({reason}); check "
                                "spec.monitoring.prometheusUrl and that Prometheus is running") from None
        try:
            body = json.loads(raw)
        except ValueError:
            raise LoadReadError(PROMETHEUS_UNAVAILABLE, f"{url} did not answer JSON: {raw[:200]!r}") from None
        if not isinstance(body, dict) or body.get("status") != "success":
            err = body.get("error") if isinstance(body, dict) else None
            raise LoadReadError(PROMETHEUS_QUERY_FAILED, f"{url}: query failed: {err or body!r}"[:500])
        return body

    def query_range(self, query: str, start: float, end: float, step: float) -> dict:
        """``/api/v1/query_range`` body (``status``, ``data.resultType == 'matrix'``, ``data.result``)."""
        return self._get("/api/v1/query_range",
                         {"query": query, "start": repr(float(start)), "end": repr(float(end)),
                          "step": repr(float(step)), "timeout": f"{self.timeout:g}s"})

    def query(self, query: str, time: float | None = None) -> dict:
        params: dict[str, Any] = {"query": query, "timeout": f"{self.timeout:g}s"}
        if time is not None:
            params["time"] = repr(float(time))
        return self._get("/api/v1/query", params)
