"""The autotune decision: what one evaluation of one MoEInference concludes. Pure, no I/O.

The kopf timer (``controller.autotune``) gathers the inputs -- the resource, the load read from
Prometheus or the pods, the tuner's result, whether a rollout is already running -- and this module
turns them into a decision and the ``status.autotune`` record. Everything a later evaluation needs
(last change time, restarts in the last 24 h, the rollout in progress) lives in ``status.autotune``,
so an operator restart resumes from the resource alone.

Knob dicts use the CRD's names: ``{"windowSize": int, "stepInterval": int,
"numRedundantExperts": int}`` (engine steps, engine steps, experts).

Times are POSIX seconds (float) inside; status holds RFC 3339 strings (UTC, microseconds).

Decisions (``status.autotune.lastEvaluation.decision`` and the ``decision`` label of
``moe_eplb_tuner_decisions_total``):

==========  =======================================================================
``Keep``    the tuner's best config is the current one, or its gain is below minGain
``Recommend``  Recommend mode: a better config exists; written to status, nothing changed
``Apply``   Apply mode: a rollout to the recommended config started
``Defer``   a change is worth it but not now (cooldown, restart budget, a rollout or
            an unready workload); the reason says which
``NoData``  the load could not be read or is too short; nothing changed
``Error``   the tuner failed; nothing changed
==========  =======================================================================
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from typing import Any

KNOBS = ("windowSize", "stepInterval", "numRedundantExperts")
MODES = ("Off", "Recommend", "Apply")
HISTORY_LIMIT = 20
DAY_SECONDS = 86400.0

KEEP, RECOMMEND, APPLY, DEFER, NODATA, ERROR = "Keep", "Recommend", "Apply", "Defer", "NoData", "Error"
DECISIONS = (KEEP, RECOMMEND, APPLY, DEFER, NODATA, ERROR)


class AutotuneSpecError(ValueError):
    """``spec.autotune`` cannot be used; the message names the field and the fix."""


# --- time --------------------------------------------------------------------------------------


def iso(t: float) -> str:
    """POSIX seconds -> RFC 3339 UTC with microseconds (``2026-12-02T16:00:00.123456Z``)."""
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_iso(s: str | None) -> float | None:
    """RFC 3339 (with or without fraction, ``Z`` or offset) -> POSIX seconds; None stays None."""
    if not s:
        return None
    text = s.strip().replace("Z", "+00:00")
    return _dt.datetime.fromisoformat(text).timestamp()


# --- spec.autotune -----------------------------------------------------------------------------


@dataclass(frozen=True)
class AutotuneConfig:
    """``spec.autotune`` with defaults applied. Durations in seconds, budget in bytes per GPU."""

    mode: str = "Off"
    bounds: dict[str, tuple[int, int]] = field(default_factory=dict)
    memory_budget_bytes: int | None = None
    evaluation_interval_s: float = 300.0
    cooldown_s: float = 3600.0
    max_restarts_per_day: int = 4
    min_gain: float = 0.02
    rollback_tolerance: float = 0.02
    observe_s: float = 600.0

    @property
    def rollout_timeout_s(self) -> float:
        """How long new pods may take to become ready before the change is rolled back."""
        return max(1800.0, 3.0 * self.observe_s)


def _quantity_bytes(value: Any, where: str) -> int:
    from kubernetes.utils.quantity import parse_quantity  # the maintained parser

    try:
        q = parse_quantity(value)
    except (ValueError, TypeError) as exc:
        raise AutotuneSpecError(
            f"{where}: {value!r} is not a quantity; write bytes like 8Gi or 8589934592"
        ) from exc
    if q < 0:
        raise AutotuneSpecError(f"{where}: must be >= 0, got {value!r}")
    return int(q)


def _number(raw: dict, key: str, default: float, *, minimum: float, integer: bool = False) -> float:
    value = raw.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AutotuneSpecError(f"spec.autotune.{key}: expected a number, got {value!r}")
    if integer and int(value) != value:
        raise AutotuneSpecError(f"spec.autotune.{key}: expected a whole number, got {value!r}")
    if value < minimum:
        raise AutotuneSpecError(f"spec.autotune.{key}: must be >= {minimum}, got {value!r}")
    return value


def autotune_config(resource: dict) -> AutotuneConfig:
    """Read ``spec.autotune`` of a MoEInference (dict as the API returns it) with defaults.

    ``memoryBudgetPerGpu`` is a Kubernetes quantity (``8Gi``) -> bytes. Bounds are
    ``{knob: (min, max)}`` for the knobs that have them.

    Raises:
        AutotuneSpecError: a field that cannot be used, named with its path.
    """
    raw = ((resource.get("spec") or {}).get("autotune")) or {}
    mode = raw.get("mode", "Off") or "Off"
    if mode not in MODES:
        raise AutotuneSpecError(f"spec.autotune.mode: {mode!r} is not one of {', '.join(MODES)}")
    bounds: dict[str, tuple[int, int]] = {}
    for knob, b in (raw.get("bounds") or {}).items():
        if knob not in KNOBS:
            raise AutotuneSpecError(f"spec.autotune.bounds.{knob}: unknown knob; use one of {', '.join(KNOBS)}")
        lo, hi = (b or {}).get("min"), (b or {}).get("max")
        lo = 0 if lo is None and knob == "numRedundantExperts" else (1 if lo is None else lo)
        hi = 1023 if hi is None and knob == "numRedundantExperts" else (10**9 if hi is None else hi)
        if int(lo) > int(hi):
            raise AutotuneSpecError(f"spec.autotune.bounds.{knob}: min {lo} > max {hi}; swap them")
        bounds[knob] = (int(lo), int(hi))
    budget = raw.get("memoryBudgetPerGpu")
    return AutotuneConfig(
        mode=mode,
        bounds=bounds,
        memory_budget_bytes=None if budget is None else _quantity_bytes(budget, "spec.autotune.memoryBudgetPerGpu"),
        evaluation_interval_s=float(_number(raw, "evaluationIntervalSeconds", 300, minimum=1, integer=True)),
        cooldown_s=float(_number(raw, "cooldownSeconds", 3600, minimum=0, integer=True)),
        max_restarts_per_day=int(_number(raw, "maxRestartsPerDay", 4, minimum=0, integer=True)),
        min_gain=float(_number(raw, "minGain", 0.02, minimum=0)),
        rollback_tolerance=float(_number(raw, "rollbackTolerance", 0.02, minimum=0)),
        observe_s=float(_number(raw, "observeSeconds", 600, minimum=0, integer=True)),
    )


# --- knobs -------------------------------------------------------------------------------------


def knobs(d: dict | None) -> dict[str, int] | None:
    """The three knobs of a dict with CRD names (extra keys dropped); None if any is missing."""
    if not d or any(d.get(k) is None for k in KNOBS):
        return None
    return {k: int(d[k]) for k in KNOBS}


def knobs_from_tuner(rec: dict) -> dict[str, int]:
    """Tuner recommendation (snake_case keys) -> CRD knob names."""
    return {
        "windowSize": int(rec["window_size"]),
        "stepInterval": int(rec["step_interval"]),
        "numRedundantExperts": int(rec["num_redundant_experts"]),
    }


def fmt_knobs(k: dict | None) -> str:
    if not k:
        return "-"
    return f"window {k['windowSize']}, interval {k['stepInterval']}, redundant {k['numRedundantExperts']}"


# --- gates -------------------------------------------------------------------------------------


def recent_restarts(state: dict, now: float) -> list[str]:
    """Restart times (RFC 3339) recorded in ``status.autotune.restarts`` within the last 24 h."""
    out = []
    for s in state.get("restarts") or []:
        t = parse_iso(s)
        if t is not None and now - t < DAY_SECONDS:
            out.append(s)
    return out


def change_blocker(cfg: AutotuneConfig, state: dict, now: float, *, workload_blocker: str | None) -> str | None:
    """Why a change may not start now, or None when it may.

    Args:
        cfg: the resource's autotune config.
        state: ``status.autotune`` (may be empty).
        now: POSIX seconds.
        workload_blocker: set by the caller when the pods are not all ready or are rolling
            (e.g. a user's edit is still rolling out); None when the workload is settled.
    """
    if state.get("rollout"):
        return f"a {state['rollout'].get('kind', 'change')} rollout is in progress"
    if workload_blocker:
        return workload_blocker
    last = parse_iso(state.get("lastChangeTime"))
    if last is not None and now - last < cfg.cooldown_s:
        left = cfg.cooldown_s - (now - last)
        return f"cooldown: last change {now - last:.0f}s ago, {left:.0f}s of cooldownSeconds={cfg.cooldown_s:.0f} left"
    n = len(recent_restarts(state, now))
    if n >= cfg.max_restarts_per_day:
        return f"restart budget spent: {n} restarts in the last 24h (maxRestartsPerDay={cfg.max_restarts_per_day})"
    return None


def due(cfg: AutotuneConfig, state: dict, now: float) -> bool:
    """True when ``evaluationIntervalSeconds`` have passed since the last evaluation."""
    last = parse_iso(((state.get("lastEvaluation") or {}).get("time")))
    return last is None or now - last >= cfg.evaluation_interval_s - 1e-6


# --- one evaluation ----------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one evaluation concludes. The caller writes ``autotune`` to ``status.autotune``
    (as a merge patch against the old one), applies the conditions and emits the events."""

    decision: str
    reason: str
    autotune: dict
    conditions: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # type -> (status, reason, message)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (Normal|Warning, reason, message)
    predicted_gain: float | None = None
    started_rollout: bool = False


def evaluate(
    cfg: AutotuneConfig,
    state: dict,
    *,
    now: float,
    generation: int,
    current: dict[str, int],
    current_override: dict | None,
    data_window: dict | None,
    load_error: tuple[str, str] | None = None,
    tune: dict | None = None,
    tune_error: str | None = None,
    workload_blocker: str | None = None,
    baseline: dict | None = None,
    from_hash: str | None = None,
    spec_eplb: dict | None = None,
) -> Outcome:
    """Decide what to do with one tuning result.

    Args:
        cfg: ``spec.autotune``.
        state: the current ``status.autotune`` (not modified).
        now: POSIX seconds.
        generation: ``metadata.generation`` (the override is stamped with it).
        current: the knobs that run now (``effective_eplb``).
        current_override: ``status.autotune.override`` now (restored on rollback).
        data_window: what load was read: ``{start, end, buckets, steps, source}``.
        load_error: ``(reason, message)`` when the load could not be used.
        tune: ``TuneResult.to_dict()`` when the tuner ran.
        tune_error: the tuner's error message when it failed.
        workload_blocker: why the workload cannot take a change now (see ``change_blocker``).
        baseline: measured performance before a change, ``{"balancedness": float, ...}``.
        from_hash: the pod-template config hash running now (rollout progress compares against it).
        spec_eplb: ``spec.eplb`` now as :func:`moe_eplb.api.spec.spec_eplb_record` gives it; recorded
            in the override and the rollout (``specEplb``) so the override runs until the user edits
            ``spec.eplb`` (None: only ``specGeneration`` is recorded, the old generation rule).

    Returns:
        An :class:`Outcome`; its ``autotune`` is the complete new ``status.autotune``.
    """
    new = {k: v for k, v in state.items()}
    now_s = iso(now)
    ev: dict[str, Any] = {"time": now_s, "dataWindow": data_window, "current": dict(current)}
    out = Outcome(decision=KEEP, reason="", autotune=new)

    if load_error is not None:
        reason, message = load_error
        out.decision, out.reason = NODATA, f"{reason}: {message}"
        out.conditions["MetricsAvailable"] = ("False", reason, message)
        out.conditions["Tuned"] = ("False", "NoData", "no change: the load could not be read (see MetricsAvailable)")
    elif tune_error is not None or tune is None:
        msg = tune_error or "the tuner returned nothing"
        out.decision, out.reason = ERROR, f"tuner failed: {msg}"
        out.conditions["MetricsAvailable"] = ("True", "LoadRead", _window_text(data_window))
        out.conditions["Tuned"] = ("False", "TunerError", f"no change: {msg}")
        out.events.append(("Warning", "TunerError", msg))
    else:
        out.conditions["MetricsAvailable"] = ("True", "LoadRead", _window_text(data_window))
        rec = tune.get("recommendation") or {}
        target = knobs_from_tuner(rec)
        gain = _gain(rec)
        out.predicted_gain = gain
        ev["recommended"] = target
        ev["predictedGain"] = gain
        ev["gainBreakdown"] = _breakdown(rec)
        ev["tunerDecision"] = rec.get("decision")
        ev["tunerReason"] = rec.get("reason")
        new["recommendation"] = {**target, "predictedGain": gain, "time": now_s}
        wants_change = target != current and (gain is None or gain >= cfg.min_gain) and _tuner_says_change(rec)
        if not wants_change:
            out.decision = KEEP
            why = rec.get("reason") or (
                "the current settings are the best found" if target == current
                else f"predicted gain {_pct(gain)} is below minGain {_pct(cfg.min_gain)}"
            )
            out.reason = why
            out.conditions["Tuned"] = ("True", "Kept", f"keeping {fmt_knobs(current)}: {why}")
        elif cfg.mode == "Recommend":
            out.decision = RECOMMEND
            out.reason = f"{fmt_knobs(target)} predicted {_pct(gain)} better; mode Recommend, not applied"
            out.conditions["Tuned"] = ("True", "Recommended", out.reason)
            out.events.append(("Normal", "Recommended", out.reason))
        else:
            blocker = change_blocker(cfg, state, now, workload_blocker=workload_blocker)
            if blocker:
                out.decision = DEFER
                out.reason = f"{fmt_knobs(target)} predicted {_pct(gain)} better, deferred: {blocker}"
                out.conditions["Tuned"] = ("True", "Deferred", out.reason)
            else:
                out.decision = APPLY
                out.reason = f"applying {fmt_knobs(target)} (was {fmt_knobs(current)}): predicted {_pct(gain)} better"
                out.conditions["Tuned"] = ("True", "Applying", out.reason)
                out.events.append(("Normal", "ApplyingTunedSettings", out.reason))
                out.started_rollout = True
                new["override"] = {**target, "specGeneration": int(generation)}
                if spec_eplb is not None:
                    new["override"]["specEplb"] = dict(spec_eplb)
                new["rollout"] = {
                    "kind": "apply",
                    "phase": "Rolling",
                    "startedAt": now_s,
                    "from": dict(current),
                    "to": dict(target),
                    "previousOverride": current_override,
                    "specGeneration": int(generation),
                    **({"specEplb": dict(spec_eplb)} if spec_eplb is not None else {}),
                    "fromHash": from_hash,
                    "baseline": baseline,
                    "predictedGain": gain,
                }
                new["lastChangeTime"] = now_s
                new["restarts"] = recent_restarts(state, now) + [now_s]
    ev["decision"] = out.decision
    ev["reason"] = out.reason
    new["lastEvaluation"] = ev
    return out


def _tuner_says_change(rec: dict) -> bool:
    d = str(rec.get("decision") or "").lower()
    return d not in ("keep", "stay", "no-change", "nochange", "hold")


def _gain(rec: dict) -> float | None:
    for key in ("gain_vs_current", "predicted_gain", "gain", "predicted_relative_gain"):
        v = rec.get(key)
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, dict):
            for k in ("total", "relative", "value", "gain"):
                if isinstance(v.get(k), (int, float)):
                    return float(v[k])
    return None


