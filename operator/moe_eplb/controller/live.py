"""Live apply of EPLB's window and interval to running engines: no restart, the same engine step on
every EP rank (the exchange: :mod:`moe_eplb.contracts.live_protocol`; the pods' side:
:mod:`moe_eplb.exporter.live_control` and :mod:`moe_eplb.exporter.live`).

:func:`live_capable` says whether a resource's engines can take a live change (else the tuner's
change restarts the pods). :func:`apply_live` carries one change to a set of engine pods:

1. **survey**: ``GET /eplb/settings`` of every pod; each engine (a Deployment pod, or a
   LeaderWorkerSet group's pods) must answer for every EP rank, support live apply, run the values
   the change expects to replace and agree on its step count (same last rearrangement step);
2. **plan**: per engine the agreed step -- ``lead_seconds`` ahead at the engine's step rate, moved
   past the next rearrangement where either interval would rearrange within the grace
   (:func:`~moe_eplb.contracts.live_protocol.safe_step`) -- unless the caller names the step;
3. **prepare** every pod; all ranks armed -> **commit** every pod, else **abort** every pod
   (nothing changed anywhere, the reason names the pod and rank);
4. **confirm**: until every rank reports the change applied from the agreed step. A change that
   ended applied on some ranks but not others is undone at once with a live change back to the
   previous values (and the outcome says so); one that no rank applied leaves the previous values.

The outcome (:class:`LiveOutcome`: ``ok``, ``step``, ``reason``) is what the tuning loop records
(``status.autotune.live``) -- only when ``ok``. The transport is :mod:`.live_client`.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from moe_eplb.api.autotune_status import AutotuneStatus
from moe_eplb.api.knobs import Knobs
from moe_eplb.api.spec import MoEInference
from moe_eplb.contracts import k8s_names, vllm_facts
from moe_eplb.contracts import live_protocol as lp
from moe_eplb.controller import live_client
from moe_eplb.eplb.workload.trace import LoadTrace
from moe_eplb.metrics.scrape import targets_from_pods

#: how far ahead of an engine's current step the agreed step lies, and how late a rank may still
#: apply (both in seconds of the engine's step rate; the grace also at most a quarter of the
#: shorter interval), the fewest steps of lead, how long a pod may take to answer a command
LEAD_SECONDS, GRACE_SECONDS, MIN_LEAD_STEPS, ANSWER_SECONDS = 3.0, 2.0, 16, 5.0
#: how long to wait for an engine to reach its agreed step beyond the lead (an idle engine does not step)
CONFIRM_SECONDS = 30.0


def live_capable(inf: MoEInference) -> str | None:
    """None when ``inf``'s engines can take a live change of window and interval, else why not
    (then a change restarts the pods, as before)."""
    if not inf.effective.enabled:
        return "EPLB is off"
    if not inf.exporter_in_pod:
        return ("the engine pods run no moe-eplb exporter (spec.engine.exporter.inject is false and the image is "
                "not the project's): live apply needs its plugin in every worker")
    env = {e.get("name"): str(e.get("value", "")).strip().lower() for e in inf.engine.env if isinstance(e, Mapping)}
    if env.get("MOE_EPLB_LIVE_APPLY") == "off" or env.get("MOE_EPLB_EXPORTER_MODE") == "off":
        return "spec.engine.env turns the exporter's live apply off (MOE_EPLB_LIVE_APPLY or MOE_EPLB_EXPORTER_MODE)"
    version = inf.engine.version
    if version is None:
        return ("the vLLM version is not known (set spec.engine.version, or an image tag with the version); live "
                f"apply is checked on vLLM {vllm_facts.live_apply_range()}")
    if not vllm_facts.live_apply_supports(version):
        return (f"vLLM {'.'.join(map(str, version))}: live apply of window and interval is checked on vLLM "
                f"{vllm_facts.live_apply_range()} only")
    return None


def live_wait(state: AutotuneStatus, now: float, trace: LoadTrace | None) -> str | None:
    """Why a live change must wait now, or None: the last live change's first rearrangement on its
    interval has not come yet (its interval in engine steps at the trace's step rate; live settings
    need no other cooldown)."""
    rec = state.live
    if rec is None or rec.applied_at is None:
        return None
    seconds = (trace.duration_seconds or 0.0) if trace is not None else 0.0
    rate = trace.total_steps / seconds if trace is not None and seconds > 0 else 0.0
    settle = rec.step_interval / rate if rate > 0 else 0.0
    ago = max(0.0, now - rec.applied_at)
    if ago >= settle:
        return None
    return (f"the live change {ago:.0f}s ago has not rearranged on its interval {rec.step_interval} yet (~{settle:.0f}s "
            "at the engines' step rate)")


@dataclass(frozen=True)
class LivePod:
    """One engine pod as live apply addresses it: its exporter's base URL, the engine it belongs to
    (the pod itself, or its LeaderWorkerSet group) and how many EP ranks it holds."""

    name: str
    url: str
    engine: str
    ranks: int | None = None


def live_pods(inf: MoEInference, pods: Sequence[Mapping]) -> list[LivePod]:
    """The running engine pods of ``inf`` (pod objects as listed from the API) as :class:`LivePod`."""
    per_pod = inf.parallelism.tensor * inf.parallelism.data_local
    out = []
    by_name = {(p.get("metadata") or {}).get("name"): p for p in pods}
    for t in targets_from_pods(pods, inf.name):
        labels = ((by_name.get(t.pod) or {}).get("metadata") or {}).get("labels") or {}
        group = labels.get(k8s_names.LWS_GROUP_INDEX_LABEL)
        out.append(LivePod(t.pod, t.url.removesuffix(k8s_names.EXPORTER_PATH),
                           f"group {group}" if group is not None else t.pod, per_pod))
    return out


@dataclass(frozen=True)
class EngineReport:
    """What happened on one engine: its pods, the agreed step, each EP rank's final state."""

    engine: str
    pods: tuple[str, ...]
    at_step: int | None = None
    states: dict[int, str] = field(default_factory=dict)
    reason: str = ""


