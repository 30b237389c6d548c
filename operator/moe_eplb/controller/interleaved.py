"""The interleaved experiment's schedule: the arms take turns on the same replicas. Pure, no I/O.

Window and interval change live (the exporter plugin applies them at one engine step on every EP
rank: :mod:`moe_eplb.controller.live`), so an experiment of them needs no restart and no second
set of pods: the replicas are split into two groups (``A``: the 1st, 3rd, ... engine pod by name,
``B``: the others), and time into **blocks**; in even blocks group A runs the trial's settings and
B the control's, in odd blocks the reverse. Every tick pairs the two groups' buckets (same
traffic, as in the cross-pod design), and a block's value is its counted buckets' mean difference,
trial minus control. A pair of consecutive blocks sees each group once on each arm, so a replica's
own speed (its GPUs, the router's share it gets) enters the pair's two blocks with opposite signs
and cancels in their average (:func:`moe_eplb.eplb.tuning.judge.crossover`).

The block length follows the slower arm (:func:`plan`): after a switch the new settings' placement
takes one rearrangement of their own to arrive -- up to the longer interval, plus the longer window
where the windows differ (the load history must refill) -- so that part of each block is
**discarded**, and then at least one more interval of the slower arm is **counted**, so that each
arm's own rearrangements (their cost included) are part of what is measured. Both arms get blocks
of the same length, so a trend in time weighs on both alike.

The state machine (:func:`moe_eplb.controller.experiment.advance`) asks for the applies as
:class:`LiveRequest` values; the loop carries them out and reports back
(:func:`moe_eplb.controller.experiment.applied`): a block starts when every pod of it confirmed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moe_eplb.api.autotune_status import Experiment
from moe_eplb.api.knobs import Knobs
from moe_eplb.eplb.tuning import judge

__all__ = ["LiveRequest", "plan", "groups", "arms_now", "block_requests", "counted", "block_value",
           "MIN_MEASURE_TICKS", "MIN_BLOCK_BUCKETS"]

#: the counted part of a block spans at least this many ticks (besides one interval of the slower arm)
MIN_MEASURE_TICKS = 4
#: fewest comparable buckets a block needs to count (else it is run again)
MIN_BLOCK_BUCKETS = 2


@dataclass(frozen=True)
class LiveRequest:
    """Window and interval ``knobs`` to apply live on ``pods``; ``block``: the block it starts (None:
    the promotion or the return to the running settings); ``why``: for the log and the Event."""

    pods: tuple[str, ...]
    knobs: Knobs
    why: str
    block: int | None = None


def _ticks(seconds: float, tick_s: float) -> float:
    """``seconds`` rounded up to whole ticks."""
    return math.ceil(max(0.0, seconds) / tick_s - 1e-9) * tick_s


def plan(trial: Knobs, control: Knobs, *, pods: Sequence[str], steps_per_second: float, tick_s: float,
         max_s: float) -> dict | str:
    """The schedule of an interleaved experiment of ``trial`` against ``control`` on the engine pods
    ``pods`` (one per replica; a group's leader) whose engines make ``steps_per_second`` steps, the
    loop ticking every ``tick_s``: the status record (``blockSeconds``, ``discardSeconds``,
    ``tickSeconds``, ``pairs`` (the block pairs that fit in ``max_s``), ``groups``,
    ``stepsPerSecond``), or why the design does not fit (a string): a change of redundancy, one
    replica, an unknown step rate, or blocks so long that fewer than
    :data:`moe_eplb.eplb.tuning.judge.MIN_PAIRS` pairs fit in ``max_s``."""
    if trial.num_redundant_experts != control.num_redundant_experts:
        return "the number of redundant experts changes: the weights' layout needs a restart"
    names = sorted(set(pods))
    if len(names) < 2:
        return f"{len(names)} serving replica: the arms need two groups to swap"
    if not steps_per_second or steps_per_second <= 0 or not math.isfinite(steps_per_second):
        return "the engines' step rate is unknown (no engine steps in the load read)"
    slow = max(trial.step_interval, control.step_interval)
    refill = max(trial.window_size, control.window_size) if trial.window_size != control.window_size else 0
    discard_s = _ticks((slow + refill) / steps_per_second + tick_s, tick_s)
    measure_s = _ticks(max(slow / steps_per_second, MIN_MEASURE_TICKS * tick_s), tick_s)
    block_s = discard_s + measure_s
    pairs = int(max_s // (2 * block_s))
    if pairs < judge.MIN_PAIRS:
        return (f"blocks of {block_s:.0f}s (a rearrangement of the slower arm, interval {slow} steps at "
                f"{steps_per_second:.1f} steps/s, discarded and one counted) leave {pairs} block pairs in "
                f"maxSeconds {max_s:.0f}s; the interleaved design needs {judge.MIN_PAIRS}")
    return {"blockSeconds": round(block_s, 3), "discardSeconds": round(discard_s, 3), "tickSeconds": float(tick_s),
            "pairs": pairs, "stepsPerSecond": round(float(steps_per_second), 3),
            "groups": [names[0::2], names[1::2]]}


def groups(exp: Experiment) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The experiment's two replica groups (engine pod names)."""
    a, b = (exp.schedule or {}).get("groups") or ([], [])
    return tuple(a), tuple(b)


def arms_now(exp: Experiment, block: int | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(trial pods, control pods)`` in ``block`` (default: the block in force; before the first,
    every pod is on the control's settings)."""
    a, b = groups(exp)
    k = exp.block if block is None else block
    if k is None or k < 0:
        return (), a + b
    return (a, b) if k % 2 == 0 else (b, a)


def block_requests(exp: Experiment, block: int) -> tuple[LiveRequest, ...]:
    """The applies that start ``block``: the trial's settings on its trial group, the control's on
    the other (both sent: a pod that missed an earlier apply is set right)."""
    trial, control = arms_now(exp, block)
    side = "A" if block % 2 == 0 else "B"
    return (LiveRequest(trial, exp.trial.knobs, f"block {block}: trial on group {side}", block),
            LiveRequest(control, exp.control.knobs, f"block {block}: control on the other group", block))


def counted(exp: Experiment, now: float) -> bool:
    """Whether the bucket that ends at ``now`` counts: it starts after the block's discarded part."""
    sched = exp.schedule or {}
    if exp.block is None or exp.block < 0 or exp.block_started_at is None:
        return False
    return now - float(sched.get("tickSeconds", 0.0)) >= exp.block_started_at + float(sched.get("discardSeconds", 0.0)) - 1e-6


def block_value(samples: Sequence[float]) -> float | None:
    """A finished block's value: the mean of its counted differences, outliers clipped
    (:func:`moe_eplb.eplb.tuning.judge.clip_outliers`); None with fewer than
    :data:`MIN_BLOCK_BUCKETS`."""
    if len(samples) < MIN_BLOCK_BUCKETS:
        return None
    return float(np.mean(judge.clip_outliers(samples)))
