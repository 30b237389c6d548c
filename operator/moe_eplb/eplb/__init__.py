"""The EPLB math: vLLM's placement policy, load traces, and choosing EPLB's settings.

- ``policy`` (vLLM's rebalance policy, vectorised; ``kernels``: its compiled inner loops and the
  replay's, with a switch back to NumPy);
- ``trace`` (``LoadTrace``, the one in-memory trace type), ``tracefile`` (trace files and the real
  routing data files), ``profiles`` (statistics fitted to real routing data, and the workload
  profiles), ``synth`` (the workload generator);
- ``simulator`` (replays vLLM's EPLB over a trace), ``costmodel`` (predicted throughput),
  ``calibrate`` (fits the cost model to a deployment's telemetry), ``capacity`` (what redundancy
  costs in KV cache and replicas), ``robust`` (decisions that hold over what cannot be measured),
  ``tuner`` (the search of window x interval x redundancy), ``exploration`` (the types an
  experiment's case, arms and learned ranges share), ``learn`` (ranges narrowed from an
  experiment's arms);
- ``report`` (plots and the markdown summary of ``--report DIR``).

Files only in ``tracefile`` and ``report``. Imports ``api`` and the contracts.
"""