@dataclass(frozen=True)
class LiveOutcome:
    """The result of :func:`apply_live`. ``ok``: every EP rank of every engine applied the change;
    ``step``: the agreed step (of the first engine: engines of a resource step independently, see
    ``steps``); ``reason``: why not, or what was done."""

    ok: bool
    step: int | None
    reason: str
    steps: dict[str, int] = field(default_factory=dict)
    engines: tuple[EngineReport, ...] = ()
    restored: bool = False
    #: the pods cannot take live changes at all (no route, an unsupported vLLM, misaligned ranks):
    #: the change needs a restart; False for what may pass (a rank not answering, an idle engine)
    unsupported: bool = False


Get = Callable[[str], Awaitable[live_client.Answer]]
Send = Callable[[str, lp.Command, float], Awaitable[live_client.Answer]]


def _answer_problem(pod: LivePod, answer: live_client.Answer) -> str | None:
    """Why a pod's ``GET`` shows it cannot take live commands, or None."""
    if answer.status == 0:
        return f"pod {pod.name} did not answer ({answer.error})"
    if answer.status == 404:
        return (f"pod {pod.name}'s exporter has no live-apply route {lp.PATH} (its plugin predates live apply, or "
                "MOE_EPLB_LIVE_APPLY=off): the change needs a restart")
    if answer.status != 200:
        return f"pod {pod.name} answered HTTP {answer.status}: {answer.body.get('error', '')}".rstrip(": ")
    if answer.body.get("protocol") != lp.PROTOCOL:
        return f"pod {pod.name} speaks live-apply protocol {answer.body.get('protocol')}, not {lp.PROTOCOL}"
    return None


