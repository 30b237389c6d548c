"""Fault recovery of a fault-tolerant wide-EP group: the operator as the orchestrator vLLM waits for.
Pure: the recovery loop (:mod:`.recovery_loop`) reads the pods and every rank's
``/v1/fault_tolerance/status`` into a :class:`GroupView`, and :func:`step` decides.

With ``spec.faultTolerance.enabled`` every data-parallel rank serves its own API, and when a rank is
lost or faults the survivors abort their requests, report ``unhealthy`` (``dead`` when their executor
failed) and wait ``engine_recovery_timeout_sec`` for ONE instruction with ONE ``request_id`` on every
survivor (:mod:`moe_eplb.api.ft_protocol`). Nothing in vLLM decides which; this does, per replica
group (a LeaderWorkerSet group, or a Deployment pod):

1. **Detect.** A rank reporting ``diagnosing``/``unhealthy``/``dead`` opens a round in state
   ``Preparing``: its ``request_id`` is drawn and stored at once (a restarted operator finds it), and
   the fault's time fixes the deadline (``faultAt`` + the recovery timeout: the engines give up then,
   whatever the rounds in between).
2. **Decide** (:func:`decide`), once every survivor reports ``unhealthy`` (vLLM refuses an
   instruction before) and none still runs an earlier one: ``scale_down`` when ranks are lost (their
   pod gone, not ready and silent, or ``dead``: whole pods, since vLLM's supervisor stops every rank
   of a pod with one), with the cumulative removed set and, when the lowest alive rank (the store
   master) goes, the new lowest rank's pod address and :data:`STORE_PORT`; ``retry`` when every pod
   is alive (a transient fault); after :data:`MAX_RETRIES` failed retries ``scale_down`` of the pods
   vLLM's all2all mask suspects. A ``scale_down`` that vLLM cannot do (before 0.34; more lost slots
   than redundant ones, :func:`moe_eplb.api.wide_ep.survives`; nothing would survive) is not sent:
   the group has failed.
3. **Send** (the loop): the round is written ``Sent`` first, then posted to every survivor at once
   (vLLM waits 10 s for all of them to check in), then the ranks it reached are written.
4. **Poll** until every survivor reports ``healthy`` (``Succeeded``), one reports the round failed
   (a failed ``retry`` or check-in leaves them ``unhealthy``: a new round with a new id; a failed
   ``scale_down`` leaves them ``dead``: the group failed), a survivor is lost meanwhile (a second
   fault: ``Superseded``, and a new round removes the cumulative set -- same deadline), or the
   deadline passes (``TimedOut``: the engines exit).
5. **Restore** (:func:`restore_blocker`): a group that runs without ranks (``Degraded``) is restarted
   at a planned moment -- no tuner rollout or experiment running, the autoscaler not scaling, and
   another replica group ready to carry the traffic -- by deleting its leader pod (its drain runs;
   LeaderWorkerSet recreates the group whole). A failed group is restarted at once (it serves
   nothing). With elastic groups the lost capacity would come back by growing the group
   (:func:`restore_mode`), but no vLLM release re-admits ranks a ``scale_down`` removed (see
   :data:`GROW_BACK_AFTER_SCALE_DOWN_SINCE`), so it is a restart there too.

A group's phase (:func:`group_phase`) follows from its rounds and its ``lostRanks`` entry alone.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace

from moe_eplb.api import ft_protocol as ftp
from moe_eplb.api import wide_ep
from moe_eplb.api.recovery_status import (
    DEGRADED,
    FAILED,
    HEALTHY,
    RECOVERING,
    RESTORING,
    ROUND_FAILED,
    SENT,
    SUCCEEDED,
    SUPERSEDED,
    TIMED_OUT,
    LostRanks,
    RecoveryStatus,
    Round,
    worst_phase,
)
from moe_eplb.api.versions import Version

#: retries of one fault before the pods vLLM's mask suspects are scaled down
MAX_RETRIES = 2
#: the port the operator asks the new data-parallel store master to listen on when the lowest rank
#: is lost (``dp_store_port``): fixed, so that it is known free in the engine pod (keep it out of
#: ``engine.extraArgs``); the engines of a group reach it pod to pod
STORE_PORT = 29650
#: the first vLLM release whose elastic EP could grow a group back over ranks a ``scale_down``
#: removed. None: no release can (0.34: ``AsyncLLM._scale_elastic_ep`` returns at once when asked
#: for the size it started with -- ``ParallelConfig.data_parallel_size`` keeps the starting size
#: after a ``scale_down`` -- and any other size runs its collectives over every old rank, the
#: removed ones included)
GROW_BACK_AFTER_SCALE_DOWN_SINCE: Version | None = None

FAULTY = (ftp.DIAGNOSING, ftp.UNHEALTHY, ftp.DEAD)
CONDITION = "FaultTolerant"

#: an Event: (Normal|Warning, reason, message)
Event = tuple[str, str, str]


# --- what the loop reads ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RankReading:
    """One rank's ``GET /v1/fault_tolerance/status`` (its engine's entry), or ``status`` None when
    its API did not answer."""

    status: str | None = None
    ft_state: str | None = None
    last_request_id: str | None = None
    error: str | None = None
    mask: tuple[int, ...] = ()


@dataclass(frozen=True)
class PodView:
    """One pod of a group: the ranks it runs, its address, and what the kubelet says."""

    name: str
    ranks: tuple[int, ...]
    ip: str | None = None
    ready: bool = False
    running: bool = False
    deleting: bool = False
    #: the latest moment the pod can have been created, in the clock's seconds: Kubernetes stamps
    #: ``creationTimestamp`` in whole seconds, so the end of that second (a pod created 0.9 s after a
    #: restart began carries a stamp from before it; on a clock faster than the wall, e.g. the
    #: simulation's, one stamped second spans several clock seconds)
    created_by: float | None = None


@dataclass(frozen=True)
class GroupView:
    """A replica group now: its pods (``index`` = LWS worker index), every rank's reading (ranks of
    absent pods have none), and the facts that bound the decision."""

    group: str
    data: int
    tensor: int
    pods: dict[int, PodView]
    readings: dict[int, RankReading]
    leader: str | None = None  # the pod a planned restart deletes

    def pod_of(self, rank: int) -> PodView | None:
        return next((p for p in self.pods.values() if rank in p.ranks), None)

    @property
    def all_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.data))


@dataclass(frozen=True)
class Facts:
    """What the decision needs of the resource: vLLM's version and the redundancy (``survives``),
    the recovery timeout (engine seconds), and whether its elastic size could grow back."""

    version: Version
    num_experts: int | None
    redundant: int
    timeout_s: float
    elastic: bool = False


# --- per group: phases, loss ---------------------------------------------------------------------


def group_phase(st: RecoveryStatus, group: str) -> str:
    """``Recovering`` with a round in flight, ``Restoring`` once its restart began, ``Failed`` when
    its last round failed for good (until the restart), ``Degraded`` while it runs without ranks,
    else ``Healthy``."""
    if st.in_flight(group) is not None:
        return RECOVERING
    entry = st.lost_entry(group)
    if entry is not None and entry.restoring_since is not None:
        return RESTORING
    if entry is not None and not entry.ranks:
        return FAILED
    return DEGRADED if entry is not None else HEALTHY


def overall(st: RecoveryStatus, groups: list[str] | tuple[str, ...]) -> RecoveryStatus:
    """``st`` with ``phase`` the worst of its groups' (those listed, and those it remembers)."""
    names = set(groups) | {r.group for r in st.rounds if r.in_flight} | {lr.group for lr in st.lost_ranks}
    return replace(st, phase=worst_phase({group_phase(st, g) for g in names}))


