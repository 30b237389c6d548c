"""The operator: kopf handlers and the reconcile logic behind them.

- ``handlers``: thin kopf handlers, registered into a given ``kopf.OperatorRegistry``;
- ``reconcile``: validate -> render -> plan -> dry run -> apply -> prune -> status, per resource;
- ``status``: phase and conditions from the children's readiness (pure);
- ``k8s``: the small async Kubernetes client (aiohttp, plain dicts);
- ``rbac``: every API call the operator makes, as ClusterRole rules (data);
- ``main``: kopf settings and ``run_operator`` (``moe-eplb run``, tests, demo, benchmark).
- ``autotune``: the tuning loop (:class:`~.autotune.AutotuneLoop`, owned by the handlers' ``Controller``),
  with ``autotune_settings`` (its clock and settings), ``observe`` (the load and measured
  balancedness), ``workload`` (the child workloads read into a ``WorkloadView``), ``decisions`` and
  ``rollout`` (the pure decisions);

Nothing outside the CLI and the tests imports this package.
"""
