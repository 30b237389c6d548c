"""Shared fixtures: an emulated Kubernetes API server, and the real operator running against it.

- ``emulated_cluster``: a fresh :class:`moe_eplb_harness.emulated.kubeapi.EmulatedCluster` (kmock-based, real HTTP on
  loopback, MoEInference CRD installed, namespace ``default``) per test.
- ``operator_runner(**kw)``: ``async with operator_runner(): ...`` runs the real kopf operator
  (``moe_eplb.controller.main.run_operator``, fresh registry, standalone) against ``emulated_cluster`` inside
  the test's event loop until the block exits; yields the
  :class:`~moe_eplb.controller.handlers.Controller`.
- ``eventually``: ``await eventually(check, timeout=10)`` polls a sync or async check until truthy.
- ``real_control_plane`` (session): ONE real control plane for the whole run, one per worker when
  pytest-xdist runs the tests in parallel (:func:`worker_id`)
  (:class:`moe_eplb_harness.real.simplane.SimPlane`: etcd, kube-apiserver, kube-controller-manager with
  its HPA controller, kube-scheduler, the aggregation layer, the project's CRDs, and the real
  LeaderWorkerSet controller where built), started on first use (seconds) and shared by the ``kube``
  tier (``control_plane``), the real-API autotune scenarios, the real LWS and GPU-resource tests, the
  real HPA controller's tests and the autoscale demo on the real plane (``SimWorld(shared_plane=...)``:
  a namespace and Nodes of their own per test, cleaned at its end; what a test needs beside the plane
  -- prometheus-adapter, a Prometheus, the operator -- it starts and stops itself). A world that needs
  other controllers (the emulated HPA controller instead of the real one) starts a plane of its own. Skipped without the built binaries, except
  in CI (``MOE_EPLB_REQUIRE_KUBE=1``: failed). The tail of each of its logs is attached to the
  report of a failing test that used it.

- tests marked ``vllm`` are skipped (with the reason) where vLLM's CPU wheel or torch is not
  installed, and failed instead where ``MOE_EPLB_REQUIRE_VLLM=1`` (CI): tests/require.py.
- tests marked ``prometheus`` likewise without a Prometheus server and promtool (``make prometheus``),
  failed where ``MOE_EPLB_REQUIRE_PROMETHEUS=1`` (``make test`` sets every ``MOE_EPLB_REQUIRE_*``).

Both cluster fixtures skip the test (with the reason) when kopf or kmock is not installed; nothing
here imports them at collection time, so other areas' tests run without the operator extras.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from tests.polling import eventually
from tests.require import missing, missing_vllm, prometheus_tools, vllm_missing_reason

#: fixtures that start a server: a test using one is ``integration`` (the fast tier skips it)
SERVER_FIXTURES = frozenset({"emulated_cluster", "operator_runner", "started", "fake_prom", "prometheus", "cluster",
                             "real_control_plane", "control_plane"})

#: the session's shared control plane once started (for the log tails of failing tests)
_SIM_PLANE: Any = None


#: the long end-to-end scenarios, marked ``slow``: ``make test`` leaves them out (it must stay within
#: 20 minutes on two cores) and ``make test-slow`` runs them (CI: right after ``make test``). Each
#: runs minutes of simulated hours or real controllers beside the control plane (KEDA, the
#: Prometheus Operator with a Prometheus 3, the Helm CLI with the chart's operator).
SLOW = (
    "tests/sim/test_demo_direct.py",  # the demo, direct read (simulated hours)
    "tests/sim/test_demo_autoscale.py",  # the autoscale demo on the emulation
    "tests/kube/test_demo_autoscale_real.py",  # the autoscale demo with the real HPA controller
    "tests/kube/test_keda_real.py",  # the real KEDA: to zero, from zero by hand, its conditions
    "tests/kube/test_prometheus_operator_real.py",  # the real Prometheus Operator and its Prometheus
    "tests/kube/test_helm_cli_real.py",  # helm install / upgrade / test / uninstall, a plane of its own
    "tests/autotune/test_operator_experiments.py",  # experiments to their verdicts, both planes
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(items: list) -> None:
    """Mark ``integration`` every test that uses a server fixture or a real Prometheus, so the fast
    tier (``-m 'not integration'``) cannot pick one up by accident; mark ``slow`` (and
    ``integration``) every test in :data:`SLOW`."""
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("prometheus"):
            item.add_marker(pytest.mark.integration)
        rel = os.path.relpath(str(item.path), ROOT).replace(os.sep, "/")
        if any(rel == s or (s.endswith("/") and rel.startswith(s)) for s in SLOW):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.integration)


def pytest_runtest_setup(item: Any) -> None:
    """A test marked ``vllm`` needs vLLM's CPU wheel, one marked ``prometheus`` a Prometheus server and
    promtool: without them, skipped with the reason by that marker (failed where
    ``MOE_EPLB_REQUIRE_VLLM=1`` / ``MOE_EPLB_REQUIRE_PROMETHEUS=1``, as in ``make test``): tests/require.py."""
    if item.get_closest_marker("vllm") is not None:
        reason = vllm_missing_reason()
        if reason is not None:
            missing_vllm(reason)
    if item.get_closest_marker("prometheus") is not None:
        prometheus_tools()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Iterator[None]:
    """On a failure of a test on the shared control plane, attach the tail of every one of its logs."""
    outcome = yield
    report = outcome.get_result()
    names = set(getattr(item, "fixturenames", ()))
    if not (report.failed and _SIM_PLANE is not None and names & {"real_control_plane", "control_plane", "plane"}):
        return
    plane, lws = _SIM_PLANE.plane, _SIM_PLANE.lws_controller
    for name in plane.logs:
        lines = [ln for ln in plane.log_tail(name, 200).splitlines() if "grpc" not in ln][-12:]
        report.sections.append((f"control plane: {name} ({plane.logs[name]})", "\n".join(lines)))
    if lws is not None:
        report.sections.append((f"control plane: lws-controller ({lws.log})", lws.log_tail(12)))


def worker_id() -> str:
    """This test process's pytest-xdist worker (``gw0``, ``gw1``, ...), ``main`` without xdist: one
    session control plane per worker, its folder named by it."""
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


@pytest.fixture(scope="session")
def real_control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The session's real control plane (see the module doc); stopped at the end of the session."""
    global _SIM_PLANE
    from moe_eplb_harness.real import simplane
    from moe_eplb_harness.real.controlplane import default_bin_dir, find_binaries
    from moe_eplb_harness.real.lwscontroller import find_lws_binary

    if find_binaries() is None:
        missing(f"no control plane built in {default_bin_dir()} (run `make kube`)")
    plane = simplane.start(tmp_path_factory.mktemp(f"control-plane-{worker_id()}"), lws=find_lws_binary() is not None,
                           aggregator=True)
    _SIM_PLANE = plane
    try:
        yield plane
    finally:
        _SIM_PLANE = None
        plane.stop()