def lost_ranks(view: GroupView, *, dead: bool = True) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The ranks lost now and the pods they were on: whole pods that are gone, being deleted, not
    running, or not ready with no rank answering, and (``dead``) the pods of a rank reporting
    ``dead`` (vLLM's supervisor stops all of a pod's ranks with one)."""
    lost, pods = set(), []
    for index in sorted(set(range(_pods_needed(view))) | set(view.pods)):
        pod = view.pods.get(index)
        ranks = pod.ranks if pod is not None else _ranks_of_index(view, index)
        silent = all(view.readings.get(r, RankReading()).status is None for r in ranks)
        died = dead and any(view.readings.get(r, RankReading()).status == ftp.DEAD for r in ranks)
        if pod is None or pod.deleting or not pod.running or (silent and not pod.ready) or died:
            lost.update(ranks)
            pods.append(pod.name if pod is not None else f"#{index}")
    return tuple(sorted(lost)), tuple(pods)


def _pods_needed(view: GroupView) -> int:
    per = max((len(p.ranks) for p in view.pods.values()), default=view.data) or view.data
    return max(1, view.data // per)


def _ranks_of_index(view: GroupView, index: int) -> tuple[int, ...]:
    per = view.data // _pods_needed(view)
    return tuple(range(index * per, (index + 1) * per))


def faulted(view: GroupView) -> tuple[int, ...]:
    """Ranks that report a fault (``diagnosing``, ``unhealthy`` or ``dead``)."""
    return tuple(sorted(r for r, x in view.readings.items() if x.status in FAULTY))


def new_request_id(resource: str, group: str, attempt: int) -> str:
    """A round's ``request_id``: the resource, the group, the attempt, and random bits (unique)."""
    return f"moe-eplb-{resource}-g{group}-a{attempt}-{secrets.token_hex(4)}"


