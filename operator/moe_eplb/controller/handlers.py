"""Thin kopf handlers: each one hands the MoEInference body to :class:`Reconciler`.

``register(registry, controller)`` adds every handler to the given ``kopf.OperatorRegistry`` (a
fresh registry per test or per process; nothing registers at import time):

- login: the controller's own ``kopf.ConnectionInfo`` if given, else kopf's service-account or
  kubeconfig login; the same credentials feed the controller's client (:mod:`.k8s`);
- create / resume / update (all spec changes except replicas alone) -> full reconcile;
- field ``spec.replicas`` (update only) -> reconcile that, by construction of the patch, changes
  only the workloads' replicas (no pod template change, no restart) + a ``Scaled`` Event;
- delete -> delete the children (ownerReferences would too), then kopf drops its finalizer;
- a timer every ``resync_seconds`` -> reconcile (drift backup and status refresh);
- events of children labelled ``app.kubernetes.io/managed-by=moe-eplb`` -> a coalesced
  refresh of the owner named in the ``eplb.ai/name`` label (readiness -> status, hand edits ->
  put back).

API errors become ``kopf.TemporaryError`` (kopf retries the handler after ``retry_delay_s``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from moe_eplb.contracts.k8s_names import (
    API_GROUP,
    API_VERSION,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    NAME_LABEL,
    PLURAL,
)
from moe_eplb.controller.autotune import AutotuneLoop
from moe_eplb.controller.autotune_settings import AutotuneSettings
from moe_eplb.controller.elastic import ElasticLoop, ElasticSettings
from moe_eplb.controller.k8s import CHILD_KINDS, KINDS, ApiError, Connection, KubeClient
from moe_eplb.controller.reconcile import ReconcileOutcome, Reconciler
from moe_eplb.controller.recovery_loop import RecoveryLoop
from moe_eplb.controller.settings import OperatorSettings

log = logging.getLogger("moe_eplb.controller")


class Controller:
    """What the handlers share: the client (set at login), the reconciler, the tuning loop and the timings.

    ``connection``: a ``kopf.ConnectionInfo`` to use instead of kopf's login (tests, demo);
    ``resync_seconds``: period of the drift/status timer; ``refresh_delay_s``: how long child
    events are coalesced before the owner is refreshed; ``counter(result)``: reconcile metric;
    ``settings``: the process's :class:`~moe_eplb.controller.settings.OperatorSettings` (e.g.
    ``settings.prometheus_url``, the default Prometheus; defaults when not given); ``autotune``: the
    tuning loop's settings (:class:`~moe_eplb.controller.autotune_settings.AutotuneSettings`: clock,
    tick, search; default from the environment). The controller owns the loop (:attr:`autotune`,
    an :class:`~moe_eplb.controller.autotune.AutotuneLoop`) and is its seam to the reconciler, and the
    elastic groups' resize loop (:attr:`elastic`, an :class:`~moe_eplb.controller.elastic.ElasticLoop`;
    ``elastic``: its settings, default from the environment).
    """

    def __init__(self, *, connection: kopf.ConnectionInfo | None = None, resync_seconds: float = 60.0,
                 refresh_delay_s: float = 0.1, retry_delay_s: float = 5.0,
                 counter: Callable[[str], None] | None = None, settings: OperatorSettings | None = None,
                 autotune: AutotuneSettings | None = None, elastic: ElasticSettings | None = None) -> None:
        self.settings = settings or OperatorSettings()
        self.connection = connection
        self.resync_seconds = resync_seconds
        self.retry_delay_s = retry_delay_s
        self.client: KubeClient | None = None
        self._counter = counter
        self._refresh_delay_s = refresh_delay_s
        self.reconciler: Reconciler | None = None
        self.autotune = AutotuneLoop(self, autotune)
        self.recovery = RecoveryLoop(self, self.autotune.settings)
        self.elastic = ElasticLoop(self, elastic)

    async def use(self, info: Any) -> None:
        """(Re)build the client for a ``kopf.ConnectionInfo`` (kopf logs in again on a 401)."""
        client = KubeClient(Connection.from_info(info))
        old, self.client = self.client, client
        if self.reconciler is None:
            self.reconciler = Reconciler(client, counter=self._counter, refresh_delay_s=self._refresh_delay_s,
                                         defaults=self.settings.defaults)
        else:
            self.reconciler.client = client
        if old is not None:
            await old.close()

    async def close(self) -> None:
        await self.autotune.close()
        await self.recovery.close()
        await self.elastic.close()
        if self.reconciler is not None:
            await self.reconciler.stop()
        if self.client is not None:
            await self.client.close()

    def _require(self) -> Reconciler:
        if self.reconciler is None:
            raise kopf.TemporaryError("not logged in yet", delay=1)
        return self.reconciler

    async def reconcile(self, body: Mapping[str, Any], *, prune: bool = True) -> ReconcileOutcome:
        try:
            return await self._require().reconcile(_plain(body), prune=prune)
        except ApiError as exc:
            raise kopf.TemporaryError(f"API error: {exc}", delay=self.retry_delay_s) from exc

    async def cleanup(self, body: Mapping[str, Any]) -> list[str]:
        try:
            return await self._require().cleanup(_plain(body))
        except ApiError as exc:
            raise kopf.TemporaryError(f"API error: {exc}", delay=self.retry_delay_s) from exc


def _plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """kopf's Body as a plain, private dict (the pure functions may read it freely)."""
    return copy.deepcopy(dict(body))


