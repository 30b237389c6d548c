"""The seam between a simulated cluster (:class:`moe_eplb_harness.cluster.world.SimWorld`) and the Kubernetes it
runs on: one :class:`ClusterBackend`, chosen once (:func:`backend_for`) where a world is built.

- :class:`EmulatedBackend`: the kmock-based API (:mod:`moe_eplb_harness.emulated.kubeapi`) and the fake
  kubelet playing the kubelet, the Deployment and the LeaderWorkerSet controllers
  (:mod:`moe_eplb_harness.emulated.kubelet`). Needs no Go build; the one with fault injection.
- :class:`RealBackend`: a real control plane (:mod:`moe_eplb_harness.real.simplane`, started here or a
  test session's shared one), simulated GPU nodes (:mod:`moe_eplb_harness.real.nodeagent`), and the
  LeaderWorkerSet controller its ``lws`` names: the real one (:mod:`moe_eplb_harness.real.lwscontroller`)
  or, where it is not built, the emulated one over the real API (the fake kubelet in LWS-only mode).

Both give the world the same things: the harness's API client (:class:`moe_eplb_harness.floor.client.ClusterClient`,
whose ``connection`` the world's operators get) and the pods' side (:class:`Nodes`). This module is
the one place that imports both backend packages (``sim.emulated`` and ``sim.real`` never import each
other); it imports each only when that backend is used.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import tempfile
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar, Protocol

from moe_eplb_harness.floor.client import ClusterClient
from moe_eplb_harness.floor.pods import KubeletSettings

#: a :class:`moe_eplb_harness.cluster.world.SimWorld` (its options and handles; not imported: it imports this)
SimWorld = Any

log = logging.getLogger(__name__)

#: the ``api`` and ``lws`` words a world is configured with
APIS = ("emulated", "real", "auto")


class Nodes(Protocol):
    """What runs a world's pods, as the world and the tests use it (the fake kubelet on the
    emulation, :class:`moe_eplb_harness.real.nodeagent.RealNodes` on the real plane)."""

    pods_created: int

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def engines(self, instance: str | None = None) -> list[Any]: ...

    def running(self) -> list[tuple[str, Any]]: ...

    def targets(self) -> list[dict]: ...

    def set_true_cost(self, true_cost: Any) -> None: ...


class ClusterBackend(abc.ABC):
    """The Kubernetes a world runs on (see the module doc). ``name``: ``emulated`` | ``real``;
    ``lws``: which LeaderWorkerSet controller runs (``emulated`` | ``real``)."""

    name: ClassVar[str]
    lws: str

    def check(self, world: SimWorld) -> None:
        """Refuse (``ValueError``) a world option this backend cannot serve."""
        if world.metrics_adapter and world.emulated_hpa:
            raise ValueError("emulated_hpa: not with metrics_adapter (the real HPA controller scales then)")

    @abc.abstractmethod
    def cluster(self, world: SimWorld) -> contextlib.AbstractAsyncContextManager[ClusterClient]:
        """The running API (its client), for as long as the block lasts."""

    @abc.abstractmethod
    def nodes(self, world: SimWorld, on_change: Callable[[list[dict]], Any] | None) -> Nodes:
        """What runs the world's pods (not started); ``on_change`` when its ready pods change."""


class EmulatedBackend(ClusterBackend):
    """The kmock-based API and the fake kubelet (no Go build needed)."""

    name = "emulated"
    lws = "emulated"

    def check(self, world: SimWorld) -> None:
        if world.metrics_adapter:
            raise ValueError("metrics_adapter: needs api='real' (an aggregation layer) and prometheus=True (its source)")
        super().check(world)

    @contextlib.asynccontextmanager
    async def cluster(self, world: SimWorld) -> AsyncIterator[ClusterClient]:
        from moe_eplb_harness.emulated.kubeapi import emulated_cluster

        async with emulated_cluster() as cluster:
            yield cluster

    def nodes(self, world: SimWorld, on_change: Callable[[list[dict]], Any] | None) -> Nodes:
        from moe_eplb_harness.emulated.kubelet import FakeKubelet

        return FakeKubelet(world.cluster.url, kubelet_settings(world, on_change), engine_factory=world.engine_factory)


