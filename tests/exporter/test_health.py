"""The exporter's health endpoints (``/livez``, ``/readyz``, ``/drain``): the heartbeat a worker keeps,
the stuck and gone checks, the drain's stop rules, and the endpoints over real HTTP of the exporter's
own server (:mod:`moe_eplb.exporter.server`). The drain against a real vLLM engine is
``tests/vllm_engine/test_engine_drain.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry

from moe_eplb.contracts import k8s_names
from moe_eplb.exporter import health as h
from moe_eplb.exporter.drain import drain_url, request_drain
from moe_eplb.exporter.drain import main as drain_main
from moe_eplb.exporter.server import from_loopback, serve

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {run}
vllm:num_requests_running{{engine="1",model_name="m"}} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {wait}
vllm:num_requests_running_total_not_this 7
"""


def test_requests_in_flight_sums_running_and_waiting_over_engines():
    assert h.requests_in_flight(VLLM_METRICS.format(run=2.0, wait=1.0)) == 3.0
    assert h.requests_in_flight(VLLM_METRICS.format(run=0.0, wait=0.0)) == 0.0
    assert h.requests_in_flight("") == 0.0


def test_heartbeat_file_and_stuck_rule(tmp_path):
    t = [100.0]
    beat = h.Heartbeat(str(tmp_path), clock=lambda: t[0])
    beat.step_ended()
    (b,) = h.read_beats(str(tmp_path))
    assert (b.pid, b.forward_began, b.last_step) == (os.getpid(), 0.0, 100.0)
    t[0] = 200.0
    beat.forward_began()
    t[0] = 250.0
    beat.forward_began()  # a second forward of the same step does not move the start
    (b,) = h.read_beats(str(tmp_path))
    assert b.forward_began == 200.0
    assert h.beat_problems([b], now=700.0, stuck_seconds=600) == []
    (why,) = h.beat_problems([b], now=801.0, stuck_seconds=600)
    assert f"worker process {os.getpid()} is stuck" in why and "601s ago" in why
    beat.step_ended()  # the step came after all: live again, however long it took
    (b,) = h.read_beats(str(tmp_path))
    assert b.forward_began == 0.0 and h.beat_problems([b], now=10_000.0, stuck_seconds=600) == []
    # an idle engine (no forward under way) is never stuck
    assert h.beat_problems([h.Beat(os.getpid(), 0.0, 1.0)], now=1e9, stuck_seconds=1) == []


def test_a_worker_process_that_is_gone_is_not_live(tmp_path):
    code = ("import sys; from moe_eplb.exporter.health import Heartbeat; "
            "Heartbeat(sys.argv[1]).step_ended()")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=env, timeout=60)
    (b,) = h.read_beats(str(tmp_path))
    assert b.pid != os.getpid()
    (why,) = h.beat_problems([b], now=time.monotonic(), stuck_seconds=600)
    assert why == f"worker process {b.pid} is gone"


def test_settings_from_the_rendered_env():
    api = h.HealthSettings.from_env({k8s_names.ENGINE_ROLE_ENV: "api", k8s_names.DRAIN_SECONDS_ENV: "120"})
    assert (api.role, api.api_url, api.drain_seconds) == ("api", "http://127.0.0.1:8000", 120.0)
    worker = h.HealthSettings.from_env({k8s_names.ENGINE_ROLE_ENV: "worker",
                                        k8s_names.LWS_LEADER_ADDRESS_ENV: "m-0.m.ns"})
    assert (worker.role, worker.api_url, worker.drain_seconds) == ("worker", "http://m-0.m.ns:8000", 600.0)
    assert h.HealthSettings.from_env({k8s_names.ENGINE_ROLE_ENV: "worker"}).api_url is None
    odd = h.HealthSettings.from_env({k8s_names.DRAIN_SECONDS_ENV: "soon", h.ENV_STUCK_SECONDS: "-1"})
    assert (odd.drain_seconds, odd.stuck_seconds) == (600.0, 600.0)


