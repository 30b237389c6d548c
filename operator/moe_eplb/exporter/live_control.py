"""The pod's side of live apply: the exporter's ``/eplb/settings`` route (the exchange:
:mod:`moe_eplb.contracts.live_protocol`; each worker's side: :mod:`moe_eplb.exporter.live`).

``GET`` answers the values in force on every rank of the pod (each worker's status file), with the
step they took effect and the state of the latest command: read-only, like ``/metrics``.

``POST`` takes a command (``prepare``, ``commit`` or ``abort``) -- only with the operator's control
token (:mod:`moe_eplb.exporter.control_auth`; refused before the body is read, nothing changed) --
writes it where every worker of the pod watches (the command file in the pod's exporter directory)
and answers once every rank has taken it (``prepare``: armed or refused; ``commit``: committed or
decided; ``abort``: no longer pending) or after the command's answer time, with what each rank
reports. A rank that has not taken it by then is reported as it stands: the operator names it as not
answering and calls the change off. The route judges nothing: whether every EP rank of the engine is
armed is the operator's decision (an engine may span several pods).
"""

from __future__ import annotations

import glob
import json
import os
import time
from collections.abc import Callable

from moe_eplb.contracts import live_protocol as lp

#: how long a POST waits for the pod's ranks by default, and at most
ANSWER_SECONDS, MAX_ANSWER_SECONDS = 5.0, 30.0
_TAKEN = {
    lp.PREPARE: lambda state: state is not None,
    lp.COMMIT: lambda state: state is not None and state != lp.ARMED,
    lp.ABORT: lambda state: state not in (lp.ARMED, lp.COMMITTED),
}


def rank_statuses(directory: str, alive: Callable[[int], bool] | None = None) -> list[lp.RankStatus]:
    """The status of every worker of the pod that runs live apply, by EP rank (files of processes
    that are gone are skipped; unreadable ones too)."""
    if alive is None:
        from moe_eplb.exporter.health import pid_alive as alive
    out = []
    for path in glob.glob(os.path.join(directory, f"{lp.STATUS_PREFIX}*.json")):
        try:
            with open(path, encoding="utf-8") as f:
                status = lp.RankStatus.from_mapping(json.load(f))
        except (OSError, ValueError, TypeError):
            continue
        if alive(status.pid):
            out.append(status)
    return sorted(out, key=lambda s: (s.ep_rank if s.ep_rank is not None else 1 << 30, s.pid))


def answer_get(directory: str | None) -> tuple[int, dict]:
    """``GET``: (HTTP status, body) with the pod's ranks."""
    ranks = rank_statuses(directory) if directory else []
    return 200, {"protocol": lp.PROTOCOL, "ranks": [json.loads(r.to_json()) for r in ranks]}


def write_command(directory: str, cmd: lp.Command) -> None:
    """The command file, replaced atomically (workers read it whole or not at all)."""
    path = os.path.join(directory, lp.COMMAND_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(cmd.to_json())
    os.replace(tmp, path)


def answer_post(directory: str | None, body: bytes, *, sleep: Callable[[float], None] = time.sleep,
                clock: Callable[[], float] = time.monotonic) -> tuple[int, dict]:
    """``POST`` (already authenticated): (HTTP status, body). 400 for a command that cannot be
    read (nothing written); else the ranks' answers once all took it or the answer time is up."""
    try:
        raw = json.loads(body or b"{}")
        cmd = lp.Command.from_mapping({k: v for k, v in raw.items() if k != "answer_seconds"})
        wait = float(raw.get("answer_seconds", ANSWER_SECONDS))
    except (ValueError, TypeError, AttributeError) as exc:
        return 400, {"protocol": lp.PROTOCOL, "error": f"bad live command: {exc}"}
    if not directory:
        return 503, {"protocol": lp.PROTOCOL, "error": "the exporter has no directory: no worker to tell"}
    wait = min(max(wait, 0.0), MAX_ANSWER_SECONDS)
    before = rank_statuses(directory)
    if not before:
        return 409, {"protocol": lp.PROTOCOL, "error": "no worker of this pod runs live apply yet (the engine is "
                                                       "loading, EPLB is off, or its workers have not stepped)"}
    write_command(directory, cmd)
    taken = _TAKEN[cmd.op]
    deadline = clock() + wait
    while True:
        ranks = rank_statuses(directory)
        if all(taken(r.state_of(cmd.id)) for r in ranks) or clock() >= deadline:
            break
        sleep(0.02)
    return 200, {"protocol": lp.PROTOCOL, "id": cmd.id, "op": cmd.op,
                 "ranks": [json.loads(r.to_json()) for r in ranks]}
