"""The resize of an elastic group as a pure state machine (no I/O): :func:`advance` takes the recorded
``status.elastic`` and what the loop observed (:class:`ElasticView`: the pods, each old pod's relay report
of vLLM's phase, the time) and returns the next record, the ``Resizing`` condition, the actions and the
Events (:class:`Step`). :mod:`moe_eplb.controller.elastic` runs it.

One operation, grow (``dataParallel`` -> ``targetDataParallel`` > it):

``Stable`` -> ``Starting`` (the new pods are rendered: the joiners' StatefulSet grows) -> every new pod's
container runs -> ``/scale_elastic_ep`` to every OLD pod (each relays it to all its API servers) ->
``Preparing`` / ``Committing`` (vLLM's phase, read from every old pod) -> ``completed`` for the
target: ``dataParallel`` = target, ``Stable``.

Shrink: ``Stable`` -> ``Draining`` (the retiring pods -- always the highest -- get ``eplb.ai/serving:
false``: the Service stops routing to them; they finish their requests, at most ``drainSeconds``) ->
``/scale_elastic_ep`` to every old pod, the retiring ones included -> ``Preparing`` / ``Committing`` ->
``completed``: ``dataParallel`` = target, ``Retiring`` (their pods are removed) -> ``Stable``.

Known states only. vLLM ``failed`` while every old pod still serves (a failure in ``prepare``: a new
rank that never became ready, a refused size) -> ``RollingBack``: the new pods are removed, the
retiring ones serve again -> ``Failed`` (the previous size serving; the same target is tried again
after :data:`moe_eplb.api.elastic.RETRY_AFTER_S`). ``failed`` with an old pod paused (vLLM leaves its
request gate closed after a failure past ``prepare``), or an operation past its deadline -> ``RestartingGroup``:
the founding pods are deleted (their LeaderWorkerSet recreates them), the joiners removed, and the group
launches again at ``spec.parallelism.data``. Never a half-joined group: ``dataParallel`` moves only on
vLLM's ``completed`` for the operation's own target. The operator keeps nothing in memory: the phase,
target and epoch are the record, the operation's start the ``Resizing`` condition's lastTransitionTime.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from moe_eplb.api import elastic as el
from moe_eplb.api.elastic import ElasticStatus

RESIZING = "Resizing"  # the condition type
#: reasons of the Resizing condition
GROWING, SHRINKING, ROLLING_BACK, RESTARTING, STABLE, FAILED, WAITING, LAUNCHING = (
    "Growing", "Shrinking", "RollingBack", "RestartingGroup", "Stable", "ResizeFailed", "WaitingForTuner",
    "Launching")
#: container waiting reasons that a pod does not get past by itself
STUCK_REASONS = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError",
                 "InvalidImageName", "Unschedulable")


@dataclass(frozen=True)
class PodState:
    """One pod of the group as the loop saw it. ``ordinal``: a joiner's StatefulSet ordinal (-1 for a
    founder); ``running``: its engine container started; ``stuck``: why it does not start (a waiting
    reason of :data:`STUCK_REASONS`, the scheduler's message); ``created``: POSIX seconds."""

    name: str
    ordinal: int = -1
    ready: bool = False
    running: bool = False
    deleting: bool = False
    serving: bool = True
    stuck: str | None = None
    created: float = 0.0


@dataclass(frozen=True)
class RankReport:
    """What one pod's relay (``GET /control/elastic/status``) said: vLLM's operation as the group's
    store shows it (every rank reads the same: ``phase``, ``epoch``, ``error``, ``requested``), whether
    every API server of the pod serves (``None``: unknown), requests in flight on the pod, and the
    forwarded ``/scale_elastic_ep`` of THIS operation (the relay keys it by :func:`op_id`): ``op_state``
    ``pending`` or ``done`` (None: never received), with vLLM's answer (``op_code``, ``op_detail``: 200
    once the operation completed on that rank, 400/408/500 with vLLM's reason). ``unreachable``: why
    the relay did not answer."""

    phase: str | None = None
    epoch: str | None = None
    error: str | None = None
    requested: int | None = None
    serving: bool | None = None
    in_flight: float | None = None
    op_state: str | None = None
    op_code: int | None = None
    op_detail: str | None = None
    unreachable: str | None = None


PENDING, DONE = "pending", "done"


def op_id(st: ElasticStatus, since: float | None) -> str:
    """The id of the operation to ``st.target_data_parallel`` that began at ``since`` (the Resizing
    condition's lastTransitionTime): what the relays key the forwarded request by, so an operator that
    restarts resends it safely and an older operation's answer is never taken for this one's."""
    return f"dp{st.target_data_parallel}-{int(since or 0)}"


@dataclass(frozen=True)
class ElasticView:
    """What :func:`advance` decides from (see the module doc). ``desired``: the size the spec asks
    for (:attr:`moe_eplb.api.spec.MoEInference.elastic_desired`); ``since``: when the current
    operation began (the Resizing condition's lastTransitionTime; None without one); ``blocker``: why
    no resize may start now (a tuner rollout or experiment); ``start_s``: how long new pods may take
    to start (``spec.engine.startupTimeoutSeconds``); ``drain_s``: how long retiring pods drain
    (``spec.engine.drainSeconds``)."""

    desired: int
    launch: int
    data_local: int
    founders_expected: int
    founders: tuple[PodState, ...] = ()
    joiners: tuple[PodState, ...] = ()
    reports: Mapping[str, RankReport] = field(default_factory=dict)
    now: float = 0.0
    since: float | None = None
    blocker: str | None = None
    start_s: float = 3600.0
    drain_s: float = 600.0
    fault_tolerance: bool = False

    def ordinal_of(self, size: int) -> int:
        """The first joiner ordinal above ``size`` ranks (pods below it hold those ranks)."""
        return el.pods_for(max(0, size - self.launch), self.data_local)

    def old_pods(self, size: int) -> tuple[PodState, ...]:
        """The pods of the committed topology of ``size`` ranks: the founders and the joiners below it."""
        n = self.ordinal_of(size)
        return self.founders + tuple(p for p in self.joiners if p.ordinal < n and not p.deleting)

    def joiners_between(self, low: int, high: int) -> tuple[PodState, ...]:
        """Joiners holding ranks in ``[low, high)``."""
        a, b = self.ordinal_of(low), self.ordinal_of(high)
        return tuple(p for p in self.joiners if a <= p.ordinal < b)

    @property
    def founders_ready(self) -> bool:
        live = [p for p in self.founders if not p.deleting]
        return len(live) >= self.founders_expected and all(p.ready for p in live)


@dataclass
class Step:
    """What one tick decides: the record, the ``Resizing`` condition ``(status, reason, message)``,
    and the actions (send ``/scale_elastic_ep`` of ``scale[0]`` ranks to the pods ``scale[1]``; set the
    serving label of pods; delete the founding pods to restart the group) and Events
    ``(type, reason, message)``."""

    status: ElasticStatus
    condition: tuple[bool, str, str]
    scale: tuple[int, tuple[str, ...]] | None = None
    serving: dict[str, bool] = field(default_factory=dict)
    restart: tuple[str, ...] = ()
    events: list[tuple[str, str, str]] = field(default_factory=list)


def deadline(view: ElasticView) -> float:
    """How long one operation may last before the group is restarted to a known state: the new pods'
    start (``startupTimeoutSeconds``), the retiring pods' drain, and vLLM's own bounds of prepare and
    commit (so that vLLM always ends first: failed or completed), plus a minute."""
    return view.start_s + view.drain_s + el.VLLM_PREPARE_TIMEOUT_S + el.VLLM_COMMIT_TIMEOUT_S + 60.0


def _size_words(view: ElasticView, a: int, b: int) -> str:
    return f"{a} -> {b} ranks ({el.pods_for(a, view.data_local)} -> {el.pods_for(b, view.data_local)} pods)"


def _replace(st: ElasticStatus, **kw) -> ElasticStatus:
    return dataclasses.replace(st, **kw)


def _store(view: ElasticView, pods: tuple[PodState, ...], target: int) -> RankReport | None:
    """vLLM's store as the first old pod that shows an operation for ``target`` ranks reports it (for
    the record: the phase and epoch; decisions follow the forwarded requests' answers)."""
    for p in pods:
        r = view.reports.get(p.name)
        if r is not None and r.epoch is not None and r.requested == target:
            return r
    return None


def advance(st: ElasticStatus, view: ElasticView) -> Step:
    """The next step of the elastic group from record ``st`` (see the module doc)."""
    if not view.founders_ready and not (view.fault_tolerance and st.phase == el.STABLE):
        return _founders_down(st, view)
    handler = {
        el.LAUNCHING: _launched, el.STABLE: _idle, el.FAILED: _idle, el.STARTING: _starting,
        el.DRAINING: _draining, el.PREPARING: _following, el.COMMITTING: _following, el.RETIRING: _retiring,
        el.ROLLING_BACK: _rolling_back, el.RESTARTING_GROUP: _restarting,
    }[st.phase]
    return handler(st, view)


def _founders_down(st: ElasticStatus, view: ElasticView) -> Step:
    """The founding pods are not all ready: the group is (re)starting at its launch size. Joiners that
    were committed cannot serve without them (their collectives end with rank 0), so they are dropped
    and the group grows again once it serves."""
    if st.phase == el.RESTARTING_GROUP:
        return _restarting(st, view)
    new = _replace(st, data_parallel=view.launch, target_data_parallel=view.desired, phase=el.LAUNCHING)
    step = Step(new, (False, LAUNCHING, f"the founding pods ({view.founders_expected}) are starting; the group "
                                        f"launches at {view.launch} ranks"))
    if st.phase not in (el.LAUNCHING,) and (st.in_progress or st.data_parallel > view.launch):
        why = (f"the founding pods restarted during the resize {_size_words(view, st.data_parallel, st.target_data_parallel)}"
               if st.in_progress else "the founding pods restarted")
        new = _replace(new, last_error=why if st.in_progress else st.last_error)
        step.status = new
        step.events.append(("Warning", "GroupRestarted", f"{why}: the group launches again at {view.launch} ranks, "
                                                         f"then grows to {view.desired}"))
    return step


def _launched(st: ElasticStatus, view: ElasticView) -> Step:
    new = _replace(st, data_parallel=view.launch, target_data_parallel=view.desired, phase=el.STABLE)
    return Step(new, (False, STABLE, f"{view.launch} ranks serve (launch size)"))


def _idle(st: ElasticStatus, view: ElasticView) -> Step:
    """``Stable`` / ``Failed``: start an operation when the spec asks for another size."""
    dp, want = st.data_parallel, view.desired
    if want == dp:
        return Step(_replace(st, target_data_parallel=want, phase=el.STABLE), (False, STABLE, f"{dp} ranks serve"))
    if st.phase == el.FAILED and want == st.target_data_parallel and view.since is not None \
            and view.now - view.since < el.RETRY_AFTER_S:
        left = el.RETRY_AFTER_S - (view.now - view.since)
        return Step(st, (False, FAILED, f"{dp} ranks serve; resizing to {want} failed ({st.last_error}); tried again "
                                        f"in {left:.0f}s"))
    if view.blocker is not None:
        return Step(_replace(st, target_data_parallel=want),
                    (False, WAITING, f"{dp} ranks serve; resizing to {want} waits: {view.blocker}"))
    grow = want > dp
    new = _replace(st, target_data_parallel=want, phase=el.STARTING if grow else el.DRAINING, epoch=None)
    words = f"{'grow' if grow else 'shrink'} {_size_words(view, dp, want)}"
    doing = "starting the new pods" if grow else "draining the highest pods"
    step = Step(new, (True, GROWING if grow else SHRINKING, f"{words}: {doing}"))
    step.events.append(("Normal", "ResizeStarted", words))
    return step


def _past(view: ElasticView, limit: float) -> bool:
    return view.since is not None and view.now - view.since > limit


def _starting(st: ElasticStatus, view: ElasticView) -> Step:
    """Grow: wait for every new pod's container to run, then ask every old pod."""
    dp, target = st.data_parallel, st.target_data_parallel
    words = _size_words(view, dp, target)
    if view.desired <= dp:
        return _roll_back(st, view, None, "the target went back before the new pods joined")
    new = view.joiners_between(dp, target)
    want = view.ordinal_of(target) - view.ordinal_of(dp)
    stuck = sorted({f"{p.name}: {p.stuck}" for p in new if p.stuck})
    if len(new) >= want and all(p.running and not p.deleting for p in new):
        old = view.old_pods(dp)
        step = Step(_replace(st, phase=el.PREPARING), (True, GROWING, f"grow {words}: asked the {len(old)} old "
                                                                      "pods; vLLM prepares"))
        step.scale = (target, tuple(p.name for p in old))
        return step
    if _past(view, view.start_s):
        why = f"the new pods did not start within {view.start_s:.0f}s" + (f" ({'; '.join(stuck)})" if stuck else "")
        return _roll_back(st, view, None, why)
    running = sum(1 for p in new if p.running)
    more = f"; {'; '.join(stuck)}" if stuck else ""
    return Step(st, (True, GROWING, f"grow {words}: {running}/{want} new pods running{more}"))


def _draining(st: ElasticStatus, view: ElasticView) -> Step:
    """Shrink: take the retiring pods out of the Service, wait until they serve nothing (at most
    ``drain_s``), then ask every old pod (the retiring ones included)."""
    dp, target = st.data_parallel, st.target_data_parallel
    words = _size_words(view, dp, target)
    retiring = view.joiners_between(target, dp)
    if view.desired >= dp:
        return _roll_back(st, view, None, "the target went back before the shrink began")
    step = Step(st, (True, SHRINKING, f"shrink {words}: draining {len(retiring)} pods"))
    step.serving = {p.name: False for p in retiring if p.serving}
    busy = [p.name for p in retiring if (view.reports.get(p.name) or RankReport()).in_flight]
    if not busy or _past(view, view.drain_s):
        old = view.old_pods(dp)
        step.status = _replace(st, phase=el.PREPARING)
        step.condition = (True, SHRINKING, f"shrink {words}: asked the {len(old)} old pods; vLLM prepares")
        step.scale = (target, tuple(p.name for p in old))
    return step


def _following(st: ElasticStatus, view: ElasticView) -> Step:
    """``Preparing`` / ``Committing``: every old pod relayed ``/scale_elastic_ep``; vLLM answers each when
    the operation is over on that rank (200) or failed (400/408/500). The store's phase shows progress."""
    dp, target = st.data_parallel, st.target_data_parallel
    verb, reason = ("grow", GROWING) if target > dp else ("shrink", SHRINKING)
    words = _size_words(view, dp, target)
    old = view.old_pods(dp)
    reports = [view.reports.get(p.name) or RankReport() for p in old]
    store = _store(view, old, target)
    epoch = store.epoch if store is not None else st.epoch
    refused = [(p.name, r) for p, r in zip(old, reports) if r.op_state == DONE and (r.op_code or 0) != 200]
    if refused:  # vLLM's router answers most failures "500 Scale failed"; its store keeps the reason
        name, r = refused[0]
        why = f"{name} answered {r.op_code}: {r.op_detail}"
        if store is not None and store.error and store.error not in why:
            why += f" (vLLM: {store.error})"
        return _failed(st, view, why, epoch)
    if reports and all(r.op_state == DONE for r in reports):
        return _completed(st, view, epoch)
    if _past(view, deadline(view)):
        return _restart(st, view, f"vLLM did not finish within {deadline(view):.0f}s "
                                  f"(phase {store.phase if store else 'unknown'})", epoch)
    phase = el.COMMITTING if store is not None and store.phase == el.VLLM_COMMITTING else el.PREPARING
    done = sum(1 for r in reports if r.op_state == DONE)
    shown = f"vLLM {store.phase} (epoch {store.epoch})" if store is not None else "waiting for vLLM"
    step = Step(_replace(st, phase=phase, epoch=epoch), (True, reason, f"{verb} {words}: {shown}; {done}/{len(old)} "
                                                                       "old pods done"))
    if any(r.op_state is None and r.unreachable is None for r in reports):
        # a relay never received it (the operator restarted before sending, or the relay restarted):
        # send again; relays that have this operation ignore the repeat
        step.scale = (target, tuple(p.name for p in old))
    return step


def _completed(st: ElasticStatus, view: ElasticView, epoch: str | None) -> Step:
    dp, target = st.data_parallel, st.target_data_parallel
    words = _size_words(view, dp, target)
    took = f" in {view.now - view.since:.0f}s" if view.since is not None else ""
    if target > dp:
        new = _replace(st, data_parallel=target, phase=el.STABLE, epoch=epoch, last_error=None)
        step = Step(new, (False, STABLE, f"{target} ranks serve"))
        step.events.append(("Normal", "Resized", f"grew {words}{took} (epoch {epoch})"))
        return step
    new = _replace(st, data_parallel=target, phase=el.RETIRING, epoch=epoch, last_error=None)
    step = Step(new, (True, SHRINKING, f"shrink {words}: committed; removing the retired pods"))
    step.events.append(("Normal", "Resized", f"shrank {words}{took} (epoch {epoch})"))
    return step


def _retiring(st: ElasticStatus, view: ElasticView) -> Step:
    left = [p.name for p in view.joiners if p.ordinal >= view.ordinal_of(st.data_parallel)]
    if left:
        return Step(st, (True, SHRINKING, f"{st.data_parallel} ranks serve; removing {', '.join(sorted(left))}"))
    return Step(_replace(st, phase=el.STABLE), (False, STABLE, f"{st.data_parallel} ranks serve"))


def _failed(st: ElasticStatus, view: ElasticView, error: str, epoch: str | None) -> Step:
    """vLLM's operation failed: roll back while every old pod still serves, else restart the group."""
    old = view.old_pods(st.data_parallel)
    paused = [p.name for p in old if (view.reports.get(p.name) or RankReport()).serving is False]
    if paused:
        return _restart(st, view, f"{error}; vLLM left {', '.join(paused)} paused", epoch)
    return _roll_back(st, view, epoch, error)


def _roll_back(st: ElasticStatus, view: ElasticView, epoch: str | None, why: str) -> Step:
    new = _replace(st, phase=el.ROLLING_BACK, epoch=epoch or st.epoch, last_error=why)
    step = Step(new, (True, ROLLING_BACK, f"back to {st.data_parallel} ranks: {why}"))
    step.events.append(("Warning", "ResizeFailed",
                        f"{_size_words(view, st.data_parallel, st.target_data_parallel)}: {why}; rolling back"))
    return step


def _rolling_back(st: ElasticStatus, view: ElasticView) -> Step:
    """Remove the new pods, let the retiring ones serve again; done once no pod above the size is
    left, vLLM's operation is over and every old pod serves (a paused one: restart the group)."""
    dp = st.data_parallel
    above = [p.name for p in view.joiners if p.ordinal >= view.ordinal_of(dp)]
    old = view.old_pods(dp)
    step = Step(st, (True, ROLLING_BACK, f"back to {dp} ranks: {st.last_error}"))
    step.serving = {p.name: True for p in old if not p.serving}
    if above:
        step.condition = (True, ROLLING_BACK, f"back to {dp} ranks: removing {', '.join(sorted(above))}")
        return step
    reports = [view.reports.get(p.name) or RankReport() for p in old]
    if any(r.op_state == PENDING for r in reports):  # vLLM has not answered every rank yet
        if _past(view, deadline(view)):
            return _restart(st, view, f"{st.last_error}; vLLM did not end the operation", st.epoch)
        return step
    paused = [p.name for p, r in zip(old, reports) if r.serving is False]
    if paused:
        return _restart(st, view, f"{st.last_error}; vLLM left {', '.join(paused)} paused", st.epoch)
    if any(r.serving is None for r in reports) or step.serving:
        return step
    new = _replace(st, phase=el.FAILED, target_data_parallel=st.target_data_parallel)
    done = Step(new, (False, FAILED, f"{dp} ranks serve; resizing to {st.target_data_parallel} failed: "
                                     f"{st.last_error}"))
    done.events.append(("Normal", "RolledBack", f"{dp} ranks serve again (the new pods removed)"))
    return done


def _restart(st: ElasticStatus, view: ElasticView, why: str, epoch: str | None) -> Step:
    new = _replace(st, phase=el.RESTARTING_GROUP, epoch=epoch or st.epoch, last_error=why)
    step = Step(new, (True, RESTARTING, f"restarting the group at {view.launch} ranks: {why}"))
    step.events.append(("Warning", "GroupRestarting", f"{why}: the group restarts at {view.launch} ranks (a known "
                                                       "state), then grows again"))
    return _restarting(new, view, step)


def _restarting(st: ElasticStatus, view: ElasticView, step: Step | None = None) -> Step:
    """Delete the founding pods older than the operation (their LeaderWorkerSet recreates the group) and
    remove the joiners; done once new founders serve and no joiner is left."""
    step = step or Step(st, (True, RESTARTING, f"restarting the group at {view.launch} ranks: {st.last_error}"))
    since = view.since if view.since is not None else view.now
    old = tuple(p.name for p in view.founders if not p.deleting and p.created <= since)
    if old:
        step.restart = old
        return step
    if view.founders_ready and not view.joiners:
        new = _replace(st, data_parallel=view.launch, phase=el.FAILED)
        done = Step(new, (False, FAILED, f"{view.launch} ranks serve after a restart; resizing to "
                                         f"{st.target_data_parallel} failed: {st.last_error}"))
        done.events.append(("Normal", "GroupRestarted", f"the group serves again at {view.launch} ranks"))
        return done
    return step
