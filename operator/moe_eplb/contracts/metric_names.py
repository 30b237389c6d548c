"""Every Prometheus series and label moe-eplb exports (a contract: imports nothing).

The exporter plugin (inside vLLM pods), the load reader, the simulated engines, the operator, the
dashboards and the alerts all take their names from here; users' queries depend on them.
Label ``model_name`` carries vLLM's served model name, under the same label name vLLM's own
metrics use, so one dashboard variable filters both.
"""

PREFIX = "moe_eplb_"

# --- exported by the vLLM plugin (per pod, port k8s_names.EXPORTER_PORT) --------------------------
EXPERT_TOKENS = "moe_eplb_expert_tokens_total"  # counter {model_name, layer, expert}
RANK_TOKENS = "moe_eplb_rank_tokens_total"  # counter {model_name, layer, rank}
EXPERT_REPLICAS = "moe_eplb_expert_replicas"  # gauge {model_name, layer, expert}
REARRANGEMENTS = "moe_eplb_rearrangements_total"  # counter {model_name}
REARRANGEMENT_SECONDS = "moe_eplb_rearrangement_duration_seconds"  # histogram {model_name}
ENGINE_STEPS = "moe_eplb_engine_steps_total"  # counter {model_name}
#: vLLM's own rearrangement health signals (vLLM >= 0.34; absent where the engine has none):
#: async rearrangement cycles vLLM timed itself (its rank-0 log line "Async EPLB rearranged N/M
#: layers of ... in T s"), and async EPLB worker failures ("Async EPLB worker failed on at least one
#: rank", raised on every rank). 0 failures is exported from the first step on such an engine.
ASYNC_REARRANGEMENT_SECONDS = "moe_eplb_async_rearrangement_duration_seconds"  # histogram {model_name}
REBALANCE_FAILURES = "moe_eplb_rebalance_failures_total"  # counter {model_name}
STEP_SECONDS = "moe_eplb_step_duration_seconds"  # histogram {model_name, rank}: wall time of one engine step
STEP_TOKENS = "moe_eplb_step_tokens"  # histogram {model_name, rank}: tokens one engine step routed
KV_CACHE_BYTES = "moe_eplb_kv_cache_bytes"  # gauge {model_name, rank}: KV cache the rank allocated
BALANCEDNESS = "moe_eplb_balancedness"  # gauge {model_name, layer}
CONFIG_INFO = "moe_eplb_config_info"  # gauge = 1 {model_name, window_size, step_interval, num_redundant_experts, ep_size}
EXPORTER_START_TIME = "moe_eplb_exporter_start_time_seconds"  # gauge {model_name}: unix time the counters started at 0
EXPORTER_RANKS = "moe_eplb_exporter_ranks"  # gauge {model_name}: EP ranks whose counters this pod serves
#: the EPLB settings in force on each EP rank (live apply: moe_eplb.contracts.live_protocol)
SETTINGS_WINDOW_SIZE = "moe_eplb_settings_window_size"  # gauge {model_name, rank}: window in force, steps
SETTINGS_STEP_INTERVAL = "moe_eplb_settings_step_interval"  # gauge {model_name, rank}: interval in force, steps
SETTINGS_SINCE_STEP = "moe_eplb_settings_since_step"  # gauge {model_name, rank}: engine step they took effect
#: pods of a multi-node replica group whose expert counts this pod's EXPERT_TOKENS holds: the group's
#: leader exports the group's one L x E copy (itself + each worker it hears from); a worker exports 0
#: and neither EXPERT_TOKENS nor EXPERT_REPLICAS. Absent on a pod outside a group (it exports its own).
EXPORTER_GROUP_PODS = "moe_eplb_exporter_group_pods"  # gauge {model_name}

# Label names of the exporter's series.
LABEL_MODEL = "model_name"  # vLLM's served model name (vLLM's own label name)
LABEL_LAYER = "layer"  # MoE layer index 0..L-1 (vLLM's moe_layers order)
LABEL_EXPERT = "expert"  # logical expert index 0..E-1
LABEL_RANK = "rank"  # EP rank that processes the tokens (destination), 0..EP-1
CONFIG_INFO_LABELS = ("window_size", "step_interval", "num_redundant_experts", "ep_size", "use_async")
#: Label of CONFIG_INFO (the last of CONFIG_INFO_LABELS): the rearrangement mode, ``true`` (async)
#: or ``false`` (sync); empty when the exporter could not tell. The calibration reads it.
LABEL_USE_ASYNC = "use_async"

