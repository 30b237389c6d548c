"""Facts about vLLM's EPLB that several packages rely on (a contract: imports nothing of the project).

Sources: vLLM 0.32's and 0.33's ``config/parallel.py`` (``EPLBConfig``, the same in both), ``distributed/eplb/eplb_state.py``
(the step counter and ``rearrange``), ``v1/metrics/loggers.py`` (its own metric names); see
``../shared/notes/vllm-eplb.md``. One place for each fact: the redundant-expert limit, the
defaults, when rearrangements happen, how balancedness is computed, and the few vLLM metric names
the product reads.
"""

from __future__ import annotations

import re

import numpy as np

#: ``EPLBConfig.num_redundant_experts`` upper limit (``le=1023``).
MAX_REDUNDANT_EXPERTS = 1023

#: ``EPLBConfig`` defaults (vLLM 0.32 and 0.33): window 1000 steps, interval 3000 steps, no redundancy.
DEFAULT_WINDOW_SIZE = 1000
DEFAULT_STEP_INTERVAL = 3000
DEFAULT_NUM_REDUNDANT_EXPERTS = 0

#: vLLM versions the exporter plugin supports: 0.12.0 (multi-model EPLB state) through 0.34.x
#: (0.33's ``EplbState`` has the same methods and signatures as 0.32's; see docs/exporter.md).
EXPORTER_MIN_VLLM = (0, 12, 0)
EXPORTER_MAX_VLLM_MINOR = (0, 34)


def exporter_supports(version: tuple[int, ...]) -> bool:
    """Whether the exporter plugin supports vLLM ``version`` (``(major, minor, patch)``)."""
    return EXPORTER_MIN_VLLM <= tuple(version[:3]) and tuple(version[:2]) <= EXPORTER_MAX_VLLM_MINOR


def exporter_range() -> str:
    """The supported range as a person reads it: ``0.12.0 - 0.33.x``."""
    lo = ".".join(map(str, EXPORTER_MIN_VLLM))
    return f"{lo} - {EXPORTER_MAX_VLLM_MINOR[0]}.{EXPORTER_MAX_VLLM_MINOR[1]}.x"


#: vLLM 0.34's async EPLB health signals (``distributed/eplb/``): the rank-0 log line of each async
#: rearrangement cycle (logger ``ASYNC_WORKER_LOGGER``; args: layers moved, layers, vLLM's EPLB
#: model name, seconds) and the message of the error ``EplbState.step`` raises on every rank once
#: the async worker failed on one (the worker's exception is its ``__cause__`` there, and
#: ``EplbState.async_worker_error`` on the failing rank). Earlier releases have neither.
ASYNC_WORKER_LOGGER = "vllm.distributed.eplb.async_worker"
ASYNC_REARRANGED_LOG = "Async EPLB rearranged %d/%d layers of %s in %.2f s."
ASYNC_WORKER_FAILED = "Async EPLB worker failed on at least one rank"
#: ``EplbState`` attribute holding the async worker's exception (vLLM >= 0.34)
ASYNC_WORKER_ERROR_ATTR = "async_worker_error"

#: The hand-picked settings of the change that brought EPLB to Qwen3-VL-MoE (vLLM PR #28849),
#: measured at +4% throughput and -21% mean TTFT: window 3000, interval 1000, 8 redundant.
SEED_WINDOW_SIZE, SEED_STEP_INTERVAL, SEED_NUM_REDUNDANT_EXPERTS = 3000, 1000, 8