class FakeVllm:
    """vLLM's /metrics and /health as a callable: running requests over (fake) time."""

    def __init__(self, running: list[float], health: int = 200) -> None:
        self.running, self.health, self.calls = list(running), health, []

    def __call__(self, url: str, timeout: float) -> tuple[int, str]:
        self.calls.append(url)
        if url.endswith("/health"):
            return self.health, ""
        if not self.running:
            return 0, ""  # the API is gone
        return 200, VLLM_METRICS.format(run=self.running.pop(0), wait=0.0)


def _health(vllm: FakeVllm, directory=None, **kw) -> tuple[h.PodHealth, list[float]]:
    t = [0.0]

    def sleep(s: float) -> None:
        t[0] += s

    settings = h.HealthSettings(**{"drain_seconds": 60.0, "drain_min_seconds": 5.0, **kw})
    return h.PodHealth(settings, directory, get=vllm, clock=lambda: t[0], sleep=sleep), t


def test_drain_waits_for_the_requests_in_flight_and_at_least_the_minimum():
    vllm = FakeVllm([2, 2, 1, 0, 0, 0, 0, 0, 0, 0])
    ph, t = _health(vllm)
    assert ph.ready() == (True, "ready")
    assert ph.drain() == "drained: no request in flight after 5.0s"
    assert ph.ready() == (False, "draining") and ph.live()[0]  # unready while draining, still live
    vllm = FakeVllm([3, 2, 1, 1, 1, 1, 1, 0])  # longer than the minimum
    ph, t = _health(vllm)
    assert ph.drain() == "drained: no request in flight after 7.0s"


def test_drain_ends_when_the_time_is_up_or_the_api_is_gone():
    ph, t = _health(FakeVllm([1] * 100), drain_seconds=10.0)
    assert ph.drain() == "drain time 10s is up with 1.0 request(s) in flight" and t[0] == 10.0
    ph, t = _health(FakeVllm([1, 1]))  # a worker's leader exits after its own drain
    assert ph.drain() == "drained: vLLM's API at http://127.0.0.1:8000 is gone after 2.0s"
    ph, _ = _health(FakeVllm([]), role="worker", api_url=None)
    assert ph.drain() == "drained: no API to wait for"


def test_live_and_ready_follow_vllm_health_in_an_api_pod(tmp_path):
    vllm = FakeVllm([], health=503)
    ph, _ = _health(vllm, str(tmp_path))
    assert ph.live() == (False, "vLLM's /health answers 503")
    assert ph.ready() == (False, "vLLM's /health answers 503")
    worker, _ = _health(FakeVllm([], health=503), str(tmp_path), role="worker", api_url="http://leader:8000")
    assert worker.live() == (True, "live") and worker.ready() == (True, "live")  # a worker: its own processes