# --- the decision ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """``instruction`` and its params for ``ranks`` (the survivors), or ``failed`` with why."""

    instruction: str | None = None
    ranks: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    store_master: tuple[str, int] | None = None
    failed: str | None = None
    wait: str | None = None

    def params(self) -> dict:
        if self.instruction == ftp.SCALE_DOWN:
            return ftp.scale_down_params(self.removed, self.store_master)
        return {}


def decide(view: GroupView, committed: tuple[int, ...], facts: Facts, attempt: int) -> Decision:
    """What to send to group ``view`` (``committed``: the ranks earlier ``scale_down``\\ s removed;
    ``attempt``: the rounds this fault had, this one included): ``wait`` while a survivor is not yet
    ``unhealthy`` or still runs an instruction, ``failed`` when nothing vLLM offers can help."""
    lost_now, _ = lost_ranks(view)
    lost = tuple(sorted(set(lost_now) - set(committed)))
    survivors = tuple(r for r in view.all_ranks if r not in committed and r not in lost)
    if not survivors:
        return Decision(failed="no data-parallel rank of the group survives")
    waiting = [r for r in survivors if view.readings.get(r, RankReading()).status != ftp.UNHEALTHY]
    if waiting:
        what = ", ".join(f"{r}: {view.readings.get(r, RankReading()).status or 'no answer'}" for r in waiting[:8])
        return Decision(wait=f"waiting for every surviving rank to report unhealthy ({what})")
    busy = [r for r in survivors if view.readings[r].ft_state == ftp.RECOVERING]
    if busy:
        return Decision(wait=f"rank(s) {list(busy)} still run an earlier instruction")
    if not lost and attempt > MAX_RETRIES:
        lost = _suspected(view, survivors, facts)
        survivors = tuple(r for r in survivors if r not in lost)
        if not lost:
            return Decision(failed=f"{MAX_RETRIES} retries failed and vLLM's all2all mask names no rank to remove")
    if not lost:
        return Decision(instruction=ftp.RETRY, ranks=survivors)
    return _scale_down(view, committed, lost, survivors, facts)


