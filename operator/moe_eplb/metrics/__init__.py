"""The operator's load reader: the exporter's counters -> a :class:`~moe_eplb.eplb.trace.LoadTrace`.

``promclient`` (Prometheus HTTP API), ``scrape`` (direct pod scraping), ``increments`` (per-bucket
increments of counters: exact, load in scrape gaps spread by time), ``reader`` (``read_load_trace``), ``errors``
(``LoadReadError`` with a status reason). See docs/exporter.md.
"""