def engine_problem(engine: str, pods: Sequence[LivePod], ranks: Sequence[lp.RankStatus], expect: Knobs,
                   target: Knobs | None = None) -> str | None:
    """Why an engine cannot take a change from ``expect`` (to ``target``: ranks already running it
    take the change as a no-op) now (pure): ranks missing, not supported, running other values, or
    not counting the same steps."""
    if not ranks:
        return f"engine {engine}: no EP rank reports live apply yet (the engine is loading, or its workers have not stepped)"
    sizes = {r.ep_size for r in ranks if r.ep_size}
    size = max(sizes) if sizes else len(ranks)
    seen = sorted({r.ep_rank for r in ranks if r.ep_rank is not None})
    want = sum(p.ranks or 0 for p in pods)
    if seen != list(range(size)) or (want and len(ranks) < want):
        missing = sorted(set(range(size)) - set(seen))
        return f"engine {engine}: EP ranks {missing or '?'} do not report (of {size}; the pod or worker is not up)"
    for r in ranks:
        if not r.supported:
            return f"engine {engine}: EP rank {r.ep_rank} cannot change live: {r.why}"
        running = (r.window_size, r.step_interval)
        if running != (expect.window_size, expect.step_interval) and (
                target is None or running != (target.window_size, target.step_interval)):
            return (f"engine {engine}: EP rank {r.ep_rank} runs window {r.window_size}, interval {r.step_interval}, "
                    f"not the expected {expect.window_size}, {expect.step_interval}")
    last = {r.rearranged_at[-1] for r in ranks if r.rearranged_at}
    if len(last) > 1 or (last and any(not r.rearranged_at and r.step > max(last) for r in ranks)):
        return (f"engine {engine}: its EP ranks disagree on when vLLM last rearranged (steps {sorted(last)}): their "
                "step counts are not aligned (ranks that joined later, e.g. an elastic resize); a change needs a restart")
    return None