# vLLM's own Prometheus series the operator reads (names as Prometheus stores them; every one
# carries labels model_name and engine). The dashboards use more of them (scripts/vllm_metric_names.py).
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # gauge, 0..1
PREEMPTIONS = "vllm:num_preemptions_total"  # counter
REQUESTS_WAITING = "vllm:num_requests_waiting"  # gauge
VLLM_MODEL_LABEL = "model_name"  # the served model name
#: Prefix cache (counters, in tokens): prompt tokens looked up and found. vLLM 0.32 names them
#: ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (``v1/metrics/loggers.py``); older
#: engines exported the same counters as ``vllm:gpu_prefix_cache_queries`` / ``..._hits`` (later
#: hidden behind ``--show-hidden-metrics-for-version``). The reader takes the new names and falls
#: back to the old ones.
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
PREFIX_CACHE_QUERIES_OLD = "vllm:gpu_prefix_cache_queries_total"
PREFIX_CACHE_HITS_OLD = "vllm:gpu_prefix_cache_hits_total"
#: Gauge = 1 whose labels are the engine's ``CacheConfig`` (``metrics_info()``), among them the KV
#: cache's size in blocks and the tokens per block.
CACHE_CONFIG_INFO = "vllm:cache_config_info"
CACHE_CONFIG_BLOCKS_LABEL = "num_gpu_blocks"
CACHE_CONFIG_BLOCK_SIZE_LABEL = "block_size"

TTFT_SECONDS = "vllm:time_to_first_token_seconds"  # histogram (series _bucket, _sum, _count)
#: What an experiment's arms are compared on (:mod:`moe_eplb.metrics.arms`): the inter-token latency
#: (one decode step as a request sees it), the tokens of one engine step (batch size) and the tokens
#: served (prompt and generated). Histograms have ``_sum`` and ``_count`` series.
ITL_SECONDS = "vllm:inter_token_latency_seconds"  # histogram
ITERATION_TOKENS = "vllm:iteration_tokens_total"  # histogram: tokens per engine step
GENERATION_TOKENS = "vllm:generation_tokens_total"  # counter
PROMPT_TOKENS = "vllm:prompt_tokens_total"  # counter

#: vLLM renamed its KV-cache gauge: ``vllm:kv_cache_usage_perc`` from 0.10.0 on (vLLM PR #18354),
#: the old ``vllm:gpu_cache_usage_perc`` deprecated in 0.10, hidden in 0.11 (PR #24245, shown only
#: with ``--show-hidden-metrics-for-version=0.10``) and removed in 0.12 (PR #29330).
KV_CACHE_USAGE_SINCE = (0, 10, 0)
KV_CACHE_USAGE_OLD = "vllm:gpu_cache_usage_perc"

#: The metrics ``spec.autoscaling.metric.type`` can scale on: type -> ((first vLLM version, the
#: series Prometheus stores), ...) newest last. RequestsWaiting: requests queued in the scheduler
#: (gauge, per engine); KVCacheUsage: the fraction of the KV cache in use (gauge, 0..1, per engine);
#: TTFT: time to first token (histogram; the autoscaler takes a quantile of its buckets).
AUTOSCALING_METRICS: dict[str, tuple[tuple[tuple[int, int, int], str], ...]] = {
    "RequestsWaiting": (((0, 0, 0), REQUESTS_WAITING),),
    "KVCacheUsage": (((0, 0, 0), KV_CACHE_USAGE_OLD), (KV_CACHE_USAGE_SINCE, KV_CACHE_USAGE)),
    "TTFT": (((0, 0, 0), TTFT_SECONDS),),
}


def autoscaling_metric(metric_type: str, version: tuple[int, ...] | None) -> str | None:
    """vLLM's series for ``metric_type`` in engine ``version`` (``(major, minor, patch)``); None when
    the version is unknown or has none (the TTFT name is the histogram's: add ``_bucket``)."""
    if version is None or metric_type not in AUTOSCALING_METRICS:
        return None
    found = None
    for since, name in AUTOSCALING_METRICS[metric_type]:
        if tuple(version[:3]) >= since:
            found = name
    return found


def smallest_valid_redundant(num_experts: int, ep_size: int) -> int:
    """The smallest R with (E + R) divisible by the EP size (vLLM refuses to start otherwise)."""
    return (ep_size - num_experts % ep_size) % ep_size


