"""A whole simulated cluster: ``backend`` (``ClusterBackend``, the one seam between the emulated and
the real Kubernetes, chosen once where a world is built; the one module that imports both) and
``world`` (``SimWorld``: the API, the nodes, the engines, Prometheus and the operator in one event
loop)."""
