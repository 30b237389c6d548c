"""The operator's relay of an elastic resize, inside an engine pod (the exporter's port).

vLLM's resize routes (``POST /scale_elastic_ep``, ``POST /is_scaling_elastic_ep``) are on the API port
and guarded by nothing (``--api-key`` covers ``/v1/*`` only). The operator does not call them across the
network: it asks this relay, on the exporter's port, with its control token
(:mod:`moe_eplb.exporter.control_auth`; refused without it), and the relay forwards the request to every
API server of its own pod on loopback (one per data-parallel rank). So the operator's calls are
authenticated, reach every rank of a pod in one request, and a resize outlives the operator's
connection (vLLM answers ``/scale_elastic_ep`` only when the operation is over, minutes later): the
relay keeps each rank's answer, keyed by the operator's operation id, for the operator to read.

* ``POST /control/elastic/scale`` ``{"op": id, "new_data_parallel_size": N, "drain_timeout": s}``
  (token): 202 and the forward starts on every API server of the pod, each in its own thread; a repeat
  of an operation it has is answered 200 and does nothing; a second operation while one runs is 409.
* ``GET /control/elastic/status``: for each API server, vLLM's ``/is_scaling_elastic_ep`` answer, whether
  it serves (``GET /v1/models``: vLLM answers 503 while a resize pauses it or after it retired the rank),
  the requests in flight (its ``/metrics``), and the forwarded operations' answers. Read-only.

Only ``contracts`` and the exporter's own ``health`` are imported (the exporter runs inside vLLM pods).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from moe_eplb.exporter.health import http_get, http_post
from moe_eplb.exporter.health import requests_in_flight as in_flight

#: vLLM's own bounds of one operation (prepare 300 s, commit 600 s) and a margin: how long a forwarded
#: ``/scale_elastic_ep`` may take on top of its drain timeout
FORWARD_MARGIN_SECONDS = 960.0
#: operations remembered (the newest)
KEEP_OPERATIONS = 8
STATUS_TIMEOUT_SECONDS = 2.0

Post = Callable[[str, dict[str, Any] | None, float], tuple[int, str]]
Get = Callable[[str, float], tuple[int, str]]


def post_json(url: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, str]:
    """(status, body) of a JSON POST; status 0 when nothing answers."""
    return http_post(url, json.dumps(body or {}).encode(), timeout, {"Content-Type": "application/json"})


def detail(text: str) -> str:
    """vLLM's reason from an error body (FastAPI's ``{"detail": ...}``, vLLM's ``{"error": ...}`` or
    ``{"message": ...}``), else the text, in one line."""
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        for key in ("detail", "error", "message"):
            if isinstance(body.get(key), (str, int, float)):
                return str(body[key])
            if isinstance(body.get(key), dict) and "message" in body[key]:
                return str(body[key]["message"])
    return " ".join(text.split())[:300]


class ElasticRelay:
    """The relay of one pod (see the module doc). ``api_urls``: its API servers (``http://127.0.0.1:8000``,
    ...); ``post``/``get``: the HTTP calls (replaced in tests); ``clock``: for the records' times."""

    def __init__(self, api_urls: tuple[str, ...], post: Post = post_json, get: Get = http_get,
                 clock: Callable[[], float] = time.time) -> None:
        self.api_urls = tuple(u.rstrip("/") for u in api_urls)
        self.post, self.get, self.clock = post, get, clock
        self._lock = threading.Lock()
        self.operations: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def scale(self, body: Any) -> tuple[int, dict[str, Any]]:
        """``POST /control/elastic/scale`` (after the token check): (status, JSON answer)."""
        if not isinstance(body, dict):
            return 400, {"error": "expected a JSON object {op, new_data_parallel_size, drain_timeout}"}
        op, size, drain = body.get("op"), body.get("new_data_parallel_size"), body.get("drain_timeout", 120)
        if not isinstance(op, str) or not op or len(op) > 128:
            return 400, {"error": "op: the operation's id (a non-empty string) is required"}
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            return 400, {"error": "new_data_parallel_size must be a positive integer"}
        if not isinstance(drain, int) or isinstance(drain, bool) or drain <= 0:
            return 400, {"error": "drain_timeout must be a positive integer"}
        if not self.api_urls:
            return 409, {"error": "this pod serves no API (no rank to resize)"}
        with self._lock:
            if op in self.operations:
                return 200, {"op": op, "accepted": False, "reason": "already received"}
            running = [o for o, rec in self.operations.items()
                       if any(r["state"] == "pending" for r in rec["ranks"].values())]
            if running:
                return 409, {"error": f"operation {running[0]} is still running on this pod"}
            record = {"target": size, "received": self.clock(),
                      "ranks": {url: {"state": "pending", "code": None, "detail": None} for url in self.api_urls}}
            self.operations[op] = record
            while len(self.operations) > KEEP_OPERATIONS:
                self.operations.popitem(last=False)
        for url in self.api_urls:
            threading.Thread(target=self._forward, args=(op, url, size, drain), daemon=True,
                             name=f"elastic-relay:{url}").start()
        return 202, {"op": op, "accepted": True, "ranks": len(self.api_urls)}

    def _forward(self, op: str, url: str, size: int, drain: int) -> None:
        code, text = self.post(f"{url}/scale_elastic_ep", {"new_data_parallel_size": size, "drain_timeout": drain},
                               float(drain) + FORWARD_MARGIN_SECONDS)
        with self._lock:
            rank = self.operations.get(op, {}).get("ranks", {}).get(url)
            if rank is not None:
                rank.update(state="done", code=code, detail=detail(text) if code != 200 else None,
                            finished=self.clock())

    def status(self) -> dict[str, Any]:
        """``GET /control/elastic/status``: every API server's view and the operations' answers."""
        ranks = []
        for url in self.api_urls:
            code, text = self.post(f"{url}/is_scaling_elastic_ep", None, STATUS_TIMEOUT_SECONDS)
            try:
                store = json.loads(text) if code == 200 else None
            except ValueError:
                store = None
            models, _ = self.get(f"{url}/v1/models", STATUS_TIMEOUT_SECONDS)
            metrics_code, metrics = self.get(f"{url}/metrics", STATUS_TIMEOUT_SECONDS)
            ranks.append({"url": url, "status": store if isinstance(store, dict) else None,
                          "statusCode": code, "statusError": None if code == 200 else detail(text),
                          "serving": True if models == 200 else False if models == 503 else None,
                          "inFlight": in_flight(metrics) if metrics_code == 200 else None})
        with self._lock:
            ops = {op: {"target": rec["target"], "ranks": [dict(r, url=u) for u, r in rec["ranks"].items()]}
                   for op, rec in self.operations.items()}
        return {"ranks": ranks, "operations": ops}
