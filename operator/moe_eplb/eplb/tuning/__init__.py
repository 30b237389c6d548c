"""Choosing EPLB's settings: ``tuner`` (the search) and ``options`` (``TuneOptions``, what it searches
and decides by), ``robust`` (decisions robust to what cannot be measured), ``calibrate`` (the cost
model fitted to telemetry), ``exploration``, ``experiment`` and ``learn`` (experiments on part of the
replicas and what they teach), ``report`` (plots, markdown). Imports ``workload`` and ``replay``."""