class RealBackend(ClusterBackend):
    """A real control plane on loopback (``make kube``), simulated GPU nodes, the LWS controller ``lws``.

    ``shared``: a running :class:`moe_eplb_harness.real.simplane.SimPlane` (a test session's) to run on
    when it has the controllers the world needs; the world then works in a namespace and on Nodes of
    its own, cleaned at its end."""

    name = "real"

    def __init__(self, lws: str = "auto", shared: Any = None) -> None:
        self.lws = resolve_lws(lws)
        self.shared = shared
        self.on_shared = False  # set by cluster(): whether this run uses ``shared``
        self.node_prefix = "gpu-node"  # the simulated Nodes' names: <node_prefix>-0 ... (set by cluster())

    def check(self, world: SimWorld) -> None:
        if world.metrics_adapter and not world.prometheus:
            raise ValueError("metrics_adapter: needs api='real' (an aggregation layer) and prometheus=True (its source)")
        super().check(world)

    def _usable(self, world: SimWorld) -> Any:
        sp = self.shared
        if sp is None or sp.lws != self.lws or (world.metrics_adapter and not sp.aggregator) or sp.hpa == world.emulated_hpa:
            return None  # not the controllers this world needs: a plane of its own
        return sp

    @contextlib.asynccontextmanager
    async def cluster(self, world: SimWorld) -> AsyncIterator[ClusterClient]:
        from moe_eplb_harness.real import simplane
        from moe_eplb_harness.real.realapi import real_cluster

        shared = self._usable(world)
        self.on_shared = shared is not None
        self.node_prefix = "gpu-node"
        with contextlib.ExitStack() as stack:
            if shared is None:
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="moe-eplb-kube-"))
                # one HPA controller: the emulated one reads the pods, the real one would have no metrics API
                sp = await asyncio.to_thread(simplane.start, tmp, lws=self.lws == "real",
                                             aggregator=world.metrics_adapter, hpa=not world.emulated_hpa)
            else:
                sp = shared
                world.namespace = await asyncio.to_thread(sp.new_namespace)
                self.node_prefix = f"{world.namespace}-gpu"  # Nodes of its own on the shared plane
            world.plane, world.lws_controller = sp.plane, sp.lws_controller
            try:
                async with real_cluster(sp.plane) as cluster:
                    yield cluster
            finally:
                world.plane = world.lws_controller = None
                if shared is None:
                    await asyncio.to_thread(sp.stop)
                else:  # a failure here must not hide the world's own
                    try:
                        await asyncio.to_thread(sp.clean_namespace, world.namespace)
                    except Exception as exc:  # noqa: BLE001
                        log.warning("could not clean namespace %s of the shared control plane: %s", world.namespace, exc)

    def nodes(self, world: SimWorld, on_change: Callable[[list[dict]], Any] | None) -> Nodes:
        from moe_eplb_harness.real.nodeagent import NodeAgent, NodePool, RealNodes

        prefix, kubelet = self.node_prefix, kubelet_settings(world, on_change)
        agent = NodeAgent(world.cluster, kubelet, NodePool(nodes=8, gpus_per_node=16, prefix=prefix,
                                                           gpu_resource=world.gpu_resource, remove_on_stop=self.on_shared,
                                                           api_ports=world.api_ports))
        lws = None
        if self.lws == "emulated":  # the emulated LWS controller over the real API (the real one not built)
            from moe_eplb_harness.emulated.kubelet import FakeKubelet

            lws = FakeKubelet(world.cluster.connection, kubelet, engine_factory=world.engine_factory, deployments=False,
                              node_name=f"{prefix}-7", namespace=world.namespace if self.on_shared else None)
        return RealNodes(agent, lws)


def kubelet_settings(world: SimWorld, on_change: Callable[[list[dict]], Any] | None) -> KubeletSettings:
    """What every simulated kubelet of a world is given."""
    return KubeletSettings(world.workload, world.clock, startup_seconds=world.startup_seconds,
                           engine_tick=world.engine_tick, poll=world.kubelet_poll, num_groups=world.num_groups,
                           true_cost=world.true_cost, crash_if=world.crash_if, crash_pod_if=world.crash_pod_if,
                           faults_for=world.faults_for, on_change=on_change)


def resolve_api(api: str) -> str:
    """``emulated`` | ``real`` | ``auto`` (real when the control plane is built, else emulated)."""
    if api not in APIS:
        raise ValueError(f"api: {api!r} is not one of {', '.join(APIS)}")
    if api == "emulated":
        return api
    from moe_eplb_harness.real.controlplane import default_bin_dir, find_binaries

    built = find_binaries() is not None
    if api == "auto":
        return "real" if built else "emulated"
    if not built:
        raise RuntimeError(f"api=real: no control plane built in {default_bin_dir()} (run `make kube`)")
    return api


def resolve_lws(lws: str) -> str:
    """On the real API: ``real`` | ``emulated`` | ``auto`` (real when ``tools/build-go-tool.sh tools/lws`` built it)."""
    from moe_eplb_harness.real.lwscontroller import default_lws_bin_dir, find_lws_binary

    if lws not in APIS:
        raise ValueError(f"lws: {lws!r} is not one of {', '.join(APIS)}")
    if lws == "auto":
        return "real" if find_lws_binary() is not None else "emulated"
    if lws == "real" and find_lws_binary() is None:
        raise RuntimeError(f"lws=real: no LeaderWorkerSet controller built in {default_lws_bin_dir()} (run `make kube`)")
    return lws


def backend_for(api: str, *, lws: str = "auto", shared_plane: Any = None) -> ClusterBackend:
    """The backend for a world's ``api`` word (``auto``: real when the control plane is built)."""
    if resolve_api(api) == "real":
        return RealBackend(lws, shared_plane)
    return EmulatedBackend()
