"""Choosing EPLB's settings: ``tuner`` (the search), ``robust`` (decisions robust to what cannot be
measured), ``calibrate`` (the cost model fitted to telemetry), ``exploration``, ``experiment`` and
``learn`` (experiments on part of the replicas and what they teach), ``judge`` (an experiment's
verdict: robust errors, the pre-period, the sequential rule), ``report`` (plots, markdown).
Imports ``workload`` and ``replay``."""
