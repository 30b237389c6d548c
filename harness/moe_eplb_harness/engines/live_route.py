"""SIMULATED: the exporter's live-apply route (``/eplb/settings``) as a simulated engine's pods
answer it -- the exchange of :mod:`moe_eplb.contracts.live_protocol` over the engine's one EPLB
replay (:class:`~moe_eplb_harness.engines.engine.SimulatedEplb`), whose ranks step in lockstep by
construction. Not vLLM, not the real exporter (that is :mod:`moe_eplb.exporter.live_control`).

What a pod answers: ``GET`` the values in force on each of its EP ranks, with the engine step they
took effect, vLLM's counter, the step rate (engine steps per WALL second: the operator plans in
wall time, the simulated clock runs ``scale`` times faster) and the latest command's state;
``POST`` (the operator's control token, as the engine's pod mounts it: ``SimulatedEngine.control_token``,
set by the simulated kubelet from the Secret) a command: ``prepare`` is checked (step not past, the
values expected or already the target), ``commit`` schedules the change on the replay at the agreed
step (:meth:`SimulatedEngine.apply_live`), ``abort`` calls it off while it is still due. The replay
applies it when it reaches that step, or refuses it by the guard, as every worker would.
"""

from __future__ import annotations

import json
import time
from typing import Any

from moe_eplb.api.knobs import Knobs
from moe_eplb.contracts import k8s_names
from moe_eplb.contracts import live_protocol as lp


