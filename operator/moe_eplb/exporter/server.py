"""The pod's dedicated ``/metrics`` server (port ``eplb-metrics``, 9400), which also answers the
pod's probes and its ``preStop`` drain (``/livez``, ``/readyz``, ``/drain``: :mod:`moe_eplb.exporter.health`).
The drain is a ``POST`` from loopback only (the pod's own ``preStop``, :mod:`moe_eplb.exporter.drain`);
any ``GET`` -- a scrape of any path -- changes nothing. The operator's resize of an elastic group is a
``POST`` with its control token, relayed to the pod's own API servers on loopback
(:mod:`moe_eplb.exporter.elastic_relay`).

It runs in its own small process (``python -m moe_eplb.exporter.server``), started by the plugin in
the pod's first vLLM process and ending when that process ends: rendering ~30 000 series takes a
fraction of a second of CPU, which must not hold the GIL of vLLM's API server (its event loop
serves the requests). With ``MOE_EPLB_TRACE_DIR`` set, this process also captures traces.

Always answers in the classic Prometheus text format (``text/plain; version=0.0.4``), whatever the
scraper's ``Accept`` header asks for: Prometheus asks for OpenMetrics first, and serving the same
bytes in every case keeps every name exactly as documented. No ``*_created`` series: they double
the series count of every counter and histogram and nothing reads them (the start time is
``moe_eplb_exporter_start_time_seconds``).

On SIGTERM (a pod shutting down, or a test stopping the engine's process group) it ends like when
its parent exits: last trace bucket written, owned directory removed.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.exposition import generate_latest

from moe_eplb.contracts import k8s_names
from moe_eplb.contracts import live_protocol as lp
from moe_eplb.exporter.group import GROUP_PATH

log = logging.getLogger("moe_eplb.exporter")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DRAIN_BY_GET = (b"the drain is started only by the pod's own preStop hook (POST from loopback: "
                b"python3 -m moe_eplb.exporter.drain); a GET changes nothing\n")
DRAIN_NOT_LOOPBACK = b"the drain is started only from inside the pod (loopback); refused\n"


def from_loopback(host: str) -> bool:
    """Whether a client address is the pod's own loopback (``127.0.0.0/8``, ``::1``, or an
    IPv4-mapped loopback): what a process inside the pod's network namespace connects from, never
    another pod or the kubelet on the node."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return bool(addr.is_loopback or (mapped is not None and mapped.is_loopback))


def make_registry(collector) -> CollectorRegistry:
    """A registry with only ``collector``; ``*_created`` series are switched off for the process
    (this is the exporter's own process, so vLLM's metrics are not affected)."""
    disable_created_metrics()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


