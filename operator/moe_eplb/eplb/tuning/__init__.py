"""Choosing EPLB's settings: ``tuner`` (the search) and ``options`` (``TuneOptions``, what it searches
and decides by), ``robust`` (decisions robust to what cannot be measured), ``calibrate`` (the cost
model fitted to telemetry), ``exploration``, ``experiment`` and ``learn`` (experiments on part of the
replicas and what they teach), ``overlap`` (is EPLB worth it: the shared-expert overlap it costs, EPLB
off and rearrange-only, what would change the answer), ``replicas`` (replicas whose loads diverge:
their divergence, each tuned on its own load), ``judge`` (an experiment's verdict: robust errors, the
pre-period, the sequential rule), ``report`` (plots, markdown).
Imports ``workload`` and ``replay``."""
