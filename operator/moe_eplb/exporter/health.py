"""Health and drain of an engine pod, served by the pod's exporter process (port ``eplb-metrics``).

The operator points every engine pod's probes and its ``preStop`` hook here (``render/objects.py``):

``/livez`` (liveness)
    fails when the engine is dead or stuck: the exporter process ends with the ``vllm serve``
    process that started it (so the port stops answering when the engine's main process is gone); a
    worker process that reported a heartbeat and is gone fails it; a worker whose forward pass began
    more than ``MOE_EPLB_STUCK_SECONDS`` (default 600) ago with no EPLB step after it is stuck (a
    hung collective: the one failure that leaves every process alive). An idle engine runs no
    forward, so it is never stuck. A pod that serves the API also fails it when vLLM's own
    ``/health`` does not answer 200.
``/readyz`` (readiness)
    fails while the pod drains; else, in a pod that serves the API, it is vLLM's ``/health``; in a
    worker, it is ``/livez``.
``/drain`` (the ``preStop`` hook: a ``POST`` from the pod itself, see below)
    turns ``/readyz`` to 503 at once, then returns once vLLM reports no running or waiting request
    (``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` on its ``/metrics``, summed over
    every API server of the pod), once vLLM's API no longer answers (it has exited), or after
    ``MOE_EPLB_DRAIN_SECONDS``, whichever comes first, and never before ``MOE_EPLB_DRAIN_MIN_SECONDS``
    (default 5: the time Service endpoints take to drop the pod). A worker drains against its group's
    leader (``LWS_LEADER_ADDRESS``): it stays up while the leader still serves requests through it.

Only the pod drains itself. The port is the one Prometheus scrapes and any pod may reach, so the
server accepts a drain only as ``POST /drain`` from a loopback address (:func:`from_loopback`): the
rendered ``preStop`` hook is an ``exec`` of ``python3 -m moe_eplb.exporter.drain`` inside the engine
container, which shares the pod's network namespace (a kubelet ``httpGet`` hook would come from the
node's address instead). A ``GET /drain`` -- a scraper following paths, a curious ``curl`` --
changes nothing (405). A drain that was not followed by the stop (the hook run by hand, a stop that
never came) expires after ``MOE_EPLB_DRAIN_EXPIRY_SECONDS`` (default: the drain time plus 60 s,
the pod's whole ``terminationGracePeriodSeconds``): the pod is then ready again.

Several API servers in one pod (vLLM's multi-port supervisor: one per data-parallel rank, ports
8000, 8001, ...; ``MOE_EPLB_API_PORTS``): liveness and readiness need every one of them healthy,
and the drain waits for the requests of all of them.

Heartbeats: each worker process that runs an ``EplbState`` (the hook, :mod:`moe_eplb.exporter.hook`)
maps a 16-byte file ``beat-<pid>.bin`` in the exporter directory and stores two monotonic times in it
(no system call per step): when the forward under way began (0: none), and when its last EPLB step
ended. Without EPLB vLLM makes no ``EplbState``: liveness then covers the processes only.
"""

from __future__ import annotations

import glob
import mmap
import os
import re
import struct
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from moe_eplb.contracts import k8s_names

ENV_STUCK_SECONDS = "MOE_EPLB_STUCK_SECONDS"
ENV_DRAIN_MIN_SECONDS = "MOE_EPLB_DRAIN_MIN_SECONDS"
ENV_API_URL = "MOE_EPLB_API_URL"  # vLLM's API (default http://127.0.0.1:8000, a worker's: its leader's)
ENV_DRAIN_EXPIRY_SECONDS = "MOE_EPLB_DRAIN_EXPIRY_SECONDS"
#: a drain not followed by the stop expires this long after the drain time (vLLM's shutdown timeout
#: and the kubelet's margin: the rest of the pod's terminationGracePeriodSeconds)
DRAIN_EXPIRY_MARGIN_SECONDS = 60.0
BEAT_PREFIX = "beat-"
_BEAT = struct.Struct("<dd")  # forward began (monotonic s; 0: none under way), last step ended
#: how long vLLM's /health may take (below the readiness probe's timeoutSeconds, 5)
API_HEALTH_TIMEOUT_SECONDS = 3.0
#: series whose sum is the requests vLLM still has to finish
IN_FLIGHT_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


# --- worker side ---------------------------------------------------------------------------------