#: Bucket bounds (seconds) of STEP_SECONDS: 1 ms .. 10 s, about three per decade.
STEP_SECONDS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
#: Bucket bounds of STEP_TOKENS (tokens per engine step).
STEP_TOKENS_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
#: Bucket bounds (seconds) of REARRANGEMENT_SECONDS.
REARRANGEMENT_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# --- exported by the operator (its own /metrics) --------------------------------------------------
TUNER_EVALUATIONS = "moe_eplb_tuner_evaluations_total"  # counter {namespace, name, result}
TUNER_DECISIONS = "moe_eplb_tuner_decisions_total"  # counter {namespace, name, decision}
TUNER_PREDICTED_GAIN = "moe_eplb_tuner_predicted_gain_ratio"  # gauge {namespace, name}
TUNER_DURATION_SECONDS = "moe_eplb_tuner_duration_seconds"  # histogram {}
TUNER_LAST_SUCCESS = "moe_eplb_tuner_last_success_timestamp_seconds"  # gauge {namespace, name}
ROLLBACKS = "moe_eplb_rollbacks_total"  # counter {namespace, name, reason}
RECONCILES = "moe_eplb_reconciles_total"  # counter {result}
CALIBRATION_VALUE = "moe_eplb_calibration_value"  # gauge {namespace, name, parameter, source}
CALIBRATION_UNCERTAINTY = "moe_eplb_calibration_uncertainty"  # gauge {namespace, name, parameter}
#: Jensen-Shannon divergence (bits) between the replicas' expert loads over the last evaluation's
#: window (two or more replicas; moe_eplb.eplb.tuning.replicas.js_divergence); above the threshold
#: the loop tunes each replica on its own load
REPLICA_LOAD_DIVERGENCE = "moe_eplb_replica_load_divergence_bits"  # gauge {namespace, name}
#: replica groups of a MoEInference: ``state`` desired (spec.replicas, the autoscaler's choice when
#: spec.autoscaling is on) or ready (status.readyReplicas); set by the reconciler
REPLICAS = "moe_eplb_replicas"  # gauge {namespace, name, state}
#: spec.autoscaling of a MoEInference while an autoscaler runs: min and max replica groups, and
#: the target of its metric (``metric``: RequestsWaiting, KVCacheUsage, TTFT); absent without one
AUTOSCALER_MIN_REPLICAS = "moe_eplb_autoscaler_min_replicas"  # gauge {namespace, name}
AUTOSCALER_MAX_REPLICAS = "moe_eplb_autoscaler_max_replicas"  # gauge {namespace, name}
AUTOSCALER_TARGET = "moe_eplb_autoscaler_target"  # gauge {namespace, name, metric}
#: fault recovery (spec.faultTolerance, controller/recovery_loop.py): the phase of a MoEInference
#: (1 for the one it is in, 0 for the others: Healthy, Recovering, Degraded, Restoring, Failed), the
#: data-parallel ranks its groups run without, the rounds sent by instruction and result, their
#: durations (from the fault to the round's end), and the deadline of a round in flight (the engines'
#: recovery timeout; absent without one) that the stuck-recovery alert compares with time()
RECOVERY_PHASE = "moe_eplb_recovery_phase"  # gauge {namespace, name, phase}
RECOVERY_LOST_RANKS = "moe_eplb_recovery_lost_ranks"  # gauge {namespace, name}
RECOVERY_ROUNDS = "moe_eplb_recovery_rounds_total"  # counter {namespace, name, instruction, result}
RECOVERY_ROUND_SECONDS = "moe_eplb_recovery_round_duration_seconds"  # histogram {instruction, result}
RECOVERY_DEADLINE = "moe_eplb_recovery_deadline_timestamp_seconds"  # gauge {namespace, name, group}
#: Bucket bounds (seconds) of RECOVERY_ROUND_SECONDS: vLLM's recovery timeout is 120 s by default
RECOVERY_SECONDS_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0)
#: an elastic group (spec.parallelism.elastic): its data-parallel ranks now and the size it is driven
#: to, the phase of status.elastic (1 for the current one), how long the operation in progress has run
#: and the deadline after which the operator restarts the group, and the operations by direction
#: (grow, shrink) and result (completed, rolled_back, group_restarted) with their durations
ELASTIC_DATA_PARALLEL = "moe_eplb_elastic_data_parallel"  # gauge {namespace, name}
ELASTIC_TARGET_DATA_PARALLEL = "moe_eplb_elastic_target_data_parallel"  # gauge {namespace, name}
ELASTIC_PHASE = "moe_eplb_elastic_phase"  # gauge = 1 {namespace, name, phase}
ELASTIC_RESIZE_SECONDS = "moe_eplb_elastic_resize_seconds"  # gauge {namespace, name}: 0 without an operation
ELASTIC_RESIZE_DEADLINE = "moe_eplb_elastic_resize_deadline_seconds"  # gauge {namespace, name}
ELASTIC_RESIZES = "moe_eplb_elastic_resizes_total"  # counter {namespace, name, direction, result}
ELASTIC_RESIZE_DURATION = "moe_eplb_elastic_resize_duration_seconds"  # histogram {namespace, name, direction, result}

#: Label that the PodMonitor copies from the pod label ``eplb.ai/name`` onto every series.
MOEINFERENCE_LABEL = "moeinference"
#: Labels the PodMonitor copies from the pods of a multi-node replica group (a LeaderWorkerSet
#: group): the group's index (pod label ``leaderworkerset.sigs.k8s.io/group-index``), the pod's
#: index in its group (``.../worker-index``, 0 = leader) and the group's size in pods (pod annotation
#: ``leaderworkerset.sigs.k8s.io/size``). Series of single-node pods carry none of them.
#: Label that the PodMonitor copies from the pod label ``eplb.ai/arm`` (an experiment's trial pods
#: carry ``trial``; the other pods none: the control arm)
ARM_LABEL = "arm"
GROUP_LABEL = "replica_group"
GROUP_WORKER_LABEL = "group_worker"
GROUP_SIZE_LABEL = "group_size"


def adapter_metric_name(series: str, quantile: float | None = None) -> str:
    """The name prometheus-adapter serves a vLLM series under in the custom and external metrics APIs
    (the metric name of an HPA's Pods or External metric): vLLM's ``vllm:`` prefix becomes ``vllm_``
    (``vllm:num_requests_waiting`` -> ``vllm_num_requests_waiting``), as the adapter's rule renames
    it (:func:`moe_eplb_harness.real.metricsadapter.adapter_config`); a quantile of a histogram (TTFT) adds
    ``_p<percent>`` (0.9 -> ``..._p90``, 0.995 -> ``..._p99_5``)."""
    name = series.replace(":", "_")
    if quantile is not None:
        name += "_p" + f"{quantile * 100:g}".replace(".", "_")
    return name
