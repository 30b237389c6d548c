"""What a step of the tuning loop's pure state machines returns (:mod:`decisions`, :mod:`rollout`,
:mod:`experiment`): the complete new ``status.autotune`` (:class:`StatusStep`), the Events and the
condition updates to write beside it, and how a configuration reads in their messages
(:func:`describe`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_eplb.api.autotune_status import AutotuneStatus
from moe_eplb.api.knobs import Knobs

#: a condition update: type -> (status, reason, message)
Conditions = dict[str, tuple[str, str, str]]
#: an Event: (Normal|Warning, reason, message)
Event = tuple[str, str, str]


def describe(k: Knobs | None) -> str:
    return k.describe() if k is not None else "-"


@dataclass
class StatusStep:
    """The complete new ``status.autotune`` plus side effects: whether it changed, the Events to
    emit and the conditions to set."""

    status: AutotuneStatus
    changed: bool = False
    events: list[Event] = field(default_factory=list)
    conditions: Conditions = field(default_factory=dict)