class _Handler(BaseHTTPRequestHandler):
    registry: CollectorRegistry
    health = None  # a moe_eplb.exporter.health.PodHealth: /livez, /readyz, /drain
    group_totals = None  # a worker pod of a replica group: group.WorkerTotals (group.GROUP_PATH)
    relay = None  # an elastic_relay.ElasticRelay: the operator's resize of an elastic group
    live_directory = None  # the pod's exporter directory when live apply is on (live_control, lp.PATH)

    def _health(self, path: str) -> tuple[bytes, int, str]:
        ok, why = self.health.live() if path == k8s_names.EXPORTER_LIVE_PATH else self.health.ready()
        return (why + "\n").encode(), 200 if ok else 503, "text/plain"

    def _send(self, body: bytes, status: int, ctype: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for key, value in headers:
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the scraper gave up (timeout); nothing to do

    def _live_post(self) -> None:
        """``POST /eplb/settings``: the operator's token first (before the body is read), then the
        command (:mod:`moe_eplb.exporter.live_control`)."""
        from moe_eplb.exporter import control_auth, live_control

        refused = control_auth.check(dict(self.headers.items()))
        if refused is not None:
            log.warning("moe-eplb exporter: refused a live command from %s: %s", self.client_address[0],
                        refused.reason)
            self.close_connection = True
            return self._send(json.dumps({"protocol": lp.PROTOCOL, "error": refused.reason}).encode(),
                              refused.status, "application/json")
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 <= length <= 65536:
            return self._send(b'{"error": "body too large"}', 413, "application/json")
        status, body = live_control.answer_post(self.live_directory, self.rfile.read(length) if length else b"")
        self._send(json.dumps(body).encode(), status, "application/json")

    def do_POST(self):  # noqa: N802 - http.server API
        """``POST /drain`` from loopback (the pod's preStop): drain and answer when done;
        ``POST /eplb/settings`` with the operator's token: a live command."""
        path = self.path.split("?", 1)[0]
        if path == lp.PATH and self.live_directory is not None:
            return self._live_post()
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if 0 < length <= 65536 else b""
        if path == k8s_names.ELASTIC_SCALE_PATH and self.relay is not None:
            return self._relay_scale(body)
        if path != k8s_names.EXPORTER_DRAIN_PATH or self.health is None:
            return self._send(b"not found\n", 404, "text/plain")
        if not from_loopback(self.client_address[0]):
            log.warning("moe-eplb exporter: refused a drain from %s (only the pod's own preStop drains it)",
                        self.client_address[0])
            return self._send(DRAIN_NOT_LOOPBACK, 403, "text/plain")
        try:
            body, status = (self.health.drain() + "\n").encode(), 200
        except Exception as exc:  # noqa: BLE001
            log.exception("moe-eplb exporter: the drain failed")
            body, status = f"drain failed: {exc}\n".encode(), 500
        self._send(body, status, "text/plain")

    def _relay_scale(self, body: bytes) -> None:
        """The operator's resize (:mod:`moe_eplb.exporter.elastic_relay`): only with its control token."""
        from moe_eplb.exporter import control_auth

        refusal = control_auth.check(dict(self.headers.items()))
        if refusal is not None:
            log.warning("moe-eplb exporter: refused a resize from %s: %s", self.client_address[0], refusal.reason)
            return self._send((refusal.reason + "\n").encode(), refusal.status, "text/plain")
        try:
            status, answer = self.relay.scale(json.loads(body or b"null"))
        except ValueError:
            status, answer = 400, {"error": "the body is not JSON"}
        self._send(json.dumps(answer).encode(), status, "application/json")

    def do_GET(self):  # noqa: N802 - http.server API
        path = self.path.split("?", 1)[0]
        if path == k8s_names.ELASTIC_STATUS_PATH and self.relay is not None:
            return self._send(json.dumps(self.relay.status()).encode(), 200, "application/json")
        health_paths = (k8s_names.EXPORTER_LIVE_PATH, k8s_names.EXPORTER_READY_PATH)
        if path == k8s_names.EXPORTER_DRAIN_PATH and self.health is not None:
            return self._send(DRAIN_BY_GET, 405, "text/plain", (("Allow", "POST"),))
        if path in health_paths and self.health is not None:
            try:
                body, status, ctype = self._health(path)
            except Exception as exc:  # noqa: BLE001
                log.exception("moe-eplb exporter: %s failed", path)
                body, status, ctype = f"{path} failed: {exc}\n".encode(), 500, "text/plain"
        elif path == k8s_names.EXPORTER_PATH:
            try:
                body, status, ctype = generate_latest(self.registry), 200, CONTENT_TYPE
            except Exception as exc:  # noqa: BLE001
                log.exception("moe-eplb exporter: collecting failed")
                body, status, ctype = f"collect failed: {exc}\n".encode(), 500, "text/plain"
        elif path == GROUP_PATH and self.group_totals is not None:
            try:
                leader = urllib.parse.parse_qs(self.path.partition("?")[2]).get("leader", [""])[0]
                body, status, ctype = self.group_totals.answer(leader), 200, "application/octet-stream"
            except Exception as exc:  # noqa: BLE001
                body, status, ctype = f"group totals failed: {exc}\n".encode(), 500, "text/plain"
        elif path == lp.PATH and self.live_directory is not None:
            from moe_eplb.exporter import live_control

            status, answer = live_control.answer_get(self.live_directory)
            body, ctype = json.dumps(answer).encode(), "application/json"
        elif path in ("/", "/healthz"):
            body, status, ctype = b"moe-eplb exporter: see /metrics\n", 200, "text/plain"
        else:
            body, status, ctype = b"not found\n", 404, "text/plain"
        self._send(body, status, ctype)

    def log_message(self, fmt, *args):  # keep vLLM's log clean
        pass


def serve(registry: CollectorRegistry, address: str, port: int, bind_retry_seconds: float = 0.0,
          health=None, group_totals=None, relay=None, live_directory: str | None = None) -> ThreadingHTTPServer:
    """Start serving in a daemon thread; returns the server (``server_address[1]`` is the port).
    Retries binding for ``bind_retry_seconds`` (a previous server of a restarted engine may still
    be on its way out). ``health``: a :class:`~moe_eplb.exporter.health.PodHealth` answering the
    health paths (404 without). ``group_totals``: a worker pod's
    :class:`~moe_eplb.exporter.group.WorkerTotals`, answering its group's leader on
    :data:`~moe_eplb.exporter.group.GROUP_PATH` (:mod:`moe_eplb.exporter.group`). ``relay``: an
    :class:`~moe_eplb.exporter.elastic_relay.ElasticRelay` answering the operator's resize paths.
    ``live_directory``: the pod's exporter directory, where live commands go (``/eplb/settings``;
    None: no such route, 404 as from a plugin without live apply)."""
    handler = type("MoeEplbMetricsHandler", (_Handler,), {"registry": registry, "health": health,
                                                          "group_totals": group_totals, "relay": relay,
                                                          "live_directory": live_directory})
    deadline = time.monotonic() + bind_retry_seconds
    while True:
        try:
            httpd = ThreadingHTTPServer((address, port), handler)
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, name="moe-eplb-metrics", daemon=True)
    thread.start()
    return httpd