class LiveRoute:
    """The live-apply state of one simulated engine (all its pods share it)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.command: lp.Command | None = None
        self.state: str | None = None  # armed | committed | a final state
        self.reason = ""
        self._rate_mark: tuple[float, int] | None = None
        self.rate = 0.0

    # --- what the pods answer ---------------------------------------------------------------------
    def _refresh(self) -> None:
        """The command's state from the replay (applied or refused at its step); the step rate: the
        workload's steps per second now, in WALL seconds (the simulated clock runs ``scale`` faster)."""
        e = self.engine
        replay, cmd = e.replay, self.command
        if cmd is not None and self.state == lp.COMMITTED and cmd.at_step in replay.live_done:
            self.state, self.reason = replay.live_done[cmd.at_step]
        trace = e.trace
        bucket = int(max(0.0, e._pos or 0.0) // float(trace.bucket_seconds)) % trace.num_buckets
        self.rate = float(trace.bucket_steps[bucket]) / float(trace.bucket_seconds) * float(e.clock.scale)

    def ranks(self, pod: int) -> list[lp.RankStatus]:
        e = self.engine
        with e._lock:
            if e.ready and e._pos is not None:
                e._advance_to(e.clock.workload_seconds())
            self._refresh()
            replay, cmd = e.replay, self.command
            per_pod = e.settings.ep_size // e.pods
            report = {} if cmd is None else {"id": cmd.id, "state": self.state, "reason": self.reason,
                                             "at_step": cmd.at_step,
                                             "applied_step": cmd.at_step if self.state == lp.APPLIED else None}
            knobs = replay.s.knobs
            return [lp.RankStatus(ep_rank=r, ep_size=e.settings.ep_size, pid=0, step=replay.steps,
                                  counter=replay.counter(), window_size=knobs.window_size,
                                  step_interval=knobs.step_interval, since_step=replay.since_step,
                                  source=lp.SOURCE_LIVE if replay.since_step else lp.SOURCE_ENGINE,
                                  command=dict(report), rearranged_at=tuple(replay.rearranged_steps),
                                  rate=round(self.rate, 3), time=time.time())
                    for r in range(pod * per_pod, (pod + 1) * per_pod)]

    def get(self, pod: int) -> tuple[int, bytes, str]:
        if not self.engine.ready:
            body = {"protocol": lp.PROTOCOL, "ranks": []}
        else:
            body = {"protocol": lp.PROTOCOL, "ranks": [json.loads(r.to_json()) for r in self.ranks(pod)]}
        return 200, json.dumps(body).encode(), "application/json"

    # --- commands ---------------------------------------------------------------------------------
    def post(self, pod: int, headers: dict[str, str], body: bytes) -> tuple[int, bytes, str]:
        token = self.engine.control_token
        given = next((v for k, v in headers.items() if k.lower() == k8s_names.CONTROL_AUTH_HEADER.lower()), "")
        if token is None:
            return _error(503, "no control token in this pod: control requests are off")
        if not given.startswith(k8s_names.CONTROL_AUTH_SCHEME + " "):
            return _error(401, f"a control request needs '{k8s_names.CONTROL_AUTH_HEADER}: "
                               f"{k8s_names.CONTROL_AUTH_SCHEME} <token>' (the operator's token)")
        if given.split(" ", 1)[1].strip() != token:
            return _error(403, "the control token does not match this pod's")
        try:
            raw = json.loads(body or b"{}")
            cmd = lp.Command.from_mapping({k: v for k, v in raw.items() if k != "answer_seconds"})
        except (ValueError, TypeError, AttributeError) as exc:
            return _error(400, f"bad live command: {exc}")
        if not self.engine.ready:
            return _error(409, "no worker of this pod runs live apply yet (the engine is loading)")
        with self.engine._lock:
            self._take(cmd)
        return 200, json.dumps({"protocol": lp.PROTOCOL, "id": cmd.id, "op": cmd.op, "ranks": [
            json.loads(r.to_json()) for r in self.ranks(pod)]}).encode(), "application/json"

    def _take(self, cmd: lp.Command) -> None:
        replay, mine = self.engine.replay, self.command is not None and self.command.id == cmd.id
        if cmd.op == lp.PREPARE:
            if mine:
                return
            if self.command is not None and self.state in (lp.ARMED, lp.COMMITTED):
                replay.cancel_live(self.command.at_step)
            self.command, self.reason = cmd, ""
            running = (replay.s.knobs.window_size, replay.s.knobs.step_interval)
            if replay.steps > cmd.at_step:
                self.state, self.reason = lp.REFUSED, (f"step {cmd.at_step} is already past: this rank is at engine "
                                                       f"step {replay.steps}")
            elif running not in ((cmd.expect_window_size, cmd.expect_step_interval),
                                 (cmd.window_size, cmd.step_interval)):
                self.state, self.reason = lp.REFUSED, (f"this rank runs window {running[0]}, interval {running[1]}, "
                                                       f"not the {cmd.expect_window_size}, {cmd.expect_step_interval} "
                                                       "the command expects")
            else:
                self.state = lp.ARMED
        elif mine and cmd.op == lp.COMMIT and self.state == lp.ARMED:
            self.state = lp.COMMITTED
            knobs = Knobs(cmd.window_size, cmd.step_interval, replay.s.knobs.num_redundant_experts)
            if replay.steps > cmd.at_step + cmd.grace_steps:  # the commit came too late: as a worker does
                self.state, self.reason = lp.EXPIRED, (f"no commit arrived by step {cmd.at_step + cmd.grace_steps}; "
                                                       "nothing changed")
                return
            # what SimulatedEngine.apply_live does, with the command's grace for the guard (the caller
            # holds the lock); a commit within the grace applies at the next step, as if on time
            replay.schedule_live(max(cmd.at_step, replay.steps), knobs, cmd.grace_steps, agreed=cmd.at_step)
        elif mine and cmd.op == lp.ABORT and self.state in (lp.ARMED, lp.COMMITTED):
            if self.state == lp.ARMED or replay.cancel_live(cmd.at_step):
                self.state, self.reason = lp.ABORTED, "the operator aborted it"


def _error(status: int, message: str) -> tuple[int, bytes, str]:
    return status, json.dumps({"protocol": lp.PROTOCOL, "error": message}).encode(), "application/json"