def _suspected(view: GroupView, survivors: tuple[int, ...], facts: Facts) -> tuple[int, ...]:
    """Whole pods holding a rank some survivor's mask excludes (0.34's ``mask``)."""
    bad = {r for x in (view.readings[s] for s in survivors) for r in ftp.ep_mask_to_dp_ranks(x.mask, view.tensor)}
    ranks = set()
    for r in bad:
        pod = view.pod_of(r)
        ranks.update(pod.ranks if pod is not None else (r,))
    return tuple(sorted(ranks & set(survivors)))


def _scale_down(view: GroupView, committed: tuple[int, ...], lost: tuple[int, ...], survivors: tuple[int, ...],
                facts: Facts) -> Decision:
    removed = tuple(sorted(set(committed) | set(lost)))
    if not ftp.has(ftp.SCALE_DOWN, facts.version):
        return Decision(failed=f"rank(s) {list(lost)} lost and vLLM {_v(facts.version)} has no scale_down "
                               f"(0.34 and later): the engines restart")
    if facts.num_experts is not None and not wide_ep.survives(facts.num_experts, facts.redundant, view.data,
                                                               len(removed)):
        return Decision(failed=f"{len(removed)} lost data-parallel rank(s) hold more expert slots than the "
                               f"{facts.redundant} redundant ones (spec.faultTolerance.rankFailuresToSurvive "
                               f"sets the floor): scale_down cannot re-host them")
    alive_before = [r for r in view.all_ranks if r not in committed]
    store = None
    if alive_before and alive_before[0] in lost:
        master = view.pod_of(survivors[0])
        if master is None or not master.ip:
            return Decision(wait=f"the new store master (rank {survivors[0]}) has no pod address yet")
        store = (master.ip, STORE_PORT)
    return Decision(instruction=ftp.SCALE_DOWN, ranks=survivors, removed=removed, store_master=store)


def _v(version: Version) -> str:
    return ".".join(str(x) for x in version)


def restore_mode(facts: Facts) -> str:
    """``grow_back`` (the elastic group grows over the lost ranks again) where vLLM can, else
    ``restart`` (a planned restart of the group)."""
    since = GROW_BACK_AFTER_SCALE_DOWN_SINCE
    if facts.elastic and since is not None and facts.version >= since:
        return "grow_back"
    return "restart"


@dataclass(frozen=True)
class Coordination:
    """What a planned restart must not collide with: the tuner's rollout or experiment (``tuner``:
    why it is busy, None), the autoscaler (:func:`moe_eplb.controller.decisions.scaling_blocker`), and
    the other replica groups serving now (ready groups other than this one)."""

    tuner: str | None = None
    autoscaler: str | None = None
    other_ready_groups: int = 0
    restoring_groups: int = 0


def restore_blocker(phase: str, coord: Coordination) -> str | None:
    """Why a group in ``phase`` is not restarted now, or None (go). A failed group serves nothing:
    it is restarted at once. A degraded one still serves: its restart waits for a moment that
    costs no capacity the service needs."""
    if phase == FAILED:
        return None
    if coord.restoring_groups:
        return "another replica group is being restarted"
    if coord.tuner is not None:
        return f"the tuner is busy ({coord.tuner})"
    if coord.autoscaler is not None:
        return f"the autoscaler: {coord.autoscaler}"
    if coord.other_ready_groups < 1:
        return ("no other replica group is ready to carry the traffic while this one restarts: raise spec.replicas "
                "(or the autoscaler's minimum), or delete the group's leader pod at a quiet moment to restart it now")
    return None


# --- one tick of one group -----------------------------------------------------------------------------


@dataclass
class Step:
    """What one tick decided for one group: the new status, the round to send (``send``), a restart
    to start (``restart``: the pod to delete), Events, and what the condition says while waiting."""

    status: RecoveryStatus
    send: Round | None = None
    params: dict = field(default_factory=dict)
    restart: str | None = None
    events: list[Event] = field(default_factory=list)
    waiting: str | None = None
    finished: list[Round] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.send is not None or self.restart is not None or bool(self.events) or bool(self.finished)


