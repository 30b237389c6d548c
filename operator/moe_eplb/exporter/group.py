"""One copy of the expert counters per multi-node replica group (a LeaderWorkerSet group).

Each pod of a group counts the tokens its own ranks routed, so every pod used to export its own
``L x E`` ``moe_eplb_expert_tokens_total`` (and, in full mode, its ``L x E`` replica gauges): for
DeepSeek-V3 at EP 32 over 4 pods, four copies of 14 848 series per group. vLLM gathers the global
load only at a rearrangement (the last ``window_size`` steps' logical load, all-reduced over the EP
group), which is neither every step nor every token, so the group's counts cannot be read from
vLLM. The exporters gather them themselves, off the engine:

* a **worker** pod (``LWS_WORKER_INDEX`` > 0) serves its own expert totals on
  ``/group/expert-tokens`` (:func:`encode`) and leaves ``moe_eplb_expert_tokens_total`` and
  ``moe_eplb_expert_replicas`` out of its ``/metrics`` (its per-rank series stay);
  ``moe_eplb_exporter_group_pods`` = 0 says where its counts went;
* the **leader** pod (worker index 0) fetches its workers' totals every ``flush`` seconds
  (:class:`PeerPoller`) and exports ``own + sum over workers`` as its
  ``moe_eplb_expert_tokens_total`` (:class:`GroupMerge`); ``moe_eplb_exporter_group_pods`` = the
  pods whose counts that counter holds.

So ``sum`` over the group's pods of either family is what it was, and the load reader and the
dashboards read the same numbers. Restarts (:meth:`GroupMerge.update`): a worker whose counters
restart (new start time, or a value that dropped) is counted from zero again on top of what the
leader already exported, so the leader's counter never drops. A leader that restarts starts a new
counter (its own start time) and counts each worker from where the previous leader's last fetch
left it: the worker remembers the totals of its last answer and hands them to a leader it has not
answered before as its baseline (:class:`WorkerTotals`), so nothing is counted twice and nothing is
missed beyond what the old leader fetched after its last scrape. This module imports only numpy and
the standard library (it runs in the vLLM pod).
"""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from moe_eplb.contracts import k8s_names

log = logging.getLogger("moe_eplb.exporter")

#: path on the exporter port where a worker pod serves its own expert totals to its leader
GROUP_PATH = "/group/expert-tokens"
ENV_GROUP = "MOE_EPLB_EXPORTER_GROUP"  # "auto" (default): one copy per LWS group; "off": every pod its own
ENV_GROUP_PEERS = "MOE_EPLB_EXPORTER_GROUP_PEERS"  # leader: comma-separated base URLs of its workers
GROUP_MODES = ("auto", "off")


@dataclass(frozen=True)
class GroupRole:
    """What this pod exports: ``single`` (a pod on its own, or grouping off), ``leader`` or ``worker``."""

    role: str = "single"
    worker: int = 0
    size: int = 1
    peers: tuple[str, ...] = ()  # leader: base URLs (``http://host:port``) of workers 1..size-1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, port: int = k8s_names.EXPORTER_PORT) -> GroupRole:
        """From the env the LeaderWorkerSet webhook injects (``LWS_WORKER_INDEX``, ``LWS_GROUP_SIZE``,
        ``LWS_LEADER_ADDRESS``); ``MOE_EPLB_EXPORTER_GROUP=off`` or a group of one pod: ``single``.
        Raises ValueError naming the variable on a bad value."""
        env = os.environ if env is None else env
        mode = (env.get(ENV_GROUP) or "auto").strip()
        if mode not in GROUP_MODES:
            raise ValueError(f"{ENV_GROUP}={mode!r}: expected one of {', '.join(GROUP_MODES)}")
        raw_worker, raw_size = env.get(k8s_names.LWS_WORKER_INDEX_ENV), env.get(k8s_names.LWS_GROUP_SIZE_ENV)
        if mode == "off" or raw_worker in (None, "") or raw_size in (None, ""):
            return cls()
        try:
            worker, size = int(raw_worker), int(raw_size)
        except ValueError:
            raise ValueError(f"{k8s_names.LWS_WORKER_INDEX_ENV}={raw_worker!r} / {k8s_names.LWS_GROUP_SIZE_ENV}="
                             f"{raw_size!r}: expected whole numbers") from None
        if size <= 1:
            return cls()
        if not 0 <= worker < size:
            raise ValueError(f"{k8s_names.LWS_WORKER_INDEX_ENV}={worker}: expected 0..{size - 1} "
                             f"({k8s_names.LWS_GROUP_SIZE_ENV}={size})")
        if worker > 0:
            return cls("worker", worker, size)
        peers = tuple(p.strip().rstrip("/") for p in (env.get(ENV_GROUP_PEERS) or "").split(",") if p.strip())
        if not peers:
            peers = worker_urls(env.get(k8s_names.LWS_LEADER_ADDRESS_ENV) or "", size, port)
        if len(peers) != size - 1:
            raise ValueError(f"{ENV_GROUP_PEERS}: {len(peers)} worker URL(s) for a group of {size} pods "
                             f"(expected {size - 1}); or set {k8s_names.LWS_LEADER_ADDRESS_ENV}")
        return cls("leader", 0, size, peers)


