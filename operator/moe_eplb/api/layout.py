"""How a replica group is launched: which pod runs which data-parallel ranks, which API servers each
pod serves on which port, and which ranks each of them dispatches to (pure; one place for the
renderer, validation and the launch-logic tests).

vLLM decides the load-balancing mode of a data-parallel group from its flags
(``engine/arg_utils.py`` ``create_engine_config``, ``entrypoints/cli/serve.py`` ``ServeSubcommand.cmd``;
see ``/work/shared/notes/vllm-launch-logic.md``). The layouts the operator renders, as a function of
``spec.parallelism`` and ``spec.faultTolerance``:

``internal`` (no fault tolerance)
    one front end dispatches to every rank of the group: one pod (a Deployment), or a
    LeaderWorkerSet whose leader has no ``--data-parallel-start-rank`` (a start rank on a process
    that is not ``--headless`` would make vLLM infer hybrid load balancing: the leader's API would
    then dispatch to its own pod's ranks only) and whose workers run ``--headless
    --data-parallel-start-rank <first rank of the pod>``. vLLM starts ``--data-parallel-size`` API
    server processes on the one port (8000), all dispatching to every rank.
``external`` (fault tolerance, or later elastic EP: one API server per rank)
    every rank serves its own API. One rank per pod: ``--data-parallel-rank r``, port 8000. Several
    ranks per pod: vLLM's multi-port supervisor (``--data-parallel-multi-port-external-lb``) starts
    one API server per local rank, rank ``start + i`` on port ``8000 + i``, and serves their
    aggregated health on its own port (:data:`SUPERVISOR_PORT`).

Every rank's API is reachable through what the operator renders from :class:`Layout`: the
container ports and the Service ports (``http``, ``http-1``, ...), the probes, the PodMonitor's
endpoints (one per port) and so the autoscaler's and the tuner's queries.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_eplb.contracts.k8s_names import API_PORT, api_port_name

INTERNAL, EXTERNAL = "internal", "external"
LEADER, WORKER, SINGLE = "leader", "worker", "pod"
#: vLLM's DP supervisor's own port (``--data-parallel-supervisor-port``, vLLM's default in 0.32-0.34):
#: ``/health`` there is 200 once every child API server is ready, 503 while it shuts down
SUPERVISOR_PORT = 9256
SUPERVISOR_PORT_NAME = "dp-supervisor"
#: ``--data-parallel-rpc-port``: the leader's handshake with the other pods' engines
DP_RPC_PORT = 13345


@dataclass(frozen=True)
class ApiServer:
    """One API port of a pod: its number and name, the data-parallel ranks its front end
    dispatches to, and how many vLLM API server processes share it (``--api-server-count``'s
    default in that mode)."""

    port: int
    name: str
    ranks: tuple[int, ...]
    processes: int = 1


@dataclass(frozen=True)
class PodLaunch:
    """One pod of a replica group: its role (``pod`` of a Deployment, ``leader`` / ``worker`` of a
    LeaderWorkerSet group, ``index`` = LWS worker index), the ranks whose engines it runs, whether it is
    ``--headless`` (no API) and its API servers."""

    role: str
    index: int
    ranks: tuple[int, ...]
    headless: bool
    api_servers: tuple[ApiServer, ...]
    supervised: bool = False  # vLLM's multi-port supervisor runs the pod's API servers

    @property
    def api_ports(self) -> tuple[int, ...]:
        return tuple(a.port for a in self.api_servers)


@dataclass(frozen=True)
class Layout:
    """The launch of one replica group (:func:`layout`)."""

    lb: str  # INTERNAL or EXTERNAL, as vLLM's ParallelConfig names it
    data: int
    data_local: int
    pods: tuple[PodLaunch, ...]

    @property
    def supervised(self) -> bool:
        """Each pod runs vLLM's multi-port supervisor (several API servers a pod)."""
        return any(p.supervised for p in self.pods)

    @property
    def workers_serve_api(self) -> bool:
        """Pods other than the leader serve an API too (the Service selects them)."""
        return any(p.api_servers for p in self.pods if p.role == WORKER)

    @property
    def api_servers_per_pod(self) -> int:
        """API ports of a pod that serves the API (the most of any pod)."""
        return max(len(p.api_servers) for p in self.pods)

    @property
    def api_ports(self) -> tuple[ApiServer, ...]:
        """Every API port of the group's serving pods, once each, in port order (what the Service
        and the PodMonitor name)."""
        seen: dict[int, ApiServer] = {}
        for pod in self.pods:
            for a in pod.api_servers:
                seen.setdefault(a.port, a)
        return tuple(seen[p] for p in sorted(seen))

    @property
    def served_ranks(self) -> tuple[int, ...]:
        """The ranks some API server of the group dispatches to (every rank, for a sound layout)."""
        return tuple(sorted({r for p in self.pods for a in p.api_servers for r in a.ranks}))

    @property
    def hosted_ranks(self) -> tuple[int, ...]:
        """The ranks some pod runs an engine for, once per pod that does."""
        return tuple(sorted(r for p in self.pods for r in p.ranks))

    @property
    def api_server_processes(self) -> int:
        """vLLM API server processes in the whole group."""
        return sum(a.processes for p in self.pods for a in p.api_servers)


