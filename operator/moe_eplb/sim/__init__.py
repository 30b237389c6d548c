"""The simulated cluster and the real parts run locally: for ``moe-eplb demo``, the tests and the
benchmarks. Nothing here talks to a real cluster or a GPU. By backend, behind one seam:

- ``emulated/`` (:mod:`moe_eplb.sim.emulated`): the kmock-based Kubernetes API and its emulated
  controllers (kubelet, Deployment, LeaderWorkerSet, HPA). Frozen: kept for the demo without a Go
  build and for fault injection;
- ``real/`` (:mod:`moe_eplb.sim.real`): the real control plane, LeaderWorkerSet controller and
  prometheus-adapter, KEDA, the Prometheus Operator and the Helm CLI built from Go modules, run on
  loopback, with simulated GPU nodes;
- ``backend`` (``ClusterBackend``: which of the two a world runs on, chosen once; the one module that
  imports both), ``client`` (the harness's one apiserver client, with the product's ``Connection``),
  ``pods`` (what the emulated kubelet and the real node agent share: reading a pod spec, the poll
  loop), ``procs`` (child processes that never outlive the program, ``free_port``, ``poll_ready``),
  ``prometheus`` (the one way to start a Prometheus server);
- the simulated engines beside them: ``engine`` (a vLLM engine pod's stand-in), ``physics`` (a
  deployment's true costs), ``recording`` (a trace one simulated engine served);
- ``world`` (a whole simulated cluster in one event loop: ``SimWorld``), ``demo`` and
  ``demo_autoscale`` (``moe-eplb demo``).

The vendored CRDs the emulation serves and the real plane falls back to (``lws_crd.yaml``,
``keda_scaledobject_crd.yaml``) live here, beside both. The operator never imports this package; its
image does not ship it (docs/architecture.md). May import every other package.
"""