def worker_urls(leader_address: str, size: int, port: int) -> tuple[str, ...]:
    """Base URLs of workers 1..size-1 from the leader's address. LeaderWorkerSet names the leader pod
    ``<lws>-<group>`` and its workers ``<lws>-<group>-<w>``, all under the group's headless service:
    ``<lws>-<group>.<lws>.<ns>`` -> ``<lws>-<group>-<w>.<lws>.<ns>``."""
    if not leader_address:
        return ()
    host, _, rest = leader_address.partition(".")
    return tuple(f"http://{host}-{w}{'.' + rest if rest else ''}:{port}" for w in range(1, size))


Totals = Mapping[str, tuple[float, np.ndarray]]  # model -> (counter start time, expert tokens [L, E])


def encode(models: Totals, baseline: Mapping[str, np.ndarray] | None = None) -> bytes:
    """A worker's answer on :data:`GROUP_PATH`: per model ``(start_time, expert_tokens [L, E])``, and
    per model the totals a previous leader last fetched (``baseline``; absent: none fetched them)."""
    names = sorted(models)
    baseline = baseline or {}
    arrays = {f"m{i}": np.asarray(models[n][1], np.float64) for i, n in enumerate(names)}
    arrays.update({f"b{i}": np.asarray(baseline[n], np.float64) for i, n in enumerate(names) if n in baseline})
    meta = {"models": [{"name": n, "start_time": float(models[n][0])} for n in names]}
    buf = io.BytesIO()
    np.savez(buf, meta=np.array(json.dumps(meta)), **arrays)
    return buf.getvalue()