def step(st: RecoveryStatus, view: GroupView, facts: Facts, now: float, *, resource: str, coord: Coordination,
         busy: str | None = None) -> Step:
    """One tick for ``view``'s group (``busy``: a planned change of the workload that makes faults
    expected, e.g. a tuner rollout replacing pods: no new round opens then)."""
    rnd = st.in_flight(view.group)
    if rnd is not None and rnd.state == SENT:
        return _poll(st, rnd, view, facts, now, resource)
    if rnd is not None:
        return _prepare(st, rnd, view, facts, now, resource)
    phase = group_phase(st, view.group)
    if phase == RESTORING:
        return _restoring(st, view, now)
    if phase == FAILED:  # its engines give up (or gave up): only a restart brings it back
        return _maybe_restore(st, view, facts, now, phase, coord)
    faults = faulted(view)
    if faults and busy is None:
        attempt = 1
        r = Round(request_id=new_request_id(resource, view.group, attempt), group=view.group, instruction="",
                  ranks=(), started_at=now, fault_at=now, deadline=now + facts.timeout_s, attempt=attempt)
        out = _prepare(st.with_round(r), r, view, facts, now, resource)
        out.events.insert(0, ("Warning", "FaultDetected", f"group {view.group}: rank(s) {list(faults)} report a fault "
                                                          f"({_statuses(view, faults)}); recovery deadline in "
                                                          f"{facts.timeout_s:.0f}s"))
        return out
    if phase == DEGRADED:
        return _maybe_restore(st, view, facts, now, phase, coord)
    return Step(st)


def _statuses(view: GroupView, ranks: tuple[int, ...]) -> str:
    return ", ".join(f"{r}: {view.readings[r].status}" for r in ranks[:8]) + (" ..." if len(ranks) > 8 else "")


def _prepare(st: RecoveryStatus, rnd: Round, view: GroupView, facts: Facts, now: float, resource: str) -> Step:
    """A round waiting to be sent: decide, then send, fail, or wait (within the deadline)."""
    committed = st.lost(view.group)
    if now >= rnd.deadline:
        return _finish(st, rnd, now, TIMED_OUT, "the engines' recovery timeout passed before every survivor "
                                                "reported unhealthy", fail_group=True)
    d = decide(view, committed, facts, rnd.attempt)
    if d.wait is not None:
        return Step(st, waiting=d.wait)
    if d.failed is not None:
        return _finish(st, rnd, now, ROUND_FAILED, d.failed, fail_group=True)
    store = f"{d.store_master[0]}:{d.store_master[1]}" if d.store_master else None
    sent = replace(rnd, state=SENT, instruction=d.instruction, ranks=d.ranks, removed_ranks=d.removed,
                   store_master=store, started_at=now)
    what = f"{d.instruction} removing ranks {list(d.removed)}" if d.removed else d.instruction
    if store:
        what += f" (new store master {store})"
    event = ("Normal", "RecoveryRoundSent", f"group {view.group}: {what} to ranks {list(d.ranks)}, request_id "
                                            f"{rnd.request_id}, {rnd.deadline - now:.0f}s before the engines give up")
    return Step(st.with_round(sent), send=sent, params=d.params(), events=[event])


def _retry(done: Step, rnd: Round, view: GroupView, facts: Facts, now: float, resource: str) -> Step:
    """After ``done`` (round ``rnd`` finished without success), the group's next attempt: a new round
    within the same deadline, prepared at once; the step keeps ``done``'s events and finished rounds."""
    nxt = Round(request_id=new_request_id(resource, view.group, rnd.attempt + 1), group=view.group,
                instruction="", ranks=(), started_at=now, fault_at=rnd.fault_at, deadline=rnd.deadline,
                attempt=rnd.attempt + 1)
    more = _prepare(done.status.with_round(nxt), nxt, view, facts, now, resource)
    more.events[:0] = done.events
    more.finished[:0] = done.finished
    return more


