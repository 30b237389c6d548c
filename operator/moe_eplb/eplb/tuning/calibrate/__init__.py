"""Fit the cost model (:mod:`moe_eplb.eplb.replay.costmodel`) to a deployment's own telemetry.

A trace with telemetry (:class:`~moe_eplb.eplb.workload.trace.Telemetry`: step times, the load each EP rank
served, KV-cache usage, preemptions, waiting requests, rearrangement durations, the running EPLB
settings) tells what the constants of the cost model only assume. :func:`calibrate` measures:

``moe_time_share`` f and ``seconds_per_step`` s0 -- step time against the imbalance served.
    With ``n_b`` steps, ``tok_b`` routed tokens per step (load summed over experts, mean over
    layers, divided by steps) and the served imbalance ``x_b = sum_l max_rank / sum_l mean_rank``
    of ``rank_load`` in bucket b, the model is

        step_b = (c0 + c1 * tok_b / tok_mean) * ((1 - f) + f * x_b) + d * k_b / n_b   [+ noise]

    ``c0 + c1 * tok / tok_mean`` is the balanced step time (affine in the batch: a fixed part per
    step and a part per token), ``k_b`` the rearrangements observed in the bucket and ``d`` the
    seconds each one costs. In sync mode the measured durations are subtracted from the bucket's
    time first (``step_b - stall_b / n_b``) and ``d`` is not fitted; in async mode ``d`` is fitted
    (the durations say how long copies ran, not what they cost). Residuals are relative (noise is
    taken as proportional to step time) and the fit is robust (``scipy.optimize.least_squares``
    with the soft-L1 loss scaled to the residuals' MAD, so a few outlier buckets -- a GC pause, a
    burst of long prefills -- do not pull it). Uncertainty: the Gauss-Newton covariance of the
    inlier buckets (|residual| <= 3 robust sigma) times the robust residual variance.
    ``seconds_per_step`` is the balanced step time at the step-weighted mean batch.
    Refused (the default is kept, and the note says why) with fewer than :data:`MIN_FIT_BUCKETS`
    usable buckets, when the served imbalance spans less than :data:`MIN_IMBALANCE_SPREAD`
    (5th to 95th percentile), or when the fitted share's uncertainty exceeds
    :data:`MAX_SHARE_UNCERTAINTY`.

``sync_stall_s`` -- the median measured duration (sync mode), uncertainty the standard error of
    the median (1.2533 x 1.4826 x MAD / sqrt(n)); at least :data:`MIN_REARRANGEMENTS` needed.

``async_s_per_moved_byte`` -- async mode: ``d`` above divided by the bytes one GPU receives per
    rearrangement, from a replay of the recorded configuration over the trace
    (:class:`~moe_eplb.eplb.replay.simulator.Replay`; needs the expert size).

``kv_throughput_elasticity`` -- the share of buckets in which the KV cache is the bottleneck,
    times :data:`FULL_KV_ELASTICITY` (1: losing x of the cache loses x of the throughput, batch
    size is capped by the cache). A bucket is KV-bound when its mean usage is at least
    :data:`KV_FULL_USAGE` and requests were preempted or waiting (usage alone when neither series
    was recorded). A cache that is not full costs nothing to shrink a little: elasticity 0.
    Uncertainty: the binomial standard error, at least ``1 / n`` in variance. Buckets without a
    usage sample (no engine ran) are left out.

``kv_cache_bytes_per_gpu`` -- the recorded value, plus the bytes the running redundancy takes
    (the cost model's parameter is the cache without redundant experts).

Every parameter carries ``source`` ``measured`` or ``default`` (the given cost model's value) and
an uncertainty (None for defaults). :meth:`Calibration.apply` returns the cost model with the
measured values. Pure: arrays in, numbers out (the async replay runs the policy in-process).
Assumptions and limits: docs/tuner.md ("Calibration").

In parts (each imports only the ones listed before it):

- ``record``: ``Calibration``, ``Parameter``, ``MemoryFit``, the thresholds;
- ``step_time``: step time against served imbalance;
- ``memory``: the memory model and the KV cache's pressure;
- ``fit``: ``calibrate`` itself: every parameter, the rearrangement cost, ``with_learned``.
"""

from moe_eplb.eplb.tuning.calibrate.fit import calibrate, fit_sync_stall, with_learned
from moe_eplb.eplb.tuning.calibrate.memory import kv_pressure
from moe_eplb.eplb.tuning.calibrate.record import DEFAULT, MEASURED, PARAMETERS, Calibration, CalibrationError, Parameter
from moe_eplb.eplb.tuning.calibrate.step_time import StepFit, fit_step_model

__all__ = ["MEASURED", "DEFAULT", "PARAMETERS", "CalibrationError", "Parameter", "Calibration", "StepFit", "fit_step_model",
           "fit_sync_stall", "kv_pressure", "calibrate", "with_learned"]
