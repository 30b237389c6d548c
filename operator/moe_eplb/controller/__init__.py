"""The operator: kopf handlers, the reconcile logic behind them, and the tuning loop.

- ``handlers``: thin kopf handlers, registered into a given ``kopf.OperatorRegistry``;
- ``reconcile``: validate -> render -> plan -> dry run -> apply -> prune -> status, per resource;
- ``status``: phase and conditions from the children's readiness (pure);
- ``k8s``: the small async Kubernetes client (aiohttp, plain dicts);
- ``rbac``: every API call the operator makes, as ClusterRole rules (data);
- ``control``: the control token's Secret (made once per resource) and the header that carries it on
  a request that changes a running engine;
- ``main``: kopf settings and ``run_operator`` (``moe-eplb run``, tests, demo, benchmark), with
  ``settings`` (the process's settings from CLI/env values) and ``peering`` (start-up under required
  peering);
- ``autotune``: the tuning loop (:class:`~.autotune.AutotuneLoop`, owned by the handlers' ``Controller``),
  with ``autotune_settings`` (its clock and settings), ``observe`` (the load and measured
  balancedness), ``workload`` (the child workloads read into a ``WorkloadView``), ``decisions`` and
  ``rollout`` (the pure decisions), ``opmetrics`` (its metrics on the operator's ``/metrics``),
  ``scale_down`` (the pause after a fault-tolerance scale-down, read from the engine pods' logs),
  ``rebalance`` (the ``RebalanceFailed`` condition from vLLM's async EPLB worker failures),
  ``experiment`` (the pure state machine of an experiment: a change tried against the running
  settings first, cross-pod or interleaved) and ``interleaved`` (the interleaved design's schedule:
  blocks on the same replicas, their settings applied live).

Imports ``api``, ``render``, ``eplb``, ``metrics`` and the contracts; the CLI, the simulation and
the tests import it.
"""
