"""The pod's dedicated ``/metrics`` server (port ``eplb-metrics``, 9400).

Always answers in the classic Prometheus text format (``text/plain; version=0.0.4``), whatever the
scraper's ``Accept`` header asks for: Prometheus asks for OpenMetrics first, and serving the same
bytes in every case keeps every name exactly as documented.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from moe_eplb.exporter import names

log = logging.getLogger("moe_eplb.exporter")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def make_registry(collector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


class _Handler(BaseHTTPRequestHandler):
    registry: CollectorRegistry

    def do_GET(self):  # noqa: N802 - http.server API
        path = self.path.split("?", 1)[0]
        if path == names.EXPORTER_PATH:
            try:
                body, status, ctype = generate_latest(self.registry), 200, CONTENT_TYPE
            except Exception as exc:  # noqa: BLE001
                log.exception("moe-eplb exporter: collecting failed")
                body, status, ctype = f"collect failed: {exc}\n".encode(), 500, "text/plain"
        elif path in ("/", "/healthz"):
            body, status, ctype = b"moe-eplb exporter: see /metrics\n", 200, "text/plain"
        else:
            body, status, ctype = b"not found\n", 404, "text/plain"
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the scraper gave up (timeout); nothing to do

    def log_message(self, fmt, *args):  # keep vLLM's log clean
        pass


def serve(registry: CollectorRegistry, address: str, port: int) -> ThreadingHTTPServer:
    """Start serving in a daemon thread; returns the server (``server_address[1]`` is the port)."""
    handler = type("MoeEplbMetricsHandler", (_Handler,), {"registry": registry})
    httpd = ThreadingHTTPServer((address, port), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, name="moe-eplb-metrics", daemon=True)
    thread.start()
    return httpd