def _poll(st: RecoveryStatus, rnd: Round, view: GroupView, facts: Facts, now: float, resource: str) -> Step:
    """A round in flight: done, failed, superseded by a second fault, or past the deadline."""
    committed = st.lost(view.group)
    lost_now, _ = lost_ranks(view, dead=False)  # a dead survivor is the round's own failure (below)
    second = sorted(set(lost_now) & set(rnd.ranks))
    readings = [view.readings.get(r, RankReading()) for r in rnd.ranks]
    if second:
        return _retry(_finish(st, rnd, now, SUPERSEDED, f"rank(s) {second} were lost during the round (a second fault)"),
                      rnd, view, facts, now, resource)
    if all(x.status == ftp.HEALTHY for x in readings):
        return _succeeded(st, rnd, view, now, committed)
    dead = [r for r, x in zip(rnd.ranks, readings) if x.status == ftp.DEAD]
    if dead:
        return _finish(st, rnd, now, ROUND_FAILED, f"rank(s) {dead} report dead after the round (vLLM: recovery "
                                                   "failed, a full restart is required)", fail_group=True)
    # a failed retry or check-in leaves the engines unhealthy (retryable). 0.34 marks it ft_state failed
    # with our id; before, the client only records the error with the id its server drew for the round
    own_ids = facts.version >= ftp.CLIENT_REQUEST_ID_SINCE
    if own_ids:
        failed = [(r, x) for r, x in zip(rnd.ranks, readings) if x.ft_state == ftp.FAILED
                  and x.status == ftp.UNHEALTHY and x.last_request_id == rnd.request_id]
    else:
        failed = [(r, x) for r, x in zip(rnd.ranks, readings) if x.error and x.status == ftp.UNHEALTHY
                  and x.last_request_id in rnd.accepted_ids]
    if failed:
        why = failed[0][1].error or "no reason given"
        return _retry(_finish(st, rnd, now, ROUND_FAILED, f"rank {failed[0][0]}: {why}"), rnd, view, facts, now, resource)
    if now >= rnd.deadline:
        return _finish(st, rnd, now, TIMED_OUT, "the round did not complete within the engines' recovery timeout",
                       fail_group=True)
    # a restarted operator: the round reached only some survivors before it stopped. Only where vLLM's
    # client shows a running instruction (0.34's ft_state): before, a second send would run it twice
    unsent = [r for r in rnd.ranks if r not in rnd.sent_to and view.readings.get(r, RankReading()).status == ftp.UNHEALTHY
              and view.readings[r].ft_state not in (ftp.RECOVERING, ftp.FAILED)] if own_ids else []
    if unsent:
        return Step(st, send=rnd, params=_params_of(rnd), waiting=f"resending to rank(s) {unsent}")
    return Step(st, waiting=f"round {rnd.request_id} running")


def _params_of(rnd: Round) -> dict:
    if rnd.instruction != ftp.SCALE_DOWN:
        return {}
    store = None
    if rnd.store_master:
        host, _, port = rnd.store_master.rpartition(":")
        store = (host, int(port))
    return ftp.scale_down_params(rnd.removed_ranks, store)


def _succeeded(st: RecoveryStatus, rnd: Round, view: GroupView, now: float, committed: tuple[int, ...]) -> Step:
    took = now - rnd.fault_at
    out = _finish(st, rnd, now, SUCCEEDED, f"every survivor healthy {took:.0f}s after the fault")
    if rnd.instruction == ftp.SCALE_DOWN:
        pods = tuple(sorted({p.name for p in view.pods.values() if set(p.ranks) & set(rnd.removed_ranks)}
                            | set((st.lost_entry(view.group) or LostRanks(view.group)).pods)))
        entry = LostRanks(view.group, tuple(rnd.removed_ranks), pods, now)
        out.status = out.status.with_lost(entry, view.group)
        out.events.append(("Normal", "RecoveryDegraded", f"group {view.group} serves on "
                                                         f"{view.data - len(rnd.removed_ranks)} of {view.data} ranks "
                                                         "until it is restarted at a planned moment"))
    return out


