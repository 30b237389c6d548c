"""The EPLB math, in three rooms; imports point one way between them (workload <- replay <- tuning):

- ``workload/``: what runs -- ``trace`` (``LoadTrace``, the one in-memory trace type),
  ``tracefile`` (trace files and the real routing data files), ``profiles`` (statistics fitted to
  real routing data, and the workload profiles), ``synth`` (the workload generator);
- ``replay/``: what vLLM's EPLB does with it -- ``policy`` (vLLM's rebalance policy, vectorised),
  ``kernels`` (its compiled inner loops and the replay's, with a switch back to NumPy),
  ``simulator`` (replays vLLM's EPLB over a trace), ``costmodel`` (predicted throughput),
  ``capacity`` (what redundancy costs in KV cache and replicas);
- ``tuning/``: choosing EPLB's settings -- ``calibrate`` (fits the cost model to a deployment's
  telemetry), ``robust`` (decisions that hold over what cannot be measured), ``tuner`` (the search
  of window x interval x redundancy), ``options`` (``TuneOptions``, the tuner's one settings type),
  ``exploration`` (the types an experiment's case, arms and learned ranges share), ``experiment``
  (the statistics of an experiment's arms), ``learn`` (ranges narrowed from an experiment's arms),
  ``report`` (plots and the markdown summary of ``--report DIR``).

Files only in ``workload.tracefile`` and ``tuning.report``. Imports ``api`` and the contracts.
"""
