"""Live apply of EPLB's window and interval: the wire format and the rules every party follows (a
contract: imports nothing of the project).

Three parties speak it: the operator (:mod:`moe_eplb.controller.live`), the exporter in each engine
pod (:mod:`moe_eplb.exporter.live_control`: the pod's HTTP side; :mod:`moe_eplb.exporter.live`: the
part inside each vLLM worker) and the harness's simulated engines. The values live here once.

**Why an agreed step.** vLLM's ``EplbState`` rearranges when its step counter
(``expert_rearrangement_step``, the same on every EP rank: ranks step in lockstep) reaches
``expert_rearrangement_step_interval``, and ``rearrange()`` starts with a collective over the EP
group. Two ranks that disagree on the interval reach that collective at different steps and hang.
So a change names the engine step at which it takes effect, the same on every rank.

**The exchange** (all over ``POST`` :data:`PATH` of each pod's exporter, with the operator's token):

1. ``prepare``: every rank checks the command (values, the settings it expects to replace, the step
   not yet reached) and pre-allocates the new load window; it answers ``armed`` or ``refused`` with
   a reason. Nothing changes yet.
2. ``commit`` (only when every rank of the engine is armed) or ``abort`` (otherwise).
3. At engine step ``at_step`` a rank that holds the commit applies the values before vLLM's step of
   that number. A rank that receives the commit up to ``grace_steps`` steps late still applies: it
   behaves exactly as if it had applied at ``at_step`` because :func:`guard_problem` (checked at
   ``at_step`` by every rank, with the same numbers) guarantees that no rank rearranges in
   ``[at_step, at_step + grace_steps]``, under the old interval or the new one. A rank without the
   commit by then expires the command (the values stay). Every outcome is reported per rank
   (``GET`` :data:`PATH`) and the operator confirms every rank before it records the change.

Step numbers are each worker's count of its non-profile ``EplbState.step`` calls since the state was
made (0-based: step ``n`` is the ``n``-th call), equal on every rank of an engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

#: version of this exchange; a command of another version is refused (the plugin names its own)
PROTOCOL = 1
#: the exporter's route (same port as ``/metrics``): GET the values in force per rank, POST a command
PATH = "/eplb/settings"

PREPARE, COMMIT, ABORT = "prepare", "commit", "abort"
OPS = (PREPARE, COMMIT, ABORT)

#: states of a command on one rank
ARMED = "armed"  # prepared, waiting for the commit and the step
COMMITTED = "committed"  # commit received, waiting for the step
APPLIED = "applied"  # the values are in force from ``at_step``
REFUSED = "refused"  # the rank would not take it (reason); nothing changed
ABORTED = "aborted"  # the operator called it off; nothing changed
EXPIRED = "expired"  # no commit by ``at_step + grace_steps``; nothing changed
FAILED = "failed"  # applying raised; the interval was left as it was
FINAL_STATES = (APPLIED, REFUSED, ABORTED, EXPIRED, FAILED)

#: files in the pod's exporter directory: the command the pod's exporter writes for its workers,
#: and one status per worker process (``live-<pid>.json``)
COMMAND_FILE = "live-command.json"
STATUS_PREFIX = "live-status-"

#: where the values in force came from on a rank
SOURCE_ENGINE = "engine"  # vLLM's own config (``--eplb-config``), since start
SOURCE_LIVE = "live"  # a live command
SOURCE_STARTUP = "startup"  # the operator's live-settings file (a ConfigMap), read at start

#: the operator's live-settings file (a ConfigMap mounted into every engine pod): JSON with these keys
FILE_WINDOW, FILE_INTERVAL, FILE_HASH, FILE_STEP = "windowSize", "stepInterval", "configHash", "step"


class CommandError(ValueError):
    """A command that cannot be read; the message names the field."""


@dataclass(frozen=True)
class Command:
    """One live command as the operator sends it and the exporter hands it to its workers."""

    id: str
    op: str
    at_step: int
    grace_steps: int
    window_size: int
    step_interval: int
    #: the values the operator believes in force (a rank running others refuses: nothing stale applies)
    expect_window_size: int
    expect_step_interval: int
    protocol: int = PROTOCOL

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_mapping(cls, raw: Any) -> Command:
        if not isinstance(raw, Mapping):
            raise CommandError("a live command is a JSON object")
        out: dict[str, Any] = {}
        for f in cls.__dataclass_fields__.values():
            if f.name not in raw:
                if f.name == "protocol":
                    continue
                raise CommandError(f"{f.name}: required")
            value = raw[f.name]
            want = str if f.name in ("id", "op") else int
            if isinstance(value, bool) or not isinstance(value, want):
                raise CommandError(f"{f.name}: expected {'a string' if want is str else 'a whole number'}, "
                                   f"got {value!r}")
            out[f.name] = value
        cmd = cls(**out)
        problem = cmd.problem()
        if problem:
            raise CommandError(problem)
        return cmd

    def problem(self) -> str | None:
        """What is wrong with the command's values, or None."""
        if self.protocol != PROTOCOL:
            return f"protocol {self.protocol} is not spoken here (this plugin speaks {PROTOCOL})"
        if self.op not in OPS:
            return f"op: {self.op!r} is not one of {', '.join(OPS)}"
        if not self.id or len(self.id) > 128:
            return "id: 1 to 128 characters"
        for name in ("window_size", "step_interval", "expect_window_size", "expect_step_interval"):
            if getattr(self, name) <= 0:
                return f"{name}: must be > 0 (vLLM's EPLBConfig requires it), got {getattr(self, name)}"
        if self.at_step < 0 or self.grace_steps < 0:
            return "at_step and grace_steps: must be >= 0"
        return None

    @property
    def changes(self) -> bool:
        return (self.window_size, self.step_interval) != (self.expect_window_size, self.expect_step_interval)


