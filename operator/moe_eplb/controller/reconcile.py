"""Reconcile one MoEInference: validate, render, create-or-patch the children, prune, write status.

The flow (one resource at a time, serialised per resource by :class:`Reconciler`):

1. ``validate`` the resource. Problems -> status ``SpecValid=False`` (reason ``InvalidSpec``, the
   problems in the message), phase ``Invalid``, a Warning Event (once per generation and message),
   and **no child is created, changed or deleted** (what runs keeps running).
2. ``render_children`` of the resource parsed once with validation (``check``; pure, every child in
   apply order). A render error is handled like an invalid spec (nothing applied).
3. Plan every child (GET, then absent -> create, else the minimal patch), send every pending write
   first with ``dryRun=All``: if the API server refuses any child, nothing is applied and the
   status says so (``Degraded``, reason ``ChildRejected``, a Warning Event). Then, in order:
   absent -> POST (a 409 from a concurrent creator falls through
   to patching, so a re-run never fails with AlreadyExists); present -> compute the minimal merge
   patch that makes the live object cover the desired one (:func:`merge_diff`) and PATCH only that.
   Changing only ``spec.replicas`` therefore patches only ``spec.replicas`` of the workload (no pod
   restart), while changed EPLB settings change the pod template (its config-hash annotation and
   args), which rolls the pods. A child edited by hand (drift) is put back the same way.
4. On spec changes (not on status refreshes), delete children with this resource's labels and
   ownerReference that are no longer rendered (e.g. a disabled PodMonitor).
5. Compute the status from the live children (:mod:`moe_eplb.controller.status`) and write it to
   the status subresource only when something other than timestamps changed, conditional on the
   resourceVersion (retried on 409, so other writers' keys such as ``status.autotune`` survive).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moe_eplb.api.advice import advice
from moe_eplb.api.spec import OperatorDefaults, status_eplb
from moe_eplb.api.validation import check_for_operator
from moe_eplb.contracts.k8s_names import (
    API_GROUP,
    API_VERSION,
    HPA_KIND,
    KEDA_KIND,
    KIND,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    NAME_LABEL,
    control_secret_name,
)
from moe_eplb.controller import control, elastic, elastic_metrics, opmetrics
from moe_eplb.controller import status as status_mod
from moe_eplb.controller.k8s import CHILD_KINDS, ApiError, KubeClient
from moe_eplb.controller.workload import restarts_of
from moe_eplb.render.autoscaler import describe as describe_autoscaler
from moe_eplb.render.labels import selector_string
from moe_eplb.render.objects import endpoint, render_children

log = logging.getLogger("moe_eplb.controller")

PARENT_API_VERSION = f"{API_GROUP}/{API_VERSION}"

# metadata keys of a child that the controller manages (others are the server's or other tools')
_MANAGED_METADATA = ("labels", "annotations", "ownerReferences")


# --------------------------------------------------------------------------------------------------
# pure helpers
# --------------------------------------------------------------------------------------------------

def covers(live: Any, desired: Any) -> bool:
    """Whether ``live`` already holds everything ``desired`` says: dicts by key (extra live keys,
    such as server defaults, are fine), lists element by element with equal length, scalars equal
    (``4`` and ``"4"`` count as equal: the apiserver prints quantities as strings)."""
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(covers(live.get(k), v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(live) == len(desired) and all(
            covers(a, b) for a, b in zip(live, desired))
    if live == desired:
        return True
    return isinstance(live, (str, int, float)) and isinstance(desired, (str, int, float)) \
        and not isinstance(live, bool) and not isinstance(desired, bool) and str(live) == str(desired)


def merge_diff(desired: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
    """The smallest JSON merge patch (RFC 7386) after which ``live`` covers ``desired``.

    Dicts recurse; a list or scalar that differs is sent whole (merge patches replace lists).
    Only ``metadata.labels/annotations/ownerReferences`` of the metadata are compared, and
    ``status`` never (it belongs to the workload controllers). Keys only in ``live`` are kept.
    """
    patch: dict[str, Any] = {}
    for key, want in desired.items():
        if key in ("status", "apiVersion", "kind"):
            continue
        have = live.get(key)
        if key == "metadata" and isinstance(want, Mapping):
            sub = {k: v for k, v in want.items() if k in _MANAGED_METADATA}
            meta_patch = merge_diff(sub, have or {})
            if meta_patch:
                patch["metadata"] = meta_patch
        elif isinstance(want, Mapping) and isinstance(have, Mapping):
            sub_patch = merge_diff(want, have)
            if sub_patch:
                patch[key] = sub_patch
        elif not covers(have, want):
            patch[key] = want
    return patch


def refresh_wait(failures: int, delay: float, retry: float, retry_max: float) -> float:
    """Seconds before the next attempt of a refresh: ``delay`` (coalescing) at first, then
    ``retry * 2**(failures - 1)`` capped at ``retry_max`` after ``failures`` failed attempts."""
    if failures <= 0:
        return delay
    return min(retry_max, retry * 2 ** (failures - 1))


def _child_id(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    return (obj["apiVersion"], obj["kind"], obj["metadata"]["name"])


# --------------------------------------------------------------------------------------------------
# the reconciler
# --------------------------------------------------------------------------------------------------

EventSink = Callable[[Mapping[str, Any], str, str, str], Awaitable[None]]


@dataclass
class ReconcileOutcome:
    """What one reconcile did: ``created``/``patched``/``deleted`` child ids ("Kind/name"),
    ``valid`` (spec), ``rejected`` (the API server refused a child in the dry run: nothing applied),
    the ``phase`` written, and whether the status was written."""

    valid: bool = True
    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    phase: str | None = None
    status_written: bool = False
    rejected: bool = False
    skipped: list[str] = field(default_factory=list)  # children whose kind the cluster does not serve


class Reconciler:
    """Reconciles MoEInference resources through a :class:`KubeClient`.

    ``counter`` (optional) is called as ``counter(result)`` once per reconcile with
    ``ok | invalid | rejected | error`` (the operator's ``moe_eplb_reconciles_total``);
    ``defaults``: the operator-wide defaults filled in where a resource leaves them unset.
    A refresh that fails (an API error, a status write refused with 500 or 409 Conflict) is retried
    with exponential backoff from ``refresh_retry_s`` up to ``refresh_retry_max_s`` until it
    succeeds, so the status heals within seconds instead of at the next resync.
    """

    def __init__(self, client: KubeClient, *, counter: Callable[[str], None] | None = None,
                 refresh_delay_s: float = 0.1, defaults: OperatorDefaults | None = None,
                 refresh_retry_s: float = 0.2, refresh_retry_max_s: float = 30.0) -> None:
        self.client = client
        self.defaults = defaults or OperatorDefaults()
        self.counter = counter or (lambda result: None)
        self.refresh_delay_s = refresh_delay_s
        self.refresh_retry_s = refresh_retry_s
        self.refresh_retry_max_s = refresh_retry_max_s
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._pending: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._dirty: set[tuple[str, str]] = set()

    # ---- entry points ---------------------------------------------------------------------------
    async def reconcile(self, resource: Mapping[str, Any], *, prune: bool = True, fresh: bool = False) -> ReconcileOutcome:
        """Bring the children and status of ``resource`` (a full object) in line with its spec.

        Unless ``fresh`` (just read from the API), the object is read again once the per-resource
        lock is held: a body queued in a handler may predate a status write of another loop (e.g.
        the tuner's ``status.autotune.override``), and rendering from it would flip the pods back.
        """
        meta = resource["metadata"]
        key = (meta["namespace"], meta["name"])
        async with self._locks.setdefault(key, asyncio.Lock()):
            try:
                if not fresh:
                    latest = await self.client.get(PARENT_API_VERSION, KIND, *key)
                    if latest is None or latest["metadata"].get("uid") != meta.get("uid"):
                        return ReconcileOutcome(phase=None)  # deleted (or replaced) meanwhile
                    resource = latest
                outcome = await self._reconcile(resource, prune=prune)
            except Exception:
                self.counter("error")
                raise
            self.counter("invalid" if not outcome.valid else "rejected" if outcome.rejected else "ok")
            return outcome

    def request_refresh(self, namespace: str, name: str) -> None:
        """Schedule a reconcile of ``namespace/name`` (fresh GET) soon; bursts coalesce into one."""
        key = (namespace, name)
        if key in self._pending:
            self._dirty.add(key)
            return
        self._pending[key] = asyncio.get_running_loop().create_task(self._refresh_loop(key))

    async def _refresh_loop(self, key: tuple[str, str]) -> None:
        failures = 0
        try:
            while True:
                self._dirty.discard(key)
                await asyncio.sleep(refresh_wait(failures, self.refresh_delay_s, self.refresh_retry_s,
                                                 self.refresh_retry_max_s))
                try:
                    parent = await self.client.get(PARENT_API_VERSION, KIND, *key)
                    if parent is not None and not parent["metadata"].get("deletionTimestamp"):
                        await self.reconcile(parent, prune=False, fresh=True)
                    failures = 0
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # retried with backoff until it goes through
                    failures += 1
                    log.warning("refresh of %s/%s failed (attempt %d; retrying in %.1fs): %s", key[0], key[1],
                                failures, refresh_wait(failures, self.refresh_delay_s, self.refresh_retry_s,
                                                       self.refresh_retry_max_s), exc)
                    self._dirty.add(key)
                if key not in self._dirty:
                    return
        finally:
            self._pending.pop(key, None)

    async def stop(self) -> None:
        """Cancel scheduled refreshes (operator shutdown)."""
        tasks = list(self._pending.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def cleanup(self, resource: Mapping[str, Any]) -> list[str]:
        """Delete every child of ``resource`` (by labels and ownerReference uid); returns their ids.
        The API server's garbage collector would do the same through ownerReferences; doing it
        here makes deletion complete even where garbage collection lags or is disabled."""
        meta = resource["metadata"]
        deleted = []
        for api_version, kind, name in await self._owned_children(resource):
            if await self.client.delete(api_version, kind, meta["namespace"], name):
                deleted.append(f"{kind}/{name}")
        if await control.delete_secret(self.client, meta):  # not a rendered child (never pruned)
            deleted.append(f"Secret/{control_secret_name(meta['name'])}")
        self._locks.pop((meta["namespace"], meta["name"]), None)
        opmetrics.forget(meta["namespace"], meta["name"])
        elastic_metrics.forget(meta["namespace"], meta["name"])
        if deleted:
            await self._event(resource, "Normal", "Deleted", "deleted " + ", ".join(deleted))
        return deleted

    # ---- the work -------------------------------------------------------------------------------
    async def _reconcile(self, resource: Mapping[str, Any], *, prune: bool) -> ReconcileOutcome:
        ns = resource["metadata"]["namespace"]
        # validation and the typed model (one defaulting pass), our defaults filled in (this copy only;
        # the resource is not changed) and the checks that need them: what `moe-eplb validate` runs
        checked = check_for_operator(resource, self.defaults)
        problems, inf = list(checked.problems), checked.inference
        desired: list[dict[str, Any]] = []
        if not problems and inf is not None:
            try:
                desired = render_children(inf)
            except Exception as exc:  # a bug or a case validation missed: apply nothing
                log.exception("rendering %s/%s failed", ns, resource["metadata"]["name"])
                problems = [_RenderProblem("spec", f"cannot render the children: {exc}")]
        if problems or inf is None:
            return await self._report_invalid(resource, problems)

        outcome = ReconcileOutcome()
        drift = int((resource.get("status") or {}).get("observedGeneration", -1)) == \
            int(resource["metadata"].get("generation", 1))
        plans = [await self._plan_child(child) for child in desired]
        rejected = await self._dry_run(plans)
        if rejected:  # the API server would refuse a child: apply none of them
            return await self._report_rejected(resource, rejected)
        if await control.ensure_secret(self.client, inf):  # before the pods that mount it
            outcome.created.append(f"Secret/{control_secret_name(inf.name)}")
        live_children: list[dict[str, Any]] = []
        for child, live_now, patch in plans:
            live, action = await self._apply_child(child, live_now, patch)
            if live is not None:
                live_children.append(live)
            cid = f"{child['kind']}/{child['metadata']['name']}"
            if action == "created":
                outcome.created.append(cid)
            elif action == "patched":
                outcome.patched.append(cid)
            elif action == "skipped":
                outcome.skipped.append(cid)
        if prune:
            keep = {_child_id(c) for c in desired}
            for api_version, kind, name in await self._owned_children(resource):
                if (api_version, kind, name) not in keep:
                    if await self.client.delete(api_version, kind, ns, name):
                        outcome.deleted.append(f"{kind}/{name}")

        if outcome.created:
            await self._event(resource, "Normal", "Created", "created " + ", ".join(outcome.created))
        if outcome.patched:
            reason, verb = ("DriftCorrected", "restored") if drift else ("Updated", "updated")
            await self._event(resource, "Normal" if not drift else "Warning", reason,
                              f"{verb} " + ", ".join(outcome.patched))
        if outcome.deleted:
            await self._event(resource, "Normal", "Pruned", "deleted " + ", ".join(outcome.deleted))
        if not drift:  # a generation's first reconcile: what it may cost, once (moe-eplb validate's warnings)
            for warning in advice(inf):
                await self._event(resource, "Warning", "Advice", f"{warning.field}: {warning.message}")

        # what runs: the template's settings with the window and interval applied live over them
        eplb_status = status_eplb(dataclasses.replace(inf.effective, knobs=inf.running_knobs))
        ep_size = inf.parallelism.ep_size
        scaling = _autoscaling_condition(describe_autoscaler(inf), outcome.skipped, live_children)
        restarts = await self._restarts(inf, live_children)
        group = elastic.status_fields(inf, live_children) if inf.elastic_enabled else None
        if group is not None:  # an elastic group: its size and redundancy now; the joiners' StatefulSet
            # (OnDelete: its pods keep the revision they joined with) is not a rollout to wait for
            ep_size, eplb_status = group.pop("epSize"), {**eplb_status, "numRedundantExperts": group.pop("numRedundantExperts")}
            live_children = [c for c in live_children if c.get("kind") != "StatefulSet"]
        new_status = status_mod.ready_status(
            resource, live_children, eplb=eplb_status, ep_size=ep_size, selector=selector_string(inf.name),
            endpoint=endpoint(inf), tuner=status_mod.tuner_degraded(inf.status.degraded), autoscaling=scaling,
            restarts=restarts)
        new_status.update(group or {})
        opmetrics.record_replicas(ns, inf.name, desired=inf.replicas, ready=int(new_status.get("readyReplicas") or 0),
                                  autoscaling=inf.autoscaling)
        outcome.phase = new_status["phase"]
        outcome.status_written = await self._write_status(resource, new_status,
                                                          lambda fresh: status_mod.ready_status(
                                                              fresh, live_children, eplb=eplb_status, ep_size=ep_size,
                                                              selector=new_status["selector"],
                                                              endpoint=new_status.get("endpoint"),
                                                              tuner=status_mod.tuner_degraded_of(fresh.get("status")),
                                                              autoscaling=scaling, restarts=restarts) | (group or {}))
        return outcome

    async def _restarts(self, inf: Any, live_children: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
        """Pods or groups that keep restarting (``Degraded``); None when none, or unreadable."""
        workloads = [dict(c) for c in live_children if c.get("kind") in status_mod.WORKLOAD_KINDS]
        try:
            return await restarts_of(self.client, inf, workloads, time.time())
        except ApiError as exc:  # no read access to pods or events: the condition then misses restarts
            log.info("reading the pods of %s/%s failed: %s", inf.namespace, inf.name, exc)
            return None

    async def _report_invalid(self, resource: Mapping[str, Any], problems: Sequence[Any]) -> ReconcileOutcome:
        old_status = resource.get("status") or {}
        new_status = status_mod.invalid_status(resource, problems)
        old_cond = next((c for c in old_status.get("conditions") or [] if c.get("type") == "SpecValid"), {})
        new_cond = next(c for c in new_status["conditions"] if c["type"] == "SpecValid")
        if (old_cond.get("status"), old_cond.get("message"), old_cond.get("observedGeneration")) != \
                ("False", new_cond["message"], new_cond["observedGeneration"]):
            await self._event(resource, "Warning", "InvalidSpec", new_cond["message"])
        written = await self._write_status(resource, new_status,
                                           lambda fresh: status_mod.invalid_status(fresh, problems))
        return ReconcileOutcome(valid=False, phase="Invalid", status_written=written)

    async def _plan_child(self, desired: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None,
                                                                   dict[str, Any] | None]:
        """(desired, live object or None, merge patch or None): what applying would do."""
        api_version, kind, name = _child_id(desired)
        live = await self.client.get(api_version, kind, desired["metadata"].get("namespace"), name)
        return desired, live, (merge_diff(desired, live) if live is not None else None)

    async def _dry_run(self, plans: Sequence[tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]]
                       ) -> list[str]:
        """Send every pending write with ``dryRun=All``; the refusals ("Kind/name: message")."""
        refusals = []
        for desired, live, patch in plans:
            api_version, kind, name = _child_id(desired)
            if live is not None and not patch:
                continue
            try:
                if live is None:
                    await self.client.create(desired, dry_run=True)
                else:
                    await self.client.patch(api_version, kind, desired["metadata"].get("namespace"), name, patch or {},
                                            dry_run=True)
            except ApiError as exc:
                if exc.status in (404, 409) or exc.status >= 500:  # kind missing / raced / transient:
                    continue                                       # handled when applying
                refusals.append(f"{kind}/{name}: {exc.message}")
        return refusals

    async def _report_rejected(self, resource: Mapping[str, Any], refusals: Sequence[str]) -> ReconcileOutcome:
        new_status = status_mod.rejected_status(resource, refusals)
        old = next((c for c in (resource.get("status") or {}).get("conditions") or [] if c.get("type") == "Degraded"), {})
        new = next(c for c in new_status["conditions"] if c["type"] == "Degraded")
        if (old.get("reason"), old.get("message"), old.get("observedGeneration")) != \
                (new["reason"], new["message"], new["observedGeneration"]):
            await self._event(resource, "Warning", "ChildRejected", new["message"])
        written = await self._write_status(resource, new_status,
                                           lambda fresh: status_mod.rejected_status(fresh, refusals))
        return ReconcileOutcome(valid=True, rejected=True, phase=new_status["phase"], status_written=written)

    async def _apply_child(self, desired: Mapping[str, Any], live: dict[str, Any] | None,
                           patch: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str]:
        """Create or patch one child as planned; returns (live object, 'created'|'patched'|'unchanged'|'skipped')."""
        api_version, kind, name = _child_id(desired)
        ns = desired["metadata"].get("namespace")
        if live is None:
            try:
                return await self.client.create(desired), "created"
            except ApiError as exc:
                if exc.status == 404:  # the kind is not installed (e.g. no PodMonitor CRD)
                    log.warning("cannot create %s/%s: %s", kind, name, exc)
                    return None, "skipped"
                if exc.status != 409:
                    raise
            live = await self.client.get(api_version, kind, ns, name)  # created meanwhile: patch it
            if live is None:
                raise ApiError(409, "Conflict", f"{kind}/{name} changed while being created")
            patch = merge_diff(desired, live)
        if not patch:
            return live, "unchanged"
        log.info("patching %s/%s: %s", kind, name, sorted(patch.get("spec", {}) or patch))
        return await self.client.patch(api_version, kind, ns, name, patch), "patched"

    async def _owned_children(self, resource: Mapping[str, Any]) -> list[tuple[str, str, str]]:
        meta = resource["metadata"]
        selector = f"{NAME_LABEL}={meta['name']},{MANAGED_BY_LABEL}={MANAGED_BY}"
        found = []
        for api_version, kind in CHILD_KINDS:
            try:
                items = await self.client.list(api_version, kind, meta["namespace"], selector)
            except ApiError as exc:
                if exc.status == 404:  # kind not installed in this cluster
                    continue
                raise
            for item in items:
                owners = item["metadata"].get("ownerReferences") or []
                if any(o.get("uid") == meta.get("uid") for o in owners):
                    found.append((api_version, kind, item["metadata"]["name"]))
        return found

    async def _write_status(self, resource: Mapping[str, Any], new_status: dict[str, Any],
                            recompute: Callable[[Mapping[str, Any]], dict[str, Any]]) -> bool:
        """Merge-patch the status subresource if it changed, conditional on resourceVersion."""
        meta = resource["metadata"]
        current = resource
        for attempt in range(4):
            patch = status_mod.status_patch(current.get("status"), new_status)
            if patch is None:
                return False
            try:
                await self.client.patch(PARENT_API_VERSION, KIND, meta["namespace"], meta["name"],
                                        {"metadata": {"resourceVersion": current["metadata"]["resourceVersion"]},
                                         "status": patch}, subresource="status")
                return True
            except ApiError as exc:
                if exc.status == 404:
                    return False
                if exc.status != 409 or attempt == 3:
                    raise
            fresh = await self.client.get(PARENT_API_VERSION, KIND, meta["namespace"], meta["name"])
            if fresh is None:
                return False
            if fresh["metadata"].get("generation") != meta.get("generation"):
                return False  # the spec changed meanwhile: the next reconcile writes its status
            current = fresh
            new_status = recompute(fresh)
        return False

    async def _event(self, resource: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        try:
            await self.client.post_event(resource, type=type_, reason=reason, message=message)
        except ApiError as exc:  # events are best effort
            log.warning("could not post event %s: %s", reason, exc)


def _autoscaling_condition(description: str | None, skipped: Sequence[str],
                           live: Sequence[Mapping[str, Any]] = ()) -> tuple[bool, str, str] | None:
    """The ``Autoscaling`` condition: (True, AutoscalerActive, what scales what) while the autoscaler
    runs, (False, AutoscalerKindMissing, ...) when the cluster does not serve its kind (no KEDA),
    (False, ScaledObjectNotReady, KEDA's reason and message) while KEDA reports the live ScaledObject
    (among ``live``, the applied children) not Ready, None without ``spec.autoscaling``."""
    if description is None:
        return None
    missing = next((c for c in skipped if c.split("/")[0] in (KEDA_KIND, HPA_KIND)), None)
    if missing is None:
        keda = next((c for c in live if c.get("kind") == KEDA_KIND), None)
        not_ready = scaled_object_not_ready(keda) if keda is not None else None
        if not_ready is not None:
            return False, "ScaledObjectNotReady", not_ready
        return True, "AutoscalerActive", description
    fix = "install KEDA, or use spec.autoscaling.backend: HPA" if missing.startswith(KEDA_KIND) else \
        "the API server serves no autoscaling/v2"
    return False, "AutoscalerKindMissing", f"{missing} cannot be created: the cluster does not serve its kind ({fix})"


def scaled_object_not_ready(scaled_object: Mapping[str, Any]) -> str | None:
    """What KEDA reports about a ScaledObject whose ``Ready`` condition is False (e.g. reason
    ``ScaledObjectCheckFailed``, ``Triggers defined in ScaledObject are not correct``), in one line;
    None while it is Ready or KEDA has not reported yet (no condition, or Unknown)."""
    conds = {c.get("type"): c for c in (scaled_object.get("status") or {}).get("conditions") or []}
    ready = conds.get("Ready")
    if ready is None or ready.get("status") != "False":
        return None
    name = (scaled_object.get("metadata") or {}).get("name", "?")
    why = ready.get("message") or ready.get("reason") or "no message"
    return f"KEDA reports ScaledObject {name} not Ready ({ready.get('reason') or 'no reason'}): {why}"


@dataclass(frozen=True)
class _RenderProblem:
    field: str
    message: str