def redundant_problem(num_experts: int | None, ep_size: int | None, num_redundant: int) -> str | None:
    """Why vLLM would refuse ``num_redundant`` redundant experts, or None when it accepts them.

    Checks the 0..1023 limit and, when the shape is known, that experts + redundant divide over
    the EP size."""
    if not 0 <= num_redundant <= MAX_REDUNDANT_EXPERTS:
        return f"{num_redundant} redundant experts is outside 0..{MAX_REDUNDANT_EXPERTS}"
    if num_experts and ep_size and (num_experts + num_redundant) % ep_size:
        smallest = smallest_valid_redundant(num_experts, ep_size)
        return (f"experts ({num_experts}) + redundant ({num_redundant}) is not divisible by the EP size "
                f"{ep_size}; use {smallest}, {smallest + ep_size}, {smallest + 2 * ep_size}, ...")
    return None


def first_rearrangement_step(step_interval: int) -> int:
    """Engine steps before vLLM's first rearrangement: its counter starts at ``I - I // 4``."""
    return max(step_interval // 4, 1)


def first_counter(step_interval: int) -> int:
    """vLLM's rearrangement counter at start (``EplbState.add_model``): ``max(0, I - I // 4)``."""
    return max(0, step_interval - step_interval // 4)


#: vLLM releases (major, minor) whose ``EplbState`` live apply was checked against: 0.32 (the CPU
#: wheel, also on a real engine), 0.33 and 0.34 (their released sources). The attributes it changes
#: (``expert_rearrangement_step_interval``, ``expert_load_window_size``, ``expert_load_window_step``,
#: each ``EplbModelState.expert_load_window``) are read only by ``step()`` and ``rearrange()`` there.
LIVE_APPLY_VLLM = ((0, 32), (0, 33), (0, 34))


def live_apply_supports(version: str | tuple[int, ...] | None) -> bool:
    """Whether live apply of window and interval is supported on vLLM ``version`` (a version string
    such as ``0.32.0+cpu``, or a ``(major, minor, ...)`` tuple)."""
    if isinstance(version, str):
        m = re.search(r"(\d+)\.(\d+)", version)
        version = (int(m.group(1)), int(m.group(2))) if m else None
    return version is not None and tuple(version[:2]) in LIVE_APPLY_VLLM


def live_apply_range() -> str:
    """The releases of :data:`LIVE_APPLY_VLLM` as a person reads them: ``0.32.x - 0.34.x``."""
    lo, hi = LIVE_APPLY_VLLM[0], LIVE_APPLY_VLLM[-1]
    return f"{lo[0]}.{lo[1]}.x - {hi[0]}.{hi[1]}.x"


def rearrangement_steps(step_interval: int, num_steps: int) -> np.ndarray:
    """int64 ``[n]``: the steps after which vLLM rearranges (first after ``I // 4``, then every
    ``I``), all ``< num_steps``."""
    return np.arange(first_rearrangement_step(step_interval), num_steps, step_interval, dtype=np.int64)


def balancedness_per_layer(rank_tokens: np.ndarray) -> np.ndarray:
    """``[..., L]`` mean over ranks / max over ranks of the tokens each EP rank processed
    (``rank_tokens``: ``[..., L, EP]``); NaN where a layer has no tokens. 1.0 = perfectly even,
    1/EP = everything on one rank. vLLM's ``log_balancedness`` averages over layers first; this is
    per layer."""
    rt = np.asarray(rank_tokens, np.float64)
    mx = rt.max(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mx > 0, rt.mean(axis=-1) / np.where(mx > 0, mx, 1.0), np.nan)


def balancedness_terms(rank_tokens: np.ndarray) -> tuple[float, float]:
    """``(sum mean_rank, sum max_rank)`` over every layer (and leading axis) of ``rank_tokens
    [..., L, EP]``: add them up over pods or engines before dividing."""
    rt = np.asarray(rank_tokens, np.float64)
    if rt.size == 0:
        return 0.0, 0.0
    return float(rt.mean(axis=-1).sum()), float(rt.max(axis=-1).sum())


def balancedness(rank_tokens: np.ndarray) -> float | None:
    """One figure over every layer (and leading axis): ``sum mean_rank / sum max_rank`` of
    ``rank_tokens [..., L, EP]`` -- ideal MoE time over actual; None when there are no tokens."""
    num, den = balancedness_terms(rank_tokens)
    return num / den if den > 0 else None
