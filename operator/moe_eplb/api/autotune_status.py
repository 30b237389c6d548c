"""``status.autotune`` as typed records: what the tuning loop remembers between evaluations.

Everything a later evaluation needs (the override that runs, the rollout in progress, the restart
times, the history) lives in the resource's status, so an operator restart resumes from the
resource alone. :func:`parse_autotune_status` reads it (tolerant: a malformed record is dropped and
noted, never applied) and :func:`autotune_status_to_crd` writes it, both through
:mod:`moe_eplb.api.convert`. Times are POSIX seconds inside, RFC 3339 (UTC, microseconds) in the
status.

Rollout kinds and phases::

    kind: apply | rollback         phase: Rolling | Observing | RollingBack

Experiment phases (``status.autotune.experiment``)::

    Baseline | Starting | Running | Promoting | Restoring      verdict: promoted | discarded
    design: cross-pod | interleaved       outcome: wins | loses | undecided | guard | ended
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moe_eplb.api.convert import ConvertError, camel, read_field, to_crd
from moe_eplb.api.knobs import Knobs, KnobsError

ROLLING, OBSERVING, ROLLING_BACK = "Rolling", "Observing", "RollingBack"
HISTORY_LIMIT = 20


def iso(t: float) -> str:
    """POSIX seconds -> RFC 3339 UTC with microseconds (``2026-12-02T16:00:00.123456Z``)."""
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_iso(s: str | None) -> float | None:
    """RFC 3339 (with or without fraction, ``Z`` or offset) -> POSIX seconds; None stays None."""
    if not s:
        return None
    return _dt.datetime.fromisoformat(s.strip().replace("Z", "+00:00")).timestamp()


def read_time(value: Any, path: str) -> float:
    """A status time (RFC 3339) -> POSIX seconds; :class:`ConvertError` naming ``path`` otherwise."""
    if not isinstance(value, str):
        raise ConvertError(f"{path}: expected an RFC 3339 time, got {value!r}")
    try:
        t = parse_iso(value)
    except ValueError:
        raise ConvertError(f"{path}: {value!r} is not an RFC 3339 time") from None
    assert t is not None
    return t


def time_field(**kw: Any) -> Any:
    """A dataclass field holding POSIX seconds, stored in the CRD as RFC 3339 (:func:`read_time`, :func:`iso`)."""
    return field(metadata={"read": read_time, "write": iso, **kw.pop("metadata", {})}, **kw)


def _read_times(value: Any, path: str) -> tuple[float, ...]:
    if not isinstance(value, list):
        raise ConvertError(f"{path}: expected a list of times")
    return tuple(read_time(v, f"{path}[{i}]") for i, v in enumerate(value))


@dataclass(frozen=True)
class Measurement:
    """Measured performance of the running pods over a window (``baseline``/``measured``)."""

    balancedness: float | None = None
    tokens_per_second: float | None = None
    pods: int | None = None
    source: str | None = None
    #: the objective across time (one replica): the change's gain normalised by the offered load,
    #: with its interval (:func:`moe_eplb.eplb.tuning.experiment.before_after_estimate`) and the
    #: interval's residual degrees of freedom (buckets less the fit's parameters)
    objective: str | None = None
    estimate: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    dof: int | None = None


@dataclass(frozen=True)
class DataWindow:
    """What load one evaluation read: its span, buckets, engine steps and source."""

    start: float | None = time_field(default=None)
    end: float | None = time_field(default=None)
    buckets: int | None = None
    steps: int | None = None
    source: str | None = None


@dataclass(frozen=True)
class Override:
    """``status.autotune.override``: the tuner's applied settings and the ``spec.eplb`` they were
    made for. A missing knob keeps the spec's value (:meth:`resolve`)."""

    window_size: int | None = None
    step_interval: int | None = None
    num_redundant_experts: int | None = None
    spec_generation: int | None = None
    spec_eplb: Knobs | None = None
    #: False: the tuner turned EPLB off (``spec.autotune.allowDisable``); it runs off while that field
    #: stays true and ``spec.eplb`` equals ``specEplb`` (None: EPLB as the spec says, i.e. on)
    enabled: bool | None = None

    @classmethod
    def of(cls, knobs: Knobs, *, spec_generation: int | None, spec_eplb: Knobs | None) -> Override:
        return cls(knobs.window_size, knobs.step_interval, knobs.num_redundant_experts, spec_generation, spec_eplb)

    @classmethod
    def disabled(cls, *, spec_generation: int | None, spec_eplb: Knobs | None) -> Override:
        """The tuner's "EPLB off" (the knobs stay the spec's: they do not run)."""
        return cls(spec_generation=spec_generation, spec_eplb=spec_eplb, enabled=False)

    def resolve(self, base: Knobs) -> Knobs:
        """The knobs that run: this override's values, the spec's where it has none."""
        return Knobs(base.window_size if self.window_size is None else self.window_size,
                     base.step_interval if self.step_interval is None else self.step_interval,
                     base.num_redundant_experts if self.num_redundant_experts is None else self.num_redundant_experts)


