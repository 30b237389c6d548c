"""SIMULATED vLLM external elastic EP (0.33/0.34): the resize protocol of one elastic group, for tests
and the demo. Not vLLM.

What it reproduces (read from vLLM 0.34's ``distributed/elastic_ep/external_elastic_ep.py``,
``entrypoints/serve/elastic_ep/api_router.py`` and ``middleware.py``, ``v1/engine/async_llm.py``):

* one coordination store per group (:class:`ElasticGroup`): the current operation's ``epoch`` (a new
  uuid per operation), ``phase`` (``idle``, ``preparing``, ``committing``, ``failed``, ``completed``),
  ``error`` and ``requested_data_parallel_size``; every rank reads the same;
* ``scale_elastic_ep(N)`` on a rank (:meth:`Rank.scale`): refused at once (``ValueError``, 400) above
  ``--elastic-ep-max-dp-size`` or where ``R' = (E + R) N / DP - E`` is negative; the same size as now
  returns at once; otherwise the rank takes part in the group's operation for N (a different N while one
  runs: ``RuntimeError``, 500) and returns when it is over: completed, failed (``RuntimeError``, 500) or
  timed out waiting for the new ranks (``TimeoutError``, which vLLM's router answers 408);
* prepare: every old rank must ask, and (grow) every new rank must have been launched (a pod started
  with the scale-up flag) and loaded (``join_seconds``) within ``prepare_timeout``; a failure here
  leaves the old ranks serving;
* commit: every old rank is paused (503 "The model is currently scaling") for ``commit_seconds``; a
  failure here leaves them paused (vLLM clears the gate only after a successful commit); completed:
  the new size serves, the retired ranks answer 503 ("retired and is awaiting shutdown");
* a failure on demand (:class:`ElasticFaults`: ``fail_at`` ``preparing`` or ``committing``).

Each rank is an HTTP server (:class:`ElasticPod`: one per API port of a pod, on the pod's IP) answering
``/scale_elastic_ep``, ``/is_scaling_elastic_ep``, ``/health``, ``/v1/models``, ``/v1/completions`` (the
load: served or refused as vLLM's middleware would) and ``/metrics`` (requests in flight); the pod's
exporter port serves the product's own relay (:class:`moe_eplb.exporter.elastic_relay.ElasticRelay`,
the control token checked as the real exporter does) and its health. :class:`RankClient` is the same
rank as vLLM's ``EngineClient`` sees it (async), so vLLM's own router can be driven with it
(tests/controller/test_elastic_vllm_router.py).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from moe_eplb.api import elastic as el
from moe_eplb.contracts import k8s_names
from moe_eplb.exporter import control_auth
from moe_eplb.exporter.elastic_relay import ElasticRelay

SCALING_MESSAGE = "The model is currently scaling. Please try again later."
RETIRED_MESSAGE = "This data-parallel rank has been retired and is awaiting shutdown."
PREPARE_TIMEOUT_MESSAGE = "Timed out waiting for external Elastic EP ranks to prepare."
#: rank states
STARTING, SERVING, WAITING, ORPHANED, RETIRED = "starting", "serving", "waiting", "orphaned", "retired"


@dataclass
class ElasticFaults:
    """Injected behaviour: ``fail_at`` makes the NEXT operation fail in that phase with ``error``;
    ``join_seconds`` is how long a new rank loads before it can commit, ``commit_seconds`` the pause,
    ``prepare_timeout`` vLLM's bound on the new ranks, ``launch_seconds`` the founders' start-up,
    ``request_seconds`` how long one completion takes."""

    fail_at: str | None = None
    error: str = "simulated failure"
    join_seconds: float = 1.0
    commit_seconds: float = 0.5
    prepare_timeout: float = el.VLLM_PREPARE_TIMEOUT_S
    launch_seconds: float = 1.0
    request_seconds: float = 0.02


@dataclass
class _Op:
    epoch: str
    requested: int
    old: int
    started: float
    phase: str = el.VLLM_PREPARING
    error: str | None = None
    kind: str = ""  # the exception a failed operation raised in each rank: value, timeout, runtime
    asked: set[int] = field(default_factory=set)
    commit_end: float | None = None
    fail_at: str | None = None


@dataclass
class _Rank:
    rank: int
    pod: str
    state: str
    since: float
    founder: bool


class ElasticGroup:
    """One group's shared store and ranks (see the module doc). ``launch``: the founders' size;
    ``max_data``: ``--elastic-ep-max-dp-size``; ``experts``/``redundant``: for vLLM's ``R'``."""

    def __init__(self, key: tuple[str, str], *, launch: int, data_local: int, max_data: int, experts: int | None,
                 redundant: int, faults: ElasticFaults | None = None, clock: Callable[[], float] = time.time) -> None:
        self.key, self.launch, self.data_local, self.max_data = key, launch, data_local, max_data
        self.experts, self.redundant = experts, redundant
        self.faults = faults or ElasticFaults()
        self.clock = clock
        self.cond = threading.Condition()
        self.dp: int | None = None
        self.launched_at: float | None = None
        self.ranks: dict[int, _Rank] = {}
        self.op: _Op | None = None
        self.paused = False
        self.history: list[tuple[float, str, str]] = []  # (time, event, detail): the group's timeline
        self.served: Counter[int] = Counter()
        self.refused: Counter[int] = Counter()
        self.in_flight: Counter[int] = Counter()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._run, daemon=True, name=f"elastic-group:{key[1]}")
        self._ticker.start()

    # --- membership (the node agent: pods appear and go) ------------------------------------------
    def attach(self, pod: str, ranks: tuple[int, ...], *, founder: bool) -> None:
        with self.cond:
            now = self.clock()
            for r in ranks:
                self.ranks[r] = _Rank(r, pod, STARTING if founder else WAITING, now, founder)
            self._note(f"pod {pod} started", f"ranks {ranks[0]}-{ranks[-1]}")
            self.cond.notify_all()

    def detach(self, pod: str) -> None:
        """A pod is gone: its ranks leave; a founder's loss ends the group (its collectives end with
        it): every other rank is orphaned and the group launches again when the founders are back."""
        with self.cond:
            gone = [r for r, x in self.ranks.items() if x.pod == pod]
            founder = any(self.ranks[r].founder for r in gone)
            for r in gone:
                del self.ranks[r]
            self._note(f"pod {pod} gone", f"ranks {gone}")
            if founder and self.dp is not None:
                self.dp, self.launched_at, self.paused = None, None, False
                if self.op is not None and self.op.phase in (el.VLLM_PREPARING, el.VLLM_COMMITTING):
                    self._end(el.VLLM_FAILED, "the group lost its rank 0", "runtime")
                self.op = None
                for x in self.ranks.values():
                    if not x.founder:
                        x.state = ORPHANED
                self._note("group lost", "founding pod gone")
            self.cond.notify_all()

    def pods(self) -> set[str]:
        with self.cond:
            return {x.pod for x in self.ranks.values()}

    # --- what a rank answers ---------------------------------------------------------------------
    def serving(self, rank: int) -> tuple[bool, str]:
        """(serves a completion now, vLLM's message when not)."""
        with self.cond:
            x = self.ranks.get(rank)
            if x is None or x.state in (STARTING, WAITING, ORPHANED) or self.dp is None:
                return False, "not up"
            if x.state == RETIRED:
                return False, RETIRED_MESSAGE
            if self.paused and rank < (self.op.old if self.op else self.dp):
                return False, SCALING_MESSAGE
            return True, ""

    def api_up(self, rank: int) -> bool:
        """The rank's API server runs (its ``/health`` answers): founders once launched, a new rank once
        joined; paused and retired ranks still answer ``/health`` (observability paths)."""
        with self.cond:
            x = self.ranks.get(rank)
            return x is not None and self.dp is not None and x.state in (SERVING, RETIRED)

    def status(self) -> dict[str, Any]:
        """``get_external_elastic_ep_status()``: the store's view (503 in the router while unreachable)."""
        with self.cond:
            if self.dp is None:
                raise ConnectionError("the group's store is not reachable (rank 0 is not up)")
            op = self.op
            if op is None:
                return {"phase": el.VLLM_IDLE, "epoch": None, "error": None, "requested_data_parallel_size": None}
            return {"phase": op.phase, "epoch": op.epoch, "error": op.error, "requested_data_parallel_size": op.requested}

    def scale(self, rank: int, new_size: int) -> str:
        """A rank's ``scale_elastic_ep(new_size)``: blocks until the operation is over (see the module
        doc); returns vLLM's message, or raises ``ValueError`` / ``TimeoutError`` / ``RuntimeError``."""
        with self.cond:
            if self.dp is None or rank not in self.ranks:
                raise RuntimeError("this rank is not part of a running group")
            if new_size > self.max_data:
                raise ValueError(f"Cannot scale to data_parallel_size {new_size}; --elastic-ep-max-dp-size is "
                                 f"{self.max_data}.")
            if self.experts and (self.experts + self.redundant) * new_size // self.dp - self.experts < 0:
                raise ValueError(f"Cannot scale external Elastic EP from DP size {self.dp} to {new_size}: the "
                                 "target topology cannot retain all model experts.")
            if new_size == self.dp:
                return f"Data parallel size is already {new_size}"
            op = self.op
            if op is None or op.phase in (el.VLLM_FAILED, el.VLLM_COMPLETED):
                op = self.op = _Op(uuid.uuid4().hex, new_size, self.dp, self.clock(), fail_at=self.faults.fail_at)
                self.faults.fail_at = None
                self._note("preparing", f"epoch {op.epoch[:8]}: {self.dp} -> {new_size}")
            elif op.requested != new_size:
                raise RuntimeError("A different external Elastic EP scaling operation is already in progress "
                                   f"for target dp size {op.requested}.")
            op.asked.add(rank)
            self.cond.notify_all()
            while op.phase in (el.VLLM_PREPARING, el.VLLM_COMMITTING) and not self._stop.is_set():
                self.cond.wait(0.05)
            if op.phase == el.VLLM_COMPLETED:
                return f"Scaled to {new_size} data parallel engines"
            if op.kind == "timeout":
                raise TimeoutError(op.error)
            raise RuntimeError(op.error)

    # --- the group's own progress ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(0.02):
            with self.cond:
                self._step(self.clock())

    def _step(self, now: float) -> None:
        f = self.faults
        if self.dp is None:  # launch once every founding rank is there and loaded
            founders = [x for x in self.ranks.values() if x.founder]
            if len(founders) >= self.launch and all(now - x.since >= f.launch_seconds for x in founders):
                self.dp, self.launched_at = self.launch, now
                for x in founders:
                    x.state = SERVING
                self._note("launched", f"{self.launch} ranks")
                self.cond.notify_all()
            return
        op = self.op
        if op is None or op.phase not in (el.VLLM_PREPARING, el.VLLM_COMMITTING):
            return
        if op.phase == el.VLLM_PREPARING:
            self._prepare(op, now)
        elif now >= (op.commit_end or now):
            if op.fail_at == el.VLLM_COMMITTING:
                self._end(el.VLLM_FAILED, f.error, "runtime")  # the old ranks stay paused
            else:
                self._commit(op)

    def _prepare(self, op: _Op, now: float) -> None:
        f = self.faults
        if op.fail_at == el.VLLM_PREPARING:  # fails a moment into prepare, whatever else is ready
            if now - op.started > 0.2:
                self._end(el.VLLM_FAILED, f.error, "runtime")
            return
        old = set(range(op.old))
        new = set(range(op.old, op.requested))
        joined = {r for r in new if r in self.ranks and self.ranks[r].state == WAITING
                  and now - max(self.ranks[r].since, op.started) >= f.join_seconds}
        if not old <= op.asked or joined != new:
            if now - op.started > f.prepare_timeout:
                self._end(el.VLLM_FAILED, PREPARE_TIMEOUT_MESSAGE, "timeout")
            return
        op.phase, op.commit_end, self.paused = el.VLLM_COMMITTING, now + f.commit_seconds, True
        self._note("committing", f"epoch {op.epoch[:8]}")
        self.cond.notify_all()

    def _commit(self, op: _Op) -> None:
        for r, x in self.ranks.items():
            if op.old <= r < op.requested:
                x.state = SERVING
            elif r >= op.requested and r < op.old:
                x.state = RETIRED
        if self.experts:  # every rank's eplb_config.num_redundant_experts becomes R' (_update_parallel_config)
            self.redundant = (self.experts + self.redundant) * op.requested // op.old - self.experts
        self.dp, self.paused = op.requested, False
        self._end(el.VLLM_COMPLETED, None, "")

    def _end(self, phase: str, error: str | None, kind: str) -> None:
        op = self.op
        assert op is not None
        op.phase, op.error, op.kind = phase, error, kind
        self._note(phase, f"epoch {op.epoch[:8]}" + (f": {error}" if error else ""))
        self.cond.notify_all()

    def _note(self, event: str, detail: str) -> None:
        self.history.append((self.clock(), event, detail))

    def close(self) -> None:
        self._stop.set()
        with self.cond:
            self.cond.notify_all()

    # --- the load ---------------------------------------------------------------------------------
    def complete(self, rank: int) -> tuple[int, dict[str, Any]]:
        """One completion on ``rank``: (200, a body) when it serves, else (503, vLLM's error)."""
        ok, why = self.serving(rank)
        if not ok:
            with self.cond:
                self.refused[rank] += 1
            return 503, {"error": why}
        with self.cond:
            self.in_flight[rank] += 1
        time.sleep(self.faults.request_seconds)
        with self.cond:
            self.in_flight[rank] -= 1
            self.served[rank] += 1
        return 200, {"object": "text_completion", "choices": [{"index": 0, "text": "ok"}], "rank": rank}


class RankClient:
    """One rank as vLLM's ``EngineClient`` (the part the elastic EP router calls), async."""

    def __init__(self, group: ElasticGroup, rank: int) -> None:
        self.group, self.rank = group, rank

    async def scale_elastic_ep(self, new_data_parallel_size: int, drain_timeout: int = 300) -> None:
        await asyncio.to_thread(self.group.scale, self.rank, new_data_parallel_size)

    async def get_external_elastic_ep_status(self) -> dict[str, Any]:
        return self.group.status()


def route(group: ElasticGroup, rank: int, method: str, path: str, body: bytes) -> tuple[int, dict[str, Any] | str]:
    """What a rank's API server answers (vLLM's router and middleware, as the module doc says)."""
    observability = path in ("/health", el.STATUS_PATH)
    if method == "POST" and path == el.SCALE_PATH:
        return _scale_route(group, rank, body)
    if method == "POST" and path == el.STATUS_PATH:
        try:
            st = group.status()
        except ConnectionError:
            return 503, {"detail": "External Elastic EP status is temporarily unavailable"}
        return 200, {"is_scaling_elastic_ep": st["phase"] in (el.VLLM_PREPARING, el.VLLM_COMMITTING), **st}
    if path == "/health":
        return (200, "") if group.api_up(rank) else (503, "")
    if not group.api_up(rank):
        return 503, {"error": "engine not ready"}
    if path == "/metrics":
        with group.cond:
            n = group.in_flight[rank]
        label = f'{{engine="{rank}"}}'
        return 200, f"vllm:num_requests_running{label} {float(n)}\nvllm:num_requests_waiting{label} 0.0\n"
    if not observability:
        ok, why = group.serving(rank)
        if not ok:
            return 503, {"error": why}
    if path == "/v1/models":
        return 200, {"object": "list", "data": [{"id": "simulated"}]}
    if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
        return group.complete(rank)
    return 404, {"detail": "Not Found"}


def _scale_route(group: ElasticGroup, rank: int, body: bytes) -> tuple[int, dict[str, Any]]:
    try:
        req = json.loads(body or b"null")
    except ValueError:
        return 400, {"detail": "Invalid JSON format"}
    size = req.get("new_data_parallel_size") if isinstance(req, dict) else None
    drain = req.get("drain_timeout", 120) if isinstance(req, dict) else 120
    if size is None:
        return 400, {"detail": "new_data_parallel_size is required"}
    if not isinstance(size, int) or size <= 0:
        return 400, {"detail": "new_data_parallel_size must be a positive integer"}
    if not isinstance(drain, int) or drain <= 0:
        return 400, {"detail": "drain_timeout must be a positive integer"}
    try:
        group.scale(rank, size)
    except TimeoutError:
        return 408, {"detail": f"Scale failed due to request drain timeout after {drain} seconds"}
    except ValueError as exc:
        return 400, {"detail": str(exc)}
    except Exception:  # noqa: BLE001 - vLLM's router answers any other failure so
        return 500, {"detail": "Scale failed"}
    return 200, {"message": f"Scaled to {size} data parallel engines"}


def _server(host: str, port: int, answer: Callable[[str, str, bytes, dict[str, str], str], tuple[int, Any]]
            ) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _do(self, method: str) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if 0 < n <= 1 << 20 else b""
            status, out = answer(method, self.path.split("?", 1)[0], body, dict(self.headers.items()),
                                 self.client_address[0])
            data = out.encode() if isinstance(out, str) else json.dumps(out).encode()
            ctype = "text/plain" if isinstance(out, str) else "application/json"
            try:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def do_GET(self) -> None:  # noqa: N802
            self._do("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._do("POST")

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass

    return Server((host, port), Handler)


class ElasticPod:
    """The HTTP side of one pod of an elastic group: an API server per rank on ``ip:8000+i`` and the
    exporter's port (the relay, ``/livez``, ``/readyz``, ``/metrics``). ``token_file``: the pod's
    mounted control token (the operator's Secret, as the kubelet mounts it)."""

    def __init__(self, group: ElasticGroup, name: str, ip: str, ranks: tuple[int, ...], *, exporter_port: int,
                 token_file: str | None) -> None:
        self.group, self.name, self.ip, self.ranks = group, name, ip, ranks
        self.exporter_port, self.token_file = exporter_port, token_file
        self.api_ports = tuple(k8s_names.API_PORT + i for i in range(len(ranks)))
        self.relay = ElasticRelay(tuple(f"http://{ip}:{p}" for p in self.api_ports))
        self.refused_control: list[str] = []  # addresses whose control requests were refused
        self._servers: list[ThreadingHTTPServer] = []

    @property
    def ready(self) -> bool:
        return all(self.group.api_up(r) for r in self.ranks)

    def start(self) -> None:
        for rank, port in zip(self.ranks, self.api_ports):
            self._serve(_server(self.ip, port, lambda m, p, b, h, a, rank=rank: route(self.group, rank, m, p, b)))
        self._serve(_server(self.ip, self.exporter_port, self._exporter))

    def _serve(self, server: ThreadingHTTPServer) -> None:
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
        self._servers.append(server)

    def _exporter(self, method: str, path: str, body: bytes, headers: dict[str, str], client: str) -> tuple[int, Any]:
        if method == "POST" and path == k8s_names.ELASTIC_SCALE_PATH:
            refusal = control_auth.check(headers, self.token_file or "")
            if refusal is not None:
                self.refused_control.append(client)
                return refusal.status, refusal.reason + "\n"
            try:
                return self.relay.scale(json.loads(body or b"null"))
            except ValueError:
                return 400, {"error": "the body is not JSON"}
        if method == "GET" and path == k8s_names.ELASTIC_STATUS_PATH:
            return 200, self.relay.status()
        if path == k8s_names.EXPORTER_READY_PATH:
            return (200, "ready\n") if self.ready else (503, "vLLM's /health fails\n")
        if path == k8s_names.EXPORTER_LIVE_PATH:
            return 200, "live\n"
        if path == k8s_names.EXPORTER_PATH:
            return 200, ""
        return 404, "not found\n"

    def stop(self) -> None:
        servers, self._servers = self._servers, []
        for s in servers:
            s.shutdown()
            s.server_close()


class ElasticGroups:
    """The groups a node agent runs, by ``(namespace, resource name)``; ``faults`` of new groups."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.groups: dict[tuple[str, str], ElasticGroup] = {}
        self.faults: dict[tuple[str, str], ElasticFaults] = {}

    def group(self, key: tuple[str, str], **kw: Any) -> ElasticGroup:
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = ElasticGroup(key, faults=self.faults.get(key), clock=self.clock, **kw)
        return g

    def close(self) -> None:
        for g in self.groups.values():
            g.close()
        self.groups.clear()
