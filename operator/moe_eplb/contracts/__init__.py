"""The contracts: names, facts and file formats that several packages share, in ONE package.

Every module in this package imports only the standard library, numpy and each other -- never the
rest of ``moe_eplb`` -- so that

* the exporter plugin, which runs inside vLLM pods, can use them (the injector,
  :mod:`moe_eplb.exporter.inject`, copies this package whole into a stock vLLM image);
* the layering test (``tests/test_layering.py``) reads the list of contract modules from this
  package's folder, and fails when a contract module lives anywhere else.

Modules: ``k8s_names`` (the Kubernetes API surface: group, kind, labels, annotations, ports),
``metric_names`` (every Prometheus series and label), ``vllm_facts`` (vLLM's EPLB limits, defaults,
rearrangement schedule, balancedness), ``trace_format`` (the load-trace file format),
``bounded_read`` (bounded readers of untrusted files) and ``live_protocol`` (the exchange that
changes window and interval live: commands, per-rank status, the agreed step and its guard).
"""