@dataclass(frozen=True)
class Rollout:
    """``status.autotune.rollout``: a tuner change (or its rollback) in progress."""

    kind: str
    phase: str
    started_at: float | None = time_field(default=None)
    ready_at: float | None = time_field(default=None)
    judged_at: float | None = time_field(default=None)
    rollback_started_at: float | None = time_field(default=None)
    from_knobs: Knobs | None = field(default=None, metadata={"key": "from"})
    to_knobs: Knobs | None = field(default=None, metadata={"key": "to"})
    previous_override: Override | None = None
    spec_generation: int | None = None
    spec_eplb: Knobs | None = None
    from_hash: str | None = None
    to_hash: str | None = None
    baseline: Measurement | None = None
    measured: Measurement | None = None
    predicted_gain: float | None = None
    reason: str | None = None
    degraded: bool | None = None
    #: spec.replicas when the rollout started: while it restarts pods, the rendered autoscaler
    #: keeps at least this many replicas (render/autoscaler.rollout_min_replicas)
    replicas: int | None = None
    #: the objective's buckets before the change (:func:`moe_eplb.eplb.tuning.experiment.buckets_record`)
    objective_before: dict | None = field(default=None, metadata={"raw": True})
    #: False: the change turns EPLB off (``to`` then holds the spec's knobs, which do not run)
    to_enabled: bool | None = None


@dataclass(frozen=True)
class HistoryEntry:
    """One finished rollout (kept, rolled back, superseded, ...) in ``status.autotune.history``."""

    time: float = time_field()
    action: str = ""
    from_knobs: Knobs | None = field(default=None, metadata={"key": "from"})
    to_knobs: Knobs | None = field(default=None, metadata={"key": "to"})
    reason: str | None = None
    predicted_gain: float | None = None
    baseline: Measurement | None = None
    measured: Measurement | None = None
    started_at: float | None = time_field(default=None)
    to_enabled: bool | None = None  # False: the change turned EPLB off


@dataclass(frozen=True)
class CalibratedParameter:
    """One cost-model parameter the evaluation used: its value, one standard error (None for a
    default) and its source (``measured`` from the deployment's telemetry, or ``default``)."""

    value: float
    uncertainty: float | None = None
    source: str = "default"


@dataclass(frozen=True)
class CalibrationRecord:
    """``status.autotune.lastEvaluation.calibration``: the cost model the tuner ran with, by
    parameter name (the cost model's own names: ``moe_time_share``, ``seconds_per_step``,
    ``sync_stall_s``, ``async_s_per_moved_byte``, ``kv_throughput_elasticity``,
    ``kv_cache_bytes_per_gpu``), the measured ones and the recorded rearrangement mode."""

    parameters: dict[str, CalibratedParameter] = field(default_factory=dict)
    measured: tuple[str, ...] = ()
    use_async: bool | None = None


@dataclass(frozen=True)
class ReplicaCost:
    """One candidate's redundancy priced in replicas (``lastEvaluation.replicaCosts[]``)."""

    window_size: int
    step_interval: int
    num_redundant_experts: int
    kv_cache_gib_per_gpu: float | None = None
    replicas: int | None = None  # None: the candidate leaves no KV cache


@dataclass(frozen=True)
class Evaluation:
    """``status.autotune.lastEvaluation``: what the last evaluation saw and decided."""

    time: float = time_field()
    current: Knobs | None = None
    data_window: DataWindow | None = None
    recommended: Knobs | None = None
    predicted_gain: float | None = None
    gain_breakdown: dict | None = field(default=None, metadata={"raw": True})
    tuner_decision: str | None = None
    tuner_reason: str | None = None
    calibration: CalibrationRecord | None = None
    decision: str | None = None
    reason: str | None = None
    evaluated_by: str | None = None
    tuner_cpu_seconds: float | None = None
    #: per candidate (best first), the replicas its redundancy needs at today's traffic and the
    #: autoscaler's target (spec.autoscaling on and the KV cache measured; see eplb/replay/capacity.py)
    replica_costs: tuple[ReplicaCost, ...] = field(default=(), metadata={"omit_empty": True})
    #: is EPLB worth it (the tuner's advice: mode, EPLB off against on, the overlap EPLB costs, what
    #: would change the answer; camelCase keys), see docs/autotune.md
    eplb_advice: dict | None = field(default=None, metadata={"raw": True})
    #: per-replica loads: their divergence and, above the threshold, each replica's own pick
    replicas: dict | None = field(default=None, metadata={"raw": True})
    #: how an Apply (or Experiment) changes the engines: ``live`` (window and interval on the running
    #: engines, no restart) or ``restart`` (a rollout, or the trial's pods); None for other decisions
    apply_mode: str | None = None


