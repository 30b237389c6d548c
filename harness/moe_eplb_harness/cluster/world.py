"""A whole SIMULATED cluster in one event loop, for ``moe-eplb demo`` and the autotune tests.

:class:`SimWorld` starts, in order, on the :class:`~moe_eplb_harness.cluster.backend.ClusterBackend` its ``api``
picks once (:mod:`moe_eplb_harness.cluster.backend`):

1. the Kubernetes API: the emulated one (:mod:`moe_eplb_harness.emulated.kubeapi`, kmock over real HTTP)
   or a real control plane (:mod:`moe_eplb_harness.real`);
2. what plays the kubelet -- the fake kubelet (:mod:`moe_eplb_harness.emulated.kubelet`) or the node agent
   (:mod:`moe_eplb_harness.real.nodeagent`) -- which runs a simulated engine
   (:mod:`moe_eplb_harness.engines.engine`) per pod of every moe-eplb Deployment, replaying one workload trace
   on an accelerated :class:`~moe_eplb_harness.engines.engine.SimClock`;
3. optionally a real Prometheus (``find_prometheus``) on loopback, scraping the engine pods
   found by the kubelet (file-based service discovery, with the labels a PodMonitor would add:
   ``namespace``, ``pod``, ``moeinference``);
   With ``api="real"`` and ``metrics_adapter=True``, prometheus-adapter (built by ``make kube``)
   serves vLLM's metrics from that Prometheus as ``custom.metrics.k8s.io`` to the real HPA
   controller (:mod:`moe_eplb_harness.real.metricsadapter`);
4. the real operator(s) (``moe_eplb.controller.main.run_operator``) with the autotune loop on the
   same clock.

Nothing here talks to a real cluster or GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from moe_eplb.contracts import metric_names
from moe_eplb.eplb.tuning.options import TuneOptions
from moe_eplb.eplb.workload.trace import LoadTrace
from moe_eplb_harness.cluster.backend import APIS, ClusterBackend, backend_for, resolve_api, resolve_lws  # noqa: F401  (resolve_*: the demo's)
from moe_eplb_harness.engines.engine import EngineFaults, EngineSettings, SimClock
from moe_eplb_harness.floor import procs
from moe_eplb_harness.floor.procs import free_port
from moe_eplb_harness.floor.prometheus import RunningPrometheus, find_prometheus, start_prometheus

log = logging.getLogger(__name__)

class LocalPrometheus:
    """A real Prometheus server on 127.0.0.1 scraping targets listed in a file (file_sd).

    ``update(targets)`` rewrites the target file (``[{namespace, pod, moeinference, port}]``);
    Prometheus notices within a second. ``scrape_interval`` in wall seconds. ``drop``: metric names
    not kept at ingestion (``metric_relabel_configs``, as a PodMonitor's ``metricRelabelings`` would).
    """

    def __init__(self, binary: str, *, scrape_interval: float = 1.0, workdir: str | None = None,
                 drop: tuple[str, ...] = ()) -> None:
        self.drop = tuple(drop)
        self.binary = binary
        self.scrape_interval = scrape_interval
        self._tmp = tempfile.TemporaryDirectory(prefix="moe-eplb-prom-") if workdir is None else None
        self.dir = workdir or self._tmp.name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.targets_file = os.path.join(self.dir, "targets.json")
        self.server: RunningPrometheus | None = None
        self.pod_targets: list[dict] = []
        #: targets scraped beside the pods (:meth:`add_target`: a gateway's queue, in a test)
        self.extra_targets: list[dict] = []

    def add_target(self, host_port: str, **labels: str) -> None:
        """Scrape ``host_port`` too, with ``labels`` on its series, beside the pods."""
        self.extra_targets.append({"targets": [host_port], "labels": dict(labels)})
        self.update(self.pod_targets)

    def update(self, targets: list[dict]) -> None:
        """Scrape ``targets`` (the fake kubelet's :meth:`~moe_eplb_harness.emulated.kubelet.FakeKubelet.targets`)
        with the labels the PodMonitor puts on every series: ``namespace``, ``pod``, ``moeinference``
        and, for pods of a LeaderWorkerSet group, the group labels (``metric_names.GROUP_*``)."""
        keep = ("namespace", "pod", "moeinference", metric_names.GROUP_LABEL, metric_names.GROUP_WORKER_LABEL,
                metric_names.GROUP_SIZE_LABEL)
        self.pod_targets = list(targets)
        groups = [{"targets": [f"{t.get('host', '127.0.0.1')}:{t['port']}"],
                   "labels": {k: str(t[k]) for k in keep if k in t}} for t in targets] + self.extra_targets
        tmp = self.targets_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(groups, f)
        os.replace(tmp, self.targets_file)

    async def start(self) -> None:
        self.update([])
        interval = f"{max(1, int(round(self.scrape_interval * 1000)))}ms"
        job: dict[str, Any] = {"job_name": "moe-eplb-sim", "metrics_path": "/metrics",
                               "file_sd_configs": [{"files": [self.targets_file], "refresh_interval": "1s"}]}
        if self.drop:
            job["metric_relabel_configs"] = [{"source_labels": ["__name__"], "regex": "|".join(self.drop),
                                              "action": "drop"}]
        config = {"global": {"scrape_interval": interval, "scrape_timeout": interval}, "scrape_configs": [job]}
        self.server = await asyncio.to_thread(start_prometheus, self.dir, config, binary=self.binary,
                                             port=self.port, timeout=15)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.server = None
        if self._tmp is not None:
            self._tmp.cleanup()


@dataclass
class SimWorld:
    """Configuration and handles of a simulated cluster (use ``async with world.run(): ...``).

    Attributes (configuration):
        workload: the trace all engines replay (``bucket_seconds`` set), or a mapping MoEInference
            name -> trace (``"*"``: the default).
        scale: simulated seconds per wall second.
        startup_seconds: simulated model-loading time of an engine pod.
        prometheus: start a real Prometheus (needs the binary) -- else the operator scrapes pods.
        scrape_interval: wall seconds between Prometheus' scrapes; the load read's bucket is at
            least two of them with or without Prometheus (the operator then scrapes twice a bucket).
        tick_seconds: wall seconds between autotune ticks.
        lookback_seconds, bucket_seconds, min_steps: the autotune loop's data window and bucket
            (simulated seconds) and the least engine steps it tunes on.
        search: the tuner's search (:class:`~moe_eplb.eplb.tuning.options.TuneOptions`; None: the
            operator's, ``OPERATOR_SEARCH``), its ``min_steps`` set from ``min_steps``.
        crash_if, crash_pod_if, faults_for: fault injection for the fake kubelet (tests).
        num_groups: expert groups of the model (or a mapping MoEInference name -> groups).
        observer: autotune observer (see ``AutotuneSettings.observer``).
        true_cost: the deployment's true cost parameters (:class:`moe_eplb_harness.engines.physics.TrueCost`)
            the engines produce their telemetry from; never given to the operator.
        api: ``"emulated"`` (the kmock-based API and the fake kubelet playing the workload controllers)
            or ``"real"``: a real control plane (:mod:`moe_eplb_harness.real.controlplane`, built by ``make
            kube``) with the real Deployment/ReplicaSet controllers and kube-scheduler, simulated GPU
            nodes (:mod:`moe_eplb_harness.real.nodeagent`), and the LeaderWorkerSet controller picked by
            ``lws``. ``"auto"``: real when the binaries are built.
        lws: on the real API, which LeaderWorkerSet controller runs: ``"real"`` (``sigs.k8s.io/lws``
            built by ``tools/build-go-tool.sh tools/lws``, with its webhooks: :mod:`moe_eplb_harness.real.lwscontroller`; the
            node agent runs its groups), ``"emulated"`` (:mod:`moe_eplb_harness.emulated.lws` in the fake kubelet,
            over the real API) or ``"auto"`` (real when built). Set by :meth:`run` to the one used.
        engine_factory: builds each pod's engine from a :class:`moe_eplb_harness.floor.pods.EngineRequest`
            instead of a simulated one (see :class:`~moe_eplb_harness.emulated.kubelet.FakeKubelet`); ``workload``
            is then only used by engines the factory does not build (pass an empty mapping).
        metrics_adapter: with ``api="real"`` and ``prometheus``, run prometheus-adapter as the
            ``custom.metrics.k8s.io`` API (the control plane then has the aggregation layer), so an
            HPA can scale on vLLM's per-pod metrics (``world.adapter``).
        shared_plane: with ``api="real"``, a running :class:`moe_eplb_harness.real.simplane.SimPlane` (a test
            session's) to run on instead of starting a control plane -- when its LWS controller is
            the one ``lws`` picks (and it has the aggregation layer if ``metrics_adapter``). The
            world then works in a namespace of its own (``namespace``, made at the start), its node
            agent registers Nodes of its own and deletes them at the end, and what the world left in
            its namespace is deleted at the end.
        namespace: where :meth:`apply` and :meth:`get` work (``default``; on a ``shared_plane`` a
            fresh one, set by :meth:`run`).
        gpu_resource: with ``api="real"``, the extended resource the simulated nodes' device plugin
            advertises (``amd.com/gpu`` for ROCm nodes; ``spec.engine.gpuResourceName``).
        emulated_hpa: run the emulated HPA controller (:mod:`moe_eplb_harness.emulated.hpa`, ``world.hpa``) that
            scales on the pods' vLLM metrics itself: on the emulated API (no HPA controller there), or
            on the real one without the adapter (kube-controller-manager then runs without its own HPA
            controller). Not with ``metrics_adapter`` (the real one acts then). :attr:`autoscaler`
            names the one that runs.
    """

    workload: LoadTrace | dict[str, LoadTrace]
    scale: float = 100.0
    startup_seconds: float = 120.0
    prometheus: bool = False
    scrape_interval: float = 0.5
    drop_metrics: tuple[str, ...] = ()
    http_timeout: float = 5.0
    tick_seconds: float = 0.2
    lookback_seconds: float = 3600.0
    bucket_seconds: float = 60.0
    min_steps: int = 2000
    search: TuneOptions | None = None
    crash_if: Callable[[EngineSettings], bool] | None = None
    crash_pod_if: Callable[[EngineSettings, int], bool] | None = None
    faults_for: Callable[[EngineSettings], EngineFaults] | None = None
    num_groups: int | dict[str, int] = 1
    observer: Callable[[str, dict, dict], None] | None = None
    engine_tick: float = 0.05
    true_cost: Any = None
    kubelet_poll: float = 0.1
    engine_factory: Callable[[Any], Any] | None = None
    api: str = "emulated"
    metrics_adapter: bool = False
    emulated_hpa: bool = False
    lws: str = "auto"
    gpu_resource: str = "nvidia.com/gpu"  # the simulated nodes' GPU resource name (api="real")
    api_ports: bool = False  # api="real": engines serve vLLM's series on the pod's API port, the exporter's on its own
    shared_plane: Any = None
    namespace: str = "default"
    elastic_tick: float | None = None  # the operators' elastic resize loop's tick (None: its default)
    # handles, set by run()
    backend: ClusterBackend | None = None
    plane: Any = None
    lws_controller: Any = None
    cluster: Any = None
    clock: SimClock | None = None
    kubelet: Any = None
    prom: LocalPrometheus | None = None
    adapter: Any = None
    hpa: Any = None
    autotune: Any = None  # the operators' AutotuneSettings
    operators: list = field(default_factory=list)

    @property
    def prometheus_url(self) -> str | None:
        return self.prom.url if self.prom else None

    @property
    def autoscaler(self) -> str | None:
        """Which HPA controller scales in this world, in words (None: none runs)."""
        if self.metrics_adapter:
            return "the real HPA controller (kube-controller-manager), vLLM's metrics from Prometheus via prometheus-adapter"
        if self.emulated_hpa:
            from moe_eplb_harness.emulated.hpa import NAME

            return f"the {NAME}, vLLM's metrics scraped from the pods"
        return None

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[SimWorld]:
        from moe_eplb.controller.autotune_settings import OPERATOR_SEARCH, AutotuneSettings

        self.clock = SimClock.started_now(self.scale)
        search = dataclasses.replace(self.search or OPERATOR_SEARCH, min_steps=self.min_steps)
        rt = AutotuneSettings(clock=self.clock, tick_seconds=self.tick_seconds,
                              lookback_seconds=self.lookback_seconds, search=search,
                              observer=self.observer, http_timeout=self.http_timeout,
                              bucket_seconds=self.bucket_seconds,
                              min_wall_bucket_seconds=2 * self.scrape_interval)
        self.autotune = rt  # what every operator started here runs its loop with
        backend = self.backend = backend_for(self.api, lws=self.lws, shared_plane=self.shared_plane)
        self.api, self.lws = backend.name, backend.lws
        backend.check(self)
        try:
            async with backend.cluster(self) as cluster:
                self.cluster = cluster
                if self.prometheus:
                    found = find_prometheus()
                    if found.server is None:
                        raise RuntimeError(f"{found.problem}, or run without a Prometheus")
                    binary = found.server
                    self.prom = LocalPrometheus(binary, scrape_interval=self.scrape_interval, drop=self.drop_metrics)
                    await self.prom.start()
                if self.metrics_adapter:
                    await self._start_adapter()
                self.kubelet = backend.nodes(self, self._targets_changed if self.prom else None)
                await self.kubelet.start()
                if self.emulated_hpa:
                    from moe_eplb_harness.emulated.hpa import EmulatedHpaController

                    self.hpa = EmulatedHpaController(cluster, http_timeout=self.http_timeout)
                    await self.hpa.start()
                try:
                    yield self
                finally:
                    if self.hpa is not None:
                        await self.hpa.stop()
                        self.hpa = None
                    for op in list(self.operators):
                        await self.stop_operator(op)
                    await self.kubelet.stop()
                    if self.adapter is not None:
                        await asyncio.to_thread(self.adapter.stop)
                        self.adapter = None
                    if self.prom:
                        self.prom.stop()
                        self.prom = None
        finally:
            self.autotune = None  # its clock and observer belong to this run

    async def _start_adapter(self) -> None:
        from moe_eplb_harness.real.metricsadapter import PrometheusAdapter

        assert self.prom is not None and self.plane is not None
        adapter = PrometheusAdapter(self.plane, self.prom.url, os.path.join(self.plane.workdir, "adapter"))
        self.adapter = adapter
        await asyncio.to_thread(adapter.start)

    def set_true_cost(self, true_cost: Any) -> None:
        """Change the deployment's truth (:class:`moe_eplb_harness.engines.physics.TrueCost`) while the world
        runs -- e.g. a higher ``kv_demand``, as a traffic rise fills the KV cache and requests wait:
        the running engines produce their telemetry from it from their next step on, and engines
        started later start with it."""
        self.true_cost = true_cost
        self.kubelet.set_true_cost(true_cost)

    def _targets_changed(self, _changed: list[dict]) -> None:
        """Prometheus scrapes every ready pod of the world (on the real plane: the node agent's and
        the LWS stand-in's together)."""
        if self.prom is not None and self.kubelet is not None:
            self.prom.update(self.kubelet.targets())

    def connection(self) -> Any:
        """The operator's credentials for this world's API (the harness client's own)."""
        import kopf

        c = self.cluster.connection
        return kopf.ConnectionInfo(server=c.server, token=c.token, ca_path=c.ca_path)

    async def start_operator(self, *, standalone: bool = True, priority: int = 0,
                             peering_name: str = "moe-eplb") -> dict:
        """Start the real operator in this loop; returns a handle for :meth:`stop_operator`."""

        from moe_eplb.controller.elastic import ElasticSettings
        from moe_eplb.controller.handlers import Controller
        from moe_eplb.controller.main import build_settings, run_operator

        elastic = ElasticSettings(tick_seconds=self.elastic_tick) if self.elastic_tick else None
        controller = Controller(connection=self.connection(), resync_seconds=3600.0, refresh_delay_s=0.02,
                                retry_delay_s=0.2, autotune=self.autotune, elastic=elastic)
        # peered as the chart runs its replicas: required peering (announced before any watch, so a
        # lower-priority replica never acts in its first moments), a peer alive for 20 s without a
        # heartbeat (kopf's default is 60 s; shorter ones lapse when a loaded machine starves the loop)
        settings = build_settings(standalone=standalone, peering_name=peering_name, priority=priority,
                                  peering_required=not standalone)
        if not standalone:
            settings.peering.lifetime = 20
        ready = asyncio.Event()
        task = asyncio.create_task(run_operator(controller, settings=settings, standalone=standalone,
                                                peering_name=peering_name, priority=priority,
                                                peering_required=not standalone, ready_flag=ready))
        await asyncio.wait_for(ready.wait(), 15)
        procs.give_signals_back()
        handle = {"task": task, "controller": controller, "priority": priority}
        self.operators.append(handle)
        return handle

    async def stop_operator(self, handle: dict) -> None:
        """Kill an operator at once (task cancelled: like a killed pod, no graceful shutdown)."""
        handle["task"].cancel()
        with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError, Exception):
            await asyncio.wait_for(asyncio.shield(handle["task"]), 3.0)
        with contextlib.suppress(Exception):  # its API client, also when the task did not end in time
            await handle["controller"].close()
        if handle in self.operators:
            self.operators.remove(handle)

    async def apply(self, resource: dict) -> dict:
        """Create the MoEInference in the world's namespace (whatever its ``metadata.namespace`` says)."""
        resource = {**resource, "metadata": {**resource["metadata"], "namespace": self.namespace}}
        return await self.cluster.create(self.cluster.moeinference_path(self.namespace), resource)

    async def get(self, name: str, namespace: str | None = None) -> dict:
        return await self.cluster.get(self.cluster.moeinference_path(namespace or self.namespace, name))