def _api_servers(start: int, count: int, ranks_each: tuple[int, ...] | None, processes: int) -> tuple[ApiServer, ...]:
    """``count`` API ports from :data:`API_PORT` on; the i-th dispatches to ``ranks_each`` (all of
    them share it) or to rank ``start + i`` alone."""
    return tuple(ApiServer(API_PORT + i, api_port_name(i), ranks_each if ranks_each is not None else (start + i,),
                           processes) for i in range(count))


def layout(data: int, data_local: int, nodes: int, *, external: bool, api_server_count: int | None = None) -> Layout:
    """The launch of a replica group of ``data`` data-parallel ranks over ``nodes`` pods,
    ``data_local`` ranks a pod (``data == data_local x nodes``); ``external``: every rank serves its
    own API (fault tolerance needs it; see the module doc), else vLLM's internal load balancing, with
    ``api_server_count`` API processes on the front end (``--api-server-count``; None: vLLM's default,
    one per rank)."""
    if data < 1 or data_local < 1 or nodes < 1 or data_local * nodes != data:
        raise ValueError(f"data {data} is not dataLocal {data_local} x nodes {nodes}")
    pods = []
    for i in range(nodes):
        role = SINGLE if nodes == 1 else (LEADER if i == 0 else WORKER)
        ranks = tuple(range(i * data_local, (i + 1) * data_local))
        if external:
            supervised = data_local > 1
            apis = _api_servers(ranks[0], data_local, None, 1)
            pods.append(PodLaunch(role, i, ranks, False, apis, supervised))
        elif i == 0:  # the group's one front end: vLLM's default of one API process per rank
            apis = _api_servers(0, 1, tuple(range(data)), api_server_count or data)
            pods.append(PodLaunch(role, i, ranks, False, apis))
        else:
            pods.append(PodLaunch(role, i, ranks, True, ()))
    return Layout(EXTERNAL if external else INTERNAL, data, data_local, tuple(pods))


def dp_flags(lay: Layout, pod: PodLaunch, *, start_rank: str | None = None) -> list[str]:
    """The data-parallel flags that select ``pod``'s part of ``lay`` (after ``--data-parallel-size``),
    without the multi-node wiring (``--data-parallel-size-local``, address, RPC port) that
    :mod:`moe_eplb.render.engine_args` adds for a LeaderWorkerSet. ``start_rank``: the text of the
    pod's first rank (a worker's is a shell expression of its LWS index), else the number."""
    first = start_rank if start_rank is not None else str(pod.ranks[0])
    if pod.headless:
        return ["--data-parallel-start-rank", first, "--headless"]
    if pod.supervised:
        return ["--data-parallel-start-rank", first, "--data-parallel-multi-port-external-lb",
                "--data-parallel-supervisor-port", str(SUPERVISOR_PORT)]
    if lay.lb == EXTERNAL:
        return ["--data-parallel-rank", first]
    return []  # internal load balancing: no start rank on a process that serves the API