def plan_step(ranks: Sequence[lp.RankStatus], target: Knobs, *, now: float, lead_seconds: float = LEAD_SECONDS,
              grace_seconds: float = GRACE_SECONDS) -> tuple[int, int]:
    """(agreed step, grace steps) for an engine whose ranks report ``ranks`` (pure): the freshest
    report extrapolated to ``now`` at its step rate, ``lead_seconds`` ahead, past the next
    rearrangement where needed (:func:`~moe_eplb.contracts.live_protocol.safe_step`)."""
    fresh = max(ranks, key=lambda r: (r.time, r.step))
    rate = max(r.rate for r in ranks)
    interval = int(fresh.step_interval or target.step_interval)
    shortest = min(interval, target.step_interval)
    grace = max(1, min(math.ceil(rate * grace_seconds), max(1, shortest // 4)))
    drift = math.ceil(rate * max(0.0, now - fresh.time))
    lead = max(MIN_LEAD_STEPS, math.ceil(rate * lead_seconds)) + drift
    counter = int(fresh.counter if fresh.counter is not None else 0) % interval
    return lp.safe_step(fresh.step, counter, interval, target.step_interval, lead, grace), grace


async def _each(pods: Sequence[LivePod], call: Callable[[LivePod], Awaitable[live_client.Answer]]
                ) -> dict[str, live_client.Answer]:
    answers = await asyncio.gather(*(call(p) for p in pods))
    return {p.name: a for p, a in zip(pods, answers)}


def _ranks_by_engine(pods: Sequence[LivePod], answers: Mapping[str, live_client.Answer]
                     ) -> dict[str, list[tuple[LivePod, lp.RankStatus]]]:
    out: dict[str, list[tuple[LivePod, lp.RankStatus]]] = {}
    for p in pods:
        out.setdefault(p.engine, [])
        out[p.engine] += [(p, r) for r in answers[p.name].ranks]
    return out


def _not_taken(engine: str, pairs: Sequence[tuple[LivePod, lp.RankStatus]], cmd_id: str, ok: tuple[str, ...],
               answered: Mapping[str, live_client.Answer], pods: Sequence[LivePod]) -> str | None:
    """The first rank (or pod) of ``engine`` whose answer to command ``cmd_id`` is not in ``ok``."""
    for p in pods:
        if p.engine == engine and answered[p.name].status != 200:
            a = answered[p.name]
            return f"pod {p.name} did not take the command ({a.error or f'HTTP {a.status}'})"
    for p, r in pairs:
        state = r.state_of(cmd_id)
        if state not in ok:
            why = r.command.get("reason") if state else ""
            return (f"EP rank {r.ep_rank} (pod {p.name}) {state}: {why}" if state else
                    f"EP rank {r.ep_rank} (pod {p.name}) did not answer in time (its worker may be stuck or gone)")
    return None


async def apply_live(pods: Sequence[LivePod], token: str, target: Knobs, expect: Knobs | None, *, at_step: int | None = None,
                     lead_seconds: float = LEAD_SECONDS, grace_seconds: float = GRACE_SECONDS,
                     answer_seconds: float = ANSWER_SECONDS, confirm_seconds: float = CONFIRM_SECONDS,
                     restore: bool = True, get: Get | None = None, send: Send | None = None,
                     clock: Callable[[], float] = time.time) -> LiveOutcome:
    """Change window and interval from ``expect`` to ``target`` on every EP rank of every engine of
    ``pods``, each engine at one agreed step (``at_step``: the caller's, for every engine; default:
    planned per engine). ``expect`` None: what the first rank surveyed runs (an interleaved
    experiment's pods run either arm); every rank is still checked against it. Never raises for
    what a pod does; see the module docstring."""
    get = get or (lambda url: live_client.get_settings(url))
    send = send or (lambda url, cmd, wait: live_client.send_command(url, token, cmd, answer_seconds=wait))
    if not pods:
        return LiveOutcome(False, None, "no running engine pod to change")
    survey = await _each(pods, lambda p: get(p.url))
    for p in pods:
        problem = _answer_problem(p, survey[p.name])
        if problem:
            return LiveOutcome(False, None, f"nothing changed: {problem}",
                               unsupported=survey[p.name].status not in (0, 200))
    engines = _ranks_by_engine(pods, survey)
    if expect is None:
        first = next((r for pairs in engines.values() for _, r in pairs
                      if r.window_size is not None and r.step_interval is not None), None)
        if first is None:
            return LiveOutcome(False, None, "nothing changed: no EP rank reports the window and interval it runs")
        expect = Knobs(int(first.window_size), int(first.step_interval), target.num_redundant_experts)
    plans: dict[str, tuple[int, int]] = {}
    for engine, pairs in engines.items():
        ranks = [r for _, r in pairs]
        problem = engine_problem(engine, [p for p in pods if p.engine == engine], ranks, expect, target)
        if problem:
            return LiveOutcome(False, None, f"nothing changed: {problem}",
                               unsupported="cannot change live" in problem or "not aligned" in problem)
        planned = plan_step(ranks, target, now=clock(), lead_seconds=lead_seconds, grace_seconds=grace_seconds)
        plans[engine] = (at_step, planned[1]) if at_step is not None else planned
        rate = max(r.rate for r in ranks)
        if rate > 0:  # the time the engine takes to get there, at its rate
            ahead = plans[engine][0] + plans[engine][1] - max(r.step for r in ranks)
            confirm_seconds = max(confirm_seconds, ahead / rate + lead_seconds)
    return await _exchange(pods, engines, plans, target, expect, send=send, get=get, answer_seconds=answer_seconds,
                           confirm_seconds=confirm_seconds, restore=restore, token=token)


def _commands(op: str, ids: Mapping[str, str], plans: Mapping[str, tuple[int, int]], target: Knobs,
              expect: Knobs) -> dict[str, lp.Command]:
    return {e: lp.Command(id=ids[e], op=op, at_step=at, grace_steps=grace, window_size=target.window_size,
                          step_interval=target.step_interval, expect_window_size=expect.window_size,
                          expect_step_interval=expect.step_interval) for e, (at, grace) in plans.items()}


async def _exchange(pods: Sequence[LivePod], engines: Mapping[str, list], plans: Mapping[str, tuple[int, int]],
                    target: Knobs, expect: Knobs, *, send: Send, get: Get, answer_seconds: float,
                    confirm_seconds: float, restore: bool, token: str) -> LiveOutcome:
    """Prepare, commit or abort, confirm (see the module docstring)."""
    tag = uuid.uuid4().hex[:10]
    ids = {e: f"{tag}-{i}" for i, e in enumerate(sorted(plans))}
    steps = {e: at for e, (at, _) in plans.items()}

    async def to_all(op: str) -> dict[str, live_client.Answer]:
        cmds = _commands(op, ids, plans, target, expect)
        return await _each(pods, lambda p: send(p.url, cmds[p.engine], answer_seconds))

    prepared = await to_all(lp.PREPARE)
    refusal = None
    for engine in sorted(plans):
        pairs = _ranks_by_engine(pods, prepared)[engine]
        refusal = refusal or _not_taken(engine, pairs, ids[engine], (lp.ARMED,), prepared, pods)
    if refusal is None and any(len(_ranks_by_engine(pods, prepared)[e]) < len(engines[e]) for e in plans):
        refusal = "a pod answered for fewer EP ranks than it reported before"
    if refusal is not None:
        await to_all(lp.ABORT)
        return LiveOutcome(False, None, f"nothing changed: {refusal}; the change was called off on every rank",
                           steps, _reports(pods, prepared, ids, plans, refusal))
    committed = await to_all(lp.COMMIT)
    failed = next((f"pod {p.name} did not take the commit ({committed[p.name].error or committed[p.name].status})"
                   for p in pods if committed[p.name].status != 200), None)
    if failed is not None:
        await to_all(lp.ABORT)
    final = await _confirm(pods, ids, plans, get=get, seconds=confirm_seconds + answer_seconds)
    if any(r.state_of(ids[p.engine]) not in lp.FINAL_STATES for p in pods for r in final[p.name].ranks):
        # the engine did not reach its step in time (idle?): call it off where it still waits
        failed = failed or "the engine did not reach the agreed step in time (no traffic?)"
        await to_all(lp.ABORT)
        final = await _confirm(pods, ids, plans, get=get, seconds=answer_seconds)
    return await _conclude(pods, final, ids, plans, target, expect, failed=failed, restore=restore, send=send,
                           get=get, token=token)


async def _confirm(pods: Sequence[LivePod], ids: Mapping[str, str], plans: Mapping[str, tuple[int, int]], *,
                   get: Get, seconds: float) -> dict[str, live_client.Answer]:
    """Poll every pod until each rank's command is in a final state, or ``seconds`` (then abort the
    ranks still waiting for their step: an idle engine that never got there changes nothing)."""
    deadline = time.monotonic() + seconds
    while True:
        answers = await _each(pods, lambda p: get(p.url))
        pending = [p for p in pods for r in answers[p.name].ranks
                   if r.state_of(ids[p.engine]) not in lp.FINAL_STATES]
        if not pending or time.monotonic() >= deadline:
            return answers
        await asyncio.sleep(0.2)


def _reports(pods: Sequence[LivePod], answers: Mapping[str, live_client.Answer], ids: Mapping[str, str],
             plans: Mapping[str, tuple[int, int]], reason: str = "") -> tuple[EngineReport, ...]:
    out = []
    for engine, pairs in sorted(_ranks_by_engine(pods, answers).items()):
        states = {int(r.ep_rank if r.ep_rank is not None else -1): r.state_of(ids[engine]) or "no answer"
                  for _, r in pairs}
        out.append(EngineReport(engine, tuple(p.name for p in pods if p.engine == engine), plans[engine][0], states,
                                reason))
    return tuple(out)


async def _conclude(pods: Sequence[LivePod], final: Mapping[str, live_client.Answer], ids: Mapping[str, str],
                    plans: Mapping[str, tuple[int, int]], target: Knobs, expect: Knobs, *, failed: str | None,
                    restore: bool, send: Send, get: Get, token: str) -> LiveOutcome:
    """The outcome from every rank's final state; a change applied on part of the ranks is undone."""
    steps = {e: at for e, (at, _) in plans.items()}
    reports = _reports(pods, final, ids, plans)
    states = [s for rep in reports for s in rep.states.values()]
    first = steps[sorted(steps)[0]] if steps else None
    if states and all(s == lp.APPLIED for s in states):
        return LiveOutcome(True, first, f"window {expect.window_size} -> {target.window_size}, interval "
                                        f"{expect.step_interval} -> {target.step_interval} in force on every EP rank "
                                        f"from engine step {', '.join(f'{e}: {s}' for e, s in sorted(steps.items()))}",
                           steps, reports)
    why = failed or next((f"EP rank {rank} of engine {rep.engine}: {state}" for rep in reports
                          for rank, state in sorted(rep.states.items()) if state != lp.APPLIED), "no rank answered")
    applied = [p for p in pods if any(r.state_of(ids[p.engine]) == lp.APPLIED for r in final[p.name].ranks)]
    if not applied:
        return LiveOutcome(False, None, f"nothing changed: {why}", steps, reports)
    if not restore:
        return LiveOutcome(False, first, f"applied on part of the ranks only ({why}); not restored", steps, reports)
    # ranks already on the previous values take the change back as a no-op
    back = await apply_live([p for p in pods if p.engine in {a.engine for a in applied}], token, expect, target,
                            restore=False, get=get, send=send)
    return LiveOutcome(False, None, f"applied on part of the ranks only ({why}); previous values "
                                    f"{'restored' if back.ok else 'NOT restored: ' + back.reason}", steps, reports,
                       restored=back.ok)