def guard_problem(counter_at: int, grace_steps: int, old_interval: int, new_interval: int) -> str | None:
    """Why a change may not take effect at a step where vLLM's rearrangement counter reads
    ``counter_at`` (before that step's increment), or None.

    vLLM's step ``k`` increments the counter and rearranges when it reaches the interval, so from
    ``at_step`` the first rearrangement comes ``interval - 1 - counter_at`` steps later under either
    interval. A rank that applies up to ``grace_steps`` late behaves as one that applied on time
    only if no rank rearranges before it applies: ``counter_at + grace_steps < min(old, new)``. The
    numbers are the same on every rank, so every rank draws the same conclusion."""
    first = min(old_interval, new_interval)
    if counter_at + grace_steps < first:
        return None
    return (f"a rearrangement falls within {grace_steps} steps of the agreed step (vLLM's counter {counter_at}, "
            f"interval {old_interval} -> {new_interval}); ask again for a step after the next rearrangement")


def steps_to_rearrangement(counter: int, interval: int) -> int:
    """Steps from now (counter ``counter`` before the next step's increment) until the step that
    rearranges: 0 means the next step does."""
    return max(0, interval - 1 - counter)


def safe_step(now_step: int, counter: int, interval: int, new_interval: int, lead_steps: int,
              grace_steps: int) -> int:
    """The first step at least ``lead_steps`` ahead of ``now_step`` at which a change from
    ``interval`` to ``new_interval`` passes :func:`guard_problem`, given vLLM's counter now: past the
    next rearrangement when the lead or the grace would reach it."""
    at = now_step + lead_steps
    counter_at = counter + lead_steps
    if counter_at >= interval:  # the old interval rearranges before (or at) the lead's end
        nxt = now_step + steps_to_rearrangement(counter, interval)  # the step that rearranges
        # after it the counter reads 0 at step nxt + 1, and again every `interval` steps
        counter_at = (at - (nxt + 1)) % interval
    if guard_problem(counter_at, grace_steps, interval, new_interval) is not None:
        nxt = at + steps_to_rearrangement(counter_at, interval)
        at, counter_at = nxt + 1, 0
    return at


@dataclass(frozen=True)
class RankStatus:
    """What one rank reports (its worker's status file; ``GET`` :data:`PATH` lists them)."""

    ep_rank: int | None
    ep_size: int | None
    pid: int
    step: int  # engine steps so far (the next step's number)
    counter: int | None  # vLLM's ``expert_rearrangement_step`` now
    window_size: int | None
    step_interval: int | None
    since_step: int = 0  # the step these values took effect (0: since start)
    source: str = SOURCE_ENGINE
    supported: bool = True
    why: str = ""  # why live apply is not possible on this rank (``supported`` False)
    command: dict = field(default_factory=dict)  # {id, state, reason, at_step, applied_step}
    rearranged_at: tuple[int, ...] = ()  # the last rearrangements' step numbers
    rate: float = 0.0  # engine steps per second lately (the operator's lead and grace in steps)
    time: float = 0.0
    protocol: int = PROTOCOL

    def to_json(self) -> str:
        d = asdict(self)
        d["rearranged_at"] = list(self.rearranged_at)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> RankStatus:
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        known["rearranged_at"] = tuple(int(x) for x in known.get("rearranged_at") or ())
        known["command"] = dict(known.get("command") or {})
        return cls(**known)

    def state_of(self, command_id: str) -> str | None:
        """This rank's state of command ``command_id`` (None: it has not seen it)."""
        return self.command.get("state") if self.command.get("id") == command_id else None
