"""SIMULATED vLLM fault tolerance of one data-parallel group (the ranks of a simulated engine). Not vLLM.

What a fault-tolerant vLLM group (``--enable-fault-tolerance``) shows its orchestrator, as read from
vLLM 0.34's code (``v1/fault_tolerance/engine_core_sentinel.py``, ``v1/engine/core_client.py``,
``entrypoints/serve/fault_tolerance/api_router.py``, ``entrypoints/serve/middleware/authenticate.py``;
the names are the operator's :mod:`moe_eplb.api.ft_protocol`, whose contract tests drive vLLM's own
router and sentinel):

- a lost rank (its pod gone or its engine process killed: :meth:`GroupFaultTolerance.lose`) stops the
  group from stepping at once (the survivors wait in a collective) and ``detect_s`` later every
  survivor aborts its in-flight requests (counted in vLLM's ``vllm:request_success_total
  {finished_reason="abort"}``), reports ``diagnosing`` then ``unhealthy`` with the all2all ``mask`` of
  the lost EP ranks (0.34), and waits ``engine_recovery_timeout_sec`` (``timeout_s``) from its fault
  for an instruction, else the group exits (:attr:`GroupFaultTolerance.exited`, the node agent
  restarts it);
- a transient fault (:meth:`GroupFaultTolerance.transient`) does the same on every rank with no rank
  lost; ``fail_retries`` makes that many ``retry`` votes fail, ``suspect`` sets mask bits;
- ``POST <prefix>/fault_tolerance/apply`` (202, or 400 for a body vLLM's router refuses; 401 on a
  ``/v1`` route without one of vLLM's ``--api-key`` keys when it has any): refused by the client
  while an instruction runs, by the engine unless ``unhealthy``; ``scale_down`` is validated as
  vLLM's sentinel does (a non-empty removed set within the group, not the receiver, one rank left,
  at least one newly removed rank; the new store master's address when the lowest alive rank goes,
  which must be the new lowest rank's pod). Every alive rank must check in with the same
  ``request_id`` within ``checkin_s`` (else each fails the round: ``unhealthy``, ``ft_state failed``);
  the recovery then takes ``recover_s`` and the survivors vote: a rank lost meanwhile fails it
  (``scale_down``: every member ``dead``; ``retry``: ``unhealthy``, retryable), else every member is
  ``healthy`` again, a ``scale_down``'s ranks join the cumulative dead set, and the group steps again
  on the survivors (a committed ``scale_down`` also logs vLLM's ``[FT] Engine N scale_down complete``);
- ``GET <prefix>/fault_tolerance/status``: ``{"schema_version": 1, "total_engines": 1, "engines": [entry]}``
  with the entry vLLM's client keeps (the engine's last push, replaced by the next one, plus
  ``ft_state``, ``last_ft_request_id``, ``ft_error``).

Times are the simulated clock's seconds. Requests: every serving rank completes ``rate`` requests a
second and holds ``inflight`` (aborted at a fault).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from moe_eplb.api import ft_protocol as ftp
from moe_eplb.api.versions import Version

#: how long a 0.34 engine reports ``diagnosing`` (querying its workers' all2all mask) before ``unhealthy``
DIAGNOSING_S = 0.5


@dataclass(frozen=True)
class FtConfig:
    """A group's fault tolerance as its pods were started (``--enable-fault-tolerance`` and friends)."""

    version: Version
    data: int
    tensor: int = 1
    timeout_s: float = float(ftp.DEFAULT_RECOVERY_TIMEOUT_S)
    api_keys: tuple[str, ...] = ()
    detect_s: float = 5.0
    recover_s: float = 3.0
    checkin_s: float = ftp.ROUND_CHECKIN_S
    rate: float = 2.0
    inflight: int = 4


def config_from_argv(tokens: list[str], version: Version, **timing: float) -> FtConfig | None:
    """The :class:`FtConfig` of a ``vllm serve`` argv (Kubernetes' expansion done), None without
    ``--enable-fault-tolerance``."""
    if ftp.CONFIG_FLAG not in tokens and "--enable-fault-tolerance" not in tokens:
        return None

    def value(flag: str) -> str | None:
        return tokens[tokens.index(flag) + 1] if flag in tokens and tokens.index(flag) + 1 < len(tokens) else None

    timeout = float(ftp.DEFAULT_RECOVERY_TIMEOUT_S)
    if value(ftp.CONFIG_FLAG):
        timeout = float(json.loads(value(ftp.CONFIG_FLAG)).get(ftp.CONFIG_TIMEOUT_KEY, timeout))
    keys: tuple[str, ...] = ()
    if ftp.API_KEY_FLAG in tokens:  # nargs="+": the values up to the next flag; the last --api-key wins
        at = len(tokens) - 1 - tokens[::-1].index(ftp.API_KEY_FLAG)
        vals = []
        for t in tokens[at + 1:]:
            if t.startswith("-"):
                break
            vals.append(t)
        keys = tuple(vals)
    data = int(value("--data-parallel-size") or 1)
    tensor = int(value("--tensor-parallel-size") or 1)
    return FtConfig(version=version, data=data, tensor=tensor, timeout_s=timeout, api_keys=keys, **timing)