def _finish(st: RecoveryStatus, rnd: Round, now: float, result: str, reason: str, *, fail_group: bool = False) -> Step:
    done = replace(rnd, finished_at=now, result=result, reason=reason)
    new = st.with_round(done)
    etype = "Normal" if result == SUCCEEDED else "Warning"
    name = {SUCCEEDED: "RecoveryRoundSucceeded", ROUND_FAILED: "RecoveryRoundFailed", TIMED_OUT: "RecoveryTimedOut",
            SUPERSEDED: "RecoverySuperseded"}[result]
    what = rnd.instruction or "round"
    events = [(etype, name, f"group {rnd.group}: {what} {rnd.request_id}: {reason}")]
    if fail_group:
        entry = st.lost_entry(rnd.group)
        new = new.with_lost(replace(entry, ranks=()) if entry is not None else LostRanks(rnd.group, since=now), rnd.group)
    return Step(new, events=events, finished=[done])


def _maybe_restore(st: RecoveryStatus, view: GroupView, facts: Facts, now: float, phase: str,
                   coord: Coordination) -> Step:
    why = restore_blocker(phase, coord)
    if why is not None:
        return Step(st, waiting=f"restart waits: {why}")
    if view.leader is None:
        return Step(st, waiting="restart waits: the group has no leader pod to delete")
    entry = st.lost_entry(view.group) or LostRanks(view.group, since=now)
    new = st.with_lost(replace(entry, restoring_since=now), view.group)
    mode = restore_mode(facts)
    lost = f"ranks {list(entry.ranks)} lost" if entry.ranks else "its engines failed"
    return Step(new, restart=view.leader, events=[("Normal", "RestoreStarted", f"group {view.group} ({lost}): restarting "
                                                   f"it by deleting pod {view.leader} (drained; {mode})")])


def _restoring(st: RecoveryStatus, view: GroupView, now: float) -> Step:
    """A restart in progress: done once every pod of the group is new, ready, and every rank healthy."""
    entry = st.lost_entry(view.group)
    assert entry is not None and entry.restoring_since is not None
    fresh = [p for p in view.pods.values() if p.created_by is not None and p.created_by >= entry.restoring_since]
    whole = len(view.pods) >= _pods_needed(view) and len(fresh) == len(view.pods)
    healthy = all(view.readings.get(r, RankReading()).status == ftp.HEALTHY for r in view.all_ranks)
    if whole and all(p.ready for p in fresh) and healthy:
        took = now - entry.restoring_since
        return Step(st.with_lost(None, view.group), events=[("Normal", "RecoveryRestored", f"group {view.group} serves "
                                                                                        f"on all {view.data} ranks again "
                                                                                        f"({took:.0f}s restart)")])
    return Step(st, waiting=f"group {view.group} restarting ({len(fresh)}/{_pods_needed(view)} new pods)")


def condition(st: RecoveryStatus, waiting: dict[str, str]) -> tuple[str, str, str]:
    """The ``FaultTolerant`` condition: True with every group on all its ranks; else False with the
    phase as reason and, per group, what it is and what it waits for."""
    if st.phase == HEALTHY:
        return ("True", HEALTHY, "every data-parallel rank of every replica group serves")
    parts = []
    for lr in st.lost_ranks:
        what = f"{len(lr.ranks)} rank(s) lost {list(lr.ranks)}" if lr.ranks else "its engines failed"
        parts.append(f"group {lr.group}: {what}")
    for r in st.rounds:
        if r.in_flight:
            parts.append(f"group {r.group}: round {r.request_id} {r.state.lower()}")
    for g, why in sorted(waiting.items()):
        parts.append(f"group {g}: {why}")
    reason = {FAILED: "RecoveryFailed"}.get(st.phase, st.phase)
    return ("False", reason, "; ".join(parts) or st.phase)