@pytest.fixture()
async def emulated_cluster() -> AsyncIterator[Any]:
    """A fresh emulated API server (``moe_eplb_harness.emulated.kubeapi.EmulatedCluster``) for one test."""
    pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")
    pytest.importorskip("kmock", reason="the test extra (kmock) is not installed")
    from moe_eplb_harness.emulated.kubeapi import emulated_cluster as start

    async with start() as cluster:
        yield cluster


@contextlib.asynccontextmanager
async def running_operator(cluster: Any, *, resync_seconds: float = 3600.0,
                           refresh_delay_s: float = 0.02, clusterwide: bool = True,
                           standalone: bool = True, peering_name: str = "moe-eplb",
                           counter: Callable[[str], None] | None = None,
                           namespaces: tuple[str, ...] = (), operator_settings: Any = None,
                           autotune: Any = None, elastic: Any = None) -> AsyncIterator[Any]:
    """Run the real operator against ``cluster`` until the block exits (cancelled: milliseconds).
    ``counter(result)`` is called after every reconcile (``ok``/``invalid``/``rejected``/``error``);
    ``namespaces`` serves only those (namespaced mode) instead of the whole cluster;
    ``operator_settings``: the process's OperatorSettings (``moe-eplb run`` options), e.g. defaults;
    ``autotune``: the tuning loop's AutotuneSettings (default: from the environment); ``elastic``: the
    elastic resize loop's ElasticSettings (default: from the environment)."""
    import kopf

    from moe_eplb.controller.handlers import Controller
    from moe_eplb.controller.main import build_settings, run_operator

    controller = Controller(connection=kopf.ConnectionInfo(server=cluster.url, token="emulated"),
                            resync_seconds=resync_seconds, refresh_delay_s=refresh_delay_s, retry_delay_s=0.2,
                            counter=counter, settings=operator_settings, autotune=autotune, elastic=elastic)
    settings = build_settings(standalone=standalone, peering_name=peering_name,
                              clusterwide=clusterwide and not namespaces)
    ready = asyncio.Event()
    task = asyncio.create_task(run_operator(controller, settings=settings, standalone=standalone,
                                            peering_name=peering_name, clusterwide=clusterwide and not namespaces,
                                            namespaces=namespaces, ready_flag=ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        from moe_eplb_harness.floor.procs import give_signals_back

        give_signals_back()  # a SIGTERM ends the test run (and its child processes), not just this operator
        yield controller
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


@pytest.fixture()
def operator_runner(emulated_cluster: Any) -> Callable[..., Any]:
    """``async with operator_runner(**kw) as controller:`` runs the real operator against ``emulated_cluster``."""
    return lambda **kw: running_operator(emulated_cluster, **kw)


@pytest.fixture(name="eventually")
def eventually_fixture() -> Callable[..., Any]:
    """The one poller (:func:`tests.polling.eventually`), as a fixture (``await eventually(check, timeout=5)``)."""
    return eventually