@dataclass
class _Rank:
    status: str = ftp.HEALTHY
    fault_info: str | None = None
    mask: list[int] | None = None
    ft_state: str | None = None
    last_id: str | None = None
    error: str | None = None
    fault_at: float | None = None
    unhealthy_at: float | None = None  # when the survivor reports unhealthy (after it noticed)
    served: float = 0.0
    aborted: int = 0

    def entry(self, rank: int) -> dict:
        e: dict = {"id": rank, "status": self.status}
        if self.status == ftp.UNHEALTHY:
            e["fault_info"] = self.fault_info
            if self.mask is not None:
                e["mask"] = list(self.mask)
        for key, v in (("ft_state", self.ft_state), ("last_ft_request_id", self.last_id), ("ft_error", self.error)):
            if v is not None:
                e[key] = v
        return e

    def push(self, status: str) -> None:
        """A push from the engine core replaces the client's cached entry."""
        self.status, self.ft_state, self.last_id, self.error = status, None, None, None

    def fail(self, request_id: str, why: str) -> None:
        self.ft_state, self.last_id, self.error = ftp.FAILED, request_id, why


@dataclass
class _Round:
    instruction: str
    params: dict
    first_at: float
    expected: frozenset[int]
    members: set[int] = field(default_factory=set)
    done_at: float | None = None  # check-in complete: the recovery ends then + recover_s