@dataclass(frozen=True)
class Recommendation:
    """``status.autotune.recommendation``: the tuner's latest pick (knobs flat, as the CRD has it)."""

    window_size: int
    step_interval: int
    num_redundant_experts: int
    predicted_gain: float | None = None
    time: float | None = time_field(default=None)
    enabled: bool | None = None  # False: the tuner recommends EPLB off (the knobs: the best EPLB-on setting)

    @property
    def knobs(self) -> Knobs:
        return Knobs(self.window_size, self.step_interval, self.num_redundant_experts)


@dataclass(frozen=True)
class Degraded:
    """``status.autotune.degraded``: a tuner change crash-looped (keeps ``Degraded`` true)."""

    time: float = time_field()
    reason: str = ""
    message: str = ""


#: Most learned ranges kept (one per parameter in practice; the CRD's maxItems).
LEARNED_LIMIT = 32


@dataclass(frozen=True)
class LearnedParameter:
    """One ``status.autotune.learned[]`` entry: ``parameter``'s range narrowed by an experiment from
    ``[prior_low, prior_high]`` to ``[low, high]``; ``source`` names the experiment."""

    parameter: str
    low: float
    high: float
    prior_low: float | None = None
    prior_high: float | None = None
    source: str | None = None


#: experiment phases: the pods' own differences are measured on the running settings (the
#: pre-period, cross-pod only); the trial's pods start; both arms serve and are compared; the verdict
#: is being carried out (promoted: the control replicas roll to the trial's settings; discarded: the
#: trial replica returns to the running settings)
BASELINE, STARTING, RUNNING, PROMOTING, RESTORING = "Baseline", "Starting", "Running", "Promoting", "Restoring"
EXPERIMENT_PHASES = (BASELINE, STARTING, RUNNING, PROMOTING, RESTORING)
EXPERIMENTS_LIMIT = 10
#: experiment designs: the trial on restarted replicas beside the others (redundancy, or where
#: settings cannot change live); the arms interleaved in time on the same replicas (live settings)
CROSS_POD, INTERLEAVED = "cross-pod", "interleaved"
#: how a verdict was reached: the interval cleared the promotion threshold; it fell below 0; neither
#: by maxSeconds (the running settings stay); the TTFT guard; the experiment was ended early
OUTCOMES = ("wins", "loses", "undecided", "guard", "ended")


@dataclass(frozen=True)
class Arm:
    """One arm of an experiment: ``trial`` or ``control``, its settings and its replicas."""

    arm: str
    knobs: Knobs
    replicas: int


