"""vLLM's own Prometheus metrics that moe-eplb's dashboards, alerts and docs use.

These names belong to vLLM, not to moe-eplb. They are checked against the installed vLLM
(``vllm/v1/metrics/loggers.py`` of vLLM 0.32) by ``tests/chart/test_vllm_metric_names.py`` (marker
``vllm``), so a rename upstream fails the test suite rather than leaving an empty dashboard panel.

``VLLM_METRICS`` maps the name given to ``prometheus_client`` in vLLM's code to its type. The
series Prometheus stores differ from that name by the client's suffixes: a counter ``X`` is
scraped as ``X_total`` (and ``X_created``), a histogram ``X`` as ``X_bucket``, ``X_sum`` and
``X_count``; :func:`exposed_series` gives them. Every vLLM metric carries the labels
``VLLM_LABELS`` (``model_name`` = the served model name, ``engine`` = the data-parallel engine
index as a string); extra labels are listed in ``VLLM_EXTRA_LABELS``.

Pure constants and one pure function: importing this pulls nothing in (no vLLM).
"""

from __future__ import annotations

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"

VLLM_LABELS = ("model_name", "engine")

VLLM_METRICS: dict[str, str] = {
    # scheduler state
    "vllm:num_requests_running": GAUGE,  # requests in model execution batches
    "vllm:num_requests_waiting": GAUGE,  # requests waiting to be scheduled
    "vllm:kv_cache_usage_perc": GAUGE,  # KV-cache usage, 0..1 (1 = 100 %)
    "vllm:num_preemptions": COUNTER,  # preemptions by the engine
    # tokens and requests
    "vllm:prompt_tokens": COUNTER,  # prefill tokens processed
    "vllm:generation_tokens": COUNTER,  # generated tokens
    "vllm:request_success": COUNTER,  # finished requests {finished_reason}
    "vllm:prefix_cache_queries": COUNTER,  # tokens queried in the prefix cache
    "vllm:prefix_cache_hits": COUNTER,  # tokens found in the prefix cache
    # latency histograms, seconds
    "vllm:time_to_first_token_seconds": HISTOGRAM,  # TTFT
    "vllm:inter_token_latency_seconds": HISTOGRAM,  # ITL, one sample per output token
    "vllm:request_time_per_output_token_seconds": HISTOGRAM,  # TPOT, one sample per request
    "vllm:e2e_request_latency_seconds": HISTOGRAM,  # end-to-end request latency
    "vllm:request_queue_time_seconds": HISTOGRAM,  # time spent waiting in the queue
}

VLLM_EXTRA_LABELS: dict[str, tuple[str, ...]] = {
    "vllm:request_success": ("finished_reason",),
}

_SUFFIXES = {
    COUNTER: ("_total", "_created"),
    GAUGE: ("",),
    HISTOGRAM: ("_bucket", "_sum", "_count", "_created"),
}


def exposed_series(name: str, kind: str) -> tuple[str, ...]:
    """The series names Prometheus stores for a ``prometheus_client`` metric ``name`` of ``kind``.

    >>> exposed_series("vllm:prompt_tokens", "counter")
    ('vllm:prompt_tokens_total', 'vllm:prompt_tokens_created')
    """
    try:
        return tuple(name + suffix for suffix in _SUFFIXES[kind])
    except KeyError:
        raise ValueError(f"unknown metric kind {kind!r}; use one of {sorted(_SUFFIXES)}") from None


def all_exposed_series() -> frozenset[str]:
    """Every series name of every metric in ``VLLM_METRICS``."""
    return frozenset(s for name, kind in VLLM_METRICS.items() for s in exposed_series(name, kind))