def decode(body: bytes) -> dict[str, tuple[float, np.ndarray, np.ndarray | None]]:
    """Inverse of :func:`encode`: model -> ``(start_time, totals, baseline or None)``; raises
    ValueError on anything else."""
    try:
        with np.load(io.BytesIO(body), allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            return {m["name"]: (float(m["start_time"]), np.asarray(z[f"m{i}"], np.float64),
                                np.asarray(z[f"b{i}"], np.float64) if f"b{i}" in z.files else None)
                    for i, m in enumerate(meta["models"])}
    except Exception as exc:  # noqa: BLE001 - any malformed answer is one error
        raise ValueError(f"not a {GROUP_PATH} answer: {exc}") from None


class WorkerTotals:
    """Worker side of :data:`GROUP_PATH`: answers a leader (``?leader=<id>``) with the pod's own totals
    and remembers them; a leader it has not answered before also gets the totals of the last answer
    to the previous one as its baseline (what that leader's counter already holds), as long as the
    worker's counters did not restart since."""

    def __init__(self, own):
        self.own = own  # () -> Totals (PodCollector.own)
        self.leader: str | None = None
        self.served: dict[str, tuple[float, np.ndarray]] = {}
        self.lock = threading.Lock()

    def answer(self, leader: str) -> bytes:
        with self.lock:
            totals = self.own()
            baseline = None
            if leader != self.leader:
                baseline = {n: last for n, (start, last) in self.served.items()
                            if n in totals and totals[n][0] == start and last.shape == totals[n][1].shape
                            and not np.any(totals[n][1] < last)}
                self.leader = leader
            self.served = {n: (start, np.array(t, np.float64, copy=True)) for n, (start, t) in totals.items()}
            return encode(totals, baseline)


@dataclass
class _Peer:
    start_time: float
    last: np.ndarray  # the worker's totals at the last fetch
    exported: np.ndarray  # what the leader's counter holds of this worker


@dataclass
class GroupMerge:
    """The leader's running sum of its workers' expert counters, per (worker, model); never drops."""

    start_time: float  # the leader's own counter start (unix s)
    #: who this leader is, as its workers tell leaders apart (a restarted leader is a new one)
    leader_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{time.time():.6f}")
    peers: dict[tuple[int, str], _Peer] = field(default_factory=dict)
    heard: dict[int, float] = field(default_factory=dict)  # worker -> monotonic time of its last answer
    lock: threading.Lock = field(default_factory=threading.Lock)

    def update(self, worker: int, models: Mapping[str, tuple], now: float | None = None) -> None:
        """Fold one answer of ``worker`` in (model -> ``(start_time, totals[, baseline])``, as
        :func:`decode` gives). A worker (model) seen for the first time counts from its baseline (the
        previous leader's last fetch; none: from zero); a new start time or a value that dropped is a
        restart: its new totals count from zero."""
        with self.lock:
            self.heard[worker] = time.monotonic() if now is None else now
            for name, answer in models.items():
                start, totals = answer[0], np.asarray(answer[1], np.float64)
                baseline = answer[2] if len(answer) > 2 else None
                p = self.peers.get((worker, name))
                if p is None or p.last.shape != totals.shape:
                    base = baseline if baseline is not None and baseline.shape == totals.shape else 0.0
                    self.peers[(worker, name)] = _Peer(start, totals.copy(), np.maximum(totals - base, 0.0))
                    continue
                if start != p.start_time or np.any(totals < p.last):  # the worker restarted
                    p.exported = p.exported + totals
                else:
                    p.exported = p.exported + (totals - p.last)
                p.start_time, p.last = start, totals.copy()

    def merged(self, name: str, own: np.ndarray) -> np.ndarray:
        """``own`` plus every worker's exported counts of model ``name`` (same shape only)."""
        with self.lock:
            out = np.array(own, np.float64, copy=True)
            for (_, n), p in self.peers.items():
                if n == name and p.exported.shape == out.shape:
                    out += p.exported
            return out

    def pods(self, name: str) -> int:
        """Pods whose counts of ``name`` the merged counter holds: the leader and each worker heard."""
        with self.lock:
            return 1 + len({w for (w, n) in self.peers if n == name})


class PeerPoller:
    """Leader side: fetch every worker's :data:`GROUP_PATH` every ``interval`` seconds (a daemon
    thread of the exporter process; a worker that does not answer is tried again next time: its
    counts arrive late, never lost while it lives)."""

    def __init__(self, role: GroupRole, merge: GroupMerge, interval: float = 1.0, timeout: float = 2.0):
        self.role, self.merge, self.interval, self.timeout = role, merge, interval, timeout
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing: set[int] = set()

    def poll_once(self) -> int:
        """One round; returns how many workers answered."""
        ok = 0
        for w, base in enumerate(self.role.peers, start=1):
            try:
                url = f"{base}{GROUP_PATH}?{urllib.parse.urlencode({'leader': self.merge.leader_id})}"
                with urllib.request.urlopen(url, timeout=self.timeout) as r:
                    self.merge.update(w, decode(r.read()))
                ok += 1
                self._failing.discard(w)
            except Exception as exc:  # noqa: BLE001 - a worker down or restarting: retried next round
                if w not in self._failing:
                    log.warning("moe-eplb exporter: group worker %d (%s) did not answer (%s); retrying", w, base, exc)
                self._failing.add(w)
        return ok

    def start(self) -> None:
        def loop():
            while not self._stop.is_set():
                self.poll_once()
                self._stop.wait(self.interval)

        self._thread = threading.Thread(target=loop, name="moe-eplb-group", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
