"""Metric names and label names shared by the exporter, the load reader, the simulated engine,
the operator, the dashboards and the alerts. Pure constants: importing this pulls nothing in.

Every name here is part of the public interface (dashboards and users' queries depend on it).
"""

PREFIX = "moe_eplb_"

# --- exported by the vLLM plugin (per pod, dedicated port) ---------------------------------------
EXPORTER_PORT = 9400
EXPORTER_PORT_NAME = "eplb-metrics"
EXPORTER_PATH = "/metrics"

EXPERT_TOKENS = "moe_eplb_expert_tokens_total"  # counter {model, layer, expert}
RANK_TOKENS = "moe_eplb_rank_tokens_total"  # counter {model, layer, rank}
EXPERT_REPLICAS = "moe_eplb_expert_replicas"  # gauge {model, layer, expert}
REARRANGEMENTS = "moe_eplb_rearrangements_total"  # counter {model}
REARRANGEMENT_SECONDS = "moe_eplb_rearrangement_duration_seconds"  # histogram {model}
ENGINE_STEPS = "moe_eplb_engine_steps_total"  # counter {model}
BALANCEDNESS = "moe_eplb_balancedness"  # gauge {model, layer}
CONFIG_INFO = "moe_eplb_config_info"  # gauge = 1 {model, window_size, step_interval, num_redundant_experts, ep_size}
EXPORTER_START_TIME = "moe_eplb_exporter_start_time_seconds"  # gauge {model}: unix time the counters started at 0
EXPORTER_RANKS = "moe_eplb_exporter_ranks"  # gauge {model}: EP ranks whose counters this pod serves

# Label names of the exporter's series.
LABEL_MODEL = "model"
LABEL_LAYER = "layer"  # MoE layer index 0..L-1 (vLLM's moe_layers order)
LABEL_EXPERT = "expert"  # logical expert index 0..E-1
LABEL_RANK = "rank"  # EP rank that processes the tokens (destination), 0..EP-1

# --- exported by the operator (its own /metrics) --------------------------------------------------
OPERATOR_PORT = 8080
TUNER_EVALUATIONS = "moe_eplb_tuner_evaluations_total"  # counter {namespace, name, result}
TUNER_DECISIONS = "moe_eplb_tuner_decisions_total"  # counter {namespace, name, decision}
TUNER_PREDICTED_GAIN = "moe_eplb_tuner_predicted_gain_ratio"  # gauge {namespace, name}
TUNER_DURATION_SECONDS = "moe_eplb_tuner_duration_seconds"  # histogram {}
TUNER_LAST_SUCCESS = "moe_eplb_tuner_last_success_timestamp_seconds"  # gauge {namespace, name}
ROLLBACKS = "moe_eplb_rollbacks_total"  # counter {namespace, name, reason}
RECONCILES = "moe_eplb_reconciles_total"  # counter {result}

# Label that the PodMonitor copies from the pod label ``eplb.ai/name`` onto every series.
MOEINFERENCE_LABEL = "moeinference"
POD_NAME_LABEL = "eplb.ai/name"