@dataclass(frozen=True)
class Experiment:
    """``status.autotune.experiment``: a change tried on one replica (group) while the others keep
    the running settings, on the same traffic (see :mod:`moe_eplb.controller.experiment`).

    ``design``: ``cross-pod`` (the trial restarts one replica) or ``interleaved`` (the arms take
    turns on the same replicas, settings applied live). ``samples``: the per-bucket paired
    differences that count so far (log ratio of the trial's objective over the control's; cross-pod:
    after the warm-up; interleaved: the current block's, after its discarded start) and
    ``sample_objectives`` which objective each used, ``covariates`` its log batch ratio;
    ``baseline``: cross-pod, the pre-period's per-bucket differences of each engine pod from the
    others on the same settings, by the node it runs on (``{node: {d: [...], x: [...], k: "sst..", s, t, b}}``:
    differences, log batch ratios, objective kinds ``s`` step time / ``t`` throughput, and the others'
    step seconds, tokens per step and served balancedness, as ``controlLevels`` holds them after);
    ``trialNode``: where the trial's engine runs); ``looks``: the information fractions of
    the looks taken (the sequential rule's state); ``estimate``/``ci_low``/``ci_high``: the relative
    gain and the last look's interval (the boundaries the rule compares); ``verdict``: promoted or
    discarded once decided, with ``outcome`` and ``reason``. Interleaved: ``schedule`` (block and
    discard seconds, the two replica groups, the planned block pairs), ``block`` (the block in force,
    -1 before the first), ``blockStartedAt`` and ``blockValues`` (each finished block's value)."""

    phase: str
    trial: Arm
    control: Arm
    started_at: float = time_field()
    ready_at: float | None = time_field(default=None)
    ended_at: float | None = time_field(default=None)
    elapsed_seconds: float | None = None
    restart_charge: float = 0.0
    predicted_gain: float | None = None
    explore: str | None = None  # why it runs although the point estimate alone would not switch
    objective: str | None = None
    buckets: int | None = None
    estimate: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    confidence: float | None = None
    verdict: str | None = None
    reason: str | None = None
    samples: tuple[float, ...] = field(default=(), metadata={"omit_empty": True})
    sample_objectives: tuple[str, ...] = field(default=(), metadata={"omit_empty": True})
    #: per sample, the log ratio of the trial's batch (tokens per step) over the control's
    covariates: tuple[float, ...] = field(default=(), metadata={"omit_empty": True})
    ttft_seconds: tuple[float, ...] = field(default=(), metadata={"omit_empty": True})  # (trial, control) sums
    #: cross-pod: the control arm's own buckets since the trial started (``{s: step seconds, t: tokens
    #: per step, b: served balancedness (0: unknown)}``), for the step-time model behind the batch
    #: adjustment (:func:`moe_eplb.eplb.tuning.judge.batch_elasticity`)
    control_levels: dict | None = field(default=None, metadata={"raw": True})
    previous_override: Override | None = None
    spec_eplb: Knobs | None = None
    spec_generation: int | None = None
    from_hash: str | None = None
    trial_hash: str | None = None
    #: the two arms as measured over the experiment (stored at its end; the learning step reads them)
    observations: dict | None = field(default=None, metadata={"raw": True})
    learned: tuple[dict, ...] = field(default=(), metadata={"raw": True})
    design: str = CROSS_POD
    outcome: str | None = None
    trial_started_at: float | None = time_field(default=None)
    warmup_seconds: float | None = None
    baseline: dict | None = field(default=None, metadata={"raw": True})
    trial_node: str | None = None
    looks: tuple[float, ...] = field(default=(), metadata={"omit_empty": True})
    schedule: dict | None = field(default=None, metadata={"raw": True})
    block: int | None = None
    block_started_at: float | None = time_field(default=None)
    block_values: tuple[float, ...] = field(default=(), metadata={"omit_empty": True})


#: live changes kept in ``status.autotune.liveChanges`` (the newest)
LIVE_CHANGES_LIMIT = 20


@dataclass(frozen=True)
class LiveSettings:
    """``status.autotune.live``: the window and interval applied live on top of the pod template's
    settings (:mod:`moe_eplb.controller.live`), in force while the template is the one they were
    applied on (``configHash``, the template's ``eplb.ai/eplb-config-hash``). The operator writes
    them into the pods' live-settings ConfigMap, so a restarted pod comes back with them."""

    window_size: int
    step_interval: int
    config_hash: str
    step: int | None = None  # the engine step they took effect (the first engine's; see steps)
    steps: dict | None = field(default=None, metadata={"raw": True})  # engine -> agreed step
    applied_at: float | None = time_field(default=None)

    def over(self, knobs: Knobs) -> Knobs:
        """``knobs`` (the template's) with this window and interval."""
        return Knobs(self.window_size, self.step_interval, knobs.num_redundant_experts)


@dataclass(frozen=True)
class LiveChange:
    """One ``status.autotune.liveChanges[]`` entry: a change of window and interval applied live,
    from which engine step, and why."""

    at: float = time_field()
    from_knobs: Knobs | None = field(default=None, metadata={"key": "from"})
    to_knobs: Knobs | None = field(default=None, metadata={"key": "to"})
    step: int | None = None
    steps: dict | None = field(default=None, metadata={"raw": True})
    reason: str | None = None


