"""Everything the operator applies for a MoEInference, rendered purely (no I/O) from its typed model.

``objects`` (``render_children``: every child manifest: the workload -- a Deployment or a
LeaderWorkerSet --, Service, PodDisruptionBudget, PodMonitor), ``engine_args`` (vLLM's command line
per engine version), ``autoscaler`` (the KEDA ScaledObject or HPA of ``spec.autoscaling``), ``labels``
(labels and selectors on every child), ``overlay`` (``spec.engine.podTemplate`` merged into every engine
pod the way a strategic merge does), ``experiment`` (an experiment's two arms: a trial Deployment
behind the same Service, or a LeaderWorkerSet's partition), ``control_key`` (the operator's control
token among vLLM's API keys, where the user runs with one), ``elastic`` (an elastic group's joining pods'
StatefulSet and its NetworkPolicy). Imports ``api`` and the contracts.
"""
