"""The vLLM plugin that exports per-expert load (see docs/exporter.md).

Modules, in data-flow order: ``settings`` (environment), ``layout`` (which vLLM EPLB layout runs),
``hook`` (the method patch on ``EplbState``), ``recorder`` (device accumulators, asynchronous
read-back, snapshot writer), ``snapshot`` (per-worker files), ``collector`` (pod aggregation,
Prometheus families), ``server`` (the pod's ``/metrics`` process), ``capture`` (trace files),
``plugin`` (``register()``, the entry point), ``health`` (the pod's ``/livez``, ``/readyz`` and
``/drain``: a worker's heartbeat, the preStop drain), ``rebalance_signals`` (vLLM 0.34's async
rearrangement durations and worker failures), ``group`` (one copy of the expert counters per
multi-node replica group: the leader sums its workers' totals), ``control_auth`` (the check of
the operator's control token on a request that changes the engine), ``elastic_relay`` (the operator's
resize of an elastic group, relayed to the pod's own API servers), ``live`` (inside each worker:
window and interval changed at an agreed engine step) and ``live_control`` (the pod's
``/eplb/settings`` route that hands the operator's live commands to the workers); ``inject`` (the
init container's copy of the plugin into a stock vLLM image). Metric names come from :mod:`moe_eplb.contracts.metric_names`; the
package imports only the contracts. Importing it pulls in nothing; torch and vLLM are imported only
inside workers.
"""
