"""The operator's load reader: the exporter's counters -> a :class:`~moe_eplb.eplb.workload.trace.LoadTrace`.

The I/O side: ``reader`` (``read_load_trace``: from Prometheus, or by scraping the pods),
``promclient`` (a small Prometheus HTTP API client), ``scrape`` (direct pod scraping), ``measure``
(the running pods' balancedness over a window, the judge of a tuner change), ``health`` (the
engines' async EPLB worker failures, for ``RebalanceFailed``), ``arms`` (an experiment's arms: one
bucket of the objective per arm from their pods' metrics). The pure side:
``series`` (Prometheus answers parsed into typed series), ``grid`` (the bucket grid), ``increments``
(per-bucket counter increments, load in scrape gaps spread by time), ``edges`` (regular pods read as
sums at the bucket edges), ``assemble`` (raw samples -> one MoEInference's trace),
``telemetry_keys`` (raw samples -> a trace's telemetry). ``errors``: ``LoadReadError`` with a status
reason. See docs/exporter.md#the-load-reader-operator-side. Imports ``api``, ``eplb`` and the
contracts.
"""
