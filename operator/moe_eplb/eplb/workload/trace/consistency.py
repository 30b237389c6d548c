"""Physical consistency of a trace's telemetry with its load (docs/traces.md, "Consistency
checks"): ``physical_checks`` returns the problems (errors) and the doubts (warnings).
"""

from __future__ import annotations

import numpy as np

from moe_eplb.eplb.workload.trace.loadtrace import LoadTrace

#: ``rank_load`` and ``load`` count the same (token, top-k slot) pairs: over the whole trace their
#: sums may differ by at most this factor (refused beyond), per bucket by this fraction (warned).
RANK_SUM_FACTOR = 2.0
RANK_SUM_TOLERANCE = 0.05
#: Time: one rearrangement, or one engine step, cannot last longer than the whole trace (refused);
#: a rearrangement longer than its bucket is warned (possible only for short buckets). A bucket's
#: summed busy time is not checked: ``bucket_steps`` and rearrangements add up over engines.


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def _rank_sums(load: np.ndarray, rank_load: np.ndarray) -> tuple[list[str], list[str]]:
    expert, rank = load.sum(axis=2), rank_load.sum(axis=2)  # [T, L]
    total_e, total_r = float(expert.sum()), float(rank.sum())
    if (total_e == 0) != (total_r == 0) or (total_e > 0 and not
                                             1 / RANK_SUM_FACTOR <= total_r / total_e <= RANK_SUM_FACTOR):
        return [f"rank_load: sums to {total_r:.6g} tokens but load to {total_e:.6g}; both count the same (token, "
                f"top-k slot) pairs, so they must agree (within a factor {RANK_SUM_FACTOR:g}): are they from the "
                "same pods and buckets?"], []
    with np.errstate(invalid="ignore", divide="ignore"):
        off = np.abs(rank - expert) > RANK_SUM_TOLERANCE * np.maximum(expert, 1.0)
    if off.any():
        t, l = np.argwhere(off)[0]
        return [], [f"rank_load: {int(off.sum())} of {off.size} (bucket, layer) sums differ from load's by more than "
                    f"{RANK_SUM_TOLERANCE:.0%} (first: bucket {t}, layer {l}: {rank[t, l]:.6g} vs {expert[t, l]:.6g})"]
    return [], []


def _durations(name: str, seconds: np.ndarray, buckets: np.ndarray, trace: LoadTrace,
               fix: str) -> tuple[list[str], list[str]]:
    """Refuse durations (each in bucket ``buckets[i]``) longer than the whole trace; warn those
    longer than one bucket."""
    bs = float(trace.bucket_seconds)
    span = bs * trace.num_buckets
    secs = np.nan_to_num(np.asarray(seconds, np.float64))
    if secs.size and secs.max() > span:
        i = int(np.argmax(secs))
        return [f"{name}: {secs[i]:.6g} s at bucket {int(buckets[i])}, longer than the whole trace ({trace.num_buckets} buckets "
                f"of {bs:g} s = {span:g} s); {fix}"], []
    over = secs > bs
    if over.any():
        return [], [f"{name}: {int(over.sum())} longer than one bucket ({bs:g} s; first: bucket {int(buckets[_first(over)])}, "
                    f"{secs[_first(over)]:.6g} s)"]
    return [], []


def physical_checks(trace: LoadTrace) -> tuple[list[str], list[str]]:
    """``(refusals, warnings)``: what in ``trace``'s telemetry cannot be physically true.

    * ``rank_load`` summed over ranks vs ``load`` summed over experts (the same tokens): refused
      beyond a factor :data:`RANK_SUM_FACTOR` over the whole trace, warned per (bucket, layer)
      beyond :data:`RANK_SUM_TOLERANCE`;
    * with ``bucket_seconds``: one engine step (``step_seconds``) or one rearrangement longer than
      the whole trace is refused; a rearrangement longer than its bucket is warned.

    Finite, non-negative counters are :meth:`Telemetry.check`'s job. Pure.
    """
    tel = trace.telemetry
    refusals: list[str] = []
    warnings: list[str] = []
    if tel is None:
        return refusals, warnings
    checks = []
    if tel.rank_load is not None:
        checks.append(_rank_sums(trace.load, tel.rank_load))
    if trace.bucket_seconds is not None and tel.step_seconds is not None:
        r, _ = _durations("step_seconds", tel.step_seconds, np.arange(trace.num_buckets), trace,
                          "it is the mean time of ONE engine step")
        checks.append((r, []))
    if trace.bucket_seconds is not None and tel.rearrangements:
        secs = np.array([e.seconds for e in tel.rearrangements])
        checks.append(_durations("rearrangements", secs, np.array([e.bucket for e in tel.rearrangements]), trace,
                                 "seconds are each rearrangement's own duration"))
    for r, w in checks:
        refusals += r
        warnings += w
    return refusals, warnings
