"""``status.faultTolerance`` as typed records: what the recovery loop remembers between its ticks.

``{phase, lostRanks, rounds[]}``: the phase of the worst replica group, the data-parallel ranks each
group runs without (committed by a ``scale_down``), and the last :data:`ROUNDS_LIMIT` recovery rounds
(the one in flight last, without ``finishedAt``). Everything the loop needs to resume lives here, so
a restarted operator polls the round it finds in flight instead of sending another; a group's phase
is derived from its rounds and its ``lostRanks`` entry (:func:`moe_eplb.controller.recovery.group_phase`). Read tolerantly
(:func:`parse_recovery_status`: a malformed record is dropped and noted, never acted on), written
through :mod:`moe_eplb.api.convert`; times are POSIX seconds inside, RFC 3339 in the status.

Phases::

    Healthy     every rank of every group serves (or fault tolerance is off)
    Recovering  a rank reported a fault: a round is being prepared, sent or polled
    Degraded    a scale_down succeeded: a group serves on fewer ranks until it is restored
    Restoring   a degraded (or failed) group is being restarted at a planned moment
    Failed      a round failed for good or ran past the engines' recovery timeout: vLLM restarts
                the group's engines; the loop waits for the group to serve again

Round results: ``Succeeded``, ``Failed``, ``TimedOut``, ``Superseded`` (a second fault changed the
survivors before the round finished; a new round follows).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

from moe_eplb.api.autotune_status import time_field
from moe_eplb.api.convert import ConvertError, from_crd, to_crd

HEALTHY, RECOVERING, DEGRADED, RESTORING, FAILED = "Healthy", "Recovering", "Degraded", "Restoring", "Failed"
PHASES = (HEALTHY, RECOVERING, DEGRADED, RESTORING, FAILED)
#: worst first: the resource's phase is the first any group is in
PHASE_ORDER = (FAILED, RECOVERING, RESTORING, DEGRADED, HEALTHY)
SUCCEEDED, ROUND_FAILED, TIMED_OUT, SUPERSEDED = "Succeeded", "Failed", "TimedOut", "Superseded"
#: an in-flight round's ``state``: drawn when the fault was seen, waiting for every survivor to
#: report ``unhealthy`` (vLLM refuses an instruction before) | sent to every survivor, polled
PREPARING, SENT = "Preparing", "Sent"
RESULTS = (SUCCEEDED, ROUND_FAILED, TIMED_OUT, SUPERSEDED)
ROUNDS_LIMIT = 10


@dataclass(frozen=True)
class LostRanks:
    """The data-parallel ranks replica group ``group`` runs without since ``since`` (a committed
    ``scale_down``), and the pods that held them; a group whose round failed for good is listed
    with no ranks until its restart (``restoringSince``) brings it back."""

    group: str
    ranks: tuple[int, ...] = ()
    pods: tuple[str, ...] = ()
    since: float | None = time_field(default=None)
    #: the planned restart of the group began (its pods are being replaced); None: not yet
    restoring_since: float | None = time_field(default=None)


@dataclass(frozen=True)
class Round:
    """One recovery round of replica group ``group``: ONE ``request_id`` sent to every surviving rank.

    ``state``: ``Preparing`` (the fault is seen, the round's id drawn; the survivors are not all
    ``unhealthy`` yet) then ``Sent``; ``faultAt``: when the fault was first seen (the engines'
    recovery timeout runs from about then: ``deadline``); ``ranks``: the survivors it is meant for,
    ``sentTo``: those it reached (202); ``storeMaster``: ``ip:port`` of the new data-parallel store
    master when the lowest rank was removed; ``attempt``: the rounds of this fault so far, this one
    included."""

    request_id: str
    group: str
    instruction: str
    ranks: tuple[int, ...]
    started_at: float = time_field()
    fault_at: float = time_field()
    deadline: float = time_field()
    state: str = PREPARING
    sent_to: tuple[int, ...] = ()
    #: the ``request_id`` each accepting engine answered with (0.34: the round's own; before 0.34 each
    #: API server drew one, and a failure names it)
    accepted_ids: tuple[str, ...] = ()
    removed_ranks: tuple[int, ...] = ()
    store_master: str | None = None
    attempt: int = 1
    finished_at: float | None = time_field(default=None)
    result: str | None = None
    reason: str | None = None

    @property
    def in_flight(self) -> bool:
        return self.finished_at is None


@dataclass(frozen=True)
class RecoveryStatus:
    """``status.faultTolerance``."""

    phase: str = HEALTHY
    lost_ranks: tuple[LostRanks, ...] = ()
    rounds: tuple[Round, ...] = ()
    #: the stored mapping (for the merge patch) and what could not be read
    stored: dict = field(default_factory=dict, metadata={"skip": True}, compare=False)
    problems: tuple[str, ...] = field(default=(), metadata={"skip": True}, compare=False)

    def lost_entry(self, name: str) -> LostRanks | None:
        return next((lr for lr in self.lost_ranks if lr.group == name), None)

    def lost(self, name: str) -> tuple[int, ...]:
        entry = self.lost_entry(name)
        return entry.ranks if entry is not None else ()

    def last_round(self, name: str) -> Round | None:
        return next((r for r in reversed(self.rounds) if r.group == name), None)

    def in_flight(self, name: str) -> Round | None:
        return next((r for r in reversed(self.rounds) if r.group == name and r.in_flight), None)

    def with_round(self, rnd: Round) -> RecoveryStatus:
        """The round added, or replacing the one with its request id; the last :data:`ROUNDS_LIMIT` kept."""
        rounds = [r for r in self.rounds if r.request_id != rnd.request_id]
        at = next((i for i, r in enumerate(self.rounds) if r.request_id == rnd.request_id), None)
        if at is None:
            rounds.append(rnd)
        else:
            rounds.insert(at, rnd)
        return replace(self, rounds=tuple(rounds[-ROUNDS_LIMIT:]))

    def with_lost(self, entry: LostRanks | None, group: str) -> RecoveryStatus:
        """``lostRanks`` with ``group``'s entry replaced by ``entry`` (None: removed)."""
        others = tuple(lr for lr in self.lost_ranks if lr.group != group)
        new = others if entry is None else others + (entry,)
        return replace(self, lost_ranks=tuple(sorted(new, key=lambda lr: lr.group)))