@dataclass(frozen=True)
class AutotuneStatus:
    """The whole ``status.autotune``. ``notes``: records that could not be read (dropped)."""

    override: Override | None = None
    rollout: Rollout | None = None
    last_evaluation: Evaluation | None = None
    recommendation: Recommendation | None = None
    history: tuple[HistoryEntry, ...] = field(default=(), metadata={"omit_empty": True})
    restarts: tuple[float, ...] = field(default=(), metadata={"read": _read_times, "write": lambda ts: [iso(t) for t in ts],
                                                              "omit_empty": True})
    last_change_time: float | None = time_field(default=None)
    degraded: Degraded | None = None
    #: ranges experiments narrowed, kept across decisions (one entry per parameter, the latest wins)
    learned: tuple[LearnedParameter, ...] = field(default=(), metadata={"omit_empty": True})
    experiment: Experiment | None = None
    #: the last finished experiments (verdict, estimate, interval), oldest first
    experiments: tuple[Experiment, ...] = field(default=(), metadata={"omit_empty": True})
    #: window and interval applied live over the template's (None: the template's run)
    live: LiveSettings | None = None
    #: the last live changes, oldest first
    live_changes: tuple[LiveChange, ...] = field(default=(), metadata={"omit_empty": True})
    notes: tuple[str, ...] = field(default=(), metadata={"skip": True}, compare=False)
    #: the mapping as stored (what a status patch is computed against)
    stored: Mapping[str, Any] = field(default_factory=dict, metadata={"skip": True}, compare=False, repr=False)

    def replace(self, **changes: Any) -> AutotuneStatus:
        return dataclasses.replace(self, **changes)

    def with_history(self, entry: HistoryEntry) -> AutotuneStatus:
        """This status with ``entry`` appended to the history (oldest dropped past HISTORY_LIMIT)."""
        return self.replace(history=(self.history + (entry,))[-HISTORY_LIMIT:])

    def with_learned(self, entries: tuple[LearnedParameter, ...] | list[LearnedParameter]) -> AutotuneStatus:
        """This status with ``entries`` kept: each replaces an earlier entry of the same parameter."""
        new = {e.parameter for e in entries}
        kept = tuple(e for e in self.learned if e.parameter not in new) + tuple(entries)
        return self.replace(learned=kept[-LEARNED_LIMIT:])

    def with_experiment_done(self, done: Experiment) -> AutotuneStatus:
        """This status without a running experiment and ``done`` appended to ``experiments``."""
        return self.replace(experiment=None, experiments=(self.experiments + (done,))[-EXPERIMENTS_LIMIT:])

    def with_live_change(self, change: LiveChange) -> AutotuneStatus:
        """This status with ``change`` appended to ``liveChanges`` (oldest dropped past the limit)."""
        return self.replace(live_changes=(self.live_changes + (change,))[-LIVE_CHANGES_LIMIT:])

    def recent_restarts(self, now: float, day: float = 86400.0) -> tuple[float, ...]:
        """Restart times within the last 24 h."""
        return tuple(t for t in self.restarts if now - t < day)


_RECORDS = ("override", "rollout", "last_evaluation", "recommendation", "history", "restarts",
            "last_change_time", "degraded", "learned", "experiment", "experiments", "live", "live_changes")


def parse_autotune_status(raw: Any) -> AutotuneStatus:
    """``status.autotune`` (as stored) -> :class:`AutotuneStatus`. Tolerant: each record is read on
    its own; one that cannot be read is left out and named in ``notes`` (a malformed override never
    applies; a malformed rollout is dropped)."""
    if not isinstance(raw, Mapping):
        return AutotuneStatus()
    kwargs: dict[str, Any] = {}
    notes = []
    for name in _RECORDS:
        key = camel(name)
        if raw.get(key) is None:
            continue
        try:
            kwargs[name] = read_field(AutotuneStatus, name, raw[key], f"status.autotune.{key}")
        except (ConvertError, KnobsError, TypeError) as exc:
            notes.append(str(exc) if str(exc).startswith("status.") else f"status.autotune.{key}: {exc}")
    return AutotuneStatus(**kwargs, notes=tuple(notes), stored=copy.deepcopy(dict(raw)))


def autotune_status_to_crd(status: AutotuneStatus) -> dict[str, Any]:
    """The ``status.autotune`` mapping of ``status``."""
    return to_crd(status)


def json_merge_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new`` (None deletes a key)."""
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return new
    patch: dict = {k: None for k in old if k not in new}
    for k, v in new.items():
        if k not in old:
            patch[k] = v
        elif old[k] != v:
            patch[k] = json_merge_patch(old[k], v) if isinstance(old[k], Mapping) and isinstance(v, Mapping) else v
    return patch


def autotune_status_patch(old: AutotuneStatus, new: AutotuneStatus) -> dict[str, Any]:
    """The merge patch of ``status.autotune`` from what is stored (``old.stored``) to ``new``:
    records dropped by ``new`` (or unreadable in ``old``) are deleted."""
    return json_merge_patch(dict(old.stored), autotune_status_to_crd(new))
