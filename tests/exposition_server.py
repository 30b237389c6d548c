"""A loopback HTTP server answering ``GET`` with a Prometheus exposition body, for tests that have a
real Prometheus (or the reader) scrape a stand-in exporter."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def serve_exposition(body: Callable[[], bytes | None]) -> ThreadingHTTPServer:
    """Serve ``body()`` (text format 0.0.4) on 127.0.0.1 at a free port (``server.server_address[1]``)
    from a daemon thread; ``None`` from ``body`` answers 503 (a failed scrape). ``shutdown()`` stops it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            text = body()
            if text is None:
                self.send_response(503)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