def run_forever(parent_pid: int | None, poll_seconds: float = 0.2) -> int:
    """Entry point of the server process: serve until the vLLM process that started us is gone."""
    from moe_eplb.exporter import settings as st
    from moe_eplb.exporter.elastic_relay import ElasticRelay
    from moe_eplb.exporter.group import WorkerTotals
    from moe_eplb.exporter.health import HealthSettings, PodHealth

    st.setup_logging()
    try:
        settings = st.Settings.from_env()
    except st.ExporterSettingsError as exc:
        log.error("moe-eplb exporter disabled: %s", exc)
        return 2
    if not settings.directory:
        log.error("moe-eplb exporter: %s is not set; nothing to serve", st.ENV_DIR)
        return 2
    collector, poller = None, None
    if settings.mode == "off":  # the health endpoints only (the probes rely on them)
        registry = CollectorRegistry(auto_describe=False)
    else:
        collector, poller = group_collector(settings)
        registry = make_registry(collector)
    health_settings = HealthSettings.from_env()
    health = PodHealth(health_settings, settings.directory)
    worker = collector is not None and collector.role.role == "worker"
    relay = ElasticRelay(health_settings.api_urls) if health_settings.role == k8s_names.ROLE_API else None
    try:
        httpd = serve(registry, settings.address, settings.port, bind_retry_seconds=10.0, health=health,
                      group_totals=WorkerTotals(collector.own) if worker else None, relay=relay,
                      live_directory=settings.directory if settings.live_apply and settings.mode != "off" else None)
    except OSError as exc:
        log.error("moe-eplb exporter: cannot serve %s:%d (%s); set %s to a free port",
                  settings.address, settings.port, exc, st.ENV_PORT)
        return 1
    log.info("moe-eplb exporter: serving %s:%d%s (mode %s, directory %s)", settings.address,
             httpd.server_address[1], k8s_names.EXPORTER_PATH, settings.mode, settings.directory)
    capture = None
    if settings.trace_dir:
        from moe_eplb.exporter.capture import TraceCapture

        capture = TraceCapture(settings.directory, settings.trace_dir, settings.trace_bucket_seconds,
                               settings.trace_max_buckets)
        capture.start()
        log.info("moe-eplb exporter: capturing traces every %.1f s into %s", settings.trace_bucket_seconds,
                 settings.trace_dir)
    stop = threading.Event()
    try:
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    except ValueError:  # not the main thread (tests)
        pass
    try:
        while (parent_pid is None or _alive(parent_pid)) and not stop.is_set():
            stop.wait(poll_seconds)
    except KeyboardInterrupt:
        pass
    if poller is not None:
        poller.stop()
    if capture is not None:
        capture.stop()
        try:
            capture.tick()  # the last partial bucket
        except Exception:  # noqa: BLE001
            pass
    httpd.shutdown()
    httpd.server_close()
    if os.environ.get(st.ENV_DIR_OWNED) == "1":  # a directory the plugin made (in /dev/shm): clean up
        import shutil

        shutil.rmtree(settings.directory, ignore_errors=True)
    return 0


def group_collector(settings):
    """The pod's collector and, on a replica group's leader, its started
    :class:`~moe_eplb.exporter.group.PeerPoller` (None elsewhere). A bad group setting is logged and
    the pod exports its own counters (the layout of a pod outside a group)."""
    from moe_eplb.exporter.collector import PodCollector
    from moe_eplb.exporter.group import GroupMerge, GroupRole, PeerPoller

    try:
        role = GroupRole.from_env(port=settings.port)
    except ValueError as exc:
        log.error("moe-eplb exporter: %s; exporting this pod's own expert counters", exc)
        role = GroupRole()
    merge = GroupMerge(settings.start_time or time.time()) if role.role == "leader" else None
    collector = PodCollector(settings.directory, settings.mode, settings.balancedness_window_seconds,
                             role=role, merge=merge)
    poller = None
    if merge is not None:
        poller = PeerPoller(role, merge, interval=settings.flush_seconds)
        poller.start()
        log.info("moe-eplb exporter: group leader: exporting the expert counters of %d pods (workers %s)",
                 role.size, ", ".join(role.peers))
    elif role.role == "worker":
        log.info("moe-eplb exporter: group worker %d: expert counters served to the leader on %s",
                 role.worker, GROUP_PATH)
    return collector, poller


def _alive(pid: int) -> bool:
    from moe_eplb.exporter.health import pid_alive

    return os.getppid() == pid and pid_alive(pid)  # not re-parented: our parent has not exited


if __name__ == "__main__":
    _pid = os.environ.get("MOE_EPLB_EXPORTER_SERVER_PID", "")
    sys.exit(run_forever(int(_pid) if _pid.isdigit() else None))
