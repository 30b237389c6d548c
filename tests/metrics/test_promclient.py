"""Prometheus client errors become LoadReadError with a status reason."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moe_eplb.metrics.errors import LoadReadError
from moe_eplb.metrics.promclient import PrometheusClient
from moe_eplb.metrics.reader import read_load_trace


@pytest.fixture()
def fake_prom():
    """A loopback HTTP server answering what the test puts in ``answers`` (status, body, delay)."""
    answers = {}

    class H(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            status, body, delay = answers["next"]
            time.sleep(delay)
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client timed out first (the timeout case)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", answers
    srv.shutdown()


@pytest.mark.parametrize("status,body,delay,reason", [
    (400, {"status": "error", "errorType": "bad_data", "error": "parse error"}, 0, "PrometheusQueryFailed"),
    (503, "<html>down</html>", 0, "PrometheusUnavailable"),
    (200, "not json", 0, "PrometheusUnavailable"),
    (200, {"status": "success", "data": {"resultType": "matrix", "result": []}}, 0, "NoData"),
    (200, {"status": "success"}, 0.8, "PrometheusUnavailable"),  # timeout
])
def test_errors_have_reasons(fake_prom, status, body, delay, reason):
    url, answers = fake_prom
    answers["next"] = (status, body, delay)
    with pytest.raises(LoadReadError) as ei:
        read_load_trace(prometheus_url=url, namespace="ns", name="moe", window_seconds=60, bucket_seconds=15,
                        timeout=0.3)
    assert ei.value.reason == reason, ei.value.message


def test_unreachable_and_bad_url():
    with pytest.raises(LoadReadError) as ei:
        PrometheusClient("http://127.0.0.1:1", timeout=1).query("up")
    assert ei.value.reason == "PrometheusUnavailable" and "prometheusUrl" in ei.value.message
    with pytest.raises(LoadReadError, match="not an http"):
        PrometheusClient("prometheus:9090")
