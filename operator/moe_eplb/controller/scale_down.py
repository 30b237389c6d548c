"""Pausing the tuner after a fault-tolerance scale-down (vLLM >= 0.34).

After ``POST /v1/fault_tolerance/apply`` with ``scale_down``, vLLM re-hosts the lost data-parallel
ranks' experts in the redundant slots and stops EPLB for good (``eep_eplb_suppressed``: EPLB no
longer steps) until the engines restart. New EPLB settings would only restart the engines and undo
the recovery, so the autotune loop pauses for that resource, and its ``Tuned`` condition says why.

vLLM reports a committed scale-down only in a log line of each surviving engine core
(:func:`moe_eplb.api.wide_ep.scale_downs_in_log`), so that is what this reads: the logs of the
resource's running engine pods (``pods/log``). Each pod's log is read whole once, then only what
was written since the last read; a pod that logged a scale-down stays marked while it lives (by
UID), so new pods (a restart) end the pause.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from moe_eplb.api import wide_ep
from moe_eplb.api.spec import MoEInference
from moe_eplb.controller.k8s import ApiError, KubeClient

log = logging.getLogger("moe_eplb.autotune")

#: The ``Tuned`` condition's reason while paused.
REASON = "ScaleDownPaused"


@dataclass
class _PodLog:
    read_at: float  # wall seconds of the last read
    removed: tuple[int, ...] = ()  # DP ranks a logged scale-down removed (empty: none seen)


@dataclass
class ScaleDownWatch:
    """Per-pod memory of what the logs said (one per operator process)."""

    pods: dict[str, _PodLog] = field(default_factory=dict)

    async def paused(self, client: KubeClient, inf: MoEInference, pods: list[dict], now_wall: float) -> str | None:
        """Why tuning is paused for ``inf`` (a scale-down was logged by one of its running pods), or
        None. Only with ``spec.faultTolerance.enabled`` on an engine that has ``scale_down``."""
        version = inf.engine.version
        if not inf.fault_tolerance.enabled or version is None or version < wide_ep.FT_SCALE_DOWN_SINCE:
            return None
        live = {}
        for pod in pods:
            meta = pod.get("metadata") or {}
            uid, name = meta.get("uid"), meta.get("name")
            if not uid or not name or (pod.get("status") or {}).get("phase") != "Running":
                continue
            live[uid] = name
            await self._read(client, inf.namespace, uid, name, now_wall)
        for uid in [u for u in self.pods if u not in live]:
            del self.pods[uid]  # a pod gone (restarted or replaced): its engines balance again
        hit = sorted((live[u], s.removed) for u, s in self.pods.items() if u in live and s.removed)
        if not hit:
            return None
        where = ", ".join(f"{name} (ranks {list(ranks)})" for name, ranks in hit)
        return (f"paused: vLLM scaled down lost data-parallel rank(s) ({where}); after a scale_down EPLB no longer "
                "rebalances until the engines restart, and new settings would restart them and undo the recovery. "
                "Tuning resumes when these pods are replaced")

    async def _read(self, client: KubeClient, namespace: str | None, uid: str, name: str, now_wall: float) -> None:
        seen = self.pods.get(uid)
        since = None if seen is None else int(now_wall - seen.read_at) + 5  # overlap: never miss a line
        try:
            text = await client.pod_log(namespace, name, since_seconds=since)
        except ApiError as exc:
            log.warning("autotune %s/%s: cannot read the log of pod %s for vLLM's scale_down line: %s",
                        namespace, name, name, exc)
            return
        found = wide_ep.scale_downs_in_log(text)
        removed = tuple(sorted({r for _, ranks in found for r in ranks}))
        previous = seen.removed if seen is not None else ()
        self.pods[uid] = _PodLog(read_at=now_wall, removed=tuple(sorted(set(previous) | set(removed))))
