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
  settings first, cross-pod or interleaved), ``interleaved`` (the interleaved design's schedule:
  blocks on the same replicas, their settings applied live),
  ``outcome`` (what a step of those state machines returns: the new status, Events, conditions), and
  ``shift`` (a workload shift noticed between evaluations: evaluate on the load since, at once);
- ``live``: window and interval applied live to running engines (one engine step on every EP rank,
  no restart: ``live_capable``, ``apply_live``), with ``live_client`` (its HTTP calls to the pods'
  exporters, the control token on each).
- fault recovery (``spec.faultTolerance``): ``recovery`` (the pure decision and state machine: retry or
  scale_down, one round per fault, the planned restart), ``recovery_loop`` (its kopf timer, owned by
  the ``Controller``: pods and ranks read, status written, rounds sent), ``recovery_client`` (the HTTP
  calls to the engines' fault-tolerance routes), ``recovery_metrics`` (its metrics).
- ``elastic``: the resize loop of elastic groups (:class:`~.elastic.ElasticLoop`, owned by the
  ``Controller`` too), with ``elastic_plan`` (its pure state machine) and ``elastic_metrics`` (its metrics).

Imports ``api``, ``render``, ``eplb``, ``metrics`` and the contracts; the CLI, the harness and the
tests import it.
"""