def test_the_endpoints_over_http(tmp_path):
    """The exporter's server answers the rendered probe paths; /drain blocks until vLLM is idle."""
    running = {"n": 1}

    class Vllm(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = b"" if self.path == "/health" else VLLM_METRICS.format(run=running["n"], wait=0).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    vllm = ThreadingHTTPServer(("127.0.0.1", 0), Vllm)
    threading.Thread(target=vllm.serve_forever, daemon=True).start()
    settings = h.HealthSettings(api_url=f"http://127.0.0.1:{vllm.server_address[1]}", drain_min_seconds=0.0,
                                poll_seconds=0.05, stuck_seconds=0.5)
    beat = h.Heartbeat(str(tmp_path))
    beat.step_ended()
    server = serve(CollectorRegistry(), "127.0.0.1", 0, health=h.PodHealth(settings, str(tmp_path)))
    base = f"http://127.0.0.1:{server.server_address[1]}"

    def get(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(base + path, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def post(path: str) -> tuple[int, str]:
        return request_drain(base + path, 30)

    try:
        assert get(k8s_names.EXPORTER_LIVE_PATH) == (200, "live\n")
        assert get(k8s_names.EXPORTER_READY_PATH) == (200, "ready\n")
        beat.forward_began()  # and no step follows
        time.sleep(0.7)
        status, text = get(k8s_names.EXPORTER_LIVE_PATH)
        assert status == 503 and "is stuck" in text
        beat.step_ended()
        assert get(k8s_names.EXPORTER_LIVE_PATH)[0] == 200
        result = {}
        drain = threading.Thread(target=lambda: result.setdefault("r", post(k8s_names.EXPORTER_DRAIN_PATH)))
        drain.start()
        time.sleep(0.3)
        assert drain.is_alive()  # a request is still running
        assert get(k8s_names.EXPORTER_READY_PATH) == (503, "draining\n")
        running["n"] = 0
        drain.join(10)
        assert result["r"][0] == 200 and result["r"][1].startswith("drained: no request in flight")
    finally:
        server.shutdown()
        vllm.shutdown()


@pytest.mark.parametrize("path", ["/nope"])
def test_other_paths_stay_404(path):
    server = serve(CollectorRegistry(), "127.0.0.1", 0, health=h.PodHealth(h.HealthSettings(), None))
    try:
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}{path}", timeout=10)
        assert exc.value.code == 404
    finally:
        server.shutdown()


def test_a_drain_not_followed_by_the_stop_expires():
    """Drained (the hook ran) but the pod was never stopped: unready only until the drain time plus
    60 s (the rest of terminationGracePeriodSeconds) has passed, then ready again; a later drain
    starts afresh."""
    ph, t = _health(FakeVllm([0] * 20), drain_seconds=60.0, drain_min_seconds=0.0)
    assert ph.drain().startswith("drained: no request in flight")
    assert ph.settings.drain_expiry_seconds == 120.0
    t[0] = 119.0
    assert ph.ready() == (False, "draining")
    t[0] = 120.0
    assert ph.ready() == (True, "ready") and not ph.draining
    assert ph.drain().startswith("drained") and ph.drain_started == 120.0 and ph.ready()[0] is False
    env = {k8s_names.DRAIN_SECONDS_ENV: "600", h.ENV_DRAIN_EXPIRY_SECONDS: "30"}
    assert h.HealthSettings.from_env(env).drain_expiry_seconds == 30.0
    assert h.HealthSettings.from_env({k8s_names.DRAIN_SECONDS_ENV: "600"}).drain_expiry_seconds == 660.0


def test_health_and_drain_follow_every_api_server_of_the_pod():
    """Several API servers in the pod (MOE_EPLB_API_PORTS): one unhealthy port fails readiness and
    liveness, and the drain waits for the requests of all of them."""
    settings = h.HealthSettings.from_env({k8s_names.API_PORTS_ENV: "8000,8001,8002"})
    assert settings.api_urls == ("http://127.0.0.1:8000", "http://127.0.0.1:8001", "http://127.0.0.1:8002")
    assert h.HealthSettings.from_env({k8s_names.ENGINE_ROLE_ENV: "worker", k8s_names.API_PORTS_ENV: "8000,8001",
                                      k8s_names.LWS_LEADER_ADDRESS_ENV: "l"}).api_urls == ("http://l:8000",)
    health = {8000: 200, 8001: 503, 8002: 200}
    running = {8000: [0, 0], 8001: [1, 0], 8002: [0, 0]}
    t = [0.0]

    def get(url: str, timeout: float) -> tuple[int, str]:
        port = int(url.split(":")[2].split("/")[0])
        if url.endswith("/health"):
            return health[port], ""
        n = running[port].pop(0) if len(running[port]) > 1 else running[port][0]
        return 200, VLLM_METRICS.format(run=n, wait=0.0)

    def sleep(s: float) -> None:
        t[0] += s

    ph = h.PodHealth(settings.__class__(**{**settings.__dict__, "drain_min_seconds": 0.0}), None, get=get,
                     clock=lambda: t[0], sleep=sleep)
    assert ph.ready() == (False, "vLLM's /health on port 8001 answers 503") and not ph.live()[0]
    health[8001] = 200
    assert ph.ready() == (True, "ready")
    assert ph.drain() == "drained: no request in flight after 1.0s"  # port 8001 still had one at first


class _RecordingVllm(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = b"" if self.path == "/health" else VLLM_METRICS.format(run=0, wait=0).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def _exporter(tmp_path):
    vllm = ThreadingHTTPServer(("127.0.0.1", 0), _RecordingVllm)
    threading.Thread(target=vllm.serve_forever, daemon=True).start()
    settings = h.HealthSettings(api_url=f"http://127.0.0.1:{vllm.server_address[1]}", drain_min_seconds=0.0,
                                poll_seconds=0.05)
    health = h.PodHealth(settings, str(tmp_path))
    server = serve(CollectorRegistry(), "0.0.0.0", 0, health=health)
    return vllm, server, health


def _other_address() -> str | None:
    """An address of this machine that is not loopback (as another pod or the kubelet would connect
    from), or None where there is none."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: picks the outgoing interface
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_a_drain_from_another_address_is_refused(tmp_path):
    """Only the pod's own preStop (loopback, inside the pod's network namespace) drains it: the same
    POST from another address -- another pod, the node -- is refused and the pod stays ready."""
    other = _other_address()
    if other is None:
        pytest.skip("this machine has no address other than loopback to send from")
    vllm, server, health = _exporter(tmp_path)
    port = server.server_address[1]
    try:
        status, body = request_drain(f"http://{other}:{port}{k8s_names.EXPORTER_DRAIN_PATH}", 10)
        assert status == 403 and "only from inside the pod" in body
        assert health.ready() == (True, "ready") and health.drain_started is None
        status, body = request_drain(f"http://127.0.0.1:{port}{k8s_names.EXPORTER_DRAIN_PATH}", 10)
        assert status == 200 and body.startswith("drained") and health.ready() == (False, "draining")
    finally:
        server.shutdown()
        vllm.shutdown()


def test_a_scrape_of_every_exporter_path_leaves_the_pod_ready(tmp_path):
    """A GET of any path -- a scraper following links, a curious curl of /drain -- changes nothing:
    /drain answers 405 and the pod stays ready."""
    vllm, server, health = _exporter(tmp_path)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    paths = [k8s_names.EXPORTER_PATH, k8s_names.EXPORTER_LIVE_PATH, k8s_names.EXPORTER_READY_PATH,
             k8s_names.EXPORTER_DRAIN_PATH, k8s_names.EXPORTER_DRAIN_PATH + "?now=1", "/", "/healthz", "/group"]
    try:
        for path in paths:
            try:
                with urllib.request.urlopen(base + path, timeout=10) as r:
                    status = r.status
            except urllib.error.HTTPError as exc:
                status = exc.code
            assert status != 500, path
            assert health.ready() == (True, "ready") and health.drain_started is None, path
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(base + k8s_names.EXPORTER_DRAIN_PATH, timeout=10)
        assert exc.value.code == 405 and exc.value.headers["Allow"] == "POST"
    finally:
        server.shutdown()
        vllm.shutdown()


def test_the_prestop_command_drains_through_loopback(tmp_path, capsys):
    """``python3 -m moe_eplb.exporter.drain`` (the rendered preStop) posts to the pod's own exporter
    on 127.0.0.1:$MOE_EPLB_EXPORTER_PORT and exits 0 once drained; 1 when nothing answers."""
    vllm, server, health = _exporter(tmp_path)
    port = str(server.server_address[1])
    try:
        assert drain_url({"MOE_EPLB_EXPORTER_PORT": port}) == f"http://127.0.0.1:{port}/drain"
        assert drain_url({}) == "http://127.0.0.1:9400/drain"
        assert drain_main({"MOE_EPLB_EXPORTER_PORT": port, k8s_names.DRAIN_SECONDS_ENV: "5"}) == 0
        assert "moe-eplb preStop: drained" in capsys.readouterr().out
        assert health.ready() == (False, "draining")
    finally:
        server.shutdown()
        vllm.shutdown()
    assert drain_main({"MOE_EPLB_EXPORTER_PORT": port, k8s_names.DRAIN_SECONDS_ENV: "1"}) == 1


@pytest.mark.parametrize("host,ok", [("127.0.0.1", True), ("127.8.0.3", True), ("::1", True),
                                     ("::ffff:127.0.0.1", True), ("10.0.0.7", False), ("::ffff:10.0.0.7", False),
                                     ("fe80::1%eth0", False), ("", False), ("localhost", False)])
def test_loopback_is_the_pods_own(host, ok):
    assert from_loopback(host) is ok