class GroupFaultTolerance:
    """The fault-tolerance state of one simulated data-parallel group (see the module doc).
    ``hosts``: each rank's pod address (the new store master must be named by it); ``on_exit``:
    called once when the engines give up."""

    def __init__(self, config: FtConfig, clock: Callable[[], float], *, hosts: dict[int, str] | None = None,
                 on_exit: Callable[[str], None] | None = None) -> None:
        self.cfg = config
        self.clock = clock
        self.hosts = dict(hosts or {})
        self.on_exit = on_exit
        self.ranks = {r: _Rank() for r in range(config.data)}
        self.dead: set[int] = set()  # committed by scale_down
        self.lost: set[int] = set()  # gone, not committed
        self.exited: str | None = None
        self.fail_retries = 0
        self.rounds: dict[str, _Round] = {}
        self.log: list[str] = []
        #: pods (LWS worker index) whose ranks went; their replacements wait to join (the node agent's)
        self.lost_pods: set[int] = set()
        self._last = clock()
        self._lock = threading.RLock()

    # --- faults -------------------------------------------------------------------------------------
    def alive(self) -> list[int]:
        return [r for r in range(self.cfg.data) if r not in self.dead and r not in self.lost]

    def serving(self) -> bool:
        """The group steps: nothing lost since its last recovery, every alive rank healthy."""
        with self._lock:
            self.advance()
            return self.exited is None and not self.lost and all(self.ranks[r].status == ftp.HEALTHY
                                                                  for r in self.alive())

    def lose(self, ranks: list[int] | tuple[int, ...], why: str = "lost") -> None:
        """Ranks whose pod went or whose engine died: the survivors notice after ``detect_s``."""
        with self._lock:
            self.advance()
            new = [r for r in ranks if r in self.ranks and r not in self.dead and r not in self.lost]
            if not new:
                return
            self.lost.update(new)
            for r in new:
                self.ranks[r].status = "gone"
            self._fault(self.cfg.detect_s, f"{why}: rank(s) {sorted(new)}", suspect=new)

    def transient(self, *, suspect: tuple[int, ...] = (), fail_retries: int = 0) -> None:
        """A transient fault of every alive rank (an NCCL timeout, an ECC error that cleared)."""
        with self._lock:
            self.advance()
            self.fail_retries = fail_retries
            self._fault(0.0, "transient fault", suspect=list(suspect))

    def _fault(self, after: float, info: str, suspect: list[int]) -> None:
        now = self.clock()
        ep = self.cfg.data * self.cfg.tensor
        mask = [0] * ep
        for r in set(suspect) | self.lost:
            for e in range(r * self.cfg.tensor, (r + 1) * self.cfg.tensor):
                mask[e] = 1
        for r in self.alive():
            x = self.ranks[r]
            if x.status == ftp.HEALTHY:
                x.fault_at = now + after
                # 0.34 reports diagnosing while it queries the workers' mask, then unhealthy
                x.unhealthy_at = x.fault_at + (DIAGNOSING_S if self.cfg.version >= ftp.V1_PREFIX_SINCE else 0.0)
                x.fault_info = info
                x.mask = mask if self.cfg.version >= ftp.V1_PREFIX_SINCE else None

    # --- time ------------------------------------------------------------------------------------------
    def advance(self) -> None:
        """Move to the clock's now: faults noticed, requests served, rounds checked in and ended,
        the engines' timeout."""
        with self._lock:
            now = self.clock()
            dt, self._last = max(0.0, now - self._last), now
            if self.exited is not None:
                return
            stepping = not self.lost and all(self.ranks[r].status == ftp.HEALTHY for r in self.alive())
            for r in self.alive():
                x = self.ranks[r]
                if stepping:
                    x.served += self.cfg.rate * dt
                if x.fault_at is not None and now >= x.fault_at and x.status == ftp.HEALTHY:
                    x.push(ftp.DIAGNOSING)  # the engine aborts what it runs
                    x.aborted += self.cfg.inflight
                if x.unhealthy_at is not None and now >= x.unhealthy_at and x.status == ftp.DIAGNOSING:
                    x.push(ftp.UNHEALTHY)
            self._rounds(now)
            late = [r for r in self.alive() if self.ranks[r].fault_at is not None and self.ranks[r].status != ftp.HEALTHY
                    and now >= self.ranks[r].fault_at + self.cfg.timeout_s]
            if late:
                self._exit(f"[FT] No recovery within {self.cfg.timeout_s:.0f}s timeout (rank(s) {late})")

    def _exit(self, why: str) -> None:
        self.exited = why
        if self.on_exit is not None:
            self.on_exit(why)

    def _rounds(self, now: float) -> None:
        for rid, rnd in list(self.rounds.items()):
            if rnd.done_at is None:
                if rnd.members >= rnd.expected:
                    rnd.done_at = now + self.cfg.recover_s
                elif now >= rnd.first_at + self.cfg.checkin_s:
                    why = (f"[FT] Not all engines joined recovery round '{rid}' within {self.cfg.checkin_s:.0f}s; "
                           "the same request_id must be sent to every engine.")
                    for r in rnd.members:
                        self.ranks[r].fail(rid, why)
                    del self.rounds[rid]
                continue
            if now < rnd.done_at:
                continue
            del self.rounds[rid]
            self._vote(rid, rnd)

    def _vote(self, rid: str, rnd: _Round) -> None:
        members = sorted(rnd.members)
        lost = [r for r in members if r in self.lost]
        terminal = rnd.instruction == ftp.SCALE_DOWN
        failed_retry = rnd.instruction == ftp.RETRY and self.fail_retries > 0
        if lost or failed_retry:
            if failed_retry:
                self.fail_retries -= 1
            for r in members:
                if r in self.lost:
                    continue
                x = self.ranks[r]
                if terminal:
                    x.push(ftp.DEAD)
                x.fail(rid, "[FT] Recovery vote failed" if not terminal else "Recovery failed; full restart required")
            return
        removed = set(rnd.params.get(ftp.PARAM_REMOVED) or ()) if terminal else set()
        for r in removed:
            self.lost.discard(r)
        self.dead |= removed
        for r in members:
            self.ranks[r].push(ftp.HEALTHY)
            self.ranks[r].fault_at = self.ranks[r].unhealthy_at = None
            if terminal:
                self.log.append(f"[FT] Engine {r} scale_down complete: removed {sorted(removed)}, "
                                f"cumulative dead_dp_ranks={sorted(self.dead)}")

    # --- HTTP -------------------------------------------------------------------------------------------
    def handles(self, path: str) -> bool:
        return path in (ftp.apply_path(self.cfg.version), ftp.status_path(self.cfg.version))

    def _authorized(self, path: str, headers: dict[str, str]) -> bool:
        """vLLM's ``--api-key`` guard: only paths under its guarded prefixes, only with keys set."""
        if not self.cfg.api_keys or not path.startswith(ftp.API_KEY_GUARDED_PREFIXES):
            return True
        scheme, _, token = (headers.get("authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and token in self.cfg.api_keys

    def answer(self, rank: int, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
        """What rank ``rank``'s API server answers on a fault-tolerance path."""
        with self._lock:
            self.advance()
            if not self._authorized(path, {k.lower(): v for k, v in headers.items()}):
                return 401, json.dumps({"error": "Unauthorized"}).encode()
            if rank not in self.ranks or rank in self.lost or rank in self.dead or self.exited is not None:
                return 503, b"engine gone"
            if method == "GET" and path == ftp.status_path(self.cfg.version):
                return 200, json.dumps({"schema_version": 1, "total_engines": 1,
                                        "engines": [self.ranks[rank].entry(rank)]}).encode()
            if method == "POST" and path == ftp.apply_path(self.cfg.version):
                return self._apply(rank, body)
            return 405, b"method not allowed"

    def _apply(self, rank: int, raw: bytes) -> tuple[int, bytes]:
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            return 400, b'{"detail": "Invalid JSON format"}'
        allowed = [i for i in ftp.INSTRUCTION_SINCE if ftp.has(i, self.cfg.version)]
        if not isinstance(body, dict):
            return 400, b'{"detail": "Request body must be a JSON object."}'
        instruction, params = body.get(ftp.FIELD_INSTRUCTION), body.get(ftp.FIELD_PARAMS, {})
        if not instruction:
            return 400, b'{"detail": "\'instruction\' is required."}'
        if instruction not in allowed:
            return 400, json.dumps({"detail": f"Invalid instruction: '{instruction}'."}).encode()
        if not isinstance(params, dict):
            return 400, b'{"detail": "\'params\' must be an object."}'
        rid = body.get(ftp.FIELD_REQUEST_ID)
        if self.cfg.version >= ftp.CLIENT_REQUEST_ID_SINCE:
            if not isinstance(rid, str) or not rid:
                return 400, b'{"detail": "\'request_id\' must be a non-empty string."}'
        else:  # 0.32/0.33: the server draws one per request (no round spans engines by id)
            rid = f"srv-{rank}-{len(self.log)}-{self.clock():.3f}"
        self._handle(rank, instruction, dict(params), rid)
        return 202, json.dumps({"message": "Request accepted; poll /v1/fault_tolerance/status for updates.",
                                "request_id": rid}).encode()

    def _handle(self, rank: int, instruction: str, params: dict, rid: str) -> None:
        x = self.ranks[rank]
        if x.ft_state == ftp.RECOVERING:
            return  # the client: "another recovery is in progress" (its state untouched)
        x.ft_state, x.last_id, x.error = ftp.RECOVERING, rid, None
        if x.status != ftp.UNHEALTHY:
            x.fail(rid, f"[FT] Rejecting {instruction} on engine {rank}: status is {x.status.upper()}")
            return
        try:
            expected = self._expected(rank, instruction, params)
        except (ValueError, RuntimeError) as exc:
            x.fail(rid, str(exc))
            return
        rnd = self.rounds.setdefault(rid, _Round(instruction, params, self.clock(), expected))
        rnd.members.add(rank)

    def _expected(self, rank: int, instruction: str, params: dict) -> frozenset[int]:
        """The ranks that must check in (vLLM's ``alive``), after vLLM's own checks of ``scale_down``."""
        everyone = set(range(self.cfg.data))
        if instruction == ftp.RETRY:
            return frozenset(everyone - self.dead)
        removed = set(params.get(ftp.PARAM_REMOVED) or ())
        newly = removed - self.dead
        if not removed or not removed <= everyone or rank in removed or everyone <= self.dead | newly or not newly:
            raise ValueError(f"Invalid removed_dp_ranks {sorted(removed)} for engine {rank} "
                             f"(dp_rank={rank}, dead_dp_ranks={sorted(self.dead)})")
        alive_before = sorted(everyone - self.dead)
        alive_after = sorted(everyone - self.dead - newly)
        if alive_before[0] in newly:
            ip, port = params.get(ftp.PARAM_MASTER_IP), params.get(ftp.PARAM_STORE_PORT)
            if ip is None or port is None:
                raise ValueError(f"dp_store_port and dp_master_ip required when the store master (rank "
                                 f"{alive_before[0]}) is removed")
            want = self.hosts.get(alive_after[0])
            if want is not None and ip != want:  # the store would be hosted where no survivor listens
                raise RuntimeError(f"[FT] TCPStore at {ip}:{port} unreachable (rank {alive_after[0]} is at {want})")
        return frozenset(alive_after)

    # --- vLLM's request counter -----------------------------------------------------------------------
    def exposition(self, rank: int, model: str) -> list[str]:
        """``vllm:request_success_total`` of rank ``rank``'s engine (finished ``stop`` and ``abort``)."""
        with self._lock:
            self.advance()
            x = self.ranks.get(rank)
            if x is None:
                return []
            name = "vllm:request_success_total"
            lab = f'model_name="{model}",engine="{rank}"'
            return [f"# HELP {name} Count of successfully processed requests (simulated).",
                    f"# TYPE {name} counter",
                    f'{name}{{{lab},finished_reason="stop"}} {float(int(x.served))!r}',
                    f'{name}{{{lab},finished_reason="abort"}} {float(x.aborted)!r}']

    def served(self) -> tuple[int, int]:
        """(requests finished, requests aborted) over every rank so far."""
        with self._lock:
            self.advance()
            return int(sum(x.served for x in self.ranks.values())), sum(x.aborted for x in self.ranks.values())
