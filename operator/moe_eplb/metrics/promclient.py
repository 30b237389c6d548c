"""A small blocking client for the Prometheus HTTP API (``/api/v1/query``, ``/api/v1/query_range``).

Standard library only. Every failure becomes :class:`~moe_eplb.metrics.errors.LoadReadError`
(``PrometheusUnavailable`` for transport/HTTP/JSON problems, ``PrometheusQueryFailed`` when
Prometheus answers ``status: error``). Call it from async code with ``asyncio.to_thread``.

Transient failures are retried with exponential backoff, within the client's time budget: an
evaluation reads ~10 queries, and one refused connection, timeout, HTTP 5xx/429 or Prometheus error
of type ``timeout``, ``canceled``, ``internal`` or ``unavailable`` out of them must not turn the
whole evaluation into ``NoData``. A query Prometheus refuses (``bad_data``, ``execution``, a 4xx)
is not retried, and no retry starts once the budget (``budget`` seconds from the client's creation,
one client per evaluation) would be exceeded.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from moe_eplb.metrics.errors import (
    PROMETHEUS_QUERY_FAILED,
    PROMETHEUS_UNAVAILABLE,
    LoadReadError,
)

log = logging.getLogger("moe_eplb.metrics")

#: Prometheus ``errorType`` values of failures that may go away on their own
TRANSIENT_ERROR_TYPES = frozenset({"timeout", "canceled", "internal", "unavailable"})


class _Transient(LoadReadError):
    """A failure worth retrying (see the module doc)."""


class PrometheusClient:
    """``retries``: extra attempts of a query after a transient failure (0: none); ``backoff``: the
    first wait in seconds, doubling; ``budget``: seconds from now after which no retry starts (None:
    only ``retries`` bound them). ``sleep`` / ``clock`` are replaceable for tests."""

    def __init__(self, url: str, timeout: float = 10.0, *, retries: int = 3, backoff: float = 0.2,
                 budget: float | None = 30.0, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic):
        if not url or not url.startswith(("http://", "https://")):
            raise LoadReadError(PROMETHEUS_UNAVAILABLE,
                                f"spec.monitoring.prometheusUrl {url!r} is not an http(s) URL "
                                "(e.g. http://prometheus-operated.monitoring:9090)")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retries, self.backoff = int(retries), float(backoff)
        self._sleep, self._clock = sleep, clock
        self.deadline = None if budget is None else clock() + float(budget)
        self.attempts = 0  # HTTP requests sent (retries included)
        self.retried = 0  # of them, retries after a transient failure

    def _get(self, path: str, params: dict[str, Any]) -> dict:
        attempt = 0
        while True:
            try:
                return self._get_once(path, params)
            except _Transient as exc:
                wait = self.backoff * 2 ** attempt
                if attempt >= self.retries or (self.deadline is not None and self._clock() + wait >= self.deadline):
                    raise LoadReadError(exc.reason, exc.message + (f" (after {attempt + 1} attempts)" if attempt else "")
                                        ) from None
                log.info("prometheus: %s; retrying in %.2fs", exc.message, wait)
                self._sleep(wait)
                attempt += 1
                self.retried += 1

    def _get_once(self, path: str, params: dict[str, Any]) -> dict:
        query = urllib.parse.urlencode(params)
        url = f"{self.url}{path}"
        req = urllib.request.Request(url, data=query.encode(), method="POST",
                                     headers={"Content-Type": "application/x-www-form-urlencoded",
                                              "Accept": "application/json"})
        self.attempts += 1
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            transient = exc.code >= 500 or exc.code == 429
            try:
                body = json.loads(raw)
            except ValueError:
                err = _Transient if transient else LoadReadError
                raise err(PROMETHEUS_UNAVAILABLE, f"{url} answered HTTP {exc.code}: {raw[:200]!r}") from None
            kind = body.get("errorType", "error") if isinstance(body, dict) else "error"
            err = _Transient if transient or kind in TRANSIENT_ERROR_TYPES else LoadReadError
            raise err(PROMETHEUS_QUERY_FAILED,
                      f"{url}: {kind}: {body.get('error', exc.reason) if isinstance(body, dict) else exc.reason}"
                      ) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise _Transient(PROMETHEUS_UNAVAILABLE,
                             f"cannot reach Prometheus at {self.url} ({reason}); check "
                             "spec.monitoring.prometheusUrl and that Prometheus is running") from None
        try:
            body = json.loads(raw)
        except ValueError:
            raise _Transient(PROMETHEUS_UNAVAILABLE, f"{url} did not answer JSON: {raw[:200]!r}") from None
        if not isinstance(body, dict) or body.get("status") != "success":
            err_text = body.get("error") if isinstance(body, dict) else None
            kind = body.get("errorType") if isinstance(body, dict) else None
            cls = _Transient if kind in TRANSIENT_ERROR_TYPES else LoadReadError
            raise cls(PROMETHEUS_QUERY_FAILED, f"{url}: query failed: {err_text or body!r}"[:500])
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
