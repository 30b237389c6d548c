"""Start-up of an operator replica under *required* peering (the chart's setup): announce ourselves in
kopf's peering object, then wait a moment, before any resource is processed.

Why: kopf pauses the lower-priority replica only once it has seen a higher one in the peering object.
Two replicas that start together (a Deployment of 2) each read the object before the other has
written to it, so both process the resources they list -- on a real kube-apiserver both reconciled
for ~0.5 s (tests/kube/test_operator_real.py), and work kopf had queued ran on after the pause.
Announcing in a start-up activity (kopf runs those before any watch) and waiting
:data:`SETTLE_SECONDS` lets every replica starting within that window see the others on its first
read, so only the highest priority (the oldest, :func:`moe_eplb.controller.settings.seniority_priority`)
ever acts. The entry is kopf's own (``status.<identity>: {priority, lifetime, lastseen}``); kopf's
keep-alive takes it over.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Collection
from typing import Any

from moe_eplb.controller.k8s import ApiError, KubeClient

log = logging.getLogger("moe_eplb.controller")

#: how long a replica waits after announcing itself (replicas started further apart see each other
#: through kopf's own keep-alive anyway: the earlier one is already in the object)
SETTLE_SECONDS = 3.0
PEERING_API = "kopf.dev/v1"


def peer_entry(priority: int, lifetime_s: int, now: datetime.datetime) -> dict[str, Any]:
    """kopf's record of one live peer (the shape kopf's ``Peer.as_dict`` writes)."""
    return {"priority": int(priority), "lifetime": int(lifetime_s), "lastseen": now.isoformat()}


async def announce(client: KubeClient, *, name: str, identity: str, priority: int, lifetime_s: int,
                   namespaces: Collection[str] = (), settle_s: float = SETTLE_SECONDS) -> bool:
    """Write our entry into the ClusterKopfPeering ``name`` (or the KopfPeering ``name`` of each of
    ``namespaces``), then sleep ``settle_s``. ``False`` (and no wait) when no peering object could be
    written (kopf then reports the missing object itself)."""
    patch = {"status": {identity: peer_entry(priority, lifetime_s, datetime.datetime.now(datetime.timezone.utc))}}
    targets = [("KopfPeering", ns) for ns in namespaces] or [("ClusterKopfPeering", None)]
    written = False
    for kind, ns in targets:
        try:
            await client.patch(PEERING_API, kind, ns, name, patch)
            written = True
        except ApiError as exc:
            log.warning("peering: could not announce %s in %s %s%s: %s", identity, kind, name,
                        f" ({ns})" if ns else "", exc)
    if written:
        log.info("peering: announced %s (priority %d) in %s; waiting %.0f s for replicas starting now",
                 identity, priority, name, settle_s)
        await asyncio.sleep(settle_s)
    return written