def _breakdown(rec: dict) -> dict | None:
    for key in ("breakdown", "gain_breakdown", "predicted_gain_breakdown"):
        v = rec.get(key)
        if isinstance(v, dict):
            return {str(k): (round(float(x), 6) if isinstance(x, (int, float)) else x) for k, x in v.items()}
    g = rec.get("predicted_gain")
    if isinstance(g, dict):
        return {str(k): (round(float(x), 6) if isinstance(x, (int, float)) else x) for k, x in g.items()}
    return None


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100.0 * x:+.1f}%"


def _window_text(w: dict | None) -> str:
    if not w:
        return "load read"
    return (f"{w.get('buckets', '?')} buckets, {w.get('steps', '?')} engine steps "
            f"from {w.get('source', '?')} ({w.get('start', '?')} .. {w.get('end', '?')})")


# --- status helpers ----------------------------------------------------------------------------


def set_conditions(
    conditions: list[dict] | None,
    updates: dict[str, tuple[str, str, str]],
    *,
    now: float,
    generation: int | None,
) -> list[dict]:
    """Apply ``{type: (status, reason, message)}`` to a conditions list (new list returned).

    ``lastTransitionTime`` changes only when a condition's status changes; other types are kept.
    """
    out = [dict(c) for c in (conditions or [])]
    by_type = {c.get("type"): c for c in out}
    for ctype, (status, reason, message) in updates.items():
        c = by_type.get(ctype)
        if c is None:
            c = {"type": ctype}
            out.append(c)
            by_type[ctype] = c
        if c.get("status") != status:
            c["lastTransitionTime"] = iso(now).split(".")[0] + "Z"
        c.update(status=status, reason=reason, message=message[:1000])
        if generation is not None:
            c["observedGeneration"] = int(generation)
    return out


def append_history(state: dict, entry: dict) -> list[dict]:
    """``status.autotune.history`` with ``entry`` appended, the oldest dropped past HISTORY_LIMIT."""
    hist = list(state.get("history") or []) + [entry]
    return hist[-HISTORY_LIMIT:]


def merge_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new`` (None deletes a key)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict = {}
    for k in old:
        if k not in new:
            patch[k] = None
    for k, v in new.items():
        if k not in old:
            patch[k] = v
        elif old[k] != v:
            if isinstance(old[k], dict) and isinstance(v, dict):
                patch[k] = merge_patch(old[k], v)
            else:
                patch[k] = v
    return patch