def worst_phase(phases: set[str] | list[str] | tuple[str, ...]) -> str:
    """The worst of some groups' phases (:data:`PHASE_ORDER`); ``Healthy`` without any."""
    return next((p for p in PHASE_ORDER if p in set(phases)), HEALTHY)


def parse_recovery_status(raw: Any) -> RecoveryStatus:
    """``status.faultTolerance`` read tolerantly: a record that cannot be read is left out and named
    in ``problems`` (it is never acted on; the next write drops it)."""
    if not isinstance(raw, dict):
        return RecoveryStatus()
    problems: list[str] = []

    def many(key: str, cls: type) -> tuple:
        out = []
        for i, item in enumerate(raw.get(key) or []):
            try:
                out.append(from_crd(cls, item, f"status.faultTolerance.{key}[{i}]"))
            except ConvertError as exc:
                problems.append(str(exc))
        return tuple(out)

    phase = raw.get("phase") if raw.get("phase") in PHASES else HEALTHY
    return RecoveryStatus(phase=phase, lost_ranks=many("lostRanks", LostRanks), rounds=many("rounds", Round),
                          stored=copy.deepcopy(raw), problems=tuple(problems))


def recovery_status_to_crd(st: RecoveryStatus) -> dict[str, Any]:
    """The CRD mapping of ``st`` (every key written, lists whole: they replace what is stored)."""
    return {"phase": st.phase, "lostRanks": [to_crd(x) for x in st.lost_ranks],
            "rounds": [to_crd(x) for x in st.rounds]}
