"""Run the operator: kopf embedded in an asyncio loop, with the project's settings.

:func:`run_operator` is what ``moe-eplb run``, ``moe-eplb demo``, the tests and the benchmark call.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Collection
from typing import Any

import kopf
from prometheus_client import Counter, start_http_server

from moe_eplb.contracts import metric_names
from moe_eplb.contracts.k8s_names import API_GROUP
from moe_eplb.controller.handlers import Controller, register
from moe_eplb.controller.opmetrics import no_created_series
from moe_eplb.controller.settings import PEERING_NAME

#: how often kopf checks whether a timer call in flight ended, once its resource is being deleted
CANCELLATION_POLLING_S = 1.0


def build_settings(*, peering_name: str = PEERING_NAME, priority: int = 0,
                   standalone: bool = False, clusterwide: bool = True,
                   peering_required: bool = False) -> kopf.OperatorSettings:
    """kopf settings: our finalizer and annotation prefix, peering, and no log-to-Event spam."""
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = f"{API_GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration")
    settings.posting.reporting_component = "moe-eplb"
    settings.posting.level = logging.WARNING
    settings.peering.name = peering_name
    settings.peering.priority = priority
    settings.peering.standalone = standalone
    # mandatory: every stream stays paused until the peering object was read (no start-up overlap
    # of two replicas); only when the name was given on purpose, since it needs the peering object
    settings.peering.mandatory = peering_required and not standalone
    settings.peering.clusterwide = clusterwide
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60
    # a resource's deletion waits for its timers' calls in flight (the autotune tick, the recovery and
    # elastic loops): kopf checks whether they ended every ``cancellation_polling`` seconds, 60 by
    # default -- a deletion that caught a tick in flight took a minute however short the tick
    settings.background.cancellation_polling = CANCELLATION_POLLING_S
    return settings


def configure_logging(level: str = "INFO", fmt: str = "text", *, debug: bool = False) -> logging.Logger:
    """Root logging for the operator process through kopf's own handler and formatters.

    ``level``: DEBUG | INFO | WARNING | ERROR; ``fmt``: ``text`` (kopf's timestamped lines) or
    ``json`` (kopf's JSON formatter, built on python-json-logger, a kopf dependency: one object
    per line with ``message``, ``severity``, ``timestamp`` and the ``object`` a line is about);
    ``debug`` also shows kopf's per-API-call logs. Returns the ``moe_eplb`` logger.
    """
    log_format = kopf.LogFormat.JSON if fmt.lower() == "json" else kopf.LogFormat.FULL
    kopf.configure(debug=debug, verbose=level.upper() == "DEBUG", log_format=log_format)
    logging.getLogger().setLevel(level.upper())
    return logging.getLogger("moe_eplb")


@functools.cache
def reconcile_counter() -> Callable[[str], None]:
    """``counter(result)`` incrementing ``moe_eplb_reconciles_total{result}`` (process-wide registry)."""
    no_created_series()
    counter = Counter(metric_names.RECONCILES.removesuffix("_total"), "MoEInference reconciles by result (ok, invalid, error)",
                      ["result"])
    return lambda result: counter.labels(result=result).inc()


def start_metrics_server(port: int, host: str = "0.0.0.0") -> None:
    """Serve the operator's Prometheus metrics (classic text format) on ``host:port``/metrics."""
    start_http_server(port, addr=host)


async def run_operator(controller: Controller | None = None, *, registry: kopf.OperatorRegistry | None = None,
                       settings: kopf.OperatorSettings | None = None, clusterwide: bool = True,
                       namespaces: Collection[str] = (), standalone: bool = False,
                       peering_name: str = PEERING_NAME, priority: int = 0, liveness_endpoint: str | None = None,
                       peering_required: bool = False,
                       stop_flag: Any = None, ready_flag: Any = None) -> None:
    """Run kopf with the moe-eplb handlers until ``stop_flag`` is set or the task is cancelled.

    ``clusterwide`` serves all namespaces, else only ``namespaces``; peering (several replicas, one
    active) uses kopf's ``ClusterKopfPeering`` (clusterwide) or ``KopfPeering`` named
    ``peering_name`` when that CRD is installed, unless ``standalone``; ``liveness_endpoint`` like ``http://0.0.0.0:8081/healthz``.
    """
    controller = controller or Controller()
    registry = registry or kopf.OperatorRegistry()
    register(registry, controller)
    settings = settings or build_settings(peering_name=peering_name, priority=priority, standalone=standalone,
                                          clusterwide=clusterwide, peering_required=peering_required)
    identity = None
    if settings.peering.mandatory:
        identity = _identity()
        register_announce(registry, controller, settings, identity, namespaces=() if clusterwide else namespaces)
    await kopf.operator(
        registry=registry, settings=settings, identity=identity,
        clusterwide=clusterwide and not namespaces, namespaces=list(namespaces),
        # peering_name goes through the settings: passed here, kopf would make peering mandatory
        # (and pause everything until the peering CRD exists, even when standalone).
        standalone=standalone, priority=priority,
        liveness_endpoint=liveness_endpoint, stop_flag=stop_flag, ready_flag=ready_flag,
        memo=kopf.Memo(controller=controller),
    )


def _identity() -> Any:
    """kopf's own peer identity for this process (``POD_ID`` or user@host/pid-time)."""
    from kopf._core.engines.peering import detect_own_id  # kopf 1.45's; what kopf.operator() calls itself

    return detect_own_id(manual=False)


def register_announce(registry: kopf.OperatorRegistry, controller: Controller, settings: kopf.OperatorSettings,
                      identity: Any, namespaces: Collection[str] = ()) -> None:
    """A start-up activity (kopf runs it before any watch) announcing this replica in the peering
    object and waiting for replicas starting at the same time (:mod:`moe_eplb.controller.peering`)."""

    @kopf.on.startup(registry=registry)
    async def announce_peer(**kwargs: Any) -> None:
        from moe_eplb.controller.k8s import Connection, KubeClient
        from moe_eplb.controller.peering import announce

        info = controller.connection or kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
        if info is None:
            return
        async with KubeClient(Connection.from_info(info)) as client:
            await announce(client, name=settings.peering.name, identity=str(identity), priority=settings.peering.priority,
                           lifetime_s=int(settings.peering.lifetime), namespaces=namespaces)


def main(**kwargs: Any) -> None:
    """Blocking entry point (``moe-eplb run``)."""
    asyncio.run(run_operator(**kwargs))
