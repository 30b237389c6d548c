"""Shared fixtures: an emulated Kubernetes API server, and the real operator running against it.

- ``kube``: a fresh :class:`moe_eplb.sim.kubeapi.EmulatedCluster` (kmock-based, real HTTP on
  loopback, MoEInference CRD installed, namespace ``default``) per test.
- ``operator_runner(**kw)``: ``async with operator_runner(): ...`` runs the real kopf operator
  (``moe_eplb.controller.main.run_operator``, fresh registry, standalone) against ``kube`` inside
  the test's event loop until the block exits; yields the
  :class:`~moe_eplb.controller.handlers.Controller`.
- ``eventually``: ``await eventually(check, timeout=10)`` polls a sync or async check until truthy.

Both cluster fixtures skip the test (with the reason) when kopf or kmock is not installed; nothing
here imports them at collection time, so other areas' tests run without the operator extras.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

#: fixtures that start a server: a test using one is ``integration`` (the fast tier skips it)
SERVER_FIXTURES = frozenset({"kube", "operator_runner", "started", "fake_prom", "prometheus", "cluster"})


def pytest_collection_modifyitems(items: list) -> None:
    """Mark ``integration`` every test that uses a server fixture or a real Prometheus, so the fast
    tier (``-m 'not integration'``) cannot pick one up by accident."""
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("prometheus"):
            item.add_marker(pytest.mark.integration)


@pytest.fixture()
async def kube() -> AsyncIterator[Any]:
    """A fresh emulated API server (``moe_eplb.sim.kubeapi.EmulatedCluster``) for one test."""
    pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")
    pytest.importorskip("kmock", reason="the test extra (kmock) is not installed")
    from moe_eplb.sim.kubeapi import emulated_cluster

    async with emulated_cluster() as cluster:
        yield cluster


@contextlib.asynccontextmanager
async def running_operator(cluster: Any, *, resync_seconds: float = 3600.0,
                           refresh_delay_s: float = 0.02, clusterwide: bool = True,
                           standalone: bool = True, peering_name: str = "moe-eplb",
                           counter: Callable[[str], None] | None = None,
                           namespaces: tuple[str, ...] = (), operator_settings: Any = None,
                           autotune: Any = None) -> AsyncIterator[Any]:
    """Run the real operator against ``cluster`` until the block exits (cancelled: milliseconds).
    ``counter(result)`` is called after every reconcile (``ok``/``invalid``/``rejected``/``error``);
    ``namespaces`` serves only those (namespaced mode) instead of the whole cluster;
    ``operator_settings``: the process's OperatorSettings (``moe-eplb run`` options), e.g. defaults;
    ``autotune``: the tuning loop's AutotuneSettings (default: from the environment)."""
    import kopf

    from moe_eplb.controller.handlers import Controller
    from moe_eplb.controller.main import build_settings, run_operator

    controller = Controller(connection=kopf.ConnectionInfo(server=cluster.url, token="emulated"),
                            resync_seconds=resync_seconds, refresh_delay_s=refresh_delay_s, retry_delay_s=0.2,
                            counter=counter, settings=operator_settings, autotune=autotune)
    settings = build_settings(standalone=standalone, peering_name=peering_name,
                              clusterwide=clusterwide and not namespaces)
    ready = asyncio.Event()
    task = asyncio.create_task(run_operator(controller, settings=settings, standalone=standalone,
                                            peering_name=peering_name, clusterwide=clusterwide and not namespaces,
                                            namespaces=namespaces, ready_flag=ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        yield controller
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def eventually(check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    """Await ``check()`` (sync or async) until it returns something truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
            if inspect.isawaitable(last):
                last = await last
            if last:
                return last
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s (last: {last!r})")
        await asyncio.sleep(interval)


@pytest.fixture()
def operator_runner(kube: Any) -> Callable[..., Any]:
    """``async with operator_runner(**kw) as controller:`` runs the real operator against ``kube``."""
    return lambda **kw: running_operator(kube, **kw)


@pytest.fixture(name="eventually")
def eventually_fixture() -> Callable[..., Any]:
    """The :func:`eventually` poller, as a fixture (``await eventually(check, timeout=5)``)."""
    return eventually