def _only_replicas(diff: Any) -> bool:
    return bool(diff) and all(tuple(path)[:2] == ("spec", "replicas") for _op, path, _old, _new in diff)


def register(registry: kopf.OperatorRegistry, controller: Controller) -> None:
    """Register the operator's handlers into ``registry``."""
    parent = (API_GROUP, API_VERSION, PLURAL)

    @kopf.on.login(registry=registry)
    async def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = controller.connection or kopf.login_with_service_account(**kwargs) \
            or kopf.login_with_kubeconfig(**kwargs)
        if info is not None:
            await controller.use(info)
        return info

    @kopf.on.cleanup(registry=registry)
    async def shutdown(**_: Any) -> None:
        await controller.close()

    @kopf.on.create(*parent, registry=registry)
    async def created(body: kopf.Body, **_: Any) -> None:
        await controller.reconcile(body)

    @kopf.on.resume(*parent, registry=registry)
    async def resumed(body: kopf.Body, **_: Any) -> None:
        await controller.reconcile(body)

    @kopf.on.update(*parent, registry=registry)
    async def updated(body: kopf.Body, diff: kopf.Diff, **_: Any) -> None:
        if _only_replicas(diff):
            return  # the spec.replicas field handler scales
        await controller.reconcile(body)

    @kopf.on.field(*parent, field="spec.replicas", registry=registry)
    async def scaled(body: kopf.Body, old: Any, new: Any, reason: Any, **_: Any) -> None:
        if str(reason) != "update" or old is None:
            return  # creation and resumption are the full reconcile's
        outcome = await controller.reconcile(body, prune=False)
        if controller.client is not None and outcome.valid:
            try:
                await controller.client.post_event(_plain(body), type="Normal", reason="Scaled",
                                                   message=f"replicas {old} -> {new}")
            except ApiError as exc:
                log.warning("could not post the Scaled event: %s", exc)

    @kopf.on.delete(*parent, registry=registry)
    async def deleted(body: kopf.Body, **_: Any) -> None:
        await controller.cleanup(body)

    @kopf.timer(*parent, interval=controller.resync_seconds, initial_delay=controller.resync_seconds,
                registry=registry)
    async def resync(body: kopf.Body, **_: Any) -> None:
        if not body.get("metadata", {}).get("deletionTimestamp"):
            await controller.reconcile(body, prune=False)

    async def child_event(body: kopf.Body, **_: Any) -> None:
        meta = body.get("metadata", {})
        owner = (meta.get("labels") or {}).get(NAME_LABEL)
        if owner and controller.reconciler is not None:
            controller.reconciler.request_refresh(meta.get("namespace"), owner)

    for api_version, kind in CHILD_KINDS:
        k = KINDS[(api_version, kind)]
        kopf.on.event(k.group, k.version, k.plural, id=f"child-{k.plural}", labels={MANAGED_BY_LABEL: MANAGED_BY},
                      registry=registry)(child_event)

    controller.autotune.register(registry)  # the tuning loop's timer (controller/autotune.py)
    controller.recovery.register(registry)  # the fault-recovery loop's timer (controller/recovery_loop.py)
    controller.elastic.register(registry)  # elastic groups' resizes (controller/elastic.py)