class Heartbeat:
    """A worker process's heartbeat file (created on first use, in the process that steps)."""

    def __init__(self, directory: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.directory, self.clock = directory, clock
        self._map: mmap.mmap | None = None
        self._pid: int | None = None
        self._busy = False

    def _mapped(self) -> mmap.mmap:
        if self._map is None or self._pid != os.getpid():
            path = os.path.join(self.directory, f"{BEAT_PREFIX}{os.getpid()}.bin")
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.ftruncate(fd, _BEAT.size)
                self._map = mmap.mmap(fd, _BEAT.size)
            finally:
                os.close(fd)
            self._pid, self._busy = os.getpid(), False
            _BEAT.pack_into(self._map, 0, 0.0, self.clock())
        return self._map

    def forward_began(self) -> None:
        """A forward pass starts (``EplbState.prepare_forward``); only the first of a step counts."""
        if not self._busy:
            struct.pack_into("<d", self._mapped(), 0, self.clock())
            self._busy = True

    def step_ended(self) -> None:
        """An EPLB step ended (``EplbState.step``, profile and dummy steps included)."""
        _BEAT.pack_into(self._mapped(), 0, 0.0, self.clock())
        self._busy = False


@dataclass(frozen=True)
class Beat:
    pid: int
    forward_began: float  # monotonic s; 0: no forward under way
    last_step: float


def read_beats(directory: str) -> list[Beat]:
    """The heartbeats in ``directory`` (files that cannot be read are skipped)."""
    out = []
    for path in glob.glob(os.path.join(directory, f"{BEAT_PREFIX}*.bin")):
        m = re.fullmatch(rf"{BEAT_PREFIX}(\d+)\.bin", os.path.basename(path))
        try:
            with open(path, "rb") as f:
                data = f.read(_BEAT.size)
        except OSError:
            continue
        if m is None or len(data) != _BEAT.size:
            continue
        began, last = _BEAT.unpack(data)
        out.append(Beat(int(m.group(1)), began, last))
    return sorted(out, key=lambda b: b.pid)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def beat_problems(beats: list[Beat], now: float, stuck_seconds: float,
                  alive: Callable[[int], bool] = pid_alive) -> list[str]:
    """Why the workers are not live: gone, or a forward under way for longer than ``stuck_seconds``."""
    problems = []
    for b in beats:
        if not alive(b.pid):
            problems.append(f"worker process {b.pid} is gone")
        elif b.forward_began > 0 and now - b.forward_began > stuck_seconds:
            problems.append(f"worker process {b.pid} is stuck: a forward pass began {now - b.forward_began:.0f}s ago "
                            f"and no EPLB step followed (limit {stuck_seconds:.0f}s)")
    return problems


# --- the exporter process's side -------------------------------------------------------------------


def _number(env: Mapping[str, str], key: str, default: float) -> float:
    try:
        value = float(env.get(key, "") or default)
    except ValueError:
        return default
    return value if value >= 0 and value == value else default


@dataclass(frozen=True)
class HealthSettings:
    """What the health endpoints need, from the engine container's env (rendered by the operator)."""

    role: str = k8s_names.ROLE_API
    api_url: str | None = f"http://127.0.0.1:{k8s_names.API_PORT}"
    drain_seconds: float = 600.0
    drain_min_seconds: float = 5.0
    stuck_seconds: float = 600.0
    poll_seconds: float = 1.0
    #: the pod's other API servers (vLLM's multi-port supervisor: one per data-parallel rank)
    more_api_urls: tuple[str, ...] = ()
    #: how long a drain not followed by the stop keeps the pod unready (None: drain + 60 s)
    drain_expiry: float | None = None

    @property
    def api_urls(self) -> tuple[str, ...]:
        """Every API server the pod's health and drain follow (none without an API to follow)."""
        return ((self.api_url,) if self.api_url else ()) + self.more_api_urls

    @property
    def drain_expiry_seconds(self) -> float:
        return self.drain_expiry if self.drain_expiry is not None else self.drain_seconds + DRAIN_EXPIRY_MARGIN_SECONDS

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HealthSettings:
        env = os.environ if env is None else env
        role = k8s_names.ROLE_WORKER if env.get(k8s_names.ENGINE_ROLE_ENV) == k8s_names.ROLE_WORKER \
            else k8s_names.ROLE_API
        api_url = env.get(ENV_API_URL) or None
        more: tuple[str, ...] = ()
        if api_url is None:
            host = "127.0.0.1" if role == k8s_names.ROLE_API else env.get(k8s_names.LWS_LEADER_ADDRESS_ENV)
            api_url = f"http://{host}:{k8s_names.API_PORT}" if host else None
            if role == k8s_names.ROLE_API:
                more = tuple(f"http://127.0.0.1:{p}" for p in api_ports(env.get(k8s_names.API_PORTS_ENV, ""))
                             if p != k8s_names.API_PORT)
        expiry = env.get(ENV_DRAIN_EXPIRY_SECONDS)
        return cls(role=role, api_url=api_url.rstrip("/") if api_url else None, more_api_urls=more,
                   drain_seconds=_number(env, k8s_names.DRAIN_SECONDS_ENV, 600.0),
                   drain_min_seconds=_number(env, ENV_DRAIN_MIN_SECONDS, 5.0),
                   stuck_seconds=_number(env, ENV_STUCK_SECONDS, 600.0),
                   drain_expiry=_number(env, ENV_DRAIN_EXPIRY_SECONDS, 0.0) if expiry else None)


def api_ports(text: str) -> tuple[int, ...]:
    """The ports of ``MOE_EPLB_API_PORTS`` (``8000,8001``); entries that are not ports are skipped."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if part.isdigit() and 0 < int(part) < 65536:
            out.append(int(part))
    return tuple(out)


def requests_in_flight(metrics_text: str) -> float:
    """Running + waiting requests in vLLM's ``/metrics`` (summed over engines and models)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(IN_FLIGHT_METRICS):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in IN_FLIGHT_METRICS:
                try:
                    total += float(line.rsplit(" ", 1)[1])
                except (IndexError, ValueError):
                    continue
    return total


def http_get(url: str, timeout: float) -> tuple[int, str]:
    """(status, body) of a GET; status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (OSError, ValueError):
        return 0, ""


def http_post(url: str, data: bytes, timeout: float, headers: Mapping[str, str] | None = None) -> tuple[int, str]:
    """(status, body) of a POST of ``data``; status 0 and what went wrong when nothing answers."""
    req = urllib.request.Request(url, data=data, method="POST", headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")
    except (OSError, ValueError) as exc:
        return 0, f"{type(exc).__name__}: {exc}"


class PodHealth:
    """The three endpoints' logic (the HTTP handler of :mod:`moe_eplb.exporter.server` calls it)."""

    def __init__(self, settings: HealthSettings, directory: str | None,
                 get: Callable[[str, float], tuple[int, str]] = http_get,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.settings, self.directory = settings, directory
        self.get, self.clock, self.sleep = get, clock, sleep
        self._lock = threading.Lock()
        self.drain_started: float | None = None

    @property
    def draining(self) -> bool:
        """A drain started and has not expired (:attr:`HealthSettings.drain_expiry_seconds`: a drain
        that was not followed by the stop ends, and the pod is ready again)."""
        with self._lock:
            started = self.drain_started
            if started is not None and self.clock() - started >= self.settings.drain_expiry_seconds:
                self.drain_started = started = None
            return started is not None

    def _api_health(self) -> str | None:
        if self.settings.role != k8s_names.ROLE_API:
            return None
        urls = self.settings.api_urls
        each = max(0.5, API_HEALTH_TIMEOUT_SECONDS / max(1, len(urls)))  # all within the probe's timeout
        for url in urls:
            status, _ = self.get(f"{url}/health", each)
            if status != 200:
                where = "" if len(urls) == 1 else f" on port {url.rsplit(':', 1)[-1]}"
                return f"vLLM's /health{where} answers {status or 'nothing'}"
        return None

    def live(self) -> tuple[bool, str]:
        problems = beat_problems(read_beats(self.directory), self.clock(), self.settings.stuck_seconds) \
            if self.directory else []
        api = self._api_health()
        if api:
            problems.append(api)
        return (not problems), "; ".join(problems) or "live"

    def ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        if self.settings.role == k8s_names.ROLE_API:
            api = self._api_health()
            return api is None, api or "ready"
        return self.live()

    def drain(self) -> str:
        """Stop being ready, then wait until nothing is in flight (see the module doc); a summary."""
        if not self.draining:
            with self._lock:
                self.drain_started = self.clock()
        s, start = self.settings, self.drain_started
        if start is None or not s.api_urls:
            return "drained: no API to wait for"
        while True:
            waited = self.clock() - start
            left: float | None = 0.0
            for url in s.api_urls:
                status, text = self.get(f"{url}/metrics", 5.0)
                if status == 0:
                    return f"drained: vLLM's API at {url} is gone after {waited:.1f}s"
                n = requests_in_flight(text) if status == 200 else None
                left = None if left is None or n is None else left + n
            if left == 0 and waited >= s.drain_min_seconds:
                return f"drained: no request in flight after {waited:.1f}s"
            if waited >= s.drain_seconds:
                return f"drain time {s.drain_seconds:.0f}s is up with {left if left is not None else '?'} request(s) in flight"
            self.sleep(s.poll_seconds)
